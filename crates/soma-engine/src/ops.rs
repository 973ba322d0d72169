//! Free-list maintenance, coalescing, carving and the cache searches of [`Engine`].

use smallvec::SmallVec;

use super::block::{Block, Kind, NIL, SETTLED_BY_SEVERAL};
use super::tlsf::{class_at_least, class_index, FreeIndex, SL};
use super::{
    align_up, Allocation, BlockId, Eligibility, Engine, FreeTag, OomInfo, PendingFrees, ReuseKind,
    StreamOrder, StreamSlot, CROSS_STREAM_BUDGET, OWN_CLASS_SCAN,
};

/// Index in `Engine::indexes` of the free index holding blocks with this tag state.
#[inline]
pub(super) fn index_slot(tagged: bool, stream: StreamSlot) -> usize {
    if tagged {
        stream as usize + 1
    } else {
        0
    }
}

/// The rule under which a block freed at `pos` is eligible, in the documented order.
#[inline]
pub(super) fn kind_for(pos: u64, e: &Eligibility) -> Option<ReuseKind> {
    if pos < e.host_observed {
        Some(ReuseKind::HostSynchronized)
    } else if pos < e.event {
        Some(ReuseKind::EventDependency)
    } else if pos < e.completed {
        Some(ReuseKind::Opportunistic)
    } else {
        None
    }
}

/// The largest bound of an eligibility (0: nothing eligible).
#[inline]
fn bound_of(e: &Eligibility) -> u64 {
    e.host_observed.max(e.event).max(e.completed)
}

/// Whether free blocks `a` and `b` always merge: one of them never used, both untagged (never
/// used or settled), or the same stream. A settled block and another stream's tagged block
/// merge only while that stream is the only one freeing (see [`Engine::coalescable`]).
#[inline]
fn mergeable(a: &Block, b: &Block) -> bool {
    a.kind == Kind::Free && b.kind == Kind::Free && tags_merge(a, b, NIL)
}

/// The tag part of [`mergeable`] for two free blocks, a settled block also merging with the
/// tagged blocks of stream `solo` (pass [`NIL`], no stream slot, for none).
#[inline(always)]
fn tags_merge(a: &Block, b: &Block, solo: StreamSlot) -> bool {
    match (a.tagged, b.tagged) {
        (true, true) => a.stream == b.stream,
        (false, false) => true,
        (false, true) => !a.settled || a.stream == b.stream || b.stream == solo,
        (true, false) => !b.settled || a.stream == b.stream || a.stream == solo,
    }
}

/// The `stream` of the merge of untagged block `b` with settled block `o`: `o`'s, unless
/// `b` is settled by another stream.
#[inline]
fn settled_stream(b: &Block, o: &Block) -> StreamSlot {
    if !b.settled || b.stream == o.stream {
        o.stream
    } else {
        SETTLED_BY_SEVERAL
    }
}

