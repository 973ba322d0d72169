/*
 * acl_rt_memory_soma.h - the stream-ordered memory pool part of the AscendCL (CANN runtime)
 * C API subset declared by soma-rs (aclrtMemPool*).
 *
 * Written by the soma-rs project from the public AscendCL documentation, including the
 * documented rules of the pool API (docs/c-api.md gives them with soma-capi's behaviour).
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#ifndef INC_EXTERNAL_ACL_ACL_RT_MEMORY_SOMA_H_
#define INC_EXTERNAL_ACL_ACL_RT_MEMORY_SOMA_H_

#include <stddef.h>
#include <stdint.h>

#include "acl_base.h"
#include "acl_rt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A stream-ordered memory pool of one device. */
typedef void *aclrtMemPool;

/* Pool attributes: the value type of each is given in its comment. */
typedef enum aclrtMemPoolAttr {
    ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES = 0x1,   /* uint32_t, 0 or 1 */
    ACL_RT_MEM_POOL_REUSE_ALLOW_OPPORTUNISTIC = 0x2,         /* uint32_t */
    ACL_RT_MEM_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 0x3, /* uint32_t */
    ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD = 0x4,            /* uint64_t, default 0 */
    ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT = 0x5,         /* uint64_t, read-only */
    ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH = 0x6,            /* uint64_t, set only to 0 */
    ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT = 0x7,             /* uint64_t, read-only */
    ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH = 0x8                 /* uint64_t, set only to 0 */
} aclrtMemPoolAttr;

/* Properties of a pool. allocType must be ACL_MEM_ALLOCATION_TYPE_PINNED, location.type
 * ACL_MEM_LOCATION_TYPE_DEVICE and every byte of reserved 0. maxSize is rounded up to the
 * allocation granularity; 0 means the device's total memory. */
typedef struct {
    aclrtMemAllocationType allocType;
    aclrtMemHandleType handleType;
    aclrtMemLocation location;
    size_t maxSize;
    unsigned char reserved[32];
} aclrtMemPoolProps;

ACL_FUNC_VISIBILITY aclError aclrtMemPoolCreate(aclrtMemPool *memPool,
                                                const aclrtMemPoolProps *poolProps);
ACL_FUNC_VISIBILITY aclError aclrtMemPoolDestroy(const aclrtMemPool memPool);
ACL_FUNC_VISIBILITY aclError aclrtMemPoolSetAttr(aclrtMemPool memPool, aclrtMemPoolAttr attr,
                                                 void *value);
ACL_FUNC_VISIBILITY aclError aclrtMemPoolGetAttr(aclrtMemPool memPool, aclrtMemPoolAttr attr,
                                                 void *value);
ACL_FUNC_VISIBILITY aclError aclrtMemPoolMallocAsync(void **ptr, size_t size,
                                                     aclrtMemPool memPool, aclrtStream stream);
ACL_FUNC_VISIBILITY aclError aclrtMemPoolFreeAsync(void *ptr, aclrtStream stream);
ACL_FUNC_VISIBILITY aclError aclrtMemPoolTrimTo(aclrtMemPool memPool, size_t minBytesToKeep);

#ifdef __cplusplus
}
#endif

#endif /* INC_EXTERNAL_ACL_ACL_RT_MEMORY_SOMA_H_ */
