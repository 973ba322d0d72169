//! The pool engine's bookkeeping: pure, safe Rust over an offset space, testable without a
//! device (see DESIGN.md §4).
//!
//! The typed layer (`crate::pool`) owns one [`Engine`] per pool behind a mutex and talks to
//! the device only through the [`Backing`] it passes in. The engine hands out *offsets* in
//! `[0, range_size)` and never touches memory (like offset-allocator): it decides which
//! granules are mapped, which block serves which request and which reuse rule justified it.
//!
//! # Structure
//!
//! * **Blocks** (`block.rs`): a slab of ≤ 64-byte records (56 bytes today) in one address-order
//!   list covering the whole range: `Live`, `Free` (tagged with a [`FreeTag`], or untagged =
//!   never used or *settled*, see below) and `Unmapped` blocks. Free neighbours coalesce when
//!   they carry the same stream (the result keeps the larger `pos`), when both are untagged,
//!   or when one was never used (the result takes the other's tag); a settled block joins
//!   another stream's tagged block only while that stream is the only one freeing since the
//!   last settle. Tagged blocks of different streams never merge, nothing merges across
//!   unmapped space.
//! * **Free indices** (`tlsf.rs`): one two-level segregated-fit index (rlsf-style bitmaps) per
//!   stream slot that has freed memory, created lazily on that stream's first free, plus one
//!   for untagged memory. O(1) insert / remove / class search.
//! * **Segments**: every [`Backing::map`] call creates one segment; segments are unmapped
//!   whole, exactly as mapped, and only when every byte is free and no in-flight work can
//!   touch it (untagged, or [`StreamOrder::is_complete`]). A bitset of segment boundaries
//!   (`bounds.rs`, one bit per granule) lists the segments inside a free block for recycling.
//!
//! # Search order of [`Engine::alloc`] (request of stream `T`)
//!
//! 1. **`T`'s own cached blocks and untagged (never used) blocks**: best fit among the two
//!    indices (the smaller fitting block wins; on a tie `T`'s own). Each index is searched by
//!    scanning the request's own size class (at most [`OWN_CLASS_SCAN`] blocks, for exact
//!    fits such as the block `T` just freed) and then taking the first block of the first
//!    non-empty class whose every member fits (TLSF good fit). Reported as
//!    [`ReuseKind::SameStream`] or `None` (fresh).
//! 2. **Other streams' eligible blocks**: for every other stream with cached blocks, one call
//!    of [`StreamOrder::eligibility`]; a block freed at `pos` is eligible when
//!    `pos < host_observed` ([`ReuseKind::HostSynchronized`]), else `pos < event`
//!    ([`ReuseKind::EventDependency`]), else `pos < completed`
//!    ([`ReuseKind::Opportunistic`]) — the kind reported is the first rule that holds in that
//!    order. Best fit across streams; per stream at most [`CROSS_STREAM_BUDGET`] blocks are
//!    examined when only some of its blocks are eligible (when all are — every `pos` is below
//!    the bound — the search is the plain O(1) good fit).
//! 3. **Growth** (maps memory, see below): extending an eligible free block adjacent to
//!    unmapped space, else a new run in the lowest unmapped hole that fits; before mapping
//!    above the all-time reserved high, fully free *recyclable* segments elsewhere are
//!    unmapped so that peak reserved memory does not grow while free physical memory sits
//!    idle. On [`BackingError::OutOfMemory`] (or when no unmapped hole is large enough),
//!    recyclable free segments are released like [`Engine::release`] does (highest first)
//!    until at least the request's size went back, and growth is retried once.
//! 4. **Internal dependency** (only if [`StreamOrder::internal_dependencies`]; before step 3
//!    instead after [`Engine::set_dependency_before_growth`]): best fit among
//!    any other stream's cached blocks (bounded like step 2); the returned
//!    [`Allocation::dependency`] is the block's tag, which the caller must turn into a real
//!    event wait.
//! 5. Otherwise [`AllocError::OutOfMemory`] with an [`OomInfo`] that lists, per stream, the
//!    cached bytes that were not eligible and the position to wait for.
//!
//! Internal dependencies come *after* growth, as in CUDA: its programming guide (stream
//! ordered allocator, reuse policies) describes `cudaMemPoolReuseAllowInternalDependencies`
//! as the fallback taken after failing to allocate and map more physical memory — only then
//! does the driver look for memory that depends on another stream's pending progress.
//! Rationale: an inserted dependency serialises two streams for the rest of their work — a
//! cost the user cannot see and that can be far larger than a map call — while growth costs
//! a driver call and, thanks to recycling, little extra peak memory. Under memory pressure
//! the dependency is taken rather than failing.
//!
//! # Growth and recycling
//!
//! Growth is address ordered and maps whole granules only. The engine either maps the
//! granules missing to extend an eligible free block that borders an unmapped hole (on
//! either side; the smallest mapping wins, ties to the lower address), or, when no such
//! extension fits, `round_up(size, granularity)` at the start of the lowest hole that fits;
//! the rest of the last granule becomes untagged free memory that small allocations share.
//! Newly mapped memory the block does not cover stays untagged.
//!
//! A growth of `n` bytes is mapped as several segments (one [`Backing::map`] call each): the
//! largest power of two `<= n / 4`, at least one granule and at least the power of two
//! below 1/512 of the reserved memory (within `n`), aligned to its size (capped by
//! [`Engine::set_max_segment`]). Segments are the unit of unmapping, so a large block whose
//! space is later reused by smaller ones can still give back its unused quarters. Measured
//! on the PyTorch traces (see `tests/traces.rs`): one segment per growth leaves peak
//! reserved / peak used at up to 1.088, four per growth at up to 1.026, one per granule at up
//! to 1.018 — for 1×, ~6× and ~12× the map calls (measured before recycling took the
//! smallest free blocks first; four per growth now gives up to 1.033).
//!
//! The 4 adapts: when recycling falls short of the excess while the recyclable free blocks
//! hold more whole granules than it found in whole segments — free memory in segments that
//! live blocks still touch — and the growth leaves more than 1/64 of the live bytes mapped
//! beyond them, later growths use twice as many segments, up to 16
//! (`growth::MAX_SPLIT_BOOST`, `growth::REFINE_ABOVE`). Workloads whose recycling never falls
//! short keep four and their map calls; on a GPT-2 request stream whose attention
//! temporaries interleave with a growing KV cache four fixed gave 1.081, adaptive 1.023
//! (BERT: 1.033 -> 1.008). [`Engine::set_segments_per_growth`] fixes the count instead.
//!
//! **Recycling.** When a growth would raise `reserved` above its all-time high, the engine
//! first unmaps fully free segments elsewhere whose free blocks are untagged or complete per
//! [`StreamOrder::is_complete`] (the device can no longer touch them), taken from the
//! *smallest* free blocks up — large free blocks stay whole to serve the requests they fit,
//! as in best fit — and, among the fewest such candidates that cover the excess, the
//! smallest segment that covers what remains, else the largest, until the excess is recycled
//! or no candidate is left. Candidates are first the segments inside one free block of at least one granule
//! (found through the free indices and a bitset of segment boundaries); when those do not cover the excess, an exhaustive scan
//! also finds segments covered by several free blocks (such as blocks of different streams,
//! which never merge). Memory freed on the requesting stream but not complete is *not*
//! recycled: unmapping takes effect on the host immediately, not in stream order, so
//! in-flight work could still touch it. Below the all-time high nothing is recycled: mapping
//! then costs no peak memory, and recycling would only add driver calls.
//!
//! Recycling trades driver calls for peak memory. On workloads whose shapes vary (the BERT
//! trace, RMM's `random_allocations` with sizes up to 64 MiB and more) it keeps remapping in
//! steady state — on the BERT trace about one unmap per 6 allocations, for a peak of 1.008×
//! instead of 1.084× the live bytes; with uniformly random sizes up to 64 MiB about one per
//! 3.6 allocations, up to 256 MiB about one per 1.2 until recycling pauses (below; recycling
//! from the largest free blocks as well, before the smallest-first order, took 3.5–4× as
//! many). [`Engine::set_recycle_on_growth`]`(false)` turns it off: growth only maps, the pool
//! converges to what the workload needs and then makes no driver calls.
//!
//! Recycling pauses when it has become chronic: when more than 64 growths within 512
//! allocations each recycled, growth stops recycling for the next 4096 allocations and maps
//! above the all-time high instead (`growth::RECYCLE_BURST`; counted in
//! [`EngineStats::recycling_pauses`]). The high rises to what the workload's fragmentation
//! needs, which ends the churn: on `random_allocations` with sizes up to 256 MiB one pause
//! takes the peak from about 1.09× to 1.2× the live bytes (TLSF's) and the warm replays from
//! one map per two allocations to none. The PyTorch traces never pause (at most 28 recycling
//! growths in 512 allocations).
//!
//! **Settling.** [`Engine::settle`] (the pool calls it after every host synchronisation)
//! untags the free blocks whose frees the host has observed and merges them with the untagged
//! free blocks beside them, whatever stream freed those: every stream may use that memory
//! under any policy, and without it memory freed by several streams stays in per-stream
//! pieces. A settled block remembers the stream that freed it, for the reuse statistics and
//! for merging with that stream's later frees; with another stream's tagged blocks it merges
//! only while that stream frees alone (merged while several streams free, it would wait for
//! that stream's latest free before the others could use it: BERT replayed round-robin over
//! four streams, 8 runs with a synchronisation between them, 4.43 of peak used instead of
//! 2.06). Runs of a trace on four streams in turn with a synchronisation between them then
//! place within 0.5 % of runs on one stream (`tests/traces.rs`,
//! `synchronized_runs_on_streams_in_turn_place_as_on_one_stream`).
//!
//! **Packing.** Recycling leaves unmapped holes between mapped segments. When the engine
//! has emptied (nothing live) and segments were unmapped since it last packed, its next
//! allocation first moves the free segments lying entirely above `reserved` bytes from the
//! start of the range into the lowest holes below (unmapped first, then the holes mapped:
//! `reserved` ends where it was and its high-water mark does not move; only segments no
//! in-flight work can touch move). A workload run again from empty then starts from one
//! mapped run, as the first run did from nothing. Without it, such a rerun places its
//! long-lived blocks (weights) between the holes, the partial granules beside them stay
//! mapped, and peak reserved creeps from run to run: on the BERT trace run again and again
//! from empty, 1.007 → 1.058–1.072 within 5–20 runs, a batched GPT-2 decode whose rows
//! retire 1.015 → 1.075; with packing 1.007 and 1.015 throughout (`tests/traces.rs`,
//! `trace_fragmentation_over_replays`). A run that keeps what it leaves live (weights
//! resident, as a server or training loop does) never empties and needs none: it converges
//! within 1.05 on its own.
//!
//! # Failure atomicity
//!
//! A failed [`Engine::alloc`] leaves every block as it was. The only lasting effect a failed
//! call can have is that recyclable free segments were unmapped (exactly accounted in
//! `reserved` and the unmap statistics) — physical memory the pool could give back anyway —
//! or, on an empty engine, moved by packing.
//!
//! # Complexity
//!
//! `alloc` without growth and `free` are O(1) in the number of blocks (O(streams) for the
//! cross-stream step); growth, packing, [`Engine::release`], [`Engine::relocate_lower`] and
//! the OOM report are O(n) in blocks or holes, always next to a driver call or on a cold
//! path.
//! Steady state allocates nothing on the host: records are recycled in the slab, free indices
//! live as long as the engine, the optional offset index keeps its capacity.