/// The reuse rule of an allocation from untagged free block `b` by `stream`: `None` (fresh)
/// for memory never used; for settled memory a same-stream reuse by the stream that freed
/// it, else a host-synchronized one (its free was host-observed).
#[inline]
fn untagged_kind(b: &Block, stream: StreamSlot) -> Option<ReuseKind> {
    b.settled.then_some(if b.stream == stream {
        ReuseKind::SameStream
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
    /// Puts free block `idx` (not in any index) into the index of its tag, creating the
    /// index on the stream's first free.
    #[inline(always)]
    pub(super) fn insert_free(&mut self, idx: u32) {
        let b = &self.slab.blocks[idx as usize];
        debug_assert_eq!(b.kind, Kind::Free);
        let slot = index_slot(b.tagged, b.stream);
        if !matches!(self.indexes.get(slot), Some(Some(_))) {
            self.create_index(slot);
        }
        let ix = self.indexes[slot].as_mut().expect("created above");
        ix.insert(&mut self.slab.blocks, idx, self.unit_shift);
    }

    /// Creates the free index of `slot` (on a stream's first free).
    #[cold]
    #[inline(never)]
    fn create_index(&mut self, slot: usize) {
        if slot >= self.indexes.len() {
            self.indexes.resize_with(slot + 1, || None);
        }
        self.indexes[slot].get_or_insert_with(|| Box::new(FreeIndex::new()));
    }

    /// Takes free block `idx` out of its index.
    #[inline(always)]
    pub(super) fn remove_free(&mut self, idx: u32) {
        let b = &self.slab.blocks[idx as usize];
        debug_assert_eq!(b.kind, Kind::Free);
        let slot = index_slot(b.tagged, b.stream);
        let ix = self.indexes[slot].as_mut().expect("a free block's index exists");
        ix.remove(&mut self.slab.blocks, idx);
    }

    /// Whether free blocks `a` and `b` may merge: same stream, or one of them untagged.
    #[inline]
    pub(super) fn mergeable(&self, a: u32, b: u32) -> bool {
        mergeable(&self.slab.blocks[a as usize], &self.slab.blocks[b as usize])
    }

    /// Whether free blocks `a` and `b` merge now: when they always do ([`mergeable`]), and
    /// also a settled block with a tagged block of the stream that is the only one to have
    /// freed since the last settle (`solo_freer`). While one stream runs alone (a server's
    /// request on its stream), its frees then coalesce with the settled memory around them as
    /// on one stream; while several free, settled memory stays apart, because merged into one
    /// stream's block it would wait for that stream's latest free before the others could
    /// use it again.
    #[inline(always)]
    pub(super) fn coalescable(&self, a: &Block, b: &Block) -> bool {
        a.kind == Kind::Free && b.kind == Kind::Free && tags_merge(a, b, self.solo_freer)
    }

    /// Gives `into` the tag of the merge of `into` and `other` (same stream: larger `pos`;
    /// untagged takes the other's tag; two untagged blocks are settled if either is).
    #[inline]
    fn combine_tag(&mut self, into: u32, other: u32) {
        let o = self.slab.blocks[other as usize];
        let b = &mut self.slab.blocks[into as usize];
        if o.tagged {
            if b.tagged {
                debug_assert_eq!(b.stream, o.stream);
                b.pos = b.pos.max(o.pos);
            } else {
                b.tagged = true;
                b.settled = false;
                b.stream = o.stream;
                b.pos = o.pos;
            }
        } else if !b.tagged && o.settled {
            b.stream = settled_stream(b, &o);
            b.settled = true;
        }
    }

    /// Coalesces free block `idx` (not in any index) with mergeable neighbours and indexes
    /// the result, which is returned.
    ///
    /// # Time Complexity
    ///
    /// O(1).
    #[inline(never)]
    pub(super) fn insert_free_coalesce(&mut self, idx: u32) -> u32 {
        self.coalesce_and_index(idx)
    }

    /// [`Engine::insert_free_coalesce`], inlined: for [`Engine::free`], which every free
    /// runs through.
    #[inline(always)]
    pub(super) fn coalesce_and_index(&mut self, idx: u32) -> u32 {
        let blocks = &self.slab.blocks;
        let b = &blocks[idx as usize];
        let (p, n) = (b.prev, b.next);
        let merge_p = p != NIL && self.coalescable(&blocks[p as usize], b);
        // An untagged block between free blocks of two streams merges with one of them only
        // (blocks of different streams never merge).
        let merge_n = n != NIL
            && self.coalescable(b, &blocks[n as usize])
            && (!merge_p || self.coalescable(&blocks[p as usize], &blocks[n as usize]));
        // A settled block merged into a tagged one gives it the tagged block's stream, with
        // which the block beyond it may merge now (see `Engine::coalescable`): look again.
        let settled_in = b.settled
            || merge_p && blocks[p as usize].settled
            || merge_n && blocks[n as usize].settled;
        let r = self.merge_neighbours(idx, p, n, merge_p, merge_n);
        if settled_in && self.slab.blocks[r as usize].tagged {
            return self.coalesce_again(r);
        }
        r
    }

    /// [`Engine::insert_free_coalesce`] once more for indexed free block `r`, whose tag a
    /// merge just changed.
    #[cold]
    #[inline(never)]
    fn coalesce_again(&mut self, r: u32) -> u32 {
        self.remove_free(r);
        self.insert_free_coalesce(r)
    }

    /// The merges [`Engine::insert_free_coalesce`] decided, and the indexing of the result.
    #[inline(always)]
    fn merge_neighbours(&mut self, idx: u32, p: u32, n: u32, merge_p: bool, merge_n: bool) -> u32 {
        if merge_p != merge_n {
            if let Some(r) = self.coalesce_in_place(idx, p, n, merge_p) {
                return r;
            }
        }
        let mut idx = idx;
        if merge_p {
            self.remove_free(p);
            self.combine_tag(p, idx);
            self.slab.absorb_next(p, idx);
            idx = p;
        }
        if merge_n {
            self.remove_free(n);
            self.combine_tag(idx, n);
            self.slab.absorb_next(idx, n);
        }
        self.insert_free(idx);
        idx
    }

    /// The fast paths of [`Engine::insert_free_coalesce`]: when exactly one neighbour of
    /// `idx` merges with it (`prev` if `with_prev`, else `next`) and the merged block stays in
    /// that neighbour's index and size class, the merge happens without touching the index's
    /// lists and bitmaps (the merged record takes the neighbour's list position). Same result
    /// as the general path: the lower record survives, tags combine the same way. `None`:
    /// nothing done.
    ///
    /// # Time Complexity
    ///
    /// O(1).
    #[inline(always)]
    fn coalesce_in_place(
        &mut self,
        idx: u32,
        prev: u32,
        next: u32,
        with_prev: bool,
    ) -> Option<u32> {
        let blocks = &self.slab.blocks;
        let (keep, other, indexed) = if with_prev {
            // `prev` absorbs `idx` and keeps its list position.
            (prev, idx, prev)
        } else {
            // `idx` absorbs `next` and takes its list position.
            (idx, next, next)
        };
        let (k, o, ib) =
            (&blocks[keep as usize], &blocks[other as usize], &blocks[indexed as usize]);
        // The merged tag (as `combine_tag`): tagged if either is (same stream when both are,
        // as they merge), keeping the larger position.
        let tag = match (k.tagged, o.tagged) {
            (true, true) => Some((k.stream, k.pos.max(o.pos))),
            (true, false) => Some((k.stream, k.pos)),
            (false, true) => Some((o.stream, o.pos)),
            (false, false) => None,
        };
        let slot = index_slot(tag.is_some(), tag.map_or(0, |t| t.0));
        if slot != index_slot(ib.tagged, ib.stream) {
            return None;
        }
        let merged = k.size + o.size;
        // The merged block may stay one class above the list that holds it (see `tlsf.rs`).
        if merged >= self.floors.get(usize::from(ib.cls) + 2) {
            return None;
        }
        let added = merged - ib.size;
        let o = *o;
        let kb = &mut self.slab.blocks[keep as usize];
        if let Some((stream, pos)) = tag {
            kb.tagged = true;
            kb.settled = false;
            kb.stream = stream;
            kb.pos = pos;
        } else if o.settled {
            kb.stream = settled_stream(kb, &o);
            kb.settled = true;
        }
        let ix = self.indexes[slot].as_mut().expect("a free block's index exists");
        if indexed != keep {
            ix.replace(&mut self.slab.blocks, indexed, keep);
        }
        ix.bytes += added;
        if let Some((_, pos)) = tag {
            ix.max_pos = ix.max_pos.max(pos);
        }
        self.slab.absorb_next(keep, other);
        Some(keep)
    }

    /// Turns `[start, start + size)` of free block `idx` (in no index) into a live block for
    /// a request with alignment `align`; the rest on either side stays free with the same tag,
    /// coalesced with its neighbours when `coalesce`. Pass `false` only when `idx` was an
    /// indexed free block: those are maximal (no free neighbour they may merge with), so
    /// neither rest can merge with anything and is indexed as it is. Updates the statistics
    /// and the offset index.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn finish_alloc(
        &mut self,
        idx: u32,
        start: u64,
        size: u64,
        align: u64,
        reuse: Option<ReuseKind>,
        dependency: Option<FreeTag>,
        coalesce: bool,
    ) -> Allocation {
        let b = self.slab.blocks[idx as usize];
        debug_assert_eq!(b.kind, Kind::Free);
        debug_assert!(start >= b.offset && start + size <= b.end());
        debug_assert_eq!(start % align, 0);
        let mut mid = idx;
        let front = if start > b.offset {
            mid = self.slab.split(idx, start);
            Some(idx)
        } else {
            None
        };
        let tail = if self.slab.blocks[mid as usize].size > size {
            Some(self.slab.split(mid, start + size))
        } else {
            None
        };
        // `mid` is live before its neighbours are indexed, so that they do not merge into it.
        let a = self.make_live(mid, start, size, align, reuse, dependency);
        for rest in [front, tail].into_iter().flatten() {
            if coalesce {
                self.insert_free_coalesce(rest);
            } else {
                debug_assert!(
                    [self.slab.blocks[rest as usize].prev, self.slab.blocks[rest as usize].next]
                        .iter()
                        .all(|&n| n == NIL || !self.mergeable(n, rest)),
                    "a maximal free block's rest has no mergeable neighbour"
                );
                self.insert_free(rest);
            }
        }
        a
    }

    /// Marks unindexed free block `mid` (exactly `[start, start + size)`) live and accounts
    /// the allocation.
    #[inline]
    fn make_live(
        &mut self,
        mid: u32,
        start: u64,
        size: u64,
        align: u64,
        reuse: Option<ReuseKind>,
        dependency: Option<FreeTag>,
    ) -> Allocation {
        let generation = {
            let m = &mut self.slab.blocks[mid as usize];
            m.kind = Kind::Live;
            m.tagged = false;
            m.settled = false;
            m.stream = 0;
            m.pos = 0;
            m.align_log2 = align.trailing_zeros() as u8;
            // Never 0 while live, which keeps `Option<BlockId>` one word (see `BlockId`).
            m.generation = m.generation.wrapping_add(1).max(1);
            m.generation
        };
        let s = &mut self.stats;
        s.used += size;
        s.used_high = s.used_high.max(s.used);
        s.live_blocks += 1;
        s.live_blocks_high = s.live_blocks_high.max(s.live_blocks);
        s.allocs += 1;
        match reuse {
            None => s.fresh_allocs += 1,
            Some(k) => s.reuses[k.index()] += 1,
        }
        if let Some(map) = &mut self.live_index {
            map.insert(start, mid);
        }
        Allocation { block: BlockId::new(mid, generation), offset: start, size, reuse, dependency }
    }

    /// [`Engine::finish_alloc`] from an indexed free block, at its first aligned offset.
    #[inline(always)]
    pub(super) fn commit_cached(
        &mut self,
        idx: u32,
        size: u64,
        align: u64,
        reuse: Option<ReuseKind>,
        dependency: Option<FreeTag>,
    ) -> Allocation {
        let b = &self.slab.blocks[idx as usize];
        let (offset, b_size, cls, tagged, stream) = (b.offset, b.size, b.cls, b.tagged, b.stream);
        let start = align_up(offset, align);
        // Carving the front: when the rest is not below the list that holds the block (see
        // `tlsf.rs`), the rest takes the block's list position instead of a remove and a
        // reinsert (it cannot merge with its next neighbour, which did not merge with the
        // block either).
        if start == offset && b_size > size && b_size - size >= self.floors.get(usize::from(cls)) {
            let t = self.slab.split(idx, start + size);
            let ix = self.indexes[index_slot(tagged, stream)]
                .as_mut()
                .expect("a free block's index exists");
            ix.replace(&mut self.slab.blocks, idx, t);
            ix.bytes -= size;
            return self.make_live(idx, start, size, align, reuse, dependency);
        }
        self.remove_free(idx);
        self.finish_alloc(idx, start, size, align, reuse, dependency, false)
    }

    /// Under which rule free block `b` may serve stream `stream`: `Some(None)` for untagged
    /// (fresh) memory, `Some(Some(kind))` for a reuse, `None` when not eligible (rule 4 is
    /// not considered).
    pub(super) fn eligible_kind(
        &self,
        b: &Block,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<Option<ReuseKind>> {
        if !b.tagged {
            Some(untagged_kind(b, stream))
        } else if b.stream == stream {
            Some(Some(ReuseKind::SameStream))
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
    pub(super) fn find_cached(
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
        for slot in 1..self.indexes.len() {
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

    /// Step 4: best fit among other streams' blocks regardless of eligibility.
    pub(super) fn find_internal_dependency(
        &self,
        size: u64,
        align: u64,
        stream: StreamSlot,
    ) -> Option<(u32, FreeTag)> {
        let own_slot = index_slot(true, stream);
        let mut best: Option<(u32, u64)> = None;
        for slot in 1..self.indexes.len() {
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
        best.map(|(i, _)| {
            let b = &self.slab.blocks[i as usize];
            (i, FreeTag { stream: b.stream, pos: b.pos })
        })
    }

    /// Visits every block of free index `slot`.
    fn for_each_in_index(&self, slot: usize, mut f: impl FnMut(&Block)) {
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
    /// below, so the largest block of an index is in one of these two).
    pub(super) fn largest_free_block(&self) -> u64 {
        let mut largest = 0;
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
    pub(super) fn oom_info(
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
    /// (what waiting for those streams would make reusable).
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
        for slot in 1..self.indexes.len() {
            if slot == own_slot || self.indexes[slot].as_ref().is_none_or(|i| i.is_empty()) {
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
