//! Growth (mapping granules), recycling and releasing segments.

use smallvec::SmallVec;

use super::block::{Block, Kind, NIL};
use super::tlsf::{class_index, SL};
use super::{
    align_down, align_up, Allocation, Backing, BackingError, Engine, FreeTag, ReuseKind, Segment,
    StreamOrder, StreamSlot,
};

/// A growth maps its granules as about this many segments (each a power of two of at least
/// one granule, aligned to its size), so that parts of a large block that later hold smaller
/// ones can be recycled piecewise. Measured on the PyTorch traces: 1 segment per growth gives
/// peak reserved / peak used up to 1.088 (BERT), 4 gives ≤ 1.026 at ~6× the map calls, one
/// segment per granule ≤ 1.018 at ~12× (before recycling took the smallest free blocks first;
/// 4 now gives ≤ 1.033).
pub(super) const SEGMENTS_PER_GROWTH: u64 = 4;

/// How many times an engine doubles its segments per growth (from [`SEGMENTS_PER_GROWTH`]
/// up to 16): each time recycling falls short of the excess while the recyclable free
/// blocks hold more whole granules than it found in whole segments — the free memory sits in
/// segments that live blocks still touch, which finer segments would have avoided. Frees
/// that are not complete never count (finer segments would not help them), and workloads
/// whose recycling never falls short keep 4 and their map calls.
///
/// Measured (`trace_fragmentation_by_segments_per_growth`) on the four shared PyTorch traces
/// and 13 more recorded with their tool (the first 13 of `scripts/extra_trace_recipes.py`:
/// batched decode with retiring rows, a GPT-2 request stream of varying prompts, beam
/// search, training with varying lengths, T5, ViT, RoBERTa, BERT-large), peak reserved /
/// peak used: 4 fixed up to 1.081 (the request stream, whose 32 MiB attention temporaries
/// interleave with a growing KV cache), BERT 1.033; adaptive at most 1.024 (Mistral, as with
/// 4 fixed), the request stream 1.023, BERT 1.008 (1.7x its map calls), the traces without
/// shortfalls unchanged; 16 fixed about the same peaks but 1.2-1.6x the map calls on those
/// (LLaMA weights: 628 -> 1005).
pub(super) const MAX_SPLIT_BOOST: u32 = 2;

/// Segments are refined (see [`MAX_SPLIT_BOOST`]) only when the growth leaves more than
/// `1 / REFINE_ABOVE` of the live bytes mapped beyond them: finer segments cost map calls,
/// and a pool that close to its live bytes gains little from them. Measured on the 17 traces:
/// 64 gives the same worst peak as always refining with up to 35 % fewer map calls
/// (BERT-large 2838 -> 1847, GPT-2 training 1622 -> 1284); 32 let a RoBERTa trace reach 1.042
/// and 16 the GPT-2 request stream 1.066.
pub(super) const REFINE_ABOVE: u64 = 64;

/// A segment is at least `1 / MIN_SEGMENT_FRACTION` of the memory reserved when it is mapped
/// (within the growth's size): finer pieces of a large pool save little memory (each at most
/// 0.2 % of it) but cost a map and later an unmap each. Only pools above 512 granules (1 GiB
/// of 2 MiB granules) are affected. Measured: on RMM's `random_allocations` (about 17 GiB
/// reserved) 2-5x fewer remaps per warm replay for a 1-2 % higher peak (still below TLSF's);
/// gpt2_small_train (5.7 GiB) 1.015 -> 1.014 with 6 % fewer map calls; the traces below 1 GiB
/// unchanged. 256 cut the random remaps further but gave gpt2_small_train 1.023.
pub(super) const MIN_SEGMENT_FRACTION: u64 = 512;

/// Recycling pauses when it has become chronic: when more than `RECYCLE_BURST` growths
/// within [`RECYCLE_WINDOW`] allocations each had to unmap memory elsewhere (more than one
/// allocation in 8), growth stops recycling for the next [`RECYCLE_PAUSE`] allocations and
/// maps above the all-time reserved high instead, which rises. Each recycling growth costs an
/// unmap and a map per segment (driver calls of tens of microseconds on an NPU); a workload
/// that needs them that often is trading most of its allocation time for a few percent of
/// peak memory, and giving the pool that memory ends the churn: once it holds what the
/// workload's fragmentation needs, growth stops. Measured (the most recycling growths in any
/// 512 consecutive allocations): the PyTorch traces at most 28 (BERT-large; BERT 23, RoBERTa
/// 11, the rest at most 5), so none of them pauses; RMM's `random_allocations` with sizes up
/// to 256 MiB 71–112, to 64 MiB 11–58.
pub(super) const RECYCLE_BURST: usize = 64;

