//! The cache search: which free block serves a request under which reuse rule, the
//! internal-dependency fallback, and what other streams hold that a request could not use.

use smallvec::SmallVec;

use crate::alloc::{OomInfo, PendingFrees};
use crate::block::{Block, NIL, SETTLED_ON_COMPLETION};
use crate::coalesce::index_slot;
use crate::config::align_up;
use crate::order::{bound_of, kind_for};
use crate::tlsf::{class_at_least, class_index, SL};
use crate::{Engine, FreeTag, ReuseKind, StreamOrder, StreamSlot};

/// Blocks examined in the request's own size class before the good-fit search (finds the
/// block the requesting stream just freed, which TLSF's round-up would miss).
pub const OWN_CLASS_SCAN: usize = 8;

/// Blocks examined per other stream when only some of its cached blocks are eligible.
///
/// Free lists are LIFO, so the most recent (least likely eligible) frees come first; an
/// eligible block hidden behind more than this many ineligible ones is not found and the
/// request grows instead.
pub const CROSS_STREAM_BUDGET: usize = 32;

/// The reuse rule of an allocation from untagged free block `b` by `stream`: `None` (fresh)
/// for memory never used; for settled memory a same-stream reuse by the stream that freed
/// it, else a host-synchronized one (its free was host-observed).
#[inline]
pub(crate) fn untagged_kind(b: &Block, stream: StreamSlot) -> Option<ReuseKind> {
    b.settled.then_some(if b.stream == stream {
        ReuseKind::SameStream
    } else if b.pos == SETTLED_ON_COMPLETION {
        ReuseKind::Opportunistic
    } else {
        ReuseKind::HostSynchronized
    })
}

/// Whether `size` bytes aligned to `align` fit in block `b`.
#[inline]
fn fits(b: &Block, size: u64, align: u64) -> bool {
    align_up(b.offset, align) + size <= b.end()
}