#![forbid(unsafe_code)]

mod block;
mod bounds;
mod growth;
mod invariants;
mod ops;
mod tlsf;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU64;

use block::{Kind, Slab, NIL};
use tlsf::FreeIndex;

use smallvec::SmallVec;

/// Index of a stream slot on a device (small, dense, recycled after the stream is dropped;
/// positions of a slot stay monotonic across its incarnations).
pub type StreamSlot = u32;

/// Which rule justified handing a cached block to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReuseKind {
    /// Rule 1: the block was freed on the requesting stream.
    SameStream,
    /// Rule 2: the requesting stream is ordered after the free through events.
    EventDependency,
    /// Rule 3: the free had already completed on the device.
    Opportunistic,
    /// Rule 4: the pool inserted an event dependency (the caller must make it real).
    InternalDependency,
    /// The host observed completion of the free (a synchronize, or the stream was dropped).
    HostSynchronized,
}

/// Where a freed block stands in stream order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreeTag {
    /// Stream the block was freed on.
    pub stream: StreamSlot,
    /// Tasks enqueued on that stream before the free.
    pub pos: u64,
}

/// Bounds, per other stream, under which that stream's cached blocks are eligible for the
/// requesting stream. A block freed on `s` at position `pos` is eligible when `pos < bound`.
/// A bound of 0 means "none by this rule".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Eligibility {
    /// Host observed completion (synchronize, event synchronize, stream dropped): always on.
    pub host_observed: u64,
    /// Rule 2 (follow event dependencies): the requesting stream's vector-clock entry for `s`
    /// (0 when the switch is off).
    pub event: u64,
    /// Rule 3 (opportunistic): `completed(s) + 1` (0 when the switch is off).
    pub completed: u64,
}