/// The window of [`RECYCLE_BURST`], in allocations.
pub(super) const RECYCLE_WINDOW: u64 = 512;

/// How long a chronic recycling pauses, in allocations (see [`RECYCLE_BURST`]).
pub(super) const RECYCLE_PAUSE: u64 = 4096;

/// When growth last recycled, to pause recycling while it is chronic ([`RECYCLE_BURST`]).
#[derive(Clone, Debug)]
pub(super) struct RecycleRate {
    /// The allocation count at the last `RECYCLE_BURST` recycling growths (a ring;
    /// [`NO_GROWTH`]: fewer since the engine was created or last paused).
    recent: [u64; RECYCLE_BURST],
    /// Where the ring's oldest entry is.
    next: usize,
    /// Growth does not recycle before the allocation count reaches this.
    paused_until: u64,
}

/// An empty slot of [`RecycleRate::recent`] (an allocation count never reaches it), so that
/// the ring takes 8 bytes per entry rather than an `Option<u64>`'s 16.
const NO_GROWTH: u64 = u64::MAX;

impl Default for RecycleRate {
    fn default() -> Self {
        RecycleRate { recent: [NO_GROWTH; RECYCLE_BURST], next: 0, paused_until: 0 }
    }
}

impl RecycleRate {
    /// Whether recycling is paused at allocation count `now`.
    pub(super) fn paused(&self, now: u64) -> bool {
        now < self.paused_until
    }

    /// Records a growth that recycled at allocation count `now`; returns whether recycling
    /// pauses from here: this growth and the `RECYCLE_BURST` before it all fell within
    /// [`RECYCLE_WINDOW`] allocations.
    pub(super) fn record(&mut self, now: u64) -> bool {
        let oldest = std::mem::replace(&mut self.recent[self.next], now);
        self.next = (self.next + 1) % RECYCLE_BURST;
        if oldest != NO_GROWTH && now - oldest < RECYCLE_WINDOW {
            *self = RecycleRate { paused_until: now + RECYCLE_PAUSE, ..RecycleRate::default() };
            return true;
        }
        false
    }
}

/// Why growth did not produce an allocation.
#[derive(Debug)]
pub(super) enum GrowError {
    /// No unmapped hole fits, or the backing is out of memory.
    NoRoom,
    /// The backing failed otherwise.
    Backing(String),
}

/// Where a growth maps and places its block.
#[derive(Clone, Copy, Debug)]
struct Plan {
    /// Granule-aligned range to map (inside one hole).
    map_off: u64,
    map_len: u64,
    /// Where the block goes.
    alloc_off: u64,
    /// The free block extended into the hole (right: it precedes the hole; left: it follows).
    base: Option<u32>,
    /// Whether `base` precedes the hole.
    base_left: bool,
    /// Reuse rule of `base` (`None`: fresh).
    kind: Option<ReuseKind>,
    /// Range that recycling must not touch.
    protect: (u64, u64),
}

/// What [`Engine::recycle`] did.
#[derive(Clone, Copy, Debug)]
struct Recycled {
    /// Bytes unmapped.
    bytes: u64,
    /// Recycling fell short, and the recyclable free blocks outside the growth held more
    /// whole granules than whole segments: finer segments would have given back more.
    too_coarse: bool,
}

