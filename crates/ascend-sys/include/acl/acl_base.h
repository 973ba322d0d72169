/*
 * acl_base.h - base types and error codes of the AscendCL (CANN runtime) C API subset
 * declared by soma-rs.
 *
 * Written by the soma-rs project from the public AscendCL documentation; it declares only
 * the subset that soma-rs binds (ascend-sys) and serves (soma-capi, docs/c-api.md). A program that uses only the subset compiles unchanged against these
 * headers and against the CANN toolkit's headers of the same names.
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#ifndef INC_EXTERNAL_ACL_ACL_BASE_H_
#define INC_EXTERNAL_ACL_ACL_BASE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Symbol visibility of the API functions: exported when the implementation is built with
 * FUNC_VISIBILITY defined, plain declarations for users. */
#if defined(_MSC_VER)
#ifdef FUNC_VISIBILITY
#define ACL_FUNC_VISIBILITY _declspec(dllexport)
#else
#define ACL_FUNC_VISIBILITY
#endif
#else
#ifdef FUNC_VISIBILITY
#define ACL_FUNC_VISIBILITY __attribute__((visibility("default")))
#else
#define ACL_FUNC_VISIBILITY
#endif
#endif

/* The status every API function returns; ACL_SUCCESS (0) on success. */
typedef int aclError;

/* Opaque handles. */
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void *aclrtContext;

/* Error codes. */
static const int ACL_SUCCESS = 0;
/* Outside the subset, declared as CANN's own header does: older CANN samples test against
 * ACL_ERROR_NONE, and aclInit answers a repeated call with ACL_ERROR_REPEAT_INITIALIZE there
 * (this runtime accepts it, see docs/c-api.md). */
#define ACL_ERROR_NONE 0

static const int ACL_ERROR_INVALID_PARAM = 100000;
static const int ACL_ERROR_UNINITIALIZE = 100001;
static const int ACL_ERROR_REPEAT_INITIALIZE = 100002;

static const int ACL_ERROR_BAD_ALLOC = 200000;
static const int ACL_ERROR_INVALID_RESOURCE_HANDLE = 200005;
static const int ACL_ERROR_FEATURE_UNSUPPORTED = 200006;

static const int ACL_ERROR_RT_PARAM_INVALID = 107000;
static const int ACL_ERROR_RT_INVALID_HANDLE = 107017;
static const int ACL_ERROR_RT_WAIT_TIMEOUT = 107019;
/* Stream capture (aclmdlRICapture*). */
static const int ACL_ERROR_RT_CAPTURE_DEPENDENCY = 107024;
static const int ACL_ERROR_RT_STREAM_UNJOINED = 107025;
static const int ACL_ERROR_RT_MODEL_CAPTURED = 107026;
static const int ACL_ERROR_RT_STREAM_CAPTURED = 107027;
static const int ACL_ERROR_RT_EVENT_CAPTURED = 107028;
static const int ACL_ERROR_RT_STREAM_NOT_CAPTURED = 107029;
static const int ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT = 107030;
static const int ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT = 107031;
static const int ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED = 107036;

static const int ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000;
static const int ACL_ERROR_RT_MEMORY_ALLOCATION = 207001; /* out of device memory */
/* Outside the subset, as in CANN's header: what this runtime returns for a failed device task
 * or an injected fault (docs/c-api.md). */
static const int ACL_ERROR_RT_INTERNAL_ERROR = 507899;
static const int ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED = 507903;

#ifdef __cplusplus
}
#endif

#endif /* INC_EXTERNAL_ACL_ACL_BASE_H_ */
