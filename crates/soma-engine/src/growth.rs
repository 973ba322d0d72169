//! Growth: where a request that no cached block serves maps memory, into how many segments,
//! and the bookkeeping of newly mapped memory.

use smallvec::SmallVec;

use crate::alloc::Grant;
use crate::block::{Kind, NIL};
use crate::config::{align_down, align_up};
use crate::{
    Allocation, Backing, BackingError, Engine, ReuseKind, Segment, StreamOrder, StreamSlot,
};

/// A growth maps its granules as this many segments of equal size in whole granules (fewer
/// when it has fewer granules, see `Engine::segment_count`), so that parts of a large block
/// that later hold smaller ones can be recycled piecewise. Measured on the PyTorch traces: 1 segment per growth gives
/// peak reserved / peak used up to 1.088 (BERT), 4 gives ≤ 1.026 at ~6× the map calls, one
/// segment per granule ≤ 1.018 at ~12× (before recycling took the smallest free blocks first;
/// 4 now gives ≤ 1.033).
pub(crate) const SEGMENTS_PER_GROWTH: u64 = 4;

/// How many times an engine doubles its segments per growth (from [`SEGMENTS_PER_GROWTH`]
/// up to 16): each time recycling falls short of the excess while the recyclable free
/// blocks hold more whole granules than it found in whole segments — the free memory sits in
/// segments that live blocks still touch, which finer segments would have avoided. Frees
/// that are not complete never count (finer segments would not help them), and workloads
/// whose recycling never falls short keep 4 and their map calls.
///
/// Measured (`trace_fragmentation_by_segments_per_growth`) on the four PyTorch traces of
/// `data/traces` and 13 more recorded with their tool (the first 13 of
/// `scripts/extra_trace_recipes.py`: batched decode with retiring rows, a GPT-2 request
/// stream of varying prompts, beam search, training with varying lengths, T5, ViT, RoBERTa,
/// BERT-large), peak reserved /
/// peak used: 4 fixed up to 1.081 (the request stream, whose 32 MiB attention temporaries
/// interleave with a growing KV cache), BERT 1.033; adaptive at most 1.024 (Mistral, as with
/// 4 fixed), the request stream 1.023, BERT 1.008 (1.7x its map calls), the traces without
/// shortfalls unchanged; 16 fixed about the same peaks but 1.2-1.6x the map calls on those
/// (LLaMA weights: 628 -> 1005).
pub(crate) const MAX_SPLIT_BOOST: u32 = 2;

/// Segments are refined (see [`MAX_SPLIT_BOOST`]) only when the growth leaves more than
/// `1 / REFINE_ABOVE` of the live bytes mapped beyond them: finer segments cost map calls,
/// and a pool that close to its live bytes gains little from them. Measured on the 17 traces:
/// 64 gives the same worst peak as always refining with up to 35 % fewer map calls
/// (BERT-large 2838 -> 1847, GPT-2 training 1622 -> 1284); 32 let a RoBERTa trace reach 1.042
/// and 16 the GPT-2 request stream 1.066.
pub(crate) const REFINE_ABOVE: u64 = 64;

/// A segment is at least `1 / MIN_SEGMENT_FRACTION` of the memory reserved when it is mapped
/// (a growth smaller than that is one segment): finer pieces of a large pool save little memory (each at most
/// 0.2 % of it) but cost a map and later an unmap each. Only pools above 512 granules (1 GiB
/// of 2 MiB granules) are affected. Measured: on RMM's `random_allocations` (about 17 GiB
/// reserved) 2-5x fewer remaps per warm replay for a 1-2 % higher peak (still below TLSF's);
/// gpt2_small_train (5.7 GiB) 1.015 -> 1.014 with 6 % fewer map calls; the traces below 1 GiB
/// unchanged. 256 cut the random remaps further but gave gpt2_small_train 1.023.
pub(crate) const MIN_SEGMENT_FRACTION: u64 = 512;

/// A growth within this many allocations of the previous one is part of a *burst* (a pool
/// growing fast: a model loading its weights, the first steps of a workload), and maps at
/// least [`BURST_CHUNK_FRACTION`] of the pool.
pub(crate) const GROWTH_BURST: u64 = 4;

/// A growth in a burst ([`GROWTH_BURST`]) that extends the mapped memory upward, on an
/// engine that does not recycle, maps at least `1 / BURST_CHUNK_FRACTION` of the all-time
/// reserved high (within the unmapped hole), so that a pool growing from nothing to `n`
/// bytes makes O(log n) growths instead of one every few allocations; what the last growth
/// of a burst maps beyond its request is free memory the next requests take, at most 1/64
/// of the pool. Measured on RMM's `random_allocations` (first replay, sizes up to 1 MiB,
/// 16 GiB): 8195 map calls -> 1500, for a 0.9 % higher peak; the four PyTorch traces within
/// 0.001 of their peak without it (1/64 after any growth, not only in bursts, cost LLaMA
/// 1.002 -> 1.016; 1/32 in bursts 1.018).
pub(crate) const BURST_CHUNK_FRACTION: u64 = 64;

