//! soma-capi: the CANN runtime C API subset (`libascendcl.so`) over the software NPU.
//!
//! C and C++ programs written for CANN that use only the subset (the functions declared by
//! the headers in `crates/ascend-sys/include/acl/`) compile unchanged and link against this library
//! (`-lascendcl`). The `aclrtMemPool*` functions are served by the soma-core pool engine;
//! everything else by the software NPU (`soma-sim`) through soma-core's typed handles, so
//! that stream, event and device synchronisations apply pools' release thresholds.
//!
//! The per-function table, the deliberate differences from CANN and the environment
//! variables are in `docs/c-api.md`.
//!
//! # Design
//!
//! | concern | how |
//! |---|---|
//! | runtime | one process-wide runtime, started by `aclInit` or lazily by the first call; configured once from `SOMA_SIM_DEVICES`, `SOMA_SIM_CAPACITY`, `SOMA_SIM_PRODUCT`, `SOMA_SIM_LATENCY` |
//! | handles | opaque, never-reused integers validated against a table of live objects per kind (stream, event, context, pool, physical memory): a destroyed, foreign or mistyped handle is an error, never a dereference |
//! | memory | an index of `aclrtMalloc` blocks, reservations and the device regions handed out; `aclrtMallocHost` blocks in their own table |
//! | threads | every function may be called from any thread; the current device is per thread (`aclrtSetDevice`, `aclrtCreateContext`, `aclrtSetCurrentContext`); without one, device 0 is implied |
//! | errors | every exported body runs in `catch_unwind`; an error sets the thread's `aclGetRecentErrMsg` text, prefixed with the function's name |
//!
//! The functions are also callable from Rust through the rlib (the crate's tests do that):
//!
//! ```
//! use ascend_sys::{aclrtMemPoolAttr, aclrtMemPoolProps, AclError};
//! use ascendcl::*;
//!
//! let mut props = aclrtMemPoolProps::default(); // PINNED, HOST location: fix the location
//! props.location.type_ = ascend_sys::aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE;
//! props.maxSize = 64 << 20;
//! let (mut pool, mut stream, mut ptr) =
//!     (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
//! // SAFETY: every pointer argument is valid.
//! unsafe {
//!     assert_eq!(aclrtSetDevice(0), AclError::SUCCESS);
//!     assert_eq!(aclrtCreateStream(&mut stream), AclError::SUCCESS);
//!     assert_eq!(aclrtMemPoolCreate(&mut pool, &props), AclError::SUCCESS);
//!     assert_eq!(aclrtMemPoolMallocAsync(&mut ptr, 1000, pool, stream), AclError::SUCCESS);
//!     let mut used = 0u64;
//!     let attr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT;
//!     assert_eq!(aclrtMemPoolGetAttr(pool, attr, (&mut used as *mut u64).cast()), AclError::SUCCESS);
//!     assert_eq!(used, 1024); // rounded to the pool's 512-byte alignment
//! }
//! assert_eq!(aclrtMemPoolFreeAsync(ptr, stream), AclError::SUCCESS);
//! assert_eq!(aclrtMemPoolFreeAsync(ptr, stream), AclError::ERROR_INVALID_PARAM); // double free
//! assert_eq!(aclrtSynchronizeStream(stream), AclError::SUCCESS);
//! assert_eq!(aclrtMemPoolDestroy(pool), AclError::SUCCESS);
//! assert_eq!(aclrtDestroyStream(stream), AclError::SUCCESS);
//! ```

// The exported functions carry CANN's names and parameter names.
#![allow(non_snake_case)]

mod device;
mod error;
mod ipc;
mod memory;
mod model;
mod peer;
mod pool;
mod runtime;
mod stream;
mod vmm;

pub use device::*;
pub use error::ACL_ERROR_RT_INTERNAL_ERROR;
pub use ipc::*;
pub use memory::*;
pub use model::*;
pub use peer::*;
pub use pool::*;
pub use stream::*;
pub use vmm::*;
