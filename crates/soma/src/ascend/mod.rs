//! The `ascend` backend: the soma-core driver HAL over the CANN runtime (feature `ascend`).
//!
//! # Layers
//!
//! | Level | Where | What |
//! |---|---|---|
//! | sys | [`ascend_sys`] (re-exported as [`sys`]) | generated bindings, [`Acl`] (the library opened with `dlopen`), [`AclError`] |
//! | result | `raw` (crate-private) | one function per C call, grouped as CANN's docs are (`device::set`, `stream::create`, `event::record`, `vmm::map`, `pool::malloc_async`, `mdl::capture_begin`…), returning `Result` with the runtime's message |
//! | HAL | [`AscendDevice`], [`AscendStream`], [`AscendEvent`], [`AscendGraph`] | [`DeviceHal`](soma_core::hal::DeviceHal), [`StreamHal`](soma_core::hal::StreamHal), [`EventHal`](soma_core::hal::EventHal), [`GraphHal`](soma_core::hal::GraphHal) |
//! | CANN's pool | [`NativePool`] | `aclrtMemPool*`, checked |
//!
//! # Getting a device
//!
//! ```no_run
//! use std::sync::Arc;
//! use soma::ascend::{self, Acl};
//! use soma_core::hal::DeviceHal;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // SAFETY: libascendcl.so, where found, is the CANN runtime.
//! let acl = Arc::new(unsafe { Acl::load() }?);
//! for dev in ascend::devices(acl)? {
//!     println!("{:?}", dev.info());
//! }
//! # Ok(()) }
//! ```
//!
//! [`Acl::open`] takes an explicit path instead, e.g. soma's own `libsoma_capi.so`, which
//! serves the same C API over the software NPU.
//!
//! # Behaviour worth knowing
//!
//! * **Initialisation.** `aclInit(NULL)` runs once per [`Acl`] on first use;
//!   `ACL_ERROR_REPEAT_INITIALIZE` (another component initialised the process) is accepted.
//!   soma never calls `aclFinalize` (the process may have other users of the runtime).
//! * **Current device.** CANN's current device is per thread. Every call first makes its device
//!   current with `aclrtSetDevice`, skipped when soma already made the same device current on
//!   that thread (one thread-local read). The cache assumes nothing else changes the current
//!   device of a thread between soma calls; code that changes it (calls `aclrtSetDevice` /
//!   `aclrtSetCurrentContext` itself) on a thread soma also uses must call
//!   [`forget_current_device`] afterwards. `aclrtResetDevice` is never called (CANN counts
//!   `aclrtSetDevice` calls per device; the cache keeps that count at one per thread and
//!   device in the common case).
//! * **Stream positions** are counted by the backend; see [`AscendStream`]'s module docs:
//!   completion is learnt at synchronize / successful query / event completion / host function
//!   completion, never by extra tasks, and passed on along event waits: a stream past a wait
//!   has had the event's record complete on the recording stream.
//! * **Validation.** Device ranges given to copies and memsets must lie in memory mapped,
//!   `malloc`'d or allocated from a [`NativePool`] through this backend
//!   ([`DriverError::InvalidAddress`](soma_core::hal::DriverError::InvalidAddress) otherwise);
//!   `unmap` and `free` fail while an enqueued copy or memset on the range has not completed.
//! * **Peer access** (`aclrtDeviceEnablePeerAccess`, made with the device current) is
//!   tracked per device: after it, ranges of the peer's memory are valid in the device's
//!   copies and memsets (checked against the peer's bookkeeping, under its memory lock; the
//!   use is in the peer's in-flight table, so the peer's `unmap` and `free` wait for it), and a
//!   stream may wait on events of any device of the same library.
//! * **Host functions** run on a runtime thread; a panic is caught and becomes the stream's
//!   sticky [`TaskFailed`](soma_core::hal::DriverError::TaskFailed) error (returned by every
//!   later synchronize / query). CANN does not skip the stream's later tasks after it. A host
//!   function must not block on its own stream (synchronize it, or drop the last handle to it):
//!   the stream cannot progress until the function returns. If the runtime never calls a
//!   launched host function (device lost), its closure is leaked, never freed twice.
//! * **Graph capture** is CANN's (`aclmdlRICapture*`, [`AscendGraph`] over `aclmdlRI`): the
//!   backend mirrors which streams capture so that captured tasks take no position (a wait
//!   enqueued while a capture is active asks `aclmdlRICaptureGetInfo` whether the stream
//!   joined it). A stream is drained before it begins or joins a capture, and a device
//!   synchronisation during a capture drains the other streams first, so that the runtime's
//!   refusal comes after the drain the HAL promises. A launch is `aclmdlRIExecuteAsync` and
//!   the record of an event of the graph (one position); dropping the graph waits for those
//!   events, then destroys the model. Captured host functions must be replayable
//!   ([`StreamHal::host_fn_replayable`](soma_core::hal::StreamHal::host_fn_replayable)); a
//!   panic in one during a launch becomes the device's deferred error. Memory used by captured
//!   copies and memsets is not in the in-flight table (it is used at launches).
//! * **Kernels** written as Rust closures are not supported (they run on the software NPU
//!   only): [`StreamHal::launch`](soma_core::hal::StreamHal::launch) returns
//!   [`Unsupported`](soma_core::hal::DriverError::Unsupported).
//! * **Errors** map as: `ACL_ERROR_RT_MEMORY_ALLOCATION`, `ACL_ERROR_BAD_ALLOC` →
//!   `OutOfMemory`; `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`, `ACL_ERROR_FEATURE_UNSUPPORTED` and a
//!   function missing from the library → `Unsupported`; `ACL_ERROR_RT_INVALID_HANDLE`,
//!   `ACL_ERROR_INVALID_RESOURCE_HANDLE` → `InvalidHandle`; `ACL_ERROR_INVALID_PARAM`,
//!   `ACL_ERROR_RT_PARAM_INVALID` → `InvalidValue`; the capture status codes → `Capture` of
//!   the matching kind; anything else → `Native { code, message }`
//!   with `aclGetRecentErrMsg`'s text. Errors in `Drop` (stream / event / pool destruction) are
//!   kept by the device and returned by its next fallible call.

mod capture;
mod conv;
mod device;
mod event;
mod ipc;
mod native_pool;
mod peer;
mod ranges;
mod raw;
mod stream;
mod waits;

#[cfg(test)]
mod tests;

pub use ascend_sys as sys;
pub use ascend_sys::{Acl, AclError, LoadError};
pub use capture::AscendGraph;
pub use device::{device_count, devices, forget_current_device, AscendDevice, DEFAULT_GRANULARITY};
pub use event::AscendEvent;
pub use native_pool::{attr_width, AttrWidth, NativePool};
pub use stream::{AscendStream, AscendStreamExt};