/// Why growth did not produce an allocation.
#[derive(Debug)]
pub(crate) enum GrowError<E> {
    /// No unmapped hole fits, or the backing is out of memory.
    NoRoom,
    /// The backing failed otherwise.
    Backing(E),
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

impl Engine {
    /// Growth: plan, recycle, map, commit. See the crate docs.
    pub(crate) fn grow<E>(
        &mut self,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<Allocation, GrowError<E>> {
        let Some(mut plan) = self.plan_growth(size, align, stream, order) else {
            return Err(GrowError::NoRoom);
        };
        // Recycle only what would raise reserved memory above its all-time high: below it,
        // mapping costs no peak memory and recycling would only add driver calls.
        let now = self.stats.allocs;
        let recycling = self.recycle_on_growth && !self.recycle_rate.paused(now);
        let over = if recycling {
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
        // A pool that recycles maps exactly what it needs; one that does not maps ahead in a
        // burst.
        let exact = plan.map_len;
        if !recycling {
            plan.map_len = self.burst_length(&plan, now);
        }
        let mut tokens: SmallVec<[(u64, u64, u64); 4]> = SmallVec::new();
        let mut mapped = self.map_chunks(plan.map_off, plan.map_len, backing, &mut tokens);
        if matches!(mapped, Err(BackingError::OutOfMemory)) && plan.map_len > exact {
            // The device cannot hold the burst's chunk: map what the request needs.
            plan.map_len = exact;
            mapped = self.map_chunks(plan.map_off, plan.map_len, backing, &mut tokens);
        }
        if let Err(e) = mapped {
            return Err(match e {
                BackingError::OutOfMemory => GrowError::NoRoom,
                BackingError::Driver(e) => GrowError::Backing(e),
            });
        }
        self.last_growth = Some(now);
        let fresh = self.map_into_hole(plan.map_off, plan.map_len, &tokens);
        let alloc_end = plan.alloc_off + size;
        let Some(base) = plan.base else {
            return Ok(self.finish_alloc(
                fresh,
                plan.alloc_off,
                size,
                align,
                Grant::default(),
                true,
            ));
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
        let grant = Grant { reuse: plan.kind, dependency: None };
        let a = self.finish_alloc(target, plan.alloc_off, size, align, grant, true);
        if let Some(l) = leftover {
            self.insert_free_coalesce(l);
        }
        Ok(a)
    }

    /// How much a growth planned as `plan` at allocation count `now` maps: the plan's
    /// length, or in a burst ([`GROWTH_BURST`]) when it maps upward from the start of its
    /// mapping (a new run, or the extension of the free block below a hole), at least
    /// [`BURST_CHUNK_FRACTION`] of the reserved high, as far as the hole reaches.
    fn burst_length(&self, plan: &Plan, now: u64) -> u64 {
        let in_burst = self.last_growth.is_some_and(|last| now - last <= GROWTH_BURST);
        if !in_burst || !(plan.base.is_none() || plan.base_left) {
            return plan.map_len;
        }
        let chunk = align_up(self.grow_mark / BURST_CHUNK_FRACTION, self.cfg.granularity);
        if chunk <= plan.map_len {
            return plan.map_len;
        }
        let (_, &hole) =
            self.holes.range(..=plan.map_off).next_back().expect("a growth maps inside a hole");
        chunk.min(self.slab.blocks[hole as usize].end() - plan.map_off)
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

    /// Into how many segments a mapping of `len` bytes (whole granules) is cut: the segments
    /// per growth (doubled per `split_boost`), but no more than there are granules, none
    /// smaller than `reserved / MIN_SEGMENT_FRACTION` (when that is more than a granule),
    /// and enough that none exceeds `max_segment` (if set).
    pub(crate) fn segment_count(&self, len: u64) -> u64 {
        let g = self.cfg.granularity;
        let granules = len / g;
        let smallest = (self.stats.reserved / MIN_SEGMENT_FRACTION).max(g);
        let count = (self.segments_per_growth << self.split_boost).min(len / smallest).max(1);
        let at_most = match self.max_segment {
            0 => 1,
            m => len.div_ceil(m),
        };
        count.max(at_most).min(granules)
    }

    /// Maps `[off, off + len)` (whole granules) as [`Engine::segment_count`] segments of
    /// equal size in whole granules (the first ones one granule larger when the granules do
    /// not divide evenly), recording `(offset, size, token)` of each; on failure unmaps what
    /// it mapped.
    pub(crate) fn map_chunks<E>(
        &self,
        off: u64,
        len: u64,
        backing: &mut dyn Backing<Error = E>,
        out: &mut SmallVec<[(u64, u64, u64); 4]>,
    ) -> Result<(), BackingError<E>> {
        let g = self.cfg.granularity;
        let count = self.segment_count(len);
        let (each, larger) = (len / g / count, len / g % count);
        let mut at = off;
        for i in 0..count {
            let size = (each + u64::from(i < larger)) * g;
            match backing.map(at, size) {
                Ok(token) => out.push((at, size, token)),
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
            at += size;
        }
        debug_assert_eq!(at, off + len);
        Ok(())
    }

    /// Turns `[off, off + len)` of the hole containing it into a mapped, untagged free block
    /// (in no index) and records its segments; the border block is filed in its index when
    /// the top hole no longer follows it. Returns the new block.
    pub(crate) fn map_into_hole(
        &mut self,
        off: u64,
        len: u64,
        segments: &[(u64, u64, u64)],
    ) -> u32 {
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
        self.locate_border_end();
        let m = &mut self.slab.blocks[mid as usize];
        m.kind = Kind::Free;
        m.tagged = false;
        m.settled = false;
        m.stream = 0;
        m.pos = 0;
        // The border block is below the top hole no more when the mapping starts at that
        // hole (mapped memory follows the block) or inside it (an unmapped hole does, which
        // no longer reaches the end of the range).
        if self.border != NIL && !self.below_the_top_hole(&self.slab.blocks[self.border as usize]) {
            self.refile_free(self.border);
        }
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
}
