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

pub mod engine;
pub mod hal;
pub mod observe;

mod buffer;
mod clock;
mod device;
mod error;
mod event;
mod graph;
mod pool;
mod stream;
mod sync;

pub use buffer::{BufferOwner, DeviceBuffer, DriverAlloc};
pub use clock::VectorClock;
pub use device::{Device, MAX_STREAMS};
pub use error::{Bytes, Error, OutOfMemory, Result};
pub use event::{elapsed_ms, Event};
pub use graph::Graph;
pub use hal::{CaptureInfo, CaptureMode, CaptureStatus};
pub use pool::attr;
pub use pool::{
    MemPool, MemPoolBuilder, OomAction, OomHook, PoolAlloc, PoolStats, ReuseCounts, ReusePolicy,
};
pub use stream::{KernelArg, Stream};

/// The free ring, public only for its loom model (`tests/loom.rs`).
#[cfg(loom)]
#[doc(hidden)]
pub use pool::free_ring;