/// What the engine needs to know about stream order for one request or release.
pub trait StreamOrder {
    /// Eligibility bounds for blocks cached on stream `s` (never called for the requesting
    /// stream itself).
    fn eligibility(&self, s: StreamSlot) -> Eligibility;
    /// Rule 4: may the engine take any other stream's block, returning the dependency for the
    /// caller to insert?
    fn internal_dependencies(&self) -> bool;
    /// Whether the free `tag` has completed on the device (used before unmapping: memory that
    /// in-flight work may still touch is never unmapped).
    fn is_complete(&self, tag: FreeTag) -> bool;
}

/// The physical side, implemented by the pool over the driver HAL (and by fakes in tests).
pub trait Backing {
    /// Maps physical memory at `[offset, offset + size)` of the pool's range; both are
    /// multiples of the granularity. Returns a token the engine hands back to `unmap`.
    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError>;
    /// Unmaps exactly a range previously returned by `map` and frees its physical memory.
    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), BackingError>;
}

/// Why the backing could not map or unmap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackingError {
    /// The device has no physical memory left.
    OutOfMemory,
    /// Anything else (injected faults, driver errors); carried as text.
    Failed(String),
}

impl ReuseKind {
    /// All kinds, in declaration order (the order of [`EngineStats::reuses`]).
    pub const ALL: [ReuseKind; 5] = [
        ReuseKind::SameStream,
        ReuseKind::EventDependency,
        ReuseKind::Opportunistic,
        ReuseKind::InternalDependency,
        ReuseKind::HostSynchronized,
    ];

    /// Index of this kind in [`EngineStats::reuses`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// `Engine::solo_freer` before any free since the last settle.
const NO_FREER: StreamSlot = StreamSlot::MAX;
/// `Engine::solo_freer` once frees of two streams followed the last settle.
const SEVERAL_FREERS: StreamSlot = StreamSlot::MAX - 1;

/// Blocks examined in the request's own size class before the good-fit search (finds the
/// block the requesting stream just freed, which TLSF's round-up would miss).
pub const OWN_CLASS_SCAN: usize = 8;

/// Blocks examined per other stream when only some of its cached blocks are eligible.
///
/// Free lists are LIFO, so the most recent (least likely eligible) frees come first; an
/// eligible block hidden behind more than this many ineligible ones is not found and the
/// request grows instead.
pub const CROSS_STREAM_BUDGET: usize = 32;

/// Largest supported range (2^62 bytes), so that offset arithmetic never overflows.
pub const MAX_RANGE: u64 = 1 << 62;

/// Static configuration of an [`Engine`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Size of the pool's virtual range in bytes; a non-zero multiple of `granularity`, at
    /// most [`MAX_RANGE`].
    pub range_size: u64,
    /// Mapping granularity in bytes (a power of two, e.g. 2 MiB on Ascend).
    pub granularity: u64,
    /// Minimum alignment and size rounding of every block: a power of two, `>= 32` and
    /// `<= granularity` (default 512).
    pub alignment: u64,
    /// Keep an offset → live block index so that [`Engine::lookup`] works (the C API frees by
    /// pointer). Costs one hash-map entry per live block.
    pub index_by_offset: bool,
}

impl EngineConfig {
    /// The default alignment of a pool (512 B).
    pub const DEFAULT_ALIGNMENT: u64 = 512;

    /// A configuration with the default alignment and no offset index.
    pub fn new(range_size: u64, granularity: u64) -> EngineConfig {
        EngineConfig {
            range_size,
            granularity,
            alignment: Self::DEFAULT_ALIGNMENT,
            index_by_offset: false,
        }
    }
}

/// Names one block handed out by [`Engine::alloc`]. Stale ids (of freed and reused records)
/// never match a later block: the record's 32-bit generation, bumped every time the record
/// becomes live or vacant, is part of the id (a stale id could only alias after 2^31 reuses
/// of the same record).
///
/// Eight bytes, and so is `Option<BlockId>`: a block's generation is never 0 while it is
/// live (the bump that would wrap to 0 gives 1), so no id the engine hands out is the word 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockId(NonZeroU64);

/// What [`BlockId::from_raw`] makes of the word 0: the null record index with generation 0,
/// which names no block either.
const NO_BLOCK: NonZeroU64 = match NonZeroU64::new(0xffff_ffff) {
    Some(w) => w,
    None => panic!("the word is not 0"),
};

impl BlockId {
    fn new(idx: u32, generation: u32) -> BlockId {
        BlockId::from_raw((u64::from(generation) << 32) | u64::from(idx))
    }

    fn index(self) -> u32 {
        self.0.get() as u32
    }

    /// The id as one word, e.g. to keep it in an atomic (the pool's lock-free free ring):
    /// the record index in the low 32 bits, the generation in the high ones.
    pub fn to_raw(self) -> u64 {
        self.0.get()
    }

    /// The id [`to_raw`](Self::to_raw) gave. An arbitrary word is a valid `BlockId` value:
    /// the engine rejects ids that name no block. The round trip is exact for every id the
    /// engine hands out; 0, which names no block, comes back as another word that names none.
    pub fn from_raw(raw: u64) -> BlockId {
        BlockId(NonZeroU64::new(raw).unwrap_or(NO_BLOCK))
    }

    fn generation(self) -> u32 {
        (self.0.get() >> 32) as u32
    }
}

/// A successful allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The block, for [`Engine::free`].
    pub block: BlockId,
    /// Offset of the block in the pool's range (aligned as requested).
    pub offset: u64,
    /// Rounded size of the block.
    pub size: u64,
    /// Which rule allowed reusing cached memory; `None` = fresh memory (never used, or newly
    /// mapped). For a block that extends a cached block into newly mapped granules, the rule
    /// that allowed the cached part.
    pub reuse: Option<ReuseKind>,
    /// `Some` only for [`ReuseKind::InternalDependency`]: the caller must make the requesting
    /// stream wait for `tag.stream` past `tag.pos` before using the block.
    pub dependency: Option<FreeTag>,
}

/// Why [`Engine::alloc`] failed. The engine is unchanged (see the module docs, *Failure
/// atomicity*).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// Size 0, a size that overflows when rounded, or larger than the range.
    InvalidSize(String),
    /// Alignment 0, not a power of two, or larger than the granularity.
    InvalidAlignment(String),
    /// Nothing eligible is free and no more memory could be mapped.
    OutOfMemory(OomInfo),
    /// The backing failed for another reason than memory exhaustion; nothing was allocated.
    Backing(String),
}

impl std::fmt::Display for AllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocError::InvalidSize(s) => write!(f, "invalid size: {s}"),
            AllocError::InvalidAlignment(s) => write!(f, "invalid alignment: {s}"),
            AllocError::OutOfMemory(i) => write!(
                f,
                "out of memory: requested {} (rounded {}), used {}, reserved {}, max {}, \
                 largest free block {}, {} bytes pending on other streams",
                i.requested,
                i.rounded,
                i.used,
                i.reserved,
                i.max,
                i.largest_free_block,
                i.pending_bytes
            ),
            AllocError::Backing(s) => write!(f, "backing failure: {s}"),
        }
    }
}

