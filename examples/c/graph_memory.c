/*
 * graph_memory.c - stream-ordered pool memory inside an ACL graph capture: a step whose
 * working buffers are allocated with aclrtMemPoolMallocAsync and freed with
 * aclrtMemPoolFreeAsync between aclmdlRICaptureBegin and aclmdlRICaptureEnd. The allocations
 * are made once, at capture time, from memory the pool keeps for the model; executing the
 * model allocates nothing.
 *
 *   1. a step captured once: the input (allocated before the capture) is copied into a
 *      buffer allocated in the capture, whose first bytes are overwritten, then into an
 *      output allocated in the capture; the buffer is freed inside the capture and its memory
 *      reused by the stream's next allocation there. Executed 100 times with new inputs, each
 *      result checked, while the pool's used and reserved memory stay where they were;
 *   2. the output freed after the capture stays the model's until aclmdlRIDestroy (every
 *      execution writes it): another stream's allocation does not get it; once the model is
 *      destroyed, trimming gives everything back;
 *   3. a free inside a capture of memory allocated before it is refused
 *      (ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT): the model would still use it.
 *
 * Build and run: scripts/run-c-examples.sh
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

static const size_t N = 64 * 1024;

static void Step(aclrtMemPool pool, aclrtStream stream, aclrtStream other)
{
    uint8_t *host = (uint8_t *)malloc(N);
    EXPECT(host != NULL);
    void *input = NULL;
    CHECK(aclrtMemPoolMallocAsync(&input, N, pool, stream));

    CHECK(aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL));
    void *work = NULL, *output = NULL, *scratch = NULL;
    CHECK(aclrtMemPoolMallocAsync(&work, N, pool, stream));
    CHECK(aclrtMemcpyAsync(work, N, input, N, ACL_MEMCPY_DEVICE_TO_DEVICE, stream));
    CHECK(aclrtMemsetAsync(work, N, 0xAB, 64, stream));
    CHECK(aclrtMemPoolMallocAsync(&output, N, pool, stream));
    CHECK(aclrtMemcpyAsync(output, N, work, N, ACL_MEMCPY_DEVICE_TO_DEVICE, stream));
    CHECK(aclrtMemPoolFreeAsync(work, stream));
    CHECK(aclrtMemPoolMallocAsync(&scratch, N, pool, stream));
    EXPECT(scratch == work); /* the free inside the capture serves the stream's next request */
    CHECK(aclrtMemsetAsync(scratch, N, 0, N, stream));
    CHECK(aclrtMemPoolFreeAsync(scratch, stream));
    aclmdlRI model = NULL;
    CHECK(aclmdlRICaptureEnd(stream, &model));
    CHECK(aclrtSynchronizeStream(stream));

    uint64_t used = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT);
    uint64_t reserved = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT);
    EXPECT(used == 2 * N); /* the input and the output */
    for (int step = 1; step <= 100; ++step) {
        memset(host, step, N);
        CHECK(aclrtMemcpy(input, N, host, N, ACL_MEMCPY_HOST_TO_DEVICE));
        CHECK(aclmdlRIExecuteAsync(model, stream));
        CHECK(aclrtSynchronizeStream(stream));
        CHECK(aclrtMemcpy(host, N, output, N, ACL_MEMCPY_DEVICE_TO_HOST));
        EXPECT(host[0] == 0xAB && host[63] == 0xAB);
        EXPECT(host[64] == (uint8_t)step && host[N - 1] == (uint8_t)step);
    }
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == used);
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) == reserved);
    printf("step: 100 executions, results checked, no allocation at execution time "
           "(used %llu, reserved %llu bytes throughout)\n",
           (unsigned long long)used, (unsigned long long)reserved);

    /* The output freed now: the model still writes it at every execution, so it stays the
     * model's until the model is destroyed. */
    CHECK(aclrtMemPoolFreeAsync(output, stream));
    CHECK(aclrtSynchronizeStream(stream));
    void *elsewhere = NULL;
    CHECK(aclrtMemPoolMallocAsync(&elsewhere, N, pool, other));
    EXPECT(elsewhere != output);
    CHECK(aclmdlRIExecuteAsync(model, stream));
    CHECK(aclmdlRIDestroy(model)); /* after its executions: its memory goes back */
    CHECK(aclrtMemPoolFreeAsync(elsewhere, other));
    CHECK(aclrtMemPoolFreeAsync(input, stream));
    CHECK(aclrtSynchronizeDevice());
    CHECK(aclrtMemPoolTrimTo(pool, 0));
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == 0);
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) == 0);
    printf("output: kept for the model until aclmdlRIDestroy, then given back\n");
    free(host);
}

static void Refused(aclrtMemPool pool, aclrtStream stream)
{
    void *before = NULL;
    CHECK(aclrtMemPoolMallocAsync(&before, N, pool, stream));
    CHECK(aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL));
    CHECK_FAILS(aclrtMemPoolFreeAsync(before, stream), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    aclmdlRI model = NULL;
    CHECK(aclmdlRICaptureEnd(stream, &model));
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == N);
    CHECK(aclmdlRIDestroy(model));
    CHECK(aclrtMemPoolFreeAsync(before, stream));
    CHECK(aclrtSynchronizeStream(stream));
    printf("refused: a free inside the capture of memory allocated before it\n");
}

int main(void)
{
    const int32_t deviceId = 0;
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(deviceId));
    aclrtStream s1 = NULL, s2 = NULL;
    CHECK(aclrtCreateStream(&s1));
    CHECK(aclrtCreateStream(&s2));
    aclrtMemPoolProps props = PoolProps(deviceId, 64 * MIB);
    aclrtMemPool pool = NULL;
    CHECK(aclrtMemPoolCreate(&pool, &props));

    Step(pool, s1, s2);
    Refused(pool, s1);

    CHECK(aclrtMemPoolDestroy(pool));
    CHECK(aclrtDestroyStream(s1));
    CHECK(aclrtDestroyStream(s2));
    CHECK(aclrtResetDevice(deviceId));
    CHECK(aclFinalize());
    printf("graph_memory: ok\n");
    return 0;
}
