//! Free-index membership and coalescing: which free blocks merge, how their tags combine,
//! and settling, which untags the frees the host has observed so that they merge across
//! streams.

use smallvec::SmallVec;

use crate::block::{Block, Kind, BORDER, NIL, SETTLED_BY_SEVERAL, SETTLED_ON_COMPLETION};
use crate::tlsf::{self, FreeIndex};
use crate::{Engine, StreamOrder, StreamSlot};

/// `Engine::solo_freer` before any free since the last settle.
pub(crate) const NO_FREER: StreamSlot = StreamSlot::MAX;

/// `Engine::solo_freer` once frees of two streams followed the last settle.
pub(crate) const SEVERAL_FREERS: StreamSlot = StreamSlot::MAX - 1;

/// While several streams free, an allocation settles the completed frees
/// (`Engine::settle_completed`) once the frees since the last settle number at least
/// 1 / `SETTLE_SPACING` of the free blocks that settle looked at and left pending (it looks
/// at a stream's blocks when the stream completed or was observed past something since).
/// The next settle looks at those blocks again, so the frees pay for it:
/// O(`SETTLE_SPACING`) block visits per free.
/// While the device keeps up, few stay pending and nearly every allocation settles, so that
/// frees of streams used op by op merge as one stream's would; a stream with many frees in
/// flight is looked at less often.
pub const SETTLE_SPACING: u64 = 4;

/// Index in `Engine::indexes` of the free index holding blocks with this tag state.
#[inline]
pub(crate) fn index_slot(tagged: bool, stream: StreamSlot) -> usize {
    if tagged {
        stream as usize + 1
    } else {
        0
    }
}

/// Whether free blocks `a` and `b` always merge: one of them never used, both untagged (never
/// used or settled), or the same stream — a block of a private slot (`private` and up) only
/// with the same slot's. A settled block and another stream's tagged block merge only while
/// that stream is the only one freeing (see [`Engine::coalescable`]).
#[inline]
fn mergeable(a: &Block, b: &Block, private: StreamSlot) -> bool {
    a.kind == Kind::Free && b.kind == Kind::Free && tags_merge::<true>(a, b, NIL, private)
}

/// The tag part of [`mergeable`] for two free blocks, a settled block also merging with the
/// tagged blocks of stream `solo` (pass [`NIL`], no stream slot, for none). With `PRIVATE`, a
/// tagged block of a slot from `private` up merges with no untagged block; without, the
/// caller knows that neither block is of a private slot (or that the only tagged one's
/// neighbours are tagged too).
#[inline(always)]
fn tags_merge<const PRIVATE: bool>(
    a: &Block,
    b: &Block,
    solo: StreamSlot,
    private: StreamSlot,
) -> bool {
    match (a.tagged, b.tagged) {
        (true, true) => a.stream == b.stream,
        (false, false) => true,
        (false, true) => {
            (!PRIVATE || b.stream < private)
                && (!a.settled || a.stream == b.stream || b.stream == solo)
        }
        (true, false) => {
            (!PRIVATE || a.stream < private)
                && (!b.settled || a.stream == b.stream || a.stream == solo)
        }
    }
}

