/*
 * acl.h - entry header of the AscendCL (CANN runtime) C API subset declared by soma-rs:
 * process initialisation and error messages; includes the runtime and pool headers.
 *
 * Written by the soma-rs project from the public AscendCL documentation (declarations only).
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#ifndef INC_EXTERNAL_ACL_ACL_H_
#define INC_EXTERNAL_ACL_ACL_H_

#include "acl_base.h"
#include "acl_rt.h"
#include "acl_rt_memory_soma.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Initialises AscendCL; once per process. configPath may be NULL (no configuration). */
ACL_FUNC_VISIBILITY aclError aclInit(const char *configPath);

/* Deinitialises AscendCL; once per process, after every other call. */
ACL_FUNC_VISIBILITY aclError aclFinalize(void);

/* The text of the last error raised on the calling thread (never NULL in CANN; may be ""). */
ACL_FUNC_VISIBILITY const char *aclGetRecentErrMsg(void);

#ifdef __cplusplus
}
#endif

#endif /* INC_EXTERNAL_ACL_ACL_H_ */
