//! Every allocator under test behind one trait, [`Allocator`].
//!
//! | type | what | unit / rounding | `reserved_high` is |
//! |---|---|---|---|
//! | [`SomaApi`] | soma's public API: `alloc_async::<u8>` → `PoolAlloc` dropped to free, on the software NPU | pool alignment (512 B default) | the pool's `reserved_high` (physical memory mapped, high-water) |
//! | [`SomaApi`] named `soma-recycle` / `soma-retain` ([`SomaApi::named`]) | the same over a pool built with `MemPool::builder().recycle_on_growth(true)`: growth unmaps free segments to stay near the reserved high-water mark / `(false)`, the default: growth never unmaps | pool alignment (512 B default) | the pool's `reserved_high` |
//! | [`SomaStreams`] named `soma-4-streams` | the public API with ops on 4 streams in turn (op `k` on stream `k mod 4`), frees on another stream than the allocation's handed off through an event first | pool alignment (512 B default) | the pool's `reserved_high` |
//! | [`SomaOwned`] | soma's owned API: `OwnedPool::alloc_async::<u8>` on an `OwnedStream` → `OwnedAlloc` dropped to free | pool alignment (512 B default) | the pool's `reserved_high` |
//! | [`SomaEngine`] | soma's engine alone with its default settings, over a counting fake backing, one stream whose frees count as complete | 512 B | the engine's `reserved_high` (bytes the fake backing had mapped, high-water) |
//! | [`SomaEngine`] named `soma-engine-retain` / `soma-engine-recycle` ([`SomaEngine::with_recycling`]`(…, false / true)`) | the engine alone with `Engine::set_recycle_on_growth(false)` (the default: growth only maps) / `(true)` | 512 B | the engine's `reserved_high` |
//! | [`OffsetAlloc`] | the `offset-allocator` crate (Sebastian Aaltonen's O(1) offset allocator) | 512 B units (its sizes are `u32`) | high-water end offset, rounded up to 2 MiB |
//! | [`Tlsf`] | a TLSF (rlsf's algorithm: 2-level bitmaps, good fit, immediate coalescing) over an offset space, with out-of-band block records | 512 B | high-water end offset, rounded up to 2 MiB |
//! | [`SomaReplica`] | CANN SOMA's algorithm: every request rounded up to 2 MiB, best fit over a `BTreeSet` of `(size, address)` free segments, neighbour merge | 2 MiB | high-water end offset (already 2 MiB multiples) |
//! | [`TorchNpu`] | torch_npu's caching allocator (PyTorch's `CUDACachingAllocator` on Ascend): 32 B pad, small pool ≤ 1 MiB in 2 MiB segments, 20 MiB segments under 10 MiB, best fit, split and merge within segments, segments cached until `empty_cache` | 512 B | Σ segments held, high-water |
//! | [`LlamaCppPrio`] | llama.cpp's CANN priority pool: one `aclrtMalloc` per buffer, smallest free buffer within 4 MiB of the request, free buffers > 1 MiB unused for 100 ms given back | 128 B | Σ buffers held, high-water |
//! | [`FirstFit`] | a first-fit free list: first fit over a free list sorted by offset, a merge pass over the whole list on every free | 512 B | high-water end offset, rounded up to 2 MiB |
//! | [`DriverPath`] | the plain driver: `DeviceHal::malloc` / `free` per allocation (soma-sim) | 2 MiB (the simulator rounds to its granularity) | high-water of Σ live granule-rounded sizes |
//!
//! Why not `rlsf` itself: rlsf manages *real* memory — it writes its block headers into the
//! pool it is given and hands out pointers — so it cannot serve an offset space (a device
//! range the host cannot touch) without backing that range with host memory. [`Tlsf`] is
//! the same algorithm with the headers kept in a side table, which is what a device pool
//! needs.
//!
//! The pure offset allocators (offset-allocator, TLSF, SOMA replica, first fit) carve a
//! conceptually unbounded range from address 0 upwards, as a pool that maps on demand at
//! the top of its used space would; "reserved" for them is the highest end offset ever
//! handed out, in granules. They never give memory back, so that is also what they would
//! have mapped.
//!
//! # Driver calls
//!
//! [`Allocator::driver_calls`] counts, by kind ([`DriverCalls`]), the driver calls an
//! allocator made, so that every figure can carry the modelled driver time
//! ([`crate::driver_cost`]); every allocator pays the same model:
//!
//! * soma (public API on one or several streams, owned API, engine): one physical allocation and one map per segment
//!   mapped, one unmap and one physical free per segment unmapped (the pool's, or the
//!   engine's counting backing's, map and unmap counts);
//! * the pure offset allocators: one physical allocation and one map each time an
//!   allocation ends beyond what is mapped, extending the mapping to that end in granules;
//!   never an unmap (CANN SOMA's own mapping is not documented: its replica is charged the
//!   same way);
//! * torch_npu: one `aclrtMalloc` per segment, one `aclrtFree` per segment `empty_cache`
//!   frees; llama.cpp: one `aclrtMalloc` per buffer, one `aclrtFree` per buffer cleaned;
//! * the driver path: one `malloc` per allocation, one `free` per free.
//!
//! The address-range reservation a pool makes when it is built is not counted: building an
//! allocator is not part of any replay.

mod driver;
mod first_fit;
mod growth;
mod llama_cpp;
mod offset;
#[cfg(test)]
mod replica_tests;
mod soma_pool;
mod soma_replica;
#[cfg(test)]
mod tests;
mod tlsf;
mod torch_npu;

pub use crate::driver_cost::DriverCalls;
pub use driver::DriverPath;
pub use first_fit::FirstFit;
pub use llama_cpp::LlamaCppPrio;
pub use offset::OffsetAlloc;
pub use soma_pool::{SomaApi, SomaEngine, SomaOwned, SomaStreams};
pub use soma_replica::SomaReplica;
pub use tlsf::Tlsf;
pub use torch_npu::TorchNpu;

/// Block size unit of every baseline that does not round to 2 MiB (soma's default alignment).
pub const UNIT: u64 = 512;

/// One allocator under test: allocate `bytes`, free by handle, report peak reserved memory
/// and driver calls.
///
/// Every benchmark and the replay tool drive allocators only through this trait, with static
/// dispatch, so each figure is the same loop for every allocator.
pub trait Allocator {
    /// What `alloc` returns and `free` takes back.
    type Handle;
    /// Short name used in benchmark ids and tables.
    fn name(&self) -> &'static str;
    /// Allocates `bytes` (> 0); `None` when out of memory.
    fn alloc(&mut self, bytes: u64) -> Option<Self::Handle>;
    /// Frees an allocation of this allocator.
    fn free(&mut self, handle: Self::Handle);
    /// Peak reserved bytes so far, per the definition in the [module docs](self).
    fn reserved_high(&self) -> u64;
    /// Driver calls so far, by kind, as the [module docs](self#driver-calls) define them.
    fn driver_calls(&self) -> DriverCalls;
}
