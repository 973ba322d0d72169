//! soma-capi: the CANN runtime C API subset (`libascendcl.so`) over the software NPU.
//!
//! C and C++ programs written for CANN that use only the subset (`ACL_SUBSET.md`; headers in
//! `crates/ascend-sys/include/acl/`) compile unchanged and link against this library
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
//! The functions are also callable from Rust through the rlib (the crate's tests do that).

// The exported functions carry CANN's names and parameter names.
#![allow(non_snake_case)]

mod device;
mod error;
mod memory;
mod pool;
mod runtime;
mod stream;
mod vmm;

pub use device::*;
pub use error::ACL_ERROR_RT_INTERNAL_ERROR;
pub use memory::*;
pub use pool::*;
pub use stream::*;
pub use vmm::*;