impl Engine {
    /// Growth: plan, recycle, map, commit. See the module docs.
    pub(super) fn grow(
        &mut self,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing,
    ) -> Result<Allocation, GrowError> {
        let Some(mut plan) = self.plan_growth(size, align, stream, order) else {
            return Err(GrowError::NoRoom);
        };
        // Recycle only what would raise reserved memory above its all-time high: below it,
        // mapping costs no peak memory and recycling would only add driver calls.
        let now = self.stats.allocs;
        let over = if self.recycle_on_growth && !self.recycle_rate.paused(now) {
            (self.stats.reserved + plan.map_len).saturating_sub(self.grow_mark)
        } else {
            0
        };
        let recycled = self.recycle(over, plan.protect, stream, order, backing);
        if recycled.bytes > 0 && self.recycle_rate.record(now) {
            self.stats.recycling_pauses += 1;
        }
        if recycled.too_coarse && !self.segments_fixed {
            // Enough whole granules were free and recyclable, but in segments that live
            // blocks still touch: map later growths in finer segments (`MAX_SPLIT_BOOST`) —
            // when what this growth leaves mapped beyond the live bytes is worth it.
            let (reserved, live) = (self.stats.reserved + plan.map_len, self.stats.used + size);
            if reserved.saturating_sub(live) > live / REFINE_ABOVE {
                self.split_boost = (self.split_boost + 1).min(MAX_SPLIT_BOOST);
            }
        }
        if plan.base.is_none() && recycled.bytes > 0 {
            // Recycling may have opened a lower hole.
            plan = self.plan_new_run(size).expect("recycling only enlarges holes");
        }
        let mut tokens: SmallVec<[(u64, u64, u64); 4]> = SmallVec::new();
        if let Err(e) = self.map_chunks(plan.map_off, plan.map_len, backing, &mut tokens) {
            return Err(match e {
                BackingError::OutOfMemory => GrowError::NoRoom,
                BackingError::Failed(msg) => GrowError::Backing(msg),
            });
        }
        let fresh = self.map_into_hole(plan.map_off, plan.map_len, &tokens);
        let alloc_end = plan.alloc_off + size;
        let Some(base) = plan.base else {
            return Ok(self.finish_alloc(fresh, plan.alloc_off, size, align, None, None, true));
        };
        // Extension: the newly mapped memory the block does not cover stays untagged (it was
        // never used); only the part of `base` outside the block keeps `base`'s tag.
        debug_assert_eq!(self.slab.blocks[base as usize].kind, Kind::Free);
        self.remove_free(base);
        let (target, leftover) = if plan.base_left {
            let leftover = (alloc_end < self.slab.blocks[fresh as usize].end())
                .then(|| self.slab.split(fresh, alloc_end));
            self.slab.absorb_next(base, fresh);
            (base, leftover)
        } else {
            let (used, leftover) = if plan.alloc_off > plan.map_off {
                (self.slab.split(fresh, plan.alloc_off), Some(fresh))
            } else {
                (fresh, None)
            };
            let b = self.slab.blocks[base as usize];
            let f = &mut self.slab.blocks[used as usize];
            f.tagged = b.tagged;
            f.settled = b.settled;
            f.stream = b.stream;
            f.pos = b.pos;
            self.slab.absorb_next(used, base);
            (used, leftover)
        };
        let a = self.finish_alloc(target, plan.alloc_off, size, align, plan.kind, None, true);
        if let Some(l) = leftover {
            self.insert_free_coalesce(l);
        }
        Ok(a)
    }

    /// A new run of `round_up(size, granularity)` at the start of the lowest hole that fits.
    fn plan_new_run(&self, size: u64) -> Option<Plan> {
        let run = align_up(size, self.cfg.granularity);
        self.holes.iter().find_map(|(&h0, &h)| {
            (self.slab.blocks[h as usize].size >= run).then(|| Self::new_run_at(h0, run))
        })
    }

    /// The plan of a new run of `run` bytes at the start of the hole at `h0`.
    fn new_run_at(h0: u64, run: u64) -> Plan {
        Plan {
            map_off: h0,
            map_len: run,
            alloc_off: h0,
            base: None,
            base_left: false,
            kind: None,
            protect: (h0, h0 + run),
        }
    }

