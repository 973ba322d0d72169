//! The bookkeeping of soma's stream-ordered pool: pure, safe Rust over an offset space,
//! testable without a device.
//!
//! soma-core's pool (`soma_core::MemPool`, which re-exports this crate as
//! `soma_core::engine`) owns one [`Engine`] per pool, or per shard, behind a mutex and talks
//! to the device only through the [`Backing`] it passes in. The engine hands out *offsets*
//! in `[0, range_size)` and never touches memory (like offset-allocator): it decides which
//! granules are mapped, which block serves which request and which reuse rule justified it.
//! The feature `testing` adds `soma_engine::testing`: the fake backing, stream orders and
//! test generator that the engine's tests, the benchmark baselines and the fuzz targets
//! share.
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
//!   unmapped space; the blocks of a *private* slot ([`Engine::set_private_slots`]) merge
//!   only with blocks of the same slot.
//! * **Free indices** (`tlsf.rs`): one two-level segregated-fit index (rlsf-style bitmaps) per
//!   stream slot that has freed memory, created lazily on that stream's first free, plus one
//!   for untagged memory. O(1) insert / remove / class search. Every free block is in the
//!   index of its tag except, on an engine that does not recycle (the default), the *border
//!   block*: the free block directly below the unmapped space that reaches the end of the
//!   range, where growth extends the mapped memory. It is in no index and serves a request
//!   only when no indexed block fits (search order, step 3), like the top chunk of a
//!   `malloc`: a workload run again on memory mapped by its first
//!   run then places every block where that run did, which needs no further mapping (with
//!   frees on one stream and recycling off, exactly; `tests/border.rs`).
//! * **Segments**: every [`Backing::map`] call creates one segment; segments are unmapped
//!   whole, exactly as mapped, and only when every byte is free and no in-flight work can
//!   touch it (untagged, or [`StreamOrder::is_complete`]). A bitset of segment boundaries
//!   (`bounds.rs`, one bit per granule) lists the segments inside a free block for recycling.
//!
//! | file | its one job |
//! |---|---|
//! | `order.rs` | stream slots, free tags, eligibility bounds, [`StreamOrder`], reuse rules |
//! | `backing.rs` | [`Backing`], what maps memory for the engine, and its error |
//! | `config.rs` | [`EngineConfig`], the tuning switches, the rounding of requests |
//! | `block.rs` | block records, their slab, ids and the public view of blocks |
//! | `tlsf.rs` | the segregated-fit free index |
//! | `bounds.rs` | the bitset of segment boundaries |
//! | `coalesce.rs` | free-index membership, merging free blocks, settling |
//! | `search.rs` | the cache search and the internal-dependency fallback |
//! | `alloc.rs` | the request path: allocate, carve, free, relocate |
//! | `growth.rs` | where and how growth maps memory |
//! | `recycle.rs` | unmapping idle segments before growth, and pausing it |
//! | `release.rs` | releasing and packing segments, teardown |
//! | `stats.rs` | [`EngineStats`] |
//! | `invariants.rs` | the exhaustive consistency check |
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
//! 3. **The border block** (no recycling), if the request fits it and `T` may use it (own,
//!    untagged, or eligible as in step 2). O(log holes).
//! 4. **Growth** (maps memory, see below), after settling what the other streams freed and
//!    the device completed (`Engine::settle_completed_for`, only under rule 3) and searching
//!    steps 1–3 again if that settled anything: extending an eligible free block adjacent to
//!    unmapped space, else a new run in the lowest unmapped hole that fits; before mapping
//!    above the all-time reserved high, fully free *recyclable* segments elsewhere are
//!    unmapped so that peak reserved memory does not grow while free physical memory sits
//!    idle. On [`BackingError::OutOfMemory`] (or when no unmapped hole is large enough),
//!    recyclable free segments are released like [`Engine::release`] does (highest first)
//!    until at least the request's size went back, and growth is retried; if it still finds
//!    no room, every recyclable segment is released and growth is tried once more.
//! 5. **Internal dependency** (only if [`StreamOrder::internal_dependencies`]): best fit
//!    among any other stream's cached blocks (bounded like step 2), else another stream's
//!    border block; the returned [`Allocation::dependency`] is the block's tag, which the
//!    caller must turn into a real event wait. By default this step comes after growth; with
//!    [`Engine::set_dependency_before_growth`]`(true)` it comes before step 4 and again
//!    before each retry of growth.
//! 6. Otherwise [`AllocError::OutOfMemory`] with an [`OomInfo`] that lists, per stream, the
//!    cached bytes that were not eligible and the position to wait for.
//!
//! soma's pool sets [`Engine::set_dependency_before_growth`]`(true)` on every engine: when
//! internal dependencies are allowed, every enabled reuse rule, rule 4 included, is tried
//! before fresh memory is mapped (the order `docs/semantics.md` states). The engine's own
//! default is CUDA's order, rule 4 (step 5) after growth: CUDA's programming guide (stream
//! ordered allocator, reuse policies) describes `cudaMemPoolReuseAllowInternalDependencies` as the
//! fallback taken after failing to allocate and map more physical memory. The trade-off: an
//! inserted dependency serialises two streams for the rest of their work — a cost the user
//! cannot see and that can be far larger than a map call — while growth costs a driver call
//! and, thanks to recycling, little extra peak memory; taking the dependency first maps
//! less. In either order, under memory pressure the dependency is taken rather than failing.
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
//! A growth of `n` bytes (whole granules) is mapped as `k` segments of equal size in whole
//! granules (the first ones a granule larger when the granules do not divide evenly), one
//! [`Backing::map`] call each: `k` is the segments per growth (4), but at most one per
//! granule, few enough that none is smaller than 1/512 of the reserved memory (when that
//! is more than a granule) and enough that none exceeds [`Engine::set_max_segment`]. A
//! growth of 10 MiB in 2 MiB granules is four calls (4, 2, 2 and 2 MiB), one of 6 MiB
//! three. Segments are the unit of unmapping (release, recycling), so a large block whose
//! space is later reused by smaller ones can still give back its unused parts.
//!
//! **Bursts.** A growth within 4 allocations of the previous one (`growth::GROWTH_BURST`)
//! belongs to a pool growing fast; when it extends the mapped memory upward and recycling
//! is off, it maps at least 1/64 of the all-time reserved high (`growth::BURST_CHUNK_FRACTION`,
//! within the hole; the request's own size if the backing is out of memory for more). A
//! pool growing to `n` bytes then makes O(log n) growths instead of one every few
//! allocations; what the last growth of a burst maps ahead, at most 1/64 of the pool, is
//! free memory for the next requests.
//!
//! **No recycling (the default).** Growth only maps. With the border block served last
//! (search order, step 3), a workload run again on the memory its first run mapped places
//! every block where that run did and makes no driver call: on the PyTorch traces of
//! `data/traces` replayed from empty, the second and later runs map and unmap nothing
//! (`tests/traces.rs`, `trace_replayed_again_makes_no_driver_calls`), nor do the warm
//! replays of RMM's `random_allocations`. Peak reserved memory is the address space the
//! placement spans: 1.002–1.019× the live bytes on the PyTorch traces, 1.084× on BERT
//! (`tests/traces.rs`, `without_recycling_limit`).
//!
//! **Recycling** ([`Engine::set_recycle_on_growth`]`(true)`). When a growth would raise
//! `reserved` above its all-time high, the engine first unmaps fully free segments elsewhere
//! whose free blocks are untagged or complete per [`StreamOrder::is_complete`] (the device
//! can no longer touch them), taken from the *smallest* free blocks up — large free blocks
//! stay whole to serve the requests they fit, as in best fit — and, among the fewest such
//! candidates that cover the excess, the smallest segment that covers what remains, else
//! the largest, until the excess is recycled or no candidate is left. Candidates are first
//! the segments inside one free block of at least one granule (found through the free
//! indices and a bitset of segment boundaries); when those do not cover the excess, an
//! exhaustive scan also finds segments covered by several free blocks (such as blocks of
//! different streams, which never merge). Memory freed on the requesting stream but not
//! complete is *not* recycled: unmapping takes effect on the host immediately, not in stream
//! order, so in-flight work could still touch it. Below the all-time high nothing is
//! recycled: mapping then costs no peak memory, and recycling would only add driver calls.
//! A recycling engine has no border block (its growth unmaps elsewhere to map at the top,
//! and keeping the top block for last would only move more memory) and does not map ahead
//! in bursts.
//!
//! Recycling trades driver calls for peak memory. On workloads whose shapes vary (the BERT
//! trace, RMM's `random_allocations` with sizes up to 64 MiB and more) it keeps remapping in
//! steady state — on the BERT trace about one unmap per 6 allocations, every run, for a
//! peak of 1.008× instead of 1.084× the live bytes; with uniformly random sizes up to 64 MiB
//! about one per 3.6 allocations, up to 256 MiB about one per 1.2 until recycling pauses
//! (below; recycling from the largest free blocks as well, before the smallest-first order,
//! took 3.5–4× as many).
//!
//! Within recycling, the 4 segments per growth adapt: when recycling falls short of the
//! excess while the recyclable free blocks hold more whole granules than it found in whole
//! segments — free memory in segments that live blocks still touch — and the growth leaves
//! more than 1/64 of the live bytes mapped beyond them, later growths use twice as many
//! segments, up to 16 (`growth::MAX_SPLIT_BOOST`, `growth::REFINE_ABOVE`). Workloads whose
//! recycling never falls short keep four and their map calls; on a GPT-2 request stream
//! whose attention temporaries interleave with a growing KV cache four fixed gave 1.081,
//! adaptive 1.023 (BERT: 1.033 -> 1.008). [`Engine::set_segments_per_growth`] fixes the
//! count instead.
//!
//! Recycling pauses when it has become chronic: when more than 64 growths within 512
//! allocations each recycled, growth stops recycling for the next 4096 allocations and maps
//! above the all-time high instead (`recycle::RECYCLE_BURST`; counted in
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
//! `synchronized_runs_on_streams_in_turn_place_as_on_one_stream`). Without a
//! synchronisation, a request that takes another stream's border block under rule 3 settles
//! what the device has completed (`Engine::settle_completed_for`: those frees are eligible for
//! every stream under that rule anyway), and the requester's frees then merge with it: runs
//! on streams in turn place as on one stream (`tests/border.rs`). A request about to grow
//! settles the same way first. And while several streams free (each op on the next stream,
//! frees handed off through events), every allocation settles what completed before it
//! searches — the requesting stream's own frees included, so that they merge with the rest —
//! once the frees since the last settle number at least 1 / [`SETTLE_SPACING`] of the blocks
//! that stayed pending then (each settle looks at those again; the frees pay for it). Memory
//! the streams freed then comes back together as one stream's would as soon as the device
//! completes it: the bundled traces spread op by op over four streams place as on one stream
//! (`tests/interleaved.rs`). Frees still in flight stay apart, tagged, until they complete.
//!
//! **Packing.** Recycling leaves unmapped holes between mapped segments. When a recycling
//! engine has emptied (nothing live) and segments were unmapped since it last packed, its next
//! allocation first moves the free segments lying entirely above `reserved` bytes from the
//! start of the range into the lowest holes below (unmapped first, then the holes mapped:
//! `reserved` ends where it was and its high-water mark does not move; only segments no
//! in-flight work can touch move). A workload run again from empty then starts from one
//! mapped run, as the first run did from nothing. Without it, such a rerun places its
//! long-lived blocks (weights) between the holes, the partial granules beside them stay
//! mapped, and peak reserved creeps from run to run: on the BERT trace run again and again
//! from empty, 1.007 → 1.058–1.072 within 5–20 runs, a batched GPT-2 decode whose rows
//! retire 1.015 → 1.075; with packing BERT stays at most 1.040 (`tests/traces.rs`,
//! `trace_fragmentation_over_replays` with `SOMA_RECYCLE=1`). A run that keeps what it
//! leaves live (weights resident, as a server or training loop does) never empties and
//! needs none: it converges
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

