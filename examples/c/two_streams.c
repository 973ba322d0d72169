/*
 * two_streams.c - cross-stream reuse through event dependencies. A block freed on stream s1
 * is handed to stream s2 when s2 waited on an event recorded on s1 after the free and
 * ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES is on (also along a chain s1 -> s2 -> s3);
 * with the switch off (CANN's default) it is not, and s2 gets other memory.
 *
 * Build and run: scripts/run-c-examples.sh
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

static const size_t BYTES = 2 * MIB;

/* Allocates on `from`, uses and frees it there, then orders `to` after the free through an
 * event (through `via` first, when given) and allocates on `to`. Returns whether `to` got
 * the same block. */
static int ReusedAcross(int32_t deviceId, uint32_t follow, int chain)
{
    aclrtMemPoolProps props = PoolProps(deviceId, 64 * MIB);
    aclrtMemPool pool = NULL;
    CHECK(aclrtMemPoolCreate(&pool, &props));
    CHECK(aclrtMemPoolSetAttr(pool, ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES, &follow));
    EXPECT(PoolAttr32(pool, ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES) == (follow != 0));

    aclrtStream s1 = NULL, s2 = NULL, s3 = NULL;
    CHECK(aclrtCreateStream(&s1));
    CHECK(aclrtCreateStream(&s2));
    CHECK(aclrtCreateStream(&s3));
    aclrtEvent freed = NULL, relay = NULL;
    CHECK(aclrtCreateEvent(&freed));
    CHECK(aclrtCreateEvent(&relay));

    void *first = NULL;
    CHECK(aclrtMemPoolMallocAsync(&first, BYTES, pool, s1));
    CHECK(aclrtMemsetAsync(first, BYTES, 1, BYTES, s1));
    CHECK(aclrtMemPoolFreeAsync(first, s1));
    CHECK(aclrtRecordEvent(freed, s1)); /* recorded after the free */

    aclrtStream target = s2;
    CHECK(aclrtStreamWaitEvent(s2, freed));
    if (chain) {
        CHECK(aclrtRecordEvent(relay, s2));
        CHECK(aclrtStreamWaitEvent(s3, relay));
        target = s3;
    }
    void *second = NULL;
    CHECK(aclrtMemPoolMallocAsync(&second, BYTES, pool, target));
    CHECK(aclrtMemsetAsync(second, BYTES, 2, BYTES, target));
    CHECK(aclrtMemPoolFreeAsync(second, target));

    CHECK(aclrtSynchronizeDevice());
    CHECK(aclrtDestroyEvent(freed));
    CHECK(aclrtDestroyEvent(relay));
    CHECK(aclrtDestroyStream(s1));
    CHECK(aclrtDestroyStream(s2));
    CHECK(aclrtDestroyStream(s3));
    CHECK(aclrtMemPoolDestroy(pool));
    return first == second;
}

int main(void)
{
    const int32_t deviceId = 0;
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(deviceId));

    /* Repeated: the outcome must not depend on how far the device has got. */
    int on = 1, onChain = 1, off = 0;
    for (int round = 0; round < 5; ++round) {
        on = on && ReusedAcross(deviceId, 1, 0);
        onChain = onChain && ReusedAcross(deviceId, 1, 1);
        off = off || ReusedAcross(deviceId, 0, 0);
    }
    printf("follow event dependencies on: %s; through s1 -> s2 -> s3: %s; off: %s\n",
           on ? "reused" : "not reused", onChain ? "reused" : "not reused",
           off ? "reused" : "not reused");
    EXPECT(on);
    EXPECT(onChain);
    EXPECT(!off);

    CHECK(aclrtResetDevice(deviceId));
    CHECK(aclFinalize());
    printf("two_streams: ok\n");
    return 0;
}