/// Gives free block `kb`, absorbing free block `o`, the tag of the merge: `tag` when the
/// merged block is tagged, else `o`'s settlement if `o` was settled.
#[inline(always)]
fn take_merged_tag(kb: &mut Block, o: &Block, tag: Option<(StreamSlot, u64)>) {
    if let Some((stream, pos)) = tag {
        kb.tagged = true;
        kb.settled = false;
        kb.stream = stream;
        kb.pos = pos;
    } else if o.settled {
        kb.stream = settled_stream(kb, o);
        kb.settled = true;
        kb.pos = kb.pos.max(o.pos);
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

impl Engine {
    /// Puts free block `idx` (not in any index) into the index of its tag, creating the
    /// index on the stream's first free — or, when the unmapped space at the end of the
    /// range follows it, makes it the border block (in no index, see [`BORDER`]).
    #[inline(always)]
    pub(crate) fn insert_free(&mut self, idx: u32) {
        let b = &self.slab.blocks[idx as usize];
        debug_assert_eq!(b.kind, Kind::Free);
        if self.below_the_top_hole(b) {
            self.insert_border(idx);
            return;
        }
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
        if slot <= self.private_from as usize {
            self.stream_span = self.stream_span.max(slot + 1);
        }
        self.indexes[slot].get_or_insert_with(|| Box::new(FreeIndex::new()));
    }

    /// Whether free block `b` is the border block: recycling is off and the unmapped space
    /// that reaches the end of the range follows `b`. (A pool that recycles places as best
    /// fit alone does: its growth unmaps elsewhere to map there, and keeping the top block
    /// for last only moves more memory.)
    #[inline(always)]
    pub(crate) fn below_the_top_hole(&self, b: &Block) -> bool {
        b.end() == self.border_end
    }

    /// Sets where the border block ends, after the holes or the recycling setting changed:
    /// the start of the last hole if it reaches the end of the range and recycling is off.
    pub(crate) fn locate_border_end(&mut self) {
        self.border_end = match self.holes.iter().next_back() {
            Some((&off, &h))
                if !self.recycle_on_growth && self.slab.blocks[h as usize].next == NIL =>
            {
                off
            }
            _ => u64::MAX,
        };
    }

    /// Makes free block `idx` (in no index, the top hole after it) the border block.
    #[cold]
    #[inline(never)]
    fn insert_border(&mut self, idx: u32) {
        // The stream's index exists once it freed, border block or not: it lists the
        // streams that freed here (`Engine::freeing_streams`).
        let slot = {
            let b = &self.slab.blocks[idx as usize];
            index_slot(b.tagged, b.stream)
        };
        if !matches!(self.indexes.get(slot), Some(Some(_))) {
            self.create_index(slot);
        }
        debug_assert_eq!(self.border, NIL, "one border block at most");
        self.border = idx;
        let b = &mut self.slab.blocks[idx as usize];
        b.cls = BORDER;
        b.prev_free = NIL;
        b.next_free = NIL;
        self.border_bytes.0 += b.size;
        if b.tagged {
            self.border_bytes.1 += b.size;
        }
    }

    /// Takes free block `idx` out of its index (or out of the border accounting).
    #[inline(always)]
    pub(crate) fn remove_free(&mut self, idx: u32) {
        let b = &self.slab.blocks[idx as usize];
        debug_assert_eq!(b.kind, Kind::Free);
        if b.cls == BORDER {
            self.remove_border(idx);
            return;
        }
        let slot = index_slot(b.tagged, b.stream);
        let ix = self.indexes[slot].as_mut().expect("a free block's index exists");
        ix.remove(&mut self.slab.blocks, idx);
    }

    /// Takes the border block `idx` out of the border accounting.
    #[cold]
    #[inline(never)]
    fn remove_border(&mut self, idx: u32) {
        debug_assert_eq!(self.border, idx);
        self.border = NIL;
        let b = &mut self.slab.blocks[idx as usize];
        b.cls = 0;
        self.border_bytes.0 -= b.size;
        if b.tagged {
            self.border_bytes.1 -= b.size;
        }
    }

    /// Files free block `idx` again after the space after it changed between unmapped and
    /// mapped: into an index, or as the border block.
    pub(crate) fn refile_free(&mut self, idx: u32) {
        self.remove_free(idx);
        self.insert_free(idx);
    }

    /// Whether free blocks `a` and `b` may merge: same stream, or one of them untagged.
    #[inline]
    pub(crate) fn mergeable(&self, a: u32, b: u32) -> bool {
        mergeable(&self.slab.blocks[a as usize], &self.slab.blocks[b as usize], self.private_from)
    }

    /// Whether free blocks `a` and `b` merge now: when they always do ([`mergeable`]), and
    /// also a settled block with a tagged block of the stream that is the only one to have
    /// freed since the last settle (`solo_freer`). While one stream runs alone (a server's
    /// request on its stream), its frees then coalesce with the settled memory around them as
    /// on one stream; while several free, settled memory stays apart, because merged into one
    /// stream's block it would wait for that stream's latest free before the others could
    /// use it again.
    ///
    /// `PRIVATE` applies the rule of private slots ([`Engine::set_private_slots`]); only
    /// [`Engine::free`] goes without it: the block it frees is of a stream slot, and its
    /// neighbours merge with it by the same rule as without private slots.
    #[inline(always)]
    pub(crate) fn coalescable<const PRIVATE: bool>(&self, a: &Block, b: &Block) -> bool {
        a.kind == Kind::Free
            && b.kind == Kind::Free
            && tags_merge::<PRIVATE>(a, b, self.solo_freer, self.private_from)
    }

    /// Makes the stream slots from `from` up *private*: what is freed on such a slot serves
    /// requests of that slot only — no other stream's under any rule (rule 4 included), and
    /// it is never pending for another stream ([`Engine::pending_frees`]) — and merges with
    /// free blocks of the same slot only, never with untagged (never used or settled)
    /// memory beside it, so that what is cached on such a slot is exactly what was freed
    /// there. soma's pools keep the memory of captured graphs on such slots (slots past the
    /// device's streams), which no other stream may use while the graph lives: merged with
    /// untagged memory, they would take that memory from every stream until then. Settling
    /// a private slot's frees (its bound passed them) untags them as any other, and makes
    /// them any stream's. None by default.
    pub fn set_private_slots(&mut self, from: StreamSlot) {
        self.private_from = from;
        let below = (1..self.indexes.len()).filter(|&s| s <= from as usize);
        self.stream_span = below.filter(|&s| self.indexes[s].is_some()).max().unwrap_or(0) + 1;
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
            b.pos = b.pos.max(o.pos);
        }
    }

    /// Coalesces free block `idx` (not in any index) with mergeable neighbours and indexes
    /// the result, which is returned.
    ///
    /// # Time Complexity
    ///
    /// O(1).
    #[inline(never)]
    pub(crate) fn insert_free_coalesce(&mut self, idx: u32) -> u32 {
        self.coalesce_and_index::<true>(idx)
    }

    /// [`Engine::insert_free_coalesce`], inlined: for [`Engine::free`], which every free
    /// runs through (`PRIVATE`: see [`Engine::coalescable`]).
    #[inline(always)]
    pub(crate) fn coalesce_and_index<const PRIVATE: bool>(&mut self, idx: u32) -> u32 {
        let blocks = &self.slab.blocks;
        let b = &blocks[idx as usize];
        let (p, n) = (b.prev, b.next);
        let merge_p = p != NIL && self.coalescable::<PRIVATE>(&blocks[p as usize], b);
        // An untagged block between free blocks of two streams merges with one of them only
        // (blocks of different streams never merge).
        let merge_n = n != NIL
            && self.coalescable::<PRIVATE>(b, &blocks[n as usize])
            && (!merge_p || self.coalescable::<PRIVATE>(&blocks[p as usize], &blocks[n as usize]));
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
        if ib.cls == BORDER && !with_prev {
            // `idx` absorbs the border block after it and becomes the border block.
            return Some(self.grow_border_down(keep, other, tag));
        }
        // A merge that would make the border block (the top hole after `other`) is filed
        // anew.
        if ib.cls == BORDER || self.below_the_top_hole(o) {
            return None;
        }
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
        take_merged_tag(kb, &o, tag);
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

    /// [`Engine::coalesce_in_place`] when free block `keep` (in no index) absorbs the border
    /// block `border` after it: the merged block, with tag `tag`, is the border block.
    #[inline]
    fn grow_border_down(&mut self, keep: u32, border: u32, tag: Option<(StreamSlot, u64)>) -> u32 {
        if let Some((stream, _)) = tag {
            let slot = index_slot(true, stream);
            if !matches!(self.indexes.get(slot), Some(Some(_))) {
                self.create_index(slot);
            }
        }
        let o = self.slab.blocks[border as usize];
        let kb = &mut self.slab.blocks[keep as usize];
        let merged = kb.size + o.size;
        take_merged_tag(kb, &o, tag);
        kb.cls = BORDER;
        kb.prev_free = NIL;
        kb.next_free = NIL;
        self.border_bytes =
            (self.border_bytes.0 - o.size + merged, if tag.is_some() { merged } else { 0 });
        self.border = keep;
        self.slab.absorb_next(keep, border);
        keep
    }

    /// Settles the frees the host has observed: every free block of a stream `s` freed below
    /// `order.eligibility(s).host_observed` becomes untagged (*settled*) and merges with the
    /// untagged free blocks beside it, whatever stream freed them. Every stream may use such
    /// memory under any policy (its free completed and the host knows it), so it no longer
    /// needs to stay apart from the free blocks of other streams; without this, memory freed
    /// by several streams stays cut into per-stream pieces until it is reused. A settled block
    /// merges with a tagged neighbour of the stream that freed it (taking that neighbour's
    /// tag: the merge is as safe as the neighbour), and with other streams' tagged blocks only
    /// while their stream is the only one freeing (see the crate docs).
    ///
    /// Called after host synchronisations; a stream whose observed bound did not move and
    /// whose index took no block since the last call is skipped.
    ///
    /// # Time Complexity
    ///
    /// O(free blocks of the streams whose bound moved): each free is settled at most once,
    /// blocks freed after the observation are looked at again at the next call.
    pub fn settle(&mut self, order: &dyn StreamOrder) {
        let _ = self.settle_below(order, false, None);
    }

    /// [`Engine::settle`] for the frees the device has completed as well, when `order`
    /// allows the opportunistic rule (rule 3): every stream may take such a block under that
    /// rule, so it need not stay apart from the free blocks of other streams either (a
    /// private slot's frees settle as by [`Engine::settle`] only). The requesting stream's
    /// own completed frees settle too, so that they merge with the rest. Called when several
    /// streams freed since the last settle and enough frees happened since
    /// ([`SETTLE_SPACING`]), when a stream takes another stream's border block under that
    /// rule, and before growth: memory several streams freed comes back together without a
    /// host synchronisation, as soon as the device completed the frees. A reuse of memory
    /// settled this way by another stream than the one that freed it counts as
    /// opportunistic (see [`SETTLED_ON_COMPLETION`]), and every stream may use it from then
    /// on, as memory the host observed.
    ///
    /// Returns how many free blocks it settled.
    ///
    /// # Time Complexity
    ///
    /// As [`Engine::settle`].
    pub(crate) fn settle_completed(&mut self, order: &dyn StreamOrder) -> usize {
        self.settle_below(order, true, None)
    }

    /// [`Engine::settle_completed`] but for `requester`'s own frees: before growth, and
    /// when `requester` takes another stream's border block. Its frees stay its own (it may
    /// use them anyway), so that a stream alone places as before, settled or not.
    pub(crate) fn settle_completed_for(
        &mut self,
        requester: StreamSlot,
        order: &dyn StreamOrder,
    ) -> usize {
        self.settle_below(order, true, Some(requester))
    }

    /// What an allocation does first: settles the completed frees
    /// ([`Engine::settle_completed`]) when several streams freed since the last settle and
    /// the frees since then number at least 1 / [`SETTLE_SPACING`] of the blocks that stayed
    /// pending at the last settle (each settle looks at those again).
    #[inline(always)]
    pub(crate) fn settle_if_due(&mut self, order: &dyn StreamOrder) {
        if self.solo_freer == SEVERAL_FREERS && self.stats.frees >= self.settle_due_at {
            let _ = self.settle_completed(order);
        }
    }

    /// [`Engine::settle`] (below the host-observed bounds) or, `on_completion`,
    /// [`Engine::settle_completed`] (below the completed bounds too), `except` a stream's
    /// frees.
    fn settle_below(
        &mut self,
        order: &dyn StreamOrder,
        on_completion: bool,
        except: Option<StreamSlot>,
    ) -> usize {
        let (mut settled, mut looked_at) = (0usize, 0usize);
        // Below `bound`, a block freed at or above `observed` settles on completion. A private
        // slot's frees serve that slot only, whatever completed: the host settles them.
        let private_from = self.private_from;
        let bounds = |stream: StreamSlot| {
            let e = order.completion(stream);
            if !on_completion {
                (e.host_observed, e.host_observed)
            } else if stream < private_from {
                (e.host_observed.max(e.completed), e.host_observed)
            } else {
                (0, 0)
            }
        };
        self.solo_freer = NO_FREER;
        let mut due: SmallVec<[u32; 16]> = SmallVec::new();
        for slot in 1..self.indexes.len() {
            let Some(ix) = self.indexes[slot].as_deref() else { continue };
            if ix.is_empty() {
                continue;
            }
            let stream = (slot - 1) as StreamSlot;
            if except == Some(stream) {
                continue;
            }
            let (bound, observed) = bounds(stream);
            let seen = self.settled_below.get(slot).copied().unwrap_or((0, 0));
            if bound == 0 || (bound <= seen.0 && ix.inserts == seen.1) {
                continue;
            }
            due.clear();
            let mut cls = 0;
            while let Some((fl, sl)) = ix.first_at_or_above(cls / tlsf::SL, cls % tlsf::SL) {
                let mut cur = ix.head(fl, sl);
                while cur != NIL {
                    let b = &self.slab.blocks[cur as usize];
                    looked_at += 1;
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
                if b.kind == Kind::Free && b.tagged && b.stream == stream && b.pos < bound {
                    self.settle_block(idx, b.pos >= observed);
                    settled += 1;
                }
            }
            // Merges while settling may index a block here again (one that joined a tagged
            // block of this stream, freed at or above the bound): count after them.
            let inserts = self.indexes[slot].as_deref().map_or(0, |ix| ix.inserts);
            if self.settled_below.len() <= slot {
                self.settled_below.resize(slot + 1, (0, 0));
            }
            self.settled_below[slot] = (bound, inserts);
        }
        // The border block, in no index.
        if let Some(idx) = self.border_block() {
            let b = &self.slab.blocks[idx as usize];
            if b.tagged && except != Some(b.stream) {
                looked_at += 1;
                let (bound, observed) = bounds(b.stream);
                if b.pos < bound {
                    self.settle_block(idx, b.pos >= observed);
                    settled += 1;
                }
            }
        }
        let pending = looked_at.saturating_sub(settled) as u64;
        self.settle_due_at = self.stats.frees + pending / SETTLE_SPACING;
        settled
    }

    /// Untags tagged free block `idx`, settled (`on_completion`: its free was not observed
    /// by the host, only completed), and merges it with its neighbours.
    fn settle_block(&mut self, idx: u32, on_completion: bool) {
        self.remove_free(idx);
        let b = &mut self.slab.blocks[idx as usize];
        b.tagged = false;
        b.settled = true;
        b.pos = if on_completion { SETTLED_ON_COMPLETION } else { 0 };
        self.insert_free_coalesce(idx);
    }
}