    /// The extension that maps the fewest granules (ties: lowest address), else a new run.
    ///
    /// One pass over the holes in address order that also finds the new run's hole (the
    /// first that fits); it stops at the first extension of a single granule, which no later
    /// hole can beat.
    fn plan_growth(
        &self,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<Plan> {
        let g = self.cfg.granularity;
        let run = align_up(size, g);
        let mut best: Option<Plan> = None;
        let mut new_run: Option<Plan> = None;
        let consider = |best: &mut Option<Plan>, p: Plan| {
            if best.is_none_or(|b| p.map_len < b.map_len) {
                *best = Some(p);
            }
        };
        for (&h0, &h) in &self.holes {
            if best.is_some_and(|b| b.map_len <= g) {
                break;
            }
            let hb = self.slab.blocks[h as usize];
            if new_run.is_none() && hb.size >= run {
                new_run = Some(Self::new_run_at(h0, run));
            }
            // Extend the free block before the hole to the right.
            if hb.prev != NIL {
                let l = self.slab.blocks[hb.prev as usize];
                if l.kind == Kind::Free {
                    let a = align_up(l.offset, align);
                    let end = a + size;
                    if a < h0 && end > h0 {
                        let map_len = align_up(end - h0, g);
                        if map_len <= hb.size {
                            if let Some(kind) = self.eligible_kind(&l, stream, order) {
                                consider(
                                    &mut best,
                                    Plan {
                                        map_off: h0,
                                        map_len,
                                        alloc_off: a,
                                        base: Some(hb.prev),
                                        base_left: true,
                                        kind,
                                        protect: (l.offset, h0 + map_len),
                                    },
                                );
                            }
                        }
                    }
                }
            }
            // Extend the free block after the hole to the left.
            if hb.next != NIL {
                let r = self.slab.blocks[hb.next as usize];
                if r.kind == Kind::Free && r.end() >= size {
                    let a = align_down(r.end() - size, align);
                    if a >= h0 && a < r.offset && a + size > r.offset {
                        let map_off = align_down(a, g);
                        if let Some(kind) = self.eligible_kind(&r, stream, order) {
                            consider(
                                &mut best,
                                Plan {
                                    map_off,
                                    map_len: r.offset - map_off,
                                    alloc_off: a,
                                    base: Some(hb.next),
                                    base_left: false,
                                    kind,
                                    protect: (map_off, r.end()),
                                },
                            );
                        }
                    }
                }
            }
        }
        best.or(new_run)
    }

    /// The segment size for a growth of `len` bytes: the largest power of two of at most
    /// `max(len / (segments per growth << split boost), granularity,
    /// min(len, reserved / MIN_SEGMENT_FRACTION))`, at most `max_segment` (if set).
    fn segment_size(&self, len: u64) -> u64 {
        let floor = (self.stats.reserved / MIN_SEGMENT_FRACTION).min(len);
        let c = (len / (self.segments_per_growth << self.split_boost))
            .max(self.cfg.granularity)
            .max(floor);
        let pow2 = 1u64 << (63 - c.leading_zeros());
        match self.max_segment {
            0 => pow2,
            m => pow2.min(m),
        }
    }

    /// Maps `[off, off + len)` as segments of [`Engine::segment_size`] (aligned to it),
    /// recording `(offset, size, token)` of each; on failure unmaps what it mapped.
    fn map_chunks(
        &self,
        off: u64,
        len: u64,
        backing: &mut dyn Backing,
        out: &mut SmallVec<[(u64, u64, u64); 4]>,
    ) -> Result<(), BackingError> {
        let end = off + len;
        let mut at = off;
        let max_seg = self.segment_size(len);
        while at < end {
            let chunk_end = (align_down(at, max_seg) + max_seg).min(end);
            match backing.map(at, chunk_end - at) {
                Ok(token) => out.push((at, chunk_end - at, token)),
                Err(e) => {
                    for &(o, l, t) in out.iter().rev() {
                        // Best effort: a failing unmap here leaves memory mapped in the
                        // backing that the engine does not track; report the first error.
                        let _ = backing.unmap(o, l, t);
                    }
                    out.clear();
                    return Err(e);
                }
            }
            at = chunk_end;
        }
        Ok(())
    }

    /// Turns `[off, off + len)` of the hole containing it into a mapped, untagged free block
    /// (in no index) and records its segments. Returns the new block.
    fn map_into_hole(&mut self, off: u64, len: u64, segments: &[(u64, u64, u64)]) -> u32 {
        let (&h0, &h) =
            self.holes.range(..=off).next_back().expect("a hole contains the mapped range");
        let hb = self.slab.blocks[h as usize];
        debug_assert!(h0 <= off && off + len <= hb.end());
        let mut mid = h;
        if off > h0 {
            mid = self.slab.split(h, off);
        } else {
            self.holes.remove(&h0);
        }
        if off + len < hb.end() {
            let rest = self.slab.split(mid, off + len);
            self.holes.insert(off + len, rest);
        }
        let m = &mut self.slab.blocks[mid as usize];
        m.kind = Kind::Free;
        m.tagged = false;
        m.settled = false;
        m.stream = 0;
        m.pos = 0;
        let g = self.cfg.granularity;
        for &(o, l, token) in segments {
            self.segments.insert(o, Segment { size: l, token });
            self.bounds.set(o / g);
            self.bounds.set((o + l) / g);
        }
        let s = &mut self.stats;
        s.reserved += len;
        s.reserved_high = s.reserved_high.max(s.reserved);
        self.grow_mark = self.grow_mark.max(s.reserved);
        s.map_calls += segments.len() as u64;
        s.bytes_mapped_total += len;
        mid
    }

    /// Before mapping `need` bytes for `stream`: unmaps fully free recyclable segments
    /// (untagged, or complete *and* reusable by `stream` under the reuse rules — recycling
    /// hands the same addresses out again, so it must obey the same rules) outside `protect`,
    /// chosen by [`Engine::choose_recycled`], until `need` bytes are recycled. Candidates are
    /// the segments inside one free block (found through the free indices' classes of at
    /// least one granule and the segment boundaries), and when those do not cover `need` on
    /// several streams, also those covered by several free blocks.
    /// Unmap errors end recycling silently (nothing was changed by the failed call).
    ///
    /// Returns what was unmapped and whether segments were too coarse (see [`Recycled`]).
    fn recycle(
        &mut self,
        need: u64,
        protect: (u64, u64),
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing,
    ) -> Recycled {
        if need == 0 || self.segments.is_empty() {
            return Recycled { bytes: 0, too_coarse: false };
        }
        let mut cands = std::mem::take(&mut self.scratch);
        cands.clear();
        // From one class below the granule's up (a block sits in its own class's list or the
        // one below, see `tlsf.rs`; smaller blocks cover no segment), list by list across
        // all indices. `choose_recycled` takes candidates smallest block first, so once the
        // lists up to `c` cover `need` only list `c + 1` can still matter: a block of list
        // `c` is smaller than the floor of class `c + 2`, every block of a later list is not.
        let g = self.cfg.granularity;
        let mut next_cls = class_index(g >> self.unit_shift).saturating_sub(1);
        let mut last_cls = usize::MAX;
        let mut found = 0;
        // Whole granules in the recyclable free blocks seen outside `protect` (the growth's
        // own base block): what finer segments could have given back.
        let mut granules_free = 0;
        while let Some(cls) = self
            .indexes
            .iter()
            .flatten()
            .filter_map(|ix| ix.first_at_or_above(next_cls / SL, next_cls % SL))
            .map(|(f, s)| f * SL + s)
            .min()
        {
            if cls > last_cls {
                break;
            }
            for ix in self.indexes.iter().flatten() {
                let mut cur = ix.head(cls / SL, cls % SL);
                while cur != NIL {
                    let b = &self.slab.blocks[cur as usize];
                    // A segment is whole granules aligned to the granularity: a block
                    // without an aligned granule holds none.
                    let (lo, hi) = (align_up(b.offset, g), align_down(b.end(), g));
                    if lo + g <= hi && recyclable_for(b, stream, order) {
                        if hi <= protect.0 || lo >= protect.1 {
                            granules_free += hi - lo;
                        }
                        // Inside mapped memory consecutive boundaries delimit one segment.
                        let mut start = None;
                        self.bounds.for_each_in(lo / g, hi / g, |i| {
                            let end = i * g;
                            if let Some(off) = start {
                                if end <= protect.0 || off >= protect.1 {
                                    cands.push((off, end - off, cur));
                                    found += end - off;
                                }
                            }
                            start = Some(end);
                        });
                    }
                    cur = b.next_free;
                }
            }
            if found >= need && last_cls == usize::MAX && !self.scans_every_list() {
                last_cls = cls + 1;
            }
            next_cls = cls + 1;
        }
        // Segments covered by several free blocks are only found by the exhaustive scan,
        // O(blocks + segments). Free blocks of one stream (and never-used ones) always merge,
        // so only blocks of different streams can share a segment: skip the scan unless at
        // least two streams hold free blocks (it cost ~1 µs per growth on one stream).
        let tagged_indexes =
            self.indexes.iter().skip(1).flatten().filter(|ix| !ix.is_empty()).count();
        if found < need && tagged_indexes >= 2 {
            self.collect_free_segments(
                &|b| recyclable_for(b, stream, order),
                protect,
                0,
                &mut cands,
            );
        }
        let mut chosen = self.choose_recycled(&mut cands, need);
        // Highest first: splitting a free block keeps the record of its lower part, so the
        // covering records of lower segments stay valid.
        chosen.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
        // Short of `need` (so every list was scanned) with free granules left in partly
        // live segments.
        let too_coarse = found < need && granules_free > found;
        let mut unmapped = 0;
        for &(off, len, first) in &chosen {
            if self.unmap_segment(off, len, first, backing).is_err() {
                break;
            }
            unmapped += len;
        }
        cands.clear();
        self.scratch = cands;
        Recycled { bytes: unmapped, too_coarse }
    }

    #[cfg(test)]
    fn scans_every_list(&self) -> bool {
        self.recycle_scan_all
    }

    #[cfg(not(test))]
    #[inline]
    fn scans_every_list(&self) -> bool {
        false
    }

    /// Picks the segments to unmap for `need` bytes out of `cands` (`(offset, size, first
    /// covering block)`, reordered): first the fewest candidates, taken from the *smallest*
    /// free blocks up, that cover `need`; among those, greedily the smallest segment that
    /// covers what remains, else the largest.
    ///
    /// Smallest blocks first, for the reason best fit keeps large blocks whole: a segment
    /// carved out of a large free block leaves it unable to serve the requests it fitted,
    /// which then grow, which recycles again. Measured on RMM's `random_allocations` (sizes up
    /// to 64 / 256 MiB, warm): 3.5-4x fewer remaps at the same peak than choosing among all
    /// candidates by segment size alone; BERT's peak 1.033 instead of 1.026 of the live bytes,
    /// the other traces unchanged. The greedy step within keeps the overshoot small.
    fn choose_recycled(
        &self,
        cands: &mut Vec<(u64, u64, u32)>,
        need: u64,
    ) -> SmallVec<[(u64, u64, u32); 8]> {
        let blocks = &self.slab.blocks;
        cands.sort_unstable_by_key(|c| (blocks[c.2 as usize].size, std::cmp::Reverse(c.1), c.0));
        let mut covered = 0;
        if let Some(last) = cands.iter().position(|c| {
            covered += c.1;
            covered >= need
        }) {
            cands.truncate(last + 1);
        }
        cands.sort_unstable_by_key(|c| (c.1, c.0));
        let mut chosen = SmallVec::new();
        let mut remaining = need;
        while remaining > 0 && !cands.is_empty() {
            let i = cands.partition_point(|c| c.1 < remaining);
            let c = cands.remove(i.min(cands.len() - 1));
            remaining = remaining.saturating_sub(c.1);
            chosen.push(c);
        }
        chosen
    }

    /// Replaces `out` with `(offset, size, first covering block)` of every segment starting
    /// at or above `from`, in address order, that is entirely covered by free blocks
    /// satisfying `pred` and does not intersect `protect`.
    ///
    /// # Time Complexity
    ///
    /// O(blocks + segments) from the last unmapped hole at or below `from` (O(log holes) to
    /// find it): packing looks only above `reserved`, where few segments are.
    fn collect_free_segments(
        &self,
        pred: &dyn Fn(&Block) -> bool,
        protect: (u64, u64),
        from: u64,
        out: &mut Vec<(u64, u64, u32)>,
    ) {
        out.clear();
        // The walk over the blocks may start at any block at or below the first segment.
        let mut cur = self.holes.range(..=from).next_back().map_or(self.first, |(_, &h)| h);
        for (&off, seg) in self.segments.range(from..) {
            let end = off + seg.size;
            while self.slab.blocks[cur as usize].end() <= off {
                cur = self.slab.blocks[cur as usize].next;
            }
            if end > protect.0 && off < protect.1 {
                continue;
            }
            let mut c = cur;
            let covered = loop {
                let b = &self.slab.blocks[c as usize];
                if b.kind != Kind::Free || !pred(b) {
                    break false;
                }
                if b.end() >= end {
                    break true;
                }
                c = b.next;
            };
            if covered {
                out.push((off, seg.size, cur));
            }
        }
    }

    /// Unmaps, highest address first, fully free segments whose every block satisfies
    /// `pred` until `reserved <= max(keep, used)`, without going below the target by a
    /// granule or more: a segment larger than what is left to release is skipped while
    /// smaller ones can go, and if the target is still not met, one of the skipped segments
    /// is unmapped and its lowest granules mapped again, so that `reserved` ends at the
    /// target rounded down to the granularity (the release threshold and `trim_to` keep what
    /// they were told to keep; a multi-granule segment unmapped whole would take the cache of
    /// one large allocation away entirely). Returns the bytes released, net of that remap.
    pub(super) fn release_where(
        &mut self,
        keep: u64,
        backing: &mut dyn Backing,
        pred: &dyn Fn(&Block) -> bool,
    ) -> Result<u64, BackingError> {
        let target = keep.max(self.stats.used);
        if self.stats.reserved <= target {
            return Ok(0);
        }
        let mut cands = std::mem::take(&mut self.scratch);
        self.collect_free_segments(pred, (0, 0), 0, &mut cands);
        let mut released = 0;
        let mut result = Ok(());
        // The highest segment too large to go whole.
        let mut too_large = None;
        for &(off, len, first) in cands.iter().rev() {
            if self.stats.reserved <= target {
                break;
            }
            if self.stats.reserved - len < target {
                too_large = too_large.or(Some(off));
                continue;
            }
            if let Err(e) = self.unmap_segment(off, len, first, backing) {
                result = Err(e);
                break;
            }
            released += len;
        }
        if let (Ok(()), Some(off)) = (&result, too_large) {
            if self.stats.reserved > target {
                // The unmaps above may have split the blocks covering it: find them again.
                self.collect_free_segments(pred, (0, 0), off, &mut cands);
                if let Some(&(o, len, first)) = cands.first().filter(|c| c.0 == off) {
                    result = self.release_part(o, len, first, target, backing).map(|n| {
                        released += n;
                    });
                }
            }
        }
        cands.clear();
        self.scratch = cands;
        result.map(|()| released)
    }

    /// Unmaps free segment `[off, off + len)` (covered from block `first`) and maps its
    /// lowest granules again, so that `reserved` drops to `target` rounded down to the
    /// granularity; `reserved - len < target < reserved`. Returns the bytes released. A
    /// failed remap is not an error: the segment stays unmapped (`reserved` ends lower).
    fn release_part(
        &mut self,
        off: u64,
        len: u64,
        first: u32,
        target: u64,
        backing: &mut dyn Backing,
    ) -> Result<u64, BackingError> {
        let rest = self.stats.reserved - len;
        let again = align_down(target - rest, self.cfg.granularity);
        debug_assert!(again < len, "segment at {off} not larger than what is left to release");
        self.unmap_segment(off, len, first, backing)?;
        if again == 0 || self.map_free(off, again, backing).is_err() {
            return Ok(len);
        }
        Ok(len - again)
    }

    /// Unmaps fully free segment `[off, off + len)`, whose free blocks start at `first`, and
    /// turns it into unmapped space.
    fn unmap_segment(
        &mut self,
        off: u64,
        len: u64,
        first: u32,
        backing: &mut dyn Backing,
    ) -> Result<(), BackingError> {
        let seg = self.segments[&off];
        debug_assert_eq!(seg.size, len, "boundaries and segments disagree at {off}");
        backing.unmap(off, len, seg.token)?;
        self.unmap_bookkeeping(off, len, first);
        Ok(())
    }

    /// Maps `[off, off + len)` of an unmapped hole as never-used free memory, coalesced and
    /// indexed.
    fn map_free(
        &mut self,
        off: u64,
        len: u64,
        backing: &mut dyn Backing,
    ) -> Result<(), BackingError> {
        let mut tokens: SmallVec<[(u64, u64, u64); 4]> = SmallVec::new();
        self.map_chunks(off, len, backing, &mut tokens)?;
        let fresh = self.map_into_hole(off, len, &tokens);
        self.insert_free_coalesce(fresh);
        Ok(())
    }

    /// Packing, on the first allocation after the engine emptied (nothing live) when
    /// segments were unmapped since the last packing: moves the free segments that lie
    /// entirely above `reserved` bytes from the start of the range into the lowest unmapped
    /// holes below it — unmapped first, then the holes mapped, so `reserved` ends where it
    /// was and its high-water mark does not move. The next workload then starts from one
    /// mapped run at the bottom of the range, as the first one did from nothing: without it,
    /// a workload run again from empty (a model unloaded and loaded again) places its
    /// long-lived blocks between the holes recycling left, and peak reserved memory creeps
    /// up from run to run (the BERT trace: 1.007 -> 1.07 after 20 runs). Only segments no
    /// in-flight work can touch move (untagged, or complete per [`StreamOrder::is_complete`]),
    /// as for [`Engine::release`]; pools that do not recycle on growth never pack. Best
    /// effort: a failed driver call ends it (what moved is accounted, `reserved` may end
    /// lower).
    ///
    /// # Time Complexity
    ///
    /// O(holes + log segments + the blocks and segments above `reserved`) plus one driver
    /// call per moved segment and per mapped segment; runs once per emptying of an engine
    /// that unmapped.
    #[cold]
    #[inline(never)]
    pub(super) fn pack_idle(&mut self, order: &dyn StreamOrder, backing: &mut dyn Backing) {
        self.pack_wanted = false;
        if !self.recycle_on_growth || self.holes.len() <= 1 {
            // One hole: the mapped memory is already one run (or nothing is mapped).
            return;
        }
        let top = self.stats.reserved;
        let mut cands = std::mem::take(&mut self.scratch);
        self.collect_free_segments(
            &|b| !b.tagged || order.is_complete(FreeTag { stream: b.stream, pos: b.pos }),
            (0, 0),
            top,
            &mut cands,
        );
        let mut moved = 0;
        for &(off, len, first) in cands.iter().rev() {
            if self.unmap_segment(off, len, first, backing).is_err() {
                break;
            }
            moved += len;
        }
        cands.clear();
        self.scratch = cands;
        // The holes below `top`: exactly the bytes mapped above it, so `moved` fits.
        let holes: SmallVec<[(u64, u64); 8]> = self
            .holes
            .iter()
            .map(|(&h0, &h)| (h0, self.slab.blocks[h as usize].size.min(top.saturating_sub(h0))))
            .take_while(|&(h0, _)| h0 < top)
            .collect();
        for (h0, room) in holes {
            if moved == 0 {
                break;
            }
            let len = room.min(moved);
            if self.map_free(h0, len, backing).is_err() {
                break;
            }
            moved -= len;
        }
        // Its own unmaps set the flag again.
        self.pack_wanted = false;
    }

    /// After `Backing::unmap` of segment `[off, off + len)`: carves it out of the free
    /// blocks covering it (the first being `first`) into an unmapped block, merged with
    /// unmapped neighbours.
    fn unmap_bookkeeping(&mut self, off: u64, len: u64, first: u32) {
        let end = off + len;
        let mut idx = first;
        self.remove_free(idx);
        if self.slab.blocks[idx as usize].offset < off {
            let n = self.slab.split(idx, off);
            self.insert_free(idx);
            idx = n;
        }
        let start = idx;
        loop {
            debug_assert_eq!(self.slab.blocks[idx as usize].kind, Kind::Free);
            if self.slab.blocks[idx as usize].end() > end {
                let t = self.slab.split(idx, end);
                self.insert_free(t);
            }
            let b = &mut self.slab.blocks[idx as usize];
            b.kind = Kind::Unmapped;
            b.tagged = false;
            b.settled = false;
            b.stream = 0;
            b.pos = 0;
            if b.end() == end {
                break;
            }
            idx = b.next;
            self.remove_free(idx);
        }
        // The segment's edges stay boundaries where mapped memory (another segment) touches
        // them.
        let g = self.cfg.granularity;
        let mapped = |b: u32| b != NIL && self.slab.blocks[b as usize].kind != Kind::Unmapped;
        let (before, after) = (
            mapped(self.slab.blocks[start as usize].prev),
            mapped(self.slab.blocks[idx as usize].next),
        );
        if !before {
            self.bounds.clear(off / g);
        }
        if !after {
            self.bounds.clear(end / g);
        }
        // Merge the run and any unmapped block after it.
        let u = start;
        loop {
            let n = self.slab.blocks[u as usize].next;
            if n == NIL || self.slab.blocks[n as usize].kind != Kind::Unmapped {
                break;
            }
            let n_off = self.slab.blocks[n as usize].offset;
            if n_off >= end {
                self.holes.remove(&n_off);
            }
            self.slab.absorb_next(u, n);
        }
        let p = self.slab.blocks[u as usize].prev;
        if p != NIL && self.slab.blocks[p as usize].kind == Kind::Unmapped {
            // `p` is already in the hole map under its own offset.
            self.slab.absorb_next(p, u);
        } else {
            self.holes.insert(self.slab.blocks[u as usize].offset, u);
        }
        self.segments.remove(&off);
        self.pack_wanted = true;
        let s = &mut self.stats;
        s.reserved -= len;
        s.unmap_calls += 1;
        s.bytes_unmapped_total += len;
    }
}

/// Whether free block `b` may be unmapped and its addresses handed to `stream` again: no
/// in-flight work can touch it (untagged, or its free completed) and `stream` may reuse it
/// (same stream, or eligible under an enabled rule or a host observation).
fn recyclable_for(b: &Block, stream: StreamSlot, order: &dyn StreamOrder) -> bool {
    if !b.tagged {
        return true;
    }
    let eligible =
        b.stream == stream || super::ops::kind_for(b.pos, &order.eligibility(b.stream)).is_some();
    eligible && order.is_complete(FreeTag { stream: b.stream, pos: b.pos })
}
