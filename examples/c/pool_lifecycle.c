/*
 * pool_lifecycle.c - the basic life of a stream-ordered memory pool: create it with
 * properties, allocate on a stream, copy host -> device -> host through the allocation, free
 * it in stream order, synchronize, read the attributes, destroy.
 *
 * Build and run: scripts/run-c-examples.sh
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

int main(void)
{
    const int32_t deviceId = 0;
    const size_t count = 1 << 20; /* floats */
    const size_t bytes = count * sizeof(float);

    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(deviceId));
    aclrtStream stream = NULL;
    CHECK(aclrtCreateStream(&stream));

    /* A pool of at most 64 MiB on the device. */
    aclrtMemPoolProps props = PoolProps(deviceId, 64 * MIB);
    aclrtMemPool pool = NULL;
    CHECK(aclrtMemPoolCreate(&pool, &props));

    /* CANN's defaults: every reuse switch off, release threshold 0. */
    EXPECT(PoolAttr32(pool, ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES) == 0);
    EXPECT(PoolAttr32(pool, ACL_RT_MEM_POOL_REUSE_ALLOW_OPPORTUNISTIC) == 0);
    EXPECT(PoolAttr32(pool, ACL_RT_MEM_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES) == 0);
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD) == 0);
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) == 0);

    /* Host buffers. */
    float *hostIn = NULL;
    float *hostOut = NULL;
    CHECK(aclrtMallocHost((void **)&hostIn, bytes));
    CHECK(aclrtMallocHost((void **)&hostOut, bytes));
    for (size_t i = 0; i < count; ++i) {
        hostIn[i] = (float)i * 0.5f;
        hostOut[i] = -1.0f;
    }

    /* Allocate on the stream, round trip through the allocation, free on the stream. */
    void *dev = NULL;
    CHECK(aclrtMemPoolMallocAsync(&dev, bytes, pool, stream));
    EXPECT(dev != NULL);
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == bytes);
    CHECK(aclrtMemcpyAsync(dev, bytes, hostIn, bytes, ACL_MEMCPY_HOST_TO_DEVICE, stream));
    CHECK(aclrtMemcpyAsync(hostOut, bytes, dev, bytes, ACL_MEMCPY_DEVICE_TO_HOST, stream));
    CHECK(aclrtMemPoolFreeAsync(dev, stream));
    /* The free returns the block at once, without waiting for the stream. */
    EXPECT(PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == 0);
    /* A second free of the same pointer is an error. */
    CHECK_FAILS(aclrtMemPoolFreeAsync(dev, stream), ACL_ERROR_INVALID_PARAM);

    CHECK(aclrtSynchronizeStream(stream));
    EXPECT(memcmp(hostIn, hostOut, bytes) == 0);

    uint64_t usedHigh = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH);
    uint64_t reservedHigh = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH);
    uint64_t reserved = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT);
    printf("used high %llu, reserved high %llu, reserved after synchronize %llu\n",
           (unsigned long long)usedHigh, (unsigned long long)reservedHigh,
           (unsigned long long)reserved);
    EXPECT(usedHigh == bytes);
    EXPECT(reservedHigh >= bytes);
    /* Threshold 0: the synchronize released the cached memory. */
    EXPECT(reserved == 0);

    CHECK(aclrtMemPoolDestroy(pool));
    CHECK(aclrtFreeHost(hostIn));
    CHECK(aclrtFreeHost(hostOut));
    CHECK(aclrtDestroyStream(stream));
    CHECK(aclrtResetDevice(deviceId));
    CHECK(aclFinalize());
    printf("pool_lifecycle: ok\n");
    return 0;
}
