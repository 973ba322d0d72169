//! soma-core: the driver HAL trait, typed device handles, happens-before tracking and the
//! stream-ordered pool engine.
//!
//! Users depend on `soma`, which re-exports everything here together with the backends.
//!
//! | module | what it holds |
//! |---|---|
//! | [`hal`] | the object-safe driver traits every backend implements |
//! | [`engine`] | the pool's bookkeeping over an offset space: pure, safe, device-free |
//! | [`Device`], [`Stream`], [`Event`] | typed handles; they feed the happens-before knowledge |
//! | [`Graph`], [`CaptureMode`] | graph capture: a stream's work recorded once, launched many times |
//! | [`MemPool`], [`PoolAlloc`], [`attr`] | the stream-ordered pool and its typed attributes |

pub mod hal;
pub mod observe;

mod buffer;
mod clock;
mod completion;
mod device;
mod error;
mod event;
mod graph;
mod host;
mod owned;
mod pool;
mod stream;
mod sync;
mod view;

/// The pool's bookkeeping over an offset space (the `soma-engine` crate).
pub use soma_engine as engine;
pub use soma_engine::ReuseKind;

pub use buffer::{BufferOwner, DeviceBuffer, DeviceBufferMut, DriverAlloc};
pub use clock::VectorClock;
pub use completion::{EventWait, StreamSync};
pub use device::{Device, MAX_STREAMS};
pub use error::{Bytes, Error, IpcErrorKind, OutOfMemory, Result};
pub use event::{elapsed_ms, Event};
pub use graph::Graph;
pub use hal::{CaptureInfo, CaptureMode, CaptureStatus};
pub use host::{HostBuffer, HostTransfer};
pub use owned::OwnedStream;
pub use pool::attr;
pub use pool::{
    ExportedPointer, GraphMemoryOwner, GraphMemoryStats, GraphPool, HandleType, ImportedAlloc,
    ImportedPool, MemPool, MemPoolBuilder, OomAction, OomHook, OwnedAlloc, OwnedPool, PoolAlloc,
    PoolDescriptor, PoolStats, ReuseCounts, ReusePolicy,
};
pub use stream::{KernelArg, Stream};
pub use view::{SplitMut, View, ViewMut};

/// The free ring, public only for its loom model (`tests/loom.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use pool::free_ring;

/// The device's stream slots, public only for their loom model (`tests/loom.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use device::slots;