impl std::error::Error for AllocError {}

/// What an out-of-memory report carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomInfo {
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes after rounding.
    pub rounded: u64,
    /// Bytes in live blocks.
    pub used: u64,
    /// Bytes mapped.
    pub reserved: u64,
    /// Size of the range.
    pub max: u64,
    /// Largest free mapped block, on any stream.
    pub largest_free_block: u64,
    /// Free bytes cached on other streams and not eligible for this request.
    pub pending_bytes: u64,
    /// Those bytes per stream.
    pub pending: SmallVec<[PendingFrees; 4]>,
}

/// Cached bytes of one stream that a request could not use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingFrees {
    /// The stream they were freed on.
    pub stream: StreamSlot,
    /// How many bytes.
    pub bytes: u64,
    /// The largest free position among them: once `completed(stream) >= max_pos` they are
    /// all complete, and a retry can use them.
    pub max_pos: u64,
}

/// Why [`Engine::free`] refused a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeError {
    /// No block has this id (never allocated here, or the record was reused).
    UnknownBlock,
    /// The block is not live (double free).
    NotLive,
}

impl std::fmt::Display for FreeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FreeError::UnknownBlock => f.write_str("unknown block"),
            FreeError::NotLive => f.write_str("block is not live"),
        }
    }
}

impl std::error::Error for FreeError {}

/// Counters of an engine; [`Engine::stats`] is O(1) in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Bytes in live blocks (rounded sizes).
    pub used: u64,
    /// High-water mark of `used` since creation or [`Engine::reset_used_high`].
    pub used_high: u64,
    /// Mapped bytes.
    pub reserved: u64,
    /// High-water mark of `reserved` since creation or [`Engine::reset_reserved_high`].
    pub reserved_high: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// High-water mark of `live_blocks`.
    pub live_blocks_high: u64,
    /// Successful allocations (including [`Engine::relocate_lower`]).
    pub allocs: u64,
    /// Successful frees.
    pub frees: u64,
    /// Allocations served with fresh memory (`reuse == None`).
    pub fresh_allocs: u64,
    /// Allocations per reuse rule, indexed by [`ReuseKind::index`].
    pub reuses: [u64; 5],
    /// Successful [`Backing::map`] calls.
    pub map_calls: u64,
    /// Successful [`Backing::unmap`] calls.
    pub unmap_calls: u64,
    /// Segments currently mapped.
    pub mapped_segments: u64,
    /// Bytes ever mapped.
    pub bytes_mapped_total: u64,
    /// Bytes ever unmapped.
    pub bytes_unmapped_total: u64,
    /// Times recycling on growth paused because it had become chronic (more than one
    /// allocation in 8 recycling, see the module docs).
    pub recycling_pauses: u64,
    /// Free mapped bytes tagged with a stream.
    pub pending_bytes: u64,
    /// All free mapped bytes (`reserved - used`).
    pub free_bytes: u64,
    /// Largest free mapped block (exact).
    pub largest_free_block: u64,
    /// [`AllocError::OutOfMemory`] returns.
    pub ooms: u64,
}

/// State of a block as seen by [`Engine::block`] and [`Engine::blocks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out.
    Live,
    /// Mapped and free; `None`: never used, or freed and since host-observed (settled, see
    /// [`Engine::settle`]): reusable by any stream.
    Free(Option<FreeTag>),
    /// Not backed by physical memory.
    Unmapped,
}

/// One block of the range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Start in the range.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// Live, free or unmapped.
    pub state: BlockState,
}

/// One mapped segment: exactly what one `Backing::map` call returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    size: u64,
    token: u64,
}

/// A multiplicative hasher for the offset index (offsets are multiples of the alignment).
#[derive(Default, Clone, Copy)]
struct OffsetHasher(u64);

impl std::hash::Hasher for OffsetHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type OffsetMap = HashMap<u64, u32, std::hash::BuildHasherDefault<OffsetHasher>>;

/// The bookkeeping of one pool: which parts of the range are mapped, live, free (and on
/// which stream) or unmapped. Single threaded (`&mut self`); the pool serialises access.
///
/// See the [module docs](self) for the search order, growth policy and complexity.
///
/// Stream slots index a table of free indices directly: they must be small and dense (as
/// the pool's recycled slots are), since the first free on slot `s` sizes the table to
/// `s + 1` entries (8 bytes each; an 8.5 KiB index is then created for that slot only).
pub struct Engine {
    cfg: EngineConfig,
    /// log2 of `cfg.alignment`: sizes in the free indices are counted in these units.
    unit_shift: u32,
    /// Class floors in bytes for `unit_shift`.
    floors: tlsf::ClassFloors,
    slab: Slab,
    /// The block at offset 0.
    first: u32,
    /// Free indices: `[0]` untagged, `[s + 1]` stream slot `s`; created lazily.
    indexes: Vec<Option<Box<FreeIndex>>>,
    /// Unmapped blocks by offset.
    holes: BTreeMap<u64, u32>,
    /// Mapped segments by offset.
    segments: BTreeMap<u64, Segment>,
    /// Where segments start and end (granule indices), for recycling's candidate search.
    bounds: bounds::Boundaries,
    /// Tests: recycling scans every free list (no early stop), to check the stop changes
    /// nothing.
    #[cfg(test)]
    recycle_scan_all: bool,
    /// Live blocks by offset (when `cfg.index_by_offset`).
    live_index: Option<OffsetMap>,
    stats: EngineStats,
    /// Reused buffer of (segment offset, segment size, first covering block).
    scratch: Vec<(u64, u64, u32)>,
    /// Upper bound on the size of one mapping (0: unbounded), see
    /// [`Engine::set_max_segment`].
    max_segment: u64,
    /// [`growth::SEGMENTS_PER_GROWTH`] (tests change it).
    segments_per_growth: u64,
    /// log2 of the factor on `segments_per_growth` learnt from recycling shortfalls (see
    /// [`growth::MAX_SPLIT_BOOST`]); stays 0 once the count is set explicitly.
    split_boost: u32,
    /// Whether [`Engine::set_segments_per_growth`] fixed the count.
    segments_fixed: bool,
    /// All-time high of `reserved` (not resettable): growth recycles only what would raise
    /// reserved memory above it.
    grow_mark: u64,
    /// Recycle idle segments before growing above `grow_mark` (see
    /// [`Engine::set_recycle_on_growth`]).
    recycle_on_growth: bool,
    /// When growth last recycled: recycling pauses while it is chronic.
    recycle_rate: growth::RecycleRate,
    /// A segment was unmapped since the last packing: the next allocation on an empty
    /// engine packs the mapped memory (see `growth::pack_idle`).
    pack_wanted: bool,
    /// Try rule 4 before growth (see [`Engine::set_dependency_before_growth`]).
    dependency_first: bool,
    /// Per free index (`[s + 1]` for stream slot `s`): the host-observed bound and the
    /// index's insert count when [`Engine::settle`] last looked at it.
    settled_below: Vec<(u64, u64)>,
    /// The only stream that freed since the last [`Engine::settle`], [`NO_FREER`] or
    /// [`SEVERAL_FREERS`] (see `Engine::coalescable`).
    solo_freer: StreamSlot,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Iterator over all blocks in address order ([`Engine::blocks`]).
#[derive(Debug)]
pub struct Blocks<'a> {
    engine: &'a Engine,
    cur: u32,
}