mod alloc;
mod backing;
mod block;
mod bounds;
mod coalesce;
mod config;
mod growth;
mod invariants;
mod order;
mod recycle;
mod release;
mod search;
mod stats;
mod tlsf;

#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use block::{Kind, OffsetMap, Slab};
use coalesce::NO_FREER;
use tlsf::FreeIndex;

pub use alloc::{AllocError, Allocation, FreeError, OomInfo, PendingFrees};
pub use backing::{Backing, BackingError};
pub use block::{BlockId, BlockInfo, BlockState, Blocks};
pub use coalesce::SETTLE_SPACING;
pub use config::{checked_align_up, EngineConfig, MAX_RANGE};
pub use order::{Eligibility, FreeTag, ReuseKind, StreamOrder, StreamSlot};
pub use release::TeardownError;
pub use search::{CROSS_STREAM_BUDGET, OWN_CLASS_SCAN};
pub use stats::EngineStats;

/// One mapped segment: exactly what one `Backing::map` call returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    size: u64,
    token: u64,
}

/// The bookkeeping of one pool: which parts of the range are mapped, live, free (and on
/// which stream) or unmapped. Single threaded (`&mut self`); the pool serialises access.
///
/// See the [crate docs](crate) for the search order, growth policy and complexity.
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
    /// The border block (the free block directly below the unmapped space at the top of the
    /// range, in no index: see `block::BORDER`), or `NIL`.
    border: u32,
    /// Bytes in the border block, and the same if it is tagged.
    border_bytes: (u64, u64),
    /// Where the border block ends: the start of the unmapped space that reaches the end of
    /// the range, when recycling is off; `u64::MAX` otherwise. A free block is the border
    /// block when it ends there (one compare on every free, instead of reading the block
    /// after it).
    border_end: u64,
    /// One past the last entry of `indexes` that belongs to a stream slot below the private
    /// ones: what the searches over other streams scan (private slots, numbered past every
    /// stream, would otherwise make them scan the empty entries of the streams between).
    stream_span: usize,
    /// Unmapped blocks by offset.
    holes: BTreeMap<u64, u32>,
    /// Mapped segments by offset.
    segments: BTreeMap<u64, Segment>,
    /// Where segments start and end (granule indices), for recycling's candidate search.
    bounds: bounds::Boundaries,
    /// Tests: recycling scans every free list instead of ending after the one that covers
    /// the excess, to check that ending early changes no choice.
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
    /// The allocation count at the last growth: a growth soon after it maps ahead (see
    /// `growth::GROWTH_BURST`).
    last_growth: Option<u64>,
    /// Recycle idle segments before growing above `grow_mark` (see
    /// [`Engine::set_recycle_on_growth`]).
    recycle_on_growth: bool,
    /// When growth last recycled: recycling pauses while it is chronic.
    recycle_rate: recycle::RecycleRate,
    /// A segment was unmapped since the last packing: the next allocation on an empty
    /// engine packs the mapped memory (see `Engine::pack_idle`).
    pack_wanted: bool,
    /// Try rule 4 before growth (see [`Engine::set_dependency_before_growth`]).
    dependency_first: bool,
    /// Per free index (`[s + 1]` for stream slot `s`): the host-observed bound and the
    /// index's insert count when [`Engine::settle`] last looked at it.
    settled_below: Vec<(u64, u64)>,
    /// The only stream that freed since the last [`Engine::settle`], `NO_FREER` or
    /// `SEVERAL_FREERS` (see `Engine::coalescable`).
    solo_freer: StreamSlot,
    /// The free count from which the next settle at an allocation is due (see
    /// `Engine::settle_if_due`).
    settle_due_at: u64,
    /// The first private stream slot (see [`Engine::set_private_slots`]).
    private_from: StreamSlot,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
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
        cfg.validate()?;
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
            border: block::NIL,
            border_bytes: (0, 0),
            border_end: 0,
            stream_span: 1,
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
            last_growth: None,
            recycle_on_growth: false,
            recycle_rate: recycle::RecycleRate::default(),
            pack_wanted: false,
            dependency_first: false,
            settled_below: Vec::new(),
            solo_freer: NO_FREER,
            settle_due_at: 0,
            private_from: StreamSlot::MAX,
        })
    }
}
