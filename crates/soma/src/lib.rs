//! # soma — stream-ordered device memory pools for Ascend NPUs, in safe Rust
//!
//! A pool serves device memory to tensors and takes it back without a driver call and
//! without a stream synchronisation; memory moves between streams only when a reuse rule
//! proves it safe; and the borrow checker rules out freeing onto a stream that no longer
//! exists.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use soma::{attr, MemPool};
//!
//! let npu = soma::sim::Npu::builder().build()?;          // software NPU (feature `sim`)
//! let dev = npu.device(0)?;
//! let s1 = dev.create_stream()?;                          // Stream<'d>
//! let pool = MemPool::builder().max_size(8 << 30).build(&dev)?;
//! let host = vec![1.0f32; 1 << 20];
//! let mut x = pool.alloc_async::<f32>(1 << 20, &s1)?;    // PoolAlloc<'_, f32>, usable on s1
//! s1.copy_from_host(&mut x, &host)?;                      // stream-ordered copy
//! drop(x);                                                // freed onto s1: no sync
//! let used: u64 = pool.get::<attr::UsedMemCurrent>()?;   // typed attributes
//! assert_eq!(used, 0);
//! pool.set::<attr::ReleaseThreshold>(1 << 30)?;
//! # Ok(()) }
//! ```
//!
//! ## The layers
//!
//! | layer | crate / module | what it is |
//! |---|---|---|
//! | raw FFI | `ascend-sys` | bindgen output over headers written from CANN's documented API, loaded at run time |
//! | driver HAL | [`hal`] | object-safe traits a backend implements: memory, streams, events |
//! | backends | [`sim`] (default), `ascend` (feature) | the software NPU; the CANN runtime |
//! | typed handles | [`Device`], [`Stream`], [`Event`] | they feed the pool's happens-before knowledge |
//! | graph capture | [`Graph`], [`CaptureMode`] | a stream's work recorded once and launched many times (CANN's model runtime instance) |
//! | the pool | [`MemPool`], [`PoolAlloc`], [`attr`] | stream-ordered allocation |
//!
//! ## CPU concepts and their device counterparts
//!
//! | on the CPU | on the device, with soma |
//! |---|---|
//! | `Vec<T>` / `Box<[T]>` | [`PoolAlloc<'s, T>`](PoolAlloc) — freed onto its stream when dropped; [`OwnedAlloc<T>`](OwnedAlloc) — the same without lifetimes, for engines |
//! | `&v[a..b]`, `&mut v[a..b]` | [`View`], [`ViewMut`] from `slice` / `slice_mut` ([`prelude`]) |
//! | `Arc<T>` handed to threads | [`OwnedPool`], [`OwnedStream`]: `Clone + Send + Sync + 'static` |
//! | page-locked I/O buffers | [`HostBuffer`], lent to a stream by an async copy until it completes |
//! | a `JoinHandle` / future | [`Event::wait_async`], [`Stream::synchronize_async`], [`HostTransfer`] |
//! | a thread | a [`Stream`]: work runs in order, asynchronously to the host |
//! | the global allocator | a [`MemPool`]: a virtual range, physical memory mapped on demand |
//! | a happens-before edge (join, channel) | an [`Event`] recorded on one stream and waited on by another |
//! | `std::alloc::System` | [`DriverAlloc`]: the driver's `malloc`, synchronising at every free |
//!
//! ## Reuse rules
//!
//! A block freed on stream S may be reused on S at once; on another stream T when T waited
//! on an event recorded on S after the free (through any chain of streams), when the free
//! has completed (opportunistic), when the pool inserts the dependency itself (internal), or
//! when the host synchronised after the free. See [`ReusePolicy`] and `docs/semantics.md`.

pub use soma_core::hal;
pub use soma_core::observe;
pub use soma_core::{
    attr, elapsed_ms, BufferOwner, Bytes, CaptureInfo, CaptureMode, CaptureStatus, Device,
    DeviceBuffer, DeviceBufferMut, DriverAlloc, Error, Event, EventWait, ExportedPointer, Graph,
    GraphMemoryOwner, GraphMemoryStats, GraphPool, HandleType, HostBuffer, HostTransfer,
    ImportedAlloc, ImportedPool, IpcErrorKind, KernelArg, MemPool, MemPoolBuilder, OomAction,
    OutOfMemory, OwnedAlloc, OwnedPool, OwnedStream, PoolAlloc, PoolDescriptor, PoolStats, Result,
    ReuseCounts, ReuseKind, ReusePolicy, SplitMut, Stream, StreamSync, View, ViewMut, MAX_STREAMS,
};

/// The traits whose methods every program uses (`slice`, `cast`, `record_use`…):
/// `use soma::prelude::*;`.
pub mod prelude {
    pub use soma_core::{BufferOwner, DeviceBuffer, DeviceBufferMut};
}

/// The `bytemuck` crate soma's element bounds use (`Pod`): derive `Pod` for your own element
/// types without adding the dependency yourself.
pub use bytemuck;

/// Half-precision element types (feature `half`, on by default): `PoolAlloc<'_, f16>` and
/// `bf16` buffers work like any other element type.
#[cfg(feature = "half")]
pub use half::{bf16, f16};

#[cfg(feature = "ascend")]
pub mod ascend;

#[cfg(feature = "sim")]
pub mod sim;