impl Iterator for Blocks<'_> {
    type Item = BlockInfo;

    fn next(&mut self) -> Option<BlockInfo> {
        if self.cur == NIL {
            return None;
        }
        let idx = self.cur;
        self.cur = self.engine.slab.blocks[idx as usize].next;
        Some(self.engine.info(idx))
    }
}

impl Engine {
    /// A new engine over an entirely unmapped range.
    ///
    /// # Errors
    ///
    /// A description of the problem when `granularity` is not a power of two, `alignment` is
    /// not a power of two in `32..=granularity`, or `range_size` is not a non-zero multiple of
    /// `granularity` of at most [`MAX_RANGE`].
    pub fn new(cfg: EngineConfig) -> Result<Engine, String> {
        if cfg.granularity == 0 || !cfg.granularity.is_power_of_two() {
            return Err(format!("granularity {} is not a power of two", cfg.granularity));
        }
        if !cfg.alignment.is_power_of_two() || cfg.alignment < 32 {
            return Err(format!("alignment {} is not a power of two >= 32", cfg.alignment));
        }
        if cfg.alignment > cfg.granularity {
            return Err(format!(
                "alignment {} exceeds the granularity {}",
                cfg.alignment, cfg.granularity
            ));
        }
        if cfg.range_size > MAX_RANGE {
            return Err(format!(
                "range size {} exceeds the supported maximum of 2^62 bytes",
                cfg.range_size
            ));
        }
        if cfg.range_size == 0 || cfg.range_size % cfg.granularity != 0 {
            return Err(format!(
                "range size {} is not a non-zero multiple of the granularity {}",
                cfg.range_size, cfg.granularity
            ));
        }
        let mut slab = Slab::new();
        let first = slab.take();
        {
            let b = &mut slab.blocks[first as usize];
            b.offset = 0;
            b.size = cfg.range_size;
            b.kind = Kind::Unmapped;
        }
        let mut holes = BTreeMap::new();
        holes.insert(0, first);
        let indexes = vec![None];
        Ok(Engine {
            cfg,
            unit_shift: cfg.alignment.trailing_zeros(),
            floors: tlsf::ClassFloors::new(cfg.alignment.trailing_zeros()),
            slab,
            first,
            indexes,
            holes,
            segments: BTreeMap::new(),
            bounds: bounds::Boundaries::default(),
            #[cfg(test)]
            recycle_scan_all: false,
            live_index: cfg.index_by_offset.then(OffsetMap::default),
            stats: EngineStats::default(),
            scratch: Vec::new(),
            max_segment: 0,
            segments_per_growth: growth::SEGMENTS_PER_GROWTH,
            split_boost: 0,
            segments_fixed: false,
            grow_mark: 0,
            recycle_on_growth: true,
            recycle_rate: growth::RecycleRate::default(),
            pack_wanted: false,
            dependency_first: false,
            settled_below: Vec::new(),
            solo_freer: NO_FREER,
        })
    }

    /// Bounds the size of one mapping (one segment). By default a growth of `n` bytes maps
    /// segments of the largest power of two `<= n / 4` (at least one granule), aligned to
    /// their size; `bytes` caps that further (rounded up to a power of two, at least one
    /// granule; 0 restores the default). Smaller segments let recycling and
    /// [`Engine::release`] return memory more finely — one granule per segment gives the
    /// least fragmentation — at the cost of more driver calls.
    pub fn set_max_segment(&mut self, bytes: u64) {
        self.max_segment = if bytes == 0 {
            0
        } else {
            bytes.max(self.cfg.granularity).checked_next_power_of_two().unwrap_or(0)
        };
    }

    /// Into how many segments (each unmapped whole) a growth is mapped, at least 1 (default
    /// 4, doubled up to 16 while recycling falls short for want of finer segments, see
    /// `growth::MAX_SPLIT_BOOST`; parts of a large block that later hold smaller ones can be
    /// recycled piecewise; 1: one driver call per growth, for pools of long-lived memory such
    /// as weights). Setting it fixes the count (no doubling). Segments are never smaller than
    /// 1/512 of the reserved memory (see `growth::MIN_SEGMENT_FRACTION`).
    pub fn set_segments_per_growth(&mut self, n: u64) {
        self.segments_per_growth = n.max(1);
        self.segments_fixed = true;
        self.split_boost = 0;
    }

    /// Whether a growth that would raise `reserved` above its all-time high first unmaps
    /// fully free recyclable segments elsewhere (`true`, the default; see the module docs,
    /// *Recycling*). `false`: growth never unmaps — after a warm-up in which the pool maps
    /// what the workload's fragmentation needs, a repeating workload makes no driver calls,
    /// at the price of a higher peak (what a pool that never gives memory back reaches).
    /// Memory pressure still releases free segments ([`AllocError::OutOfMemory`] is the
    /// last resort either way), and [`Engine::release`] is unaffected.
    pub fn set_recycle_on_growth(&mut self, yes: bool) {
        self.recycle_on_growth = yes;
    }

    /// When internal dependencies are allowed, take another stream's cached block with a
    /// dependency *before* growing (`true`), instead of only when growth fails (`false`, the
    /// default, CUDA's order — see the module docs). `true` trades stream concurrency for less
    /// mapping.
    pub fn set_dependency_before_growth(&mut self, yes: bool) {
        self.dependency_first = yes;
    }

    /// The configuration the engine was created with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The effective alignment of a request (`max(align, cfg.alignment)`), or `None` when
    /// `align` is 0, not a power of two or larger than the granularity.
    #[inline]
    fn effective_align(&self, align: u64) -> Option<u64> {
        (align != 0 && align.is_power_of_two() && align <= self.cfg.granularity)
            .then(|| align.max(self.cfg.alignment))
    }

    /// The size a request of `bytes` with alignment `align` occupies: `bytes` rounded up to a
    /// multiple of `max(align, cfg.alignment)` (so that blocks aligned for a request are never
    /// split below that alignment). `None` for 0 bytes, on overflow, or for an invalid
    /// alignment (0, not a power of two, above the granularity). Alignments below the pool's
    /// are raised to it.
    pub fn round_size(&self, bytes: u64, align: u64) -> Option<u64> {
        let align = self.effective_align(align)?;
        if bytes == 0 {
            return None;
        }
        checked_align_up(bytes, align)
    }

