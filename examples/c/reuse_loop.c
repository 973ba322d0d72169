/*
 * reuse_loop.c - twenty iterations of allocate / use / free on one stream with a release
 * threshold: every iteration after the first reuses the block freed by the previous one (no
 * driver call, no synchronisation), timed with events; then the pool grows above the
 * threshold and the next synchronize gives memory back down to it.
 *
 * Build and run: scripts/run-c-examples.sh
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

#define ITERATIONS 20
#define BURST 8

int main(void)
{
    const int32_t deviceId = 0;
    const size_t bytes = 1 * MIB;
    uint64_t threshold = 8 * MIB;

    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(deviceId));
    aclrtStream stream = NULL;
    CHECK(aclrtCreateStream(&stream));
    aclrtMemPoolProps props = PoolProps(deviceId, 256 * MIB);
    aclrtMemPool pool = NULL;
    CHECK(aclrtMemPoolCreate(&pool, &props));
    CHECK(aclrtMemPoolSetAttr(pool, ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD, &threshold));
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD) == threshold);

    aclrtEvent start = NULL;
    aclrtEvent end = NULL;
    CHECK(aclrtCreateEvent(&start));
    CHECK(aclrtCreateEvent(&end));

    unsigned char check[16];
    void *previous = NULL;
    int reused = 0;
    CHECK(aclrtRecordEvent(start, stream));
    for (int i = 0; i < ITERATIONS; ++i) {
        void *dev = NULL;
        CHECK(aclrtMemPoolMallocAsync(&dev, bytes, pool, stream));
        if (dev == previous) {
            ++reused;
        }
        previous = dev;
        CHECK(aclrtMemsetAsync(dev, bytes, i, bytes, stream));
        if (i == ITERATIONS - 1) {
            CHECK(aclrtMemcpyAsync(check, sizeof(check), dev, sizeof(check),
                                   ACL_MEMCPY_DEVICE_TO_HOST, stream));
        }
        CHECK(aclrtMemPoolFreeAsync(dev, stream));
    }
    CHECK(aclrtRecordEvent(end, stream));
    CHECK(aclrtSynchronizeEvent(end));
    float ms = -1.0f;
    CHECK(aclrtEventElapsedTime(&ms, start, end));
    printf("%d iterations, %d reused the previous block, %.3f ms\n", ITERATIONS, reused,
           (double)ms);
    EXPECT(reused == ITERATIONS - 1);
    EXPECT(ms >= 0.0f);
    for (size_t k = 0; k < sizeof(check); ++k) {
        EXPECT(check[k] == ITERATIONS - 1);
    }
    /* Within the threshold: the synchronize kept the block cached. */
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) <= threshold);
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) >= bytes);

    /* Grow above the threshold: BURST live blocks of 4 MiB, then free them all. */
    void *burst[BURST];
    for (int i = 0; i < BURST; ++i) {
        CHECK(aclrtMemPoolMallocAsync(&burst[i], 4 * MIB, pool, stream));
    }
    for (int i = 0; i < BURST; ++i) {
        CHECK(aclrtMemPoolFreeAsync(burst[i], stream));
    }
    uint64_t before = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT);
    EXPECT(before >= BURST * 4 * MIB); /* nothing is released before a synchronisation */
    CHECK(aclrtSynchronizeStream(stream));
    uint64_t after = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT);
    uint64_t high = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH);
    printf("reserved %llu before synchronize, %llu after (threshold %llu, high %llu)\n",
           (unsigned long long)before, (unsigned long long)after,
           (unsigned long long)threshold, (unsigned long long)high);
    EXPECT(after <= threshold);
    EXPECT(high >= before);

    /* Reset the high-water mark: it restarts from the current value. */
    uint64_t zero = 0;
    CHECK(aclrtMemPoolSetAttr(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH, &zero));
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH) == after);

    /* Trim takes precedence over the threshold. */
    CHECK(aclrtMemPoolTrimTo(pool, 0));
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) == 0);

    CHECK(aclrtDestroyEvent(start));
    CHECK(aclrtDestroyEvent(end));
    CHECK(aclrtMemPoolDestroy(pool));
    CHECK(aclrtDestroyStream(stream));
    CHECK(aclrtResetDevice(deviceId));
    CHECK(aclFinalize());
    printf("reuse_loop: ok\n");
    return 0;
}
