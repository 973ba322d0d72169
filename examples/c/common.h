/*
 * common.h - CHECK / EXPECT macros shared by the C examples, in the style of CANN's samples.
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#ifndef SOMA_EXAMPLES_COMMON_H_
#define SOMA_EXAMPLES_COMMON_H_

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "acl/acl.h"

/* Calls an ACL function; on failure prints the call, its code and aclGetRecentErrMsg(), and
 * exits with status 1. */
#define CHECK(call)                                                                        \
    do {                                                                                   \
        aclError ret_ = (call);                                                            \
        if (ret_ != ACL_SUCCESS) {                                                         \
            fprintf(stderr, "%s:%d: %s failed: error %d: %s\n", __FILE__, __LINE__, #call, \
                    ret_, aclGetRecentErrMsg());                                           \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* Calls an ACL function that must fail with `code`; prints the error message it gave. */
#define CHECK_FAILS(call, code)                                                             \
    do {                                                                                    \
        aclError ret_ = (call);                                                             \
        if (ret_ != (code)) {                                                               \
            fprintf(stderr, "%s:%d: %s returned %d, expected %d\n", __FILE__, __LINE__,     \
                    #call, ret_, (code));                                                   \
            exit(1);                                                                        \
        }                                                                                   \
        printf("  expected error %d from %s: %s\n", ret_, #call, aclGetRecentErrMsg());     \
    } while (0)

/* Asserts a condition about the results; exits with status 2 when it does not hold. */
#define EXPECT(cond)                                                                       \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: expectation failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(2);                                                                       \
        }                                                                                  \
    } while (0)

#define MIB ((size_t)1 << 20)

/* Reads a uint64_t pool attribute. */
static inline uint64_t PoolAttr64(aclrtMemPool pool, aclrtMemPoolAttr attr)
{
    uint64_t value = 0;
    CHECK(aclrtMemPoolGetAttr(pool, attr, &value));
    return value;
}

/* Reads a uint32_t pool attribute (the reuse switches). */
static inline uint32_t PoolAttr32(aclrtMemPool pool, aclrtMemPoolAttr attr)
{
    uint32_t value = 0;
    CHECK(aclrtMemPoolGetAttr(pool, attr, &value));
    return value;
}

/* Pool properties for device `deviceId` with the given maximum size. */
static inline aclrtMemPoolProps PoolProps(int32_t deviceId, size_t maxSize)
{
    aclrtMemPoolProps props;
    memset(&props, 0, sizeof(props));
    props.allocType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    props.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    props.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = (uint32_t)deviceId;
    props.maxSize = maxSize;
    return props;
}

#endif /* SOMA_EXAMPLES_COMMON_H_ */