    /// Rule 4: takes the best other stream's cached block that fits, returning the allocation
    /// with the dependency the caller must insert.
    fn take_internal_dependency(
        &mut self,
        size: u64,
        align: u64,
        stream: StreamSlot,
    ) -> Option<Allocation> {
        let (idx, tag) = self.find_internal_dependency(size, align, stream)?;
        Some(self.commit_cached(idx, size, align, Some(ReuseKind::InternalDependency), Some(tag)))
    }

    /// Allocates `bytes` (rounded per [`Engine::round_size`]) aligned to `align` for stream
    /// `stream`, reusing cached memory when a rule allows it and mapping granules through
    /// `backing` otherwise. See the [module docs](self) for the exact search order.
    ///
    /// `align` is normally `cfg.alignment`; any power of two up to the granularity is
    /// accepted (smaller ones are raised to `cfg.alignment`).
    ///
    /// # Errors
    ///
    /// [`AllocError::InvalidSize`] / [`AllocError::InvalidAlignment`] for bad input,
    /// [`AllocError::OutOfMemory`] when nothing eligible is free and nothing more can be
    /// mapped, [`AllocError::Backing`] when the backing failed otherwise. On error the blocks
    /// are as before the call (recyclable free segments may have been unmapped).
    ///
    /// # Time Complexity
    ///
    /// Served from cache: O(1) for the requesting stream and untagged memory, plus one
    /// [`StreamOrder::eligibility`] call and at most [`CROSS_STREAM_BUDGET`] block visits
    /// per other stream with cached blocks. Growth: O(holes + large free blocks × log
    /// segments), or O(n + segments) when recycling needs the exhaustive scan — always next
    /// to a driver call. The first allocation after the engine emptied, when segments were
    /// unmapped since, packs first: O(holes + the blocks and segments above `reserved`) and
    /// a driver call per moved segment (module docs, *Packing*). Out of memory: O(n) to
    /// build the report.
    #[allow(
        clippy::result_large_err,
        reason = "the API carries OomInfo by value; the error path is cold"
    )]
    #[inline]
    pub fn alloc(
        &mut self,
        bytes: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing,
    ) -> Result<Allocation, AllocError> {
        let (size, align) = self.checked_request(bytes, align)?;
        if self.pack_wanted && self.stats.live_blocks == 0 {
            self.pack_idle(order, backing);
        }
        if let Some((idx, kind)) = self.find_cached(size, align, stream, order) {
            return Ok(self.commit_cached(idx, size, align, kind, None));
        }
        self.alloc_uncached(bytes, size, align, stream, order, backing)
    }

    /// [`Engine::alloc`] when no cached block fits: rule 4 first if so configured, growth,
    /// release and retry, rule 4, out of memory.
    #[allow(clippy::result_large_err, reason = "as Engine::alloc")]
    #[inline(never)]
    fn alloc_uncached(
        &mut self,
        bytes: u64,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing,
    ) -> Result<Allocation, AllocError> {
        if self.dependency_first && order.internal_dependencies() {
            if let Some(a) = self.take_internal_dependency(size, align, stream) {
                return Ok(a);
            }
        }
        match self.grow(size, align, stream, order, backing) {
            Ok(a) => return Ok(a),
            Err(growth::GrowError::Backing(msg)) => return Err(AllocError::Backing(msg)),
            Err(growth::GrowError::NoRoom) => {
                // Release what can be released anywhere and retry: first as much as the
                // request needs (highest addresses first, the fewest unmaps); if the holes
                // that opened are not one that fits, every fully free, completed segment.
                for keep in [self.stats.reserved.saturating_sub(size), 0] {
                    match self.release(keep, order, backing) {
                        Ok(0) => continue,
                        Ok(_) => {}
                        Err(_) => break,
                    }
                    if self.dependency_first && order.internal_dependencies() {
                        if let Some(a) = self.take_internal_dependency(size, align, stream) {
                            return Ok(a);
                        }
                    }
                    match self.grow(size, align, stream, order, backing) {
                        Ok(a) => return Ok(a),
                        Err(growth::GrowError::Backing(msg)) => {
                            return Err(AllocError::Backing(msg))
                        }
                        Err(growth::GrowError::NoRoom) => {}
                    }
                }
            }
        }
        if order.internal_dependencies() {
            if let Some(a) = self.take_internal_dependency(size, align, stream) {
                return Ok(a);
            }
        }
        self.stats.ooms += 1;
        Err(AllocError::OutOfMemory(self.oom_info(bytes, size, stream, order)))
    }

    /// As [`Engine::alloc`], but only from cached memory: the reuse rules (and rule 4 when
    /// `with_dependency` is set and `order` allows internal dependencies), never a map.
    /// `Ok(None)` when nothing cached fits. A sharded pool asks every shard this before one
    /// of them grows, so that reuse anywhere comes before fresh memory.
    ///
    /// # Errors
    ///
    /// [`AllocError::InvalidSize`] / [`AllocError::InvalidAlignment`] for bad input.
    ///
    /// # Time Complexity
    ///
    /// As [`Engine::alloc`] served from cache.
    #[allow(
        clippy::result_large_err,
        reason = "the API carries OomInfo by value; the error path is cold"
    )]
    pub fn alloc_cached(
        &mut self,
        bytes: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        with_dependency: bool,
    ) -> Result<Option<Allocation>, AllocError> {
        let (size, align) = self.checked_request(bytes, align)?;
        if let Some((idx, kind)) = self.find_cached(size, align, stream, order) {
            return Ok(Some(self.commit_cached(idx, size, align, kind, None)));
        }
        if with_dependency && order.internal_dependencies() {
            return Ok(self.take_internal_dependency(size, align, stream));
        }
        Ok(None)
    }

    /// Validates a request: its rounded size and effective alignment.
    #[allow(clippy::result_large_err, reason = "as Engine::alloc, whose errors these are")]
    #[inline(always)]
    fn checked_request(&self, bytes: u64, align: u64) -> Result<(u64, u64), AllocError> {
        // The pool's own alignment (what a pool always passes) is valid by construction.
        let a = if align == self.cfg.alignment { Some(align) } else { self.effective_align(align) };
        if let Some(a) = a {
            // `round_size` with the alignment already validated and raised.
            if let Some(size) = checked_align_up(bytes, a) {
                if bytes != 0 && size <= self.cfg.range_size {
                    return Ok((size, a));
                }
            }
        }
        Err(self.request_error(bytes, align))
    }

    /// Why [`Engine::checked_request`] refused `bytes` at alignment `align`.
    #[cold]
    #[inline(never)]
    fn request_error(&self, bytes: u64, align: u64) -> AllocError {
        let Some(align) = self.effective_align(align) else {
            return AllocError::InvalidAlignment(format!(
                "alignment {align} is not a power of two in 1..={}",
                self.cfg.granularity
            ));
        };
        if bytes == 0 {
            return AllocError::InvalidSize("size 0".into());
        }
        match checked_align_up(bytes, align) {
            None => {
                AllocError::InvalidSize(format!("size {bytes} overflows when rounded to {align}"))
            }
            Some(size) => AllocError::InvalidSize(format!(
                "size {bytes} (rounded {size}) exceeds the pool's range of {} bytes",
                self.cfg.range_size
            )),
        }
    }

    /// Frees a live block onto stream `tag.stream` at position `tag.pos` (the stream may
    /// differ from the allocating one). The block coalesces with free neighbours of the same
    /// stream (keeping the larger `pos`), with never-used ones, and with settled ones freed by
    /// its stream or while its stream is the only one freeing since the last settle.
    ///
    /// # Errors
    ///
    /// [`FreeError::UnknownBlock`] for an id that names no block (stale or foreign),
    /// [`FreeError::NotLive`] for a block that is already free. Nothing changes on error.
    ///
    /// # Time Complexity
    ///
    /// O(1).
    #[inline]
    pub fn free(&mut self, block: BlockId, tag: FreeTag) -> Result<(), FreeError> {
        let idx = self.resolve(block).ok_or(FreeError::UnknownBlock)?;
        let b = &mut self.slab.blocks[idx as usize];
        if b.kind != Kind::Live {
            return Err(FreeError::NotLive);
        }
        let (offset, size) = (b.offset, b.size);
        b.kind = Kind::Free;
        b.tagged = true;
        b.settled = false;
        if self.solo_freer != tag.stream && self.solo_freer != SEVERAL_FREERS {
            self.solo_freer = if self.solo_freer == NO_FREER { tag.stream } else { SEVERAL_FREERS };
        }
        b.stream = tag.stream;
        b.pos = tag.pos;
        if let Some(map) = &mut self.live_index {
            map.remove(&offset);
        }
        self.stats.used -= size;
        self.stats.live_blocks -= 1;
        self.stats.frees += 1;
        self.coalesce_and_index(idx);
        Ok(())
    }

    /// Settles the frees the host has observed: every free block of a stream `s` freed below
    /// `order.eligibility(s).host_observed` becomes untagged (*settled*) and merges with the
    /// untagged free blocks beside it, whatever stream freed them. Every stream may use such
    /// memory under any policy (its free completed and the host knows it), so it no longer
    /// needs to stay apart from the free blocks of other streams; without this, memory freed
    /// by several streams stays cut into per-stream pieces until it is reused. A settled block
    /// merges with a tagged neighbour of the stream that freed it (taking that neighbour's
    /// tag: the merge is as safe as the neighbour), and with other streams' tagged blocks only
    /// while their stream is the only one freeing (see the module docs).
    ///
    /// Called after host synchronisations; a stream whose observed bound did not move and
    /// whose index took no block since the last call is skipped.
    ///
    /// # Time Complexity
    ///
    /// O(free blocks of the streams whose bound moved): each free is settled at most once,
    /// blocks freed after the observation are looked at again at the next call.
    pub fn settle(&mut self, order: &dyn StreamOrder) {
        self.solo_freer = NO_FREER;
        let mut due: SmallVec<[u32; 16]> = SmallVec::new();
        for slot in 1..self.indexes.len() {
            let Some(ix) = self.indexes[slot].as_deref() else { continue };
            let stream = (slot - 1) as StreamSlot;
            let bound = order.eligibility(stream).host_observed;
            let seen = self.settled_below.get(slot).copied().unwrap_or((0, 0));
            if ix.is_empty() || bound == 0 || (bound <= seen.0 && ix.inserts == seen.1) {
                continue;
            }
            due.clear();
            let mut cls = 0;
            while let Some((fl, sl)) = ix.first_at_or_above(cls / tlsf::SL, cls % tlsf::SL) {
                let mut cur = ix.head(fl, sl);
                while cur != NIL {
                    let b = &self.slab.blocks[cur as usize];
                    if b.pos < bound {
                        due.push(cur);
                    }
                    cur = b.next_free;
                }
                cls = fl * tlsf::SL + sl + 1;
            }
            for &idx in &due {
                // An earlier block of the list may have merged this one into itself.
                let b = &self.slab.blocks[idx as usize];
                if b.kind != Kind::Free || !b.tagged || b.stream != stream || b.pos >= bound {
                    continue;
                }
                self.remove_free(idx);
                let b = &mut self.slab.blocks[idx as usize];
                b.tagged = false;
                b.settled = true;
                b.pos = 0;
                self.insert_free_coalesce(idx);
            }
            // Merges while settling may index a block here again (one that joined a tagged
            // block of this stream, freed at or above the bound): count after them.
            let inserts = self.indexes[slot].as_deref().map_or(0, |ix| ix.inserts);
            if self.settled_below.len() <= slot {
                self.settled_below.resize(slot + 1, (0, 0));
            }
            self.settled_below[slot] = (bound, inserts);
        }
    }

    /// The stream slots that have freed memory here (ever), in slot order.
    pub fn freeing_streams(&self) -> impl Iterator<Item = StreamSlot> + '_ {
        let slots = self.indexes.iter().enumerate().skip(1);
        slots.filter(|(_, ix)| ix.is_some()).map(|(slot, _)| (slot - 1) as StreamSlot)
    }

    /// Counts `n` frees, each followed by an allocation of the same block on the same
    /// stream, that the caller handled without the engine (the pool's free ring): the
    /// block stayed live throughout, so only the counters change — `frees`, `allocs` and
    /// same-stream reuses grow by `n`.
    pub fn count_repeated_pairs(&mut self, n: u64) {
        self.stats.frees += n;
        self.stats.allocs += n;
        self.stats.reuses[ReuseKind::SameStream.index()] += n;
    }

    /// The live block that starts exactly at `offset`, with its size. Always `None` unless
    /// the engine was created with `index_by_offset`.
    ///
    /// # Time Complexity
    ///
    /// O(1) (one hash lookup).
    pub fn lookup(&self, offset: u64) -> Option<(BlockId, u64)> {
        let idx = *self.live_index.as_ref()?.get(&offset)?;
        let b = &self.slab.blocks[idx as usize];
        debug_assert_eq!(b.kind, Kind::Live);
        Some((BlockId::new(idx, b.generation), b.size))
    }

    /// The size of the live block that starts exactly at `offset`: through the offset index
    /// when the engine keeps one, else by a walk in address order.
    ///
    /// # Time Complexity
    ///
    /// O(1) with `index_by_offset`, else O(blocks before `offset`).
    pub fn live_size_at(&self, offset: u64) -> Option<u64> {
        if self.live_index.is_some() {
            return self.lookup(offset).map(|(_, size)| size);
        }
        let mut cur = self.first;
        while cur != NIL {
            let b = &self.slab.blocks[cur as usize];
            if b.offset >= offset {
                return (b.offset == offset && b.kind == Kind::Live).then_some(b.size);
            }
            cur = b.next;
        }
        None
    }

    /// What `block` currently is, while its record still describes it: a live block, or — after
    /// its free — the free block it coalesced into (if the record survived), or `None` once
    /// the record was merged away or reused.
    pub fn block(&self, block: BlockId) -> Option<BlockInfo> {
        self.resolve(block).map(|idx| self.info(idx))
    }

    /// Unmaps fully free segments whose memory no in-flight work can touch (untagged, or
    /// [`StreamOrder::is_complete`]) — highest address first, so that what stays mapped is
    /// packed low — until `reserved <= max(keep, used)` or nothing more can go. `reserved`
    /// never ends below the target rounded down to the granularity: a segment larger than
    /// what is left to release is skipped while smaller ones can go, and otherwise unmapped
    /// with its lowest granules mapped again (one more map call). Returns the bytes released
    /// (net).
    ///
    /// # Errors
    ///
    /// The first [`Backing::unmap`] error; what was unmapped before it is accounted.
    ///
    /// # Time Complexity
    ///
    /// O(n + segments) plus one driver call per released segment.
    pub fn release(
        &mut self,
        keep: u64,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing,
    ) -> Result<u64, BackingError> {
        self.release_where(keep, backing, &|b| {
            !b.tagged || order.is_complete(FreeTag { stream: b.stream, pos: b.pos })
        })
    }

    /// Unmaps every segment (the caller guarantees that all work is complete). Afterwards the
    /// engine is as new, except for its statistics.
    ///
    /// # Errors
    ///
    /// [`BackingError::Failed`] without touching anything when live blocks remain; otherwise
    /// the first unmap error (what was unmapped before it is accounted).
    pub fn teardown(&mut self, backing: &mut dyn Backing) -> Result<(), BackingError> {
        if self.stats.live_blocks != 0 {
            return Err(BackingError::Failed(format!(
                "teardown with {} live blocks",
                self.stats.live_blocks
            )));
        }
        self.release_where(0, backing, &|_| true)?;
        debug_assert!(self.segments.is_empty());
        Ok(())
    }

    /// For compaction: allocates a block of `block`'s size and alignment for `stream` in the
    /// lowest-address eligible free mapped space (own, untagged, or eligible per
    /// [`StreamOrder::eligibility`]) that lies entirely below `block`'s offset. Never maps.
    /// `None` when `block` is not live or nothing lower fits. The caller copies the data and
    /// then frees `block` in stream order.
    ///
    /// # Time Complexity
    ///
    /// O(number of blocks below `block`).
    pub fn relocate_lower(
        &mut self,
        block: BlockId,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<Allocation> {
        let idx = self.resolve(block)?;
        let b = self.slab.blocks[idx as usize];
        if b.kind != Kind::Live {
            return None;
        }
        let (size, align, limit) = (b.size, 1u64 << b.align_log2, b.offset);
        let mut cur = self.first;
        while cur != NIL {
            let c = self.slab.blocks[cur as usize];
            if c.offset >= limit {
                break;
            }
            if c.kind == Kind::Free {
                let start = align_up(c.offset, align);
                if start + size <= c.end().min(limit) {
                    if let Some(kind) = self.eligible_kind(&c, stream, order) {
                        return Some(self.commit_cached(cur, size, align, kind, None));
                    }
                }
            }
            cur = c.next;
        }
        None
    }

    /// Current counters. `largest_free_block` is exact.
    ///
    /// # Time Complexity
    ///
    /// O(1) in blocks: O(streams) plus the length of each stream's highest non-empty size
    /// class list (usually one block).
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        s.mapped_segments = self.segments.len() as u64;
        s.largest_free_block = self.largest_free_block();
        // Derived from the free indices (index 0 holds the untagged blocks).
        s.free_bytes = self.indexes.iter().flatten().map(|ix| ix.bytes).sum();
        s.pending_bytes = self.indexes.iter().skip(1).flatten().map(|ix| ix.bytes).sum();
        s
    }

    /// Restarts the `used` high-water mark from the current `used` (what setting the
    /// attribute to 0 means in CUDA and CANN: the mark can never be below the current value).
    pub fn reset_used_high(&mut self) {
        self.stats.used_high = self.stats.used;
    }

    /// Restarts the `reserved` high-water mark from the current `reserved`.
    pub fn reset_reserved_high(&mut self) {
        self.stats.reserved_high = self.stats.reserved;
    }

    /// Bytes in live blocks.
    pub fn used(&self) -> u64 {
        self.stats.used
    }

    /// Live blocks.
    pub fn live_blocks(&self) -> u64 {
        self.stats.live_blocks
    }

    /// Bytes mapped.
    pub fn reserved(&self) -> u64 {
        self.stats.reserved
    }

    /// All blocks in address order; together they cover `[0, range_size)` exactly.
    pub fn blocks(&self) -> Blocks<'_> {
        Blocks { engine: self, cur: self.first }
    }

    /// Exhaustive consistency check (for tests; O(n + segments + free-list lengths)).
    ///
    /// # Errors
    ///
    /// A description of the first violated invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        invariants::check(self)
    }

    /// The record index of a valid id.
    fn resolve(&self, block: BlockId) -> Option<u32> {
        let idx = block.index();
        let b = self.slab.blocks.get(idx as usize)?;
        (b.kind != Kind::Vacant && b.generation == block.generation()).then_some(idx)
    }

    fn info(&self, idx: u32) -> BlockInfo {
        let b = &self.slab.blocks[idx as usize];
        let state = match b.kind {
            Kind::Live => BlockState::Live,
            Kind::Free => {
                BlockState::Free(b.tagged.then_some(FreeTag { stream: b.stream, pos: b.pos }))
            }
            Kind::Unmapped | Kind::Vacant => BlockState::Unmapped,
        };
        BlockInfo { offset: b.offset, size: b.size, state }
    }
}

/// `x` rounded up to a multiple of the power of two `a` (no overflow for in-range offsets).
#[inline]
fn align_up(x: u64, a: u64) -> u64 {
    (x + a - 1) & !(a - 1)
}

/// `x` rounded up to a multiple of the power of two `a`, for any `x`: `None` when the rounded
/// value overflows. Also the pool's rounding of a request before it reaches the engine.
#[inline(always)]
pub fn checked_align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|b| b & !(a - 1))
}

/// `x` rounded down to a multiple of the power of two `a`.
#[inline]
fn align_down(x: u64, a: u64) -> u64 {
    x & !(a - 1)
}