impl Engine {
    /// Under which rule free block `b` may serve stream `stream`: `Some(None)` for untagged
    /// (fresh) memory, `Some(Some(kind))` for a reuse, `None` when not eligible (rule 4 is
    /// not considered).
    pub(crate) fn eligible_kind(
        &self,
        b: &Block,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<Option<ReuseKind>> {
        if !b.tagged {
            Some(untagged_kind(b, stream))
        } else if b.stream == stream {
            Some(Some(ReuseKind::SameStream))
        } else if b.stream >= self.private_from {
            // A private slot's blocks serve that slot only (`Engine::set_private_slots`).
            None
        } else {
            kind_for(b.pos, &order.eligibility(b.stream)).map(Some)
        }
    }

    /// Searches free index `slot` for a block that fits `size` aligned to `align` and, if
    /// `bound` is given, was freed at a `pos < bound`.
    ///
    /// First scans the request's own size class (at most [`OWN_CLASS_SCAN`] blocks, best fit,
    /// stopping at an exact fit); then takes the first acceptable block of the first
    /// non-empty class whose every member fits, examining at most `budget` blocks.
    ///
    /// # Time Complexity
    ///
    /// O(OWN_CLASS_SCAN + budget); O(OWN_CLASS_SCAN) without `bound`.
    #[inline(always)]
    fn search(
        &self,
        slot: usize,
        size: u64,
        align: u64,
        bound: Option<u64>,
        budget: usize,
    ) -> Option<u32> {
        let ix = self.indexes.get(slot)?.as_deref()?;
        if ix.is_empty() {
            return None;
        }
        let blocks = &self.slab.blocks;
        let ok = |b: &Block| bound.is_none_or(|bound| b.pos < bound);
        let own = class_index(size >> self.unit_shift);
        let mut cur = ix.head_at(own);
        if cur != NIL {
            // A block one class above its list (see `tlsf.rs`) — at least the next class's
            // floor — is left to the good-fit step.
            let stale_from = self.floors.get(own + 1);
            let mut seen = 0;
            let (mut best, mut best_size) = (NIL, u64::MAX);
            while cur != NIL && seen < OWN_CLASS_SCAN {
                let b = &blocks[cur as usize];
                seen += 1;
                if b.size < best_size && b.size < stale_from && ok(b) && fits(b, size, align) {
                    best = cur;
                    best_size = b.size;
                    if b.size == size {
                        break;
                    }
                }
                cur = b.next_free;
            }
            if best != NIL {
                return Some(best);
            }
        }
        let pad = align.saturating_sub(self.cfg.alignment);
        let need_units = size.checked_add(pad)? >> self.unit_shift;
        let (mut fl, mut sl) = class_at_least(need_units)?;
        let mut examined = 0usize;
        loop {
            let (f, s) = ix.first_at_or_above(fl, sl)?;
            let mut cur = ix.head(f, s);
            let stale_from = self.floors.get(f * SL + s + 1);
            // Prefer a block of the list's own class over one a class above it (which sits
            // here only because it grew or shrank in place): the first acceptable block of
            // the list's own class among the first OWN_CLASS_SCAN acceptable ones, else the
            // first acceptable one — as if the larger blocks were in the next list.
            let (mut fallback, mut acceptable) = (NIL, 0);
            while cur != NIL {
                if examined >= budget {
                    return (fallback != NIL).then_some(fallback);
                }
                examined += 1;
                let b = &blocks[cur as usize];
                if ok(b) {
                    debug_assert!(fits(b, size, align));
                    if b.size < stale_from {
                        return Some(cur);
                    }
                    if fallback == NIL {
                        fallback = cur;
                    }
                    acceptable += 1;
                    if acceptable >= OWN_CLASS_SCAN {
                        break;
                    }
                }
                cur = b.next_free;
            }
            if fallback != NIL {
                return Some(fallback);
            }
            if s + 1 < SL {
                (fl, sl) = (f, s + 1);
            } else {
                (fl, sl) = (f + 1, 0);
            }
        }
    }

    /// [`Engine::search`] out of line, for other streams' indexes (inlined, it is for the
    /// requester's own and the untagged index: every allocation searches those).
    #[inline(never)]
    fn search_other(
        &self,
        slot: usize,
        size: u64,
        align: u64,
        bound: Option<u64>,
        budget: usize,
    ) -> Option<u32> {
        self.search(slot, size, align, bound, budget)
    }

    /// Steps 1 and 2 of the search order: the requesting stream's own and untagged blocks,
    /// then other streams' eligible blocks. Returns the block and the reuse rule.
    #[inline(always)]
    pub(crate) fn find_cached(
        &self,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<(u32, Option<ReuseKind>)> {
        let own_slot = index_slot(true, stream);
        let size_of = |i: u32| self.slab.blocks[i as usize].size;
        let own = self.search(own_slot, size, align, None, usize::MAX);
        if let Some(o) = own.filter(|&o| size_of(o) == size) {
            // An exact fit cannot be beaten (the hot path: the block this stream just freed).
            return Some((o, Some(ReuseKind::SameStream)));
        }
        let fresh = if self.indexes[0].as_ref().is_some_and(|ix| !ix.is_empty()) {
            self.search(0, size, align, None, usize::MAX)
        } else {
            None
        };
        let untagged = |f: u32| (f, untagged_kind(&self.slab.blocks[f as usize], stream));
        match (own, fresh) {
            (Some(o), Some(f)) if size_of(f) < size_of(o) => return Some(untagged(f)),
            (Some(o), _) => return Some((o, Some(ReuseKind::SameStream))),
            (None, Some(f)) => return Some(untagged(f)),
            (None, None) => {}
        }
        let mut best: Option<(u32, u64, ReuseKind)> = None;
        // Private slots' blocks serve their own slot only.
        for slot in 1..self.stream_span {
            if slot == own_slot {
                continue;
            }
            let Some(ix) = self.indexes[slot].as_deref() else {
                continue;
            };
            if ix.is_empty() {
                continue;
            }
            let s = (slot - 1) as StreamSlot;
            let e = order.eligibility(s);
            let bound = bound_of(&e);
            if bound == 0 {
                continue;
            }
            let found = if bound > ix.max_pos {
                self.search_other(slot, size, align, None, usize::MAX)
            } else {
                self.search_other(slot, size, align, Some(bound), CROSS_STREAM_BUDGET)
            };
            if let Some(i) = found {
                let b = &self.slab.blocks[i as usize];
                let kind = kind_for(b.pos, &e).expect("searched under the bound");
                if best.is_none_or(|(_, sz, _)| b.size < sz) {
                    best = Some((i, b.size, kind));
                }
            }
        }
        best.map(|(i, _, k)| (i, Some(k)))
    }

    /// The border block (while recycling is off, the free block directly below the unmapped
    /// space that reaches the end of the range, in no index), if there is one. O(1).
    #[inline]
    pub(crate) fn border_block(&self) -> Option<u32> {
        (self.border != NIL).then_some(self.border)
    }

    /// After steps 1 and 2: the border block when `stream` may use it and the request fits,
    /// with its reuse rule. It serves a request only when no indexed block fits, so that a
    /// workload run again on mapped memory places its blocks as its first run did while the
    /// pool grew: where that run extended the mapped memory at its top, the next one finds
    /// the same border block, only larger.
    #[inline(always)]
    pub(crate) fn find_border(
        &self,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<(u32, Option<ReuseKind>)> {
        let p = self.border_block()?;
        let b = &self.slab.blocks[p as usize];
        if !fits(b, size, align) {
            return None;
        }
        self.eligible_kind(b, stream, order).map(|kind| (p, kind))
    }

    /// Step 4: best fit among other streams' indexed blocks regardless of eligibility, else
    /// another stream's border block (never a private slot's).
    pub(crate) fn find_internal_dependency(
        &self,
        size: u64,
        align: u64,
        stream: StreamSlot,
    ) -> Option<(u32, FreeTag)> {
        let own_slot = index_slot(true, stream);
        let mut best: Option<(u32, u64)> = None;
        for slot in 1..self.stream_span {
            if slot == own_slot {
                continue;
            }
            if let Some(i) = self.search_other(slot, size, align, None, CROSS_STREAM_BUDGET) {
                let sz = self.slab.blocks[i as usize].size;
                if best.is_none_or(|(_, b)| sz < b) {
                    best = Some((i, sz));
                }
            }
        }
        // The border block, last.
        if best.is_none() {
            best = self.border_block().and_then(|p| {
                let b = &self.slab.blocks[p as usize];
                let other = b.tagged && b.stream != stream && b.stream < self.private_from;
                (other && fits(b, size, align)).then_some((p, b.size))
            });
        }
        best.map(|(i, _)| {
            let b = &self.slab.blocks[i as usize];
            (i, FreeTag { stream: b.stream, pos: b.pos })
        })
    }

    /// Visits every block of free index `slot`, and the border block if it belongs there.
    fn for_each_in_index(&self, slot: usize, mut f: impl FnMut(&Block)) {
        if let Some(p) = self.border_block() {
            let b = &self.slab.blocks[p as usize];
            if index_slot(b.tagged, b.stream) == slot {
                f(b);
            }
        }
        let Some(ix) = self.indexes.get(slot).and_then(|i| i.as_deref()) else {
            return;
        };
        let (mut fl, mut sl) = (0, 0);
        while let Some((f_, s_)) = ix.first_at_or_above(fl, sl) {
            let mut cur = ix.head(f_, s_);
            while cur != NIL {
                let b = &self.slab.blocks[cur as usize];
                f(b);
                cur = b.next_free;
            }
            if s_ + 1 < SL {
                (fl, sl) = (f_, s_ + 1);
            } else {
                (fl, sl) = (f_ + 1, 0);
            }
        }
    }

    /// The exact largest free block: the maximum over each index's highest non-empty class
    /// list and the list just below it (a block sits in its own class's list or the one
    /// below, so the largest block of an index is in one of these two), and the border
    /// block.
    pub(crate) fn largest_free_block(&self) -> u64 {
        let mut largest = self.border_block().map_or(0, |p| self.slab.blocks[p as usize].size);
        for ix in self.indexes.iter().flatten() {
            if let Some((fl, sl)) = ix.highest() {
                let top = fl * SL + sl;
                for list in top.saturating_sub(1)..=top {
                    let mut cur = ix.head_at(list);
                    while cur != NIL {
                        let b = &self.slab.blocks[cur as usize];
                        largest = largest.max(b.size);
                        cur = b.next_free;
                    }
                }
            }
        }
        largest
    }

    /// The out-of-memory report for a request of `stream`.
    pub(crate) fn oom_info(
        &self,
        requested: u64,
        rounded: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> OomInfo {
        let pending = self.pending_frees(stream, order);
        OomInfo {
            requested,
            rounded,
            used: self.stats.used,
            reserved: self.stats.reserved,
            max: self.cfg.range_size,
            largest_free_block: self.largest_free_block(),
            pending_bytes: pending.iter().map(|p| p.bytes).sum(),
            pending,
        }
    }

    /// The frees of other streams than `stream` that no rule lets it reuse yet, by stream
    /// (what waiting for those streams would make reusable; not a private slot's, which no
    /// wait makes reusable).
    ///
    /// # Time Complexity
    ///
    /// O(cached blocks of other streams).
    pub fn pending_frees(
        &self,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> SmallVec<[PendingFrees; 4]> {
        let own_slot = index_slot(true, stream);
        let mut pending: SmallVec<[PendingFrees; 4]> = SmallVec::new();
        for slot in 1..self.stream_span {
            // A stream's index exists once it freed (border blocks are in none, see
            // `Engine::insert_free`).
            if slot == own_slot || self.indexes[slot].is_none() {
                continue;
            }
            let s = (slot - 1) as StreamSlot;
            let bound = bound_of(&order.eligibility(s));
            let (mut bytes, mut max_pos) = (0, 0);
            self.for_each_in_index(slot, |b| {
                if b.pos >= bound {
                    bytes += b.size;
                    max_pos = max_pos.max(b.pos);
                }
            });
            if bytes > 0 {
                pending.push(PendingFrees { stream: s, bytes, max_pos });
            }
        }
        pending
    }
}
