//! Recycling: before a growth raises reserved memory above its all-time high, unmapping
//! fully free segments elsewhere that no in-flight work can touch; and pausing it while it
//! is chronic.

use smallvec::SmallVec;

use crate::block::{Block, Kind, NIL};
use crate::config::{align_down, align_up};
use crate::order::kind_for;
use crate::tlsf::{class_index, SL};
use crate::{Backing, Engine, FreeTag, StreamOrder, StreamSlot};

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
pub(crate) const RECYCLE_BURST: usize = 64;

/// The window of [`RECYCLE_BURST`], in allocations.
pub(crate) const RECYCLE_WINDOW: u64 = 512;

/// How long a chronic recycling pauses, in allocations (see [`RECYCLE_BURST`]).
pub(crate) const RECYCLE_PAUSE: u64 = 4096;

/// When growth last recycled, to pause recycling while it is chronic ([`RECYCLE_BURST`]).
#[derive(Clone, Debug)]
pub(crate) struct RecycleRate {
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
    pub(crate) fn paused(&self, now: u64) -> bool {
        now < self.paused_until
    }

    /// Records a growth that recycled at allocation count `now`; returns whether recycling
    /// pauses from here: this growth and the `RECYCLE_BURST` before it all fell within
    /// [`RECYCLE_WINDOW`] allocations.
    pub(crate) fn record(&mut self, now: u64) -> bool {
        let oldest = std::mem::replace(&mut self.recent[self.next], now);
        self.next = (self.next + 1) % RECYCLE_BURST;
        if oldest != NO_GROWTH && now - oldest < RECYCLE_WINDOW {
            *self = RecycleRate { paused_until: now + RECYCLE_PAUSE, ..RecycleRate::default() };
            return true;
        }
        false
    }
}

/// What [`Engine::recycle`] did.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recycled {
    /// Bytes unmapped.
    pub bytes: u64,
    /// Recycling fell short, and the recyclable free blocks outside the growth held more
    /// whole granules than whole segments: finer segments would have given back more.
    pub too_coarse: bool,
}

impl Engine {
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
    pub(crate) fn recycle<E>(
        &mut self,
        need: u64,
        protect: (u64, u64),
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing<Error = E>,
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
                    let seen = self.segments_inside(cur, protect, stream, order, &mut cands);
                    found += seen.0;
                    granules_free += seen.1;
                    cur = self.slab.blocks[cur as usize].next_free;
                }
            }
            if found >= need && last_cls == usize::MAX && !self.scans_every_list() {
                last_cls = cls + 1;
            }
            next_cls = cls + 1;
        }
        // The border block is in no index: whatever its size, `choose_recycled` ranks it
        // among the blocks listed.
        if let Some(p) = self.border_block() {
            let seen = self.segments_inside(p, protect, stream, order, &mut cands);
            found += seen.0;
            granules_free += seen.1;
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

    /// Appends to `out` the segments lying entirely inside free block `cur`, outside
    /// `protect`, when `stream` may recycle it; returns their bytes and the bytes of whole
    /// granules in the block outside `protect` (0 and 0 when it may not).
    fn segments_inside(
        &self,
        cur: u32,
        protect: (u64, u64),
        stream: StreamSlot,
        order: &dyn StreamOrder,
        out: &mut Vec<(u64, u64, u32)>,
    ) -> (u64, u64) {
        let g = self.cfg.granularity;
        let b = &self.slab.blocks[cur as usize];
        // A segment is whole granules aligned to the granularity: a block without an
        // aligned granule holds none.
        let (lo, hi) = (align_up(b.offset, g), align_down(b.end(), g));
        if lo + g > hi || !recyclable_for(b, stream, order) {
            return (0, 0);
        }
        let granules = if hi <= protect.0 || lo >= protect.1 { hi - lo } else { 0 };
        // Inside mapped memory consecutive boundaries delimit one segment.
        let (mut start, mut found) = (None, 0);
        self.bounds.for_each_in(lo / g, hi / g, |i| {
            let end = i * g;
            if let Some(off) = start {
                if end <= protect.0 || off >= protect.1 {
                    out.push((off, end - off, cur));
                    found += end - off;
                }
            }
            start = Some(end);
        });
        (found, granules)
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
    pub(crate) fn collect_free_segments(
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
}

/// Whether free block `b` may be unmapped and its addresses handed to `stream` again: no
/// in-flight work can touch it (untagged, or its free completed) and `stream` may reuse it
/// (same stream, or eligible under an enabled rule or a host observation).
fn recyclable_for(b: &Block, stream: StreamSlot, order: &dyn StreamOrder) -> bool {
    if !b.tagged {
        return true;
    }
    let eligible = b.stream == stream || kind_for(b.pos, &order.eligibility(b.stream)).is_some();
    eligible && order.is_complete(FreeTag { stream: b.stream, pos: b.pos })
}
