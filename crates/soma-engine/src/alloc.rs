//! The request path: allocation (from cache, by growth, or with an internal dependency),
//! carving a free block into a live one, freeing, and relocation for compaction.

use std::convert::Infallible;

use smallvec::SmallVec;

use crate::block::{Kind, NIL};
use crate::coalesce::{index_slot, NO_FREER, SEVERAL_FREERS};
use crate::config::{align_down, align_up};
use crate::growth::GrowError;
use crate::{Backing, BackingError, BlockId, Engine, FreeTag, ReuseKind, StreamOrder, StreamSlot};

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

/// Why [`Engine::alloc`] failed: `E` is the backing's error ([`Backing::Error`]). The engine is
/// unchanged (see the crate docs, *Failure atomicity*).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllocError<E> {
    /// Size 0, a size that overflows when rounded, or larger than the range.
    InvalidSize(String),
    /// Alignment 0, not a power of two, or larger than the granularity.
    InvalidAlignment(String),
    /// Nothing eligible is free and no more memory could be mapped.
    OutOfMemory(OomInfo),
    /// The backing failed for another reason than memory exhaustion, with this error; nothing
    /// was allocated.
    Backing(E),
}

/// How a block was granted: the reuse rule that served it (none for fresh memory) and the
/// dependency the caller must insert (rule 4).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Grant {
    pub(crate) reuse: Option<ReuseKind>,
    pub(crate) dependency: Option<FreeTag>,
}

impl<E: std::fmt::Display> std::fmt::Display for AllocError<E> {
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
            AllocError::Backing(e) => write!(f, "backing failure: {e}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for AllocError<E> {}

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

impl Engine {
    /// Allocates `bytes` (rounded per [`Engine::round_size`]) aligned to `align` for stream
    /// `stream`, reusing cached memory when a rule allows it and mapping granules through
    /// `backing` otherwise. See the [crate docs](crate) for the exact search order.
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
    /// [`StreamOrder::eligibility`] call and at most [`CROSS_STREAM_BUDGET`] block visits per
    /// other stream with cached blocks. Growth: O(holes + large free blocks × log
    /// segments), or O(n + segments) when recycling needs the exhaustive scan — always next
    /// to a driver call. The first allocation after the engine emptied, when segments were
    /// unmapped since, packs first: O(holes + the blocks and segments above `reserved`) and
    /// a driver call per moved segment (crate docs, *Packing*). Out of memory: O(n) to
    /// build the report.
    ///
    /// [`CROSS_STREAM_BUDGET`]: crate::CROSS_STREAM_BUDGET
    #[allow(
        clippy::result_large_err,
        reason = "the API carries OomInfo by value; the error path is cold"
    )]
    #[inline]
    pub fn alloc<E>(
        &mut self,
        bytes: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<Allocation, AllocError<E>> {
        let (size, align) = self.checked_request(bytes, align)?;
        if self.pack_wanted && self.stats.live_blocks == 0 {
            self.pack_idle(order, backing);
        }
        self.settle_if_due(order);
        if let Some((idx, kind)) = self.find_cached(size, align, stream, order) {
            return Ok(self.commit_cached(idx, size, align, kind, None));
        }
        if let Some(a) = self.take_border(size, align, stream, order) {
            return Ok(a);
        }
        self.alloc_uncached(bytes, size, align, stream, order, backing)
    }

    /// [`Engine::alloc`] when neither an indexed block nor the border block fits: the
    /// completed frees of other streams settled and searched again, rule 4 first if so
    /// configured, growth, release and retry, rule 4, out of memory.
    #[allow(clippy::result_large_err, reason = "as Engine::alloc")]
    #[inline(never)]
    fn alloc_uncached<E>(
        &mut self,
        bytes: u64,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<Allocation, AllocError<E>> {
        // Before growing (a driver call, and memory kept for good once warm): other streams'
        // frees that completed are eligible under the opportunistic rule, and settled they
        // merge with the memory beside them, so streams used in turn without a host
        // synchronisation reuse what each other freed instead of growing at every turn.
        if self.settle_completed_for(stream, order) > 0 {
            if let Some((idx, kind)) = self.find_cached(size, align, stream, order) {
                return Ok(self.commit_cached(idx, size, align, kind, None));
            }
            if let Some(a) = self.take_border(size, align, stream, order) {
                return Ok(a);
            }
        }
        if self.dependency_first && order.internal_dependencies() {
            if let Some(a) = self.take_internal_dependency(size, align, stream) {
                return Ok(a);
            }
        }
        match self.grow(size, align, stream, order, backing) {
            Ok(a) => return Ok(a),
            Err(GrowError::Backing(e)) => return Err(AllocError::Backing(e)),
            Err(GrowError::NoRoom) => {
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
                        Err(GrowError::Backing(e)) => return Err(AllocError::Backing(e)),
                        Err(GrowError::NoRoom) => {}
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
    /// [`AllocError::InvalidSize`] / [`AllocError::InvalidAlignment`] for bad input (no
    /// backing is involved, hence no backing error: `Infallible`).
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
    ) -> Result<Option<Allocation>, AllocError<Infallible>> {
        let (size, align) = self.checked_request(bytes, align)?;
        self.settle_if_due(order);
        if let Some((idx, kind)) = self.find_cached(size, align, stream, order) {
            return Ok(Some(self.commit_cached(idx, size, align, kind, None)));
        }
        if let Some(a) = self.take_border(size, align, stream, order) {
            return Ok(Some(a));
        }
        if with_dependency && order.internal_dependencies() {
            return Ok(self.take_internal_dependency(size, align, stream));
        }
        Ok(None)
    }

    /// The border block [`Engine::find_border`] picks, carved at its first aligned offset.
    #[inline]
    fn take_border(
        &mut self,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<Allocation> {
        let (idx, reuse) = match self.find_border(size, align, stream, order)? {
            (idx, Some(ReuseKind::Opportunistic | ReuseKind::HostSynchronized))
                if self.slab.blocks[idx as usize].tagged =>
            {
                self.settle_for_border(size, align, stream, order)?
            }
            found => found,
        };
        let grant = Grant { reuse, dependency: None };
        let b = &self.slab.blocks[idx as usize];
        let (offset, b_size, tagged) = (b.offset, b.size, b.tagged);
        // `align` is a power of two (`checked_request`).
        if offset & (align - 1) != 0 || b_size == size {
            return Some(self.commit_unindexed(idx, size, align, grant));
        }
        // Carving the front: the rest stays the border block, with its tag, in no index.
        let rest = self.slab.split(idx, offset + size);
        self.border = rest;
        self.border_bytes.0 -= size;
        if tagged {
            self.border_bytes.1 -= size;
        }
        Some(self.make_live(idx, offset, size, align, grant))
    }

    /// Another stream's border block is eligible for `stream` because its free completed:
    /// settles what completed ([`Engine::settle_completed_for`]) and finds the border block
    /// again (larger, or merged with `stream`'s free block below it).
    #[cold]
    #[inline(never)]
    fn settle_for_border(
        &mut self,
        size: u64,
        align: u64,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<(u32, Option<ReuseKind>)> {
        let _ = self.settle_completed_for(stream, order);
        self.find_border(size, align, stream, order)
    }

    /// Carves free block `idx` at its first aligned offset the general way, which also
    /// takes the border block: out of its index (or the border accounting), the rests filed
    /// again.
    fn commit_unindexed(&mut self, idx: u32, size: u64, align: u64, grant: Grant) -> Allocation {
        let start = align_up(self.slab.blocks[idx as usize].offset, align);
        self.remove_free(idx);
        self.finish_alloc(idx, start, size, align, grant, false)
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
        let grant = Grant { reuse: Some(ReuseKind::InternalDependency), dependency: Some(tag) };
        Some(self.commit_unindexed(idx, size, align, grant))
    }

    /// Frees a live block onto stream `tag.stream` at position `tag.pos` (the stream may
    /// differ from the allocating one). The block coalesces with free neighbours of the same
    /// stream (keeping the larger `pos`), with never-used ones, and with settled ones freed by
    /// its stream or while its stream is the only one freeing since the last settle.
    ///
    /// `tag.stream` must not be a private slot ([`Engine::set_private_slots`]): frees there
    /// go through [`Engine::free_private`].
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
        debug_assert!(tag.stream < self.private_from, "a free onto private slot {}", tag.stream);
        self.free_in::<false>(block, tag)
    }

    /// [`Engine::free`] onto a private slot ([`Engine::set_private_slots`]): the block
    /// coalesces only with free blocks of the same slot.
    ///
    /// # Errors
    ///
    /// As [`Engine::free`].
    ///
    /// # Time Complexity
    ///
    /// O(1).
    pub fn free_private(&mut self, block: BlockId, tag: FreeTag) -> Result<(), FreeError> {
        self.free_in::<true>(block, tag)
    }

    /// [`Engine::free`], coalescing by the rule of private slots when `PRIVATE` (see
    /// [`Engine::coalescable`]).
    #[inline(always)]
    fn free_in<const PRIVATE: bool>(
        &mut self,
        block: BlockId,
        tag: FreeTag,
    ) -> Result<(), FreeError> {
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
        self.coalesce_and_index::<PRIVATE>(idx);
        Ok(())
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

    /// For compaction: allocates a block of `block`'s size and alignment for `stream` in the
    /// lowest-address eligible free mapped space (own, untagged, or eligible per
    /// [`StreamOrder::eligibility`]) that lies entirely below `block`'s offset. Never maps
    /// ([`Engine::relocate_lower_mapping`] does).
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
                        let grant = Grant { reuse: kind, dependency: None };
                        return Some(self.commit_unindexed(cur, size, align, grant));
                    }
                }
            }
            cur = c.next;
        }
        None
    }

    /// [`Engine::relocate_lower`] that may map: when no mapped free space below `block`
    /// fits, maps the unmapped granules of the lowest range below it that free space eligible
    /// for `stream` and unmapped space cover together, and relocates there. Compaction then
    /// works after recycling or a release unmapped the free space (the state an
    /// out-of-memory report that recommends compaction leaves). The range stays within the
    /// engine's range, and the backing may refuse a map (a pool-wide limit): `Ok(None)`, with
    /// what was mapped kept as free memory.
    ///
    /// # Errors
    ///
    /// A [`Backing::map`] failure other than out of memory.
    ///
    /// # Time Complexity
    ///
    /// O(number of blocks below `block`), plus one driver call per mapped segment.
    pub fn relocate_lower_mapping<E>(
        &mut self,
        block: BlockId,
        stream: StreamSlot,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<Option<Allocation>, E> {
        if let Some(a) = self.relocate_lower(block, stream, order) {
            return Ok(Some(a));
        }
        let Some(idx) = self.resolve(block) else { return Ok(None) };
        let b = self.slab.blocks[idx as usize];
        if b.kind != Kind::Live {
            return Ok(None);
        }
        let Some((lo, hi)) = self.lowest_mappable_run(&b, stream, order) else { return Ok(None) };
        let (size, align) = (b.size, 1u64 << b.align_log2);
        let in_one_hole = self
            .holes
            .range(..=lo)
            .next_back()
            .is_some_and(|(_, &h)| self.slab.blocks[h as usize].end() >= hi);
        if in_one_hole {
            // Fresh memory carved at once, as growth's new run: merged with its neighbours
            // first, it would take the tag of another stream's free block beside it.
            let mut tokens: SmallVec<[(u64, u64, u64); 4]> = SmallVec::new();
            match self.map_chunks(lo, hi - lo, backing, &mut tokens) {
                Ok(()) => {}
                Err(BackingError::OutOfMemory) => return Ok(None),
                Err(BackingError::Driver(e)) => return Err(e),
            }
            let fresh = self.map_into_hole(lo, hi - lo, &tokens);
            return Ok(Some(self.finish_alloc(fresh, lo, size, align, Grant::default(), true)));
        }
        // Eligible free blocks and holes together: the holes' granules are mapped as free
        // memory, which merges with the eligible blocks beside it.
        let gaps: SmallVec<[(u64, u64); 4]> = self
            .holes
            .range(..hi)
            .map(|(&h0, &h)| (h0.max(lo), self.slab.blocks[h as usize].end().min(hi)))
            .filter(|&(from, to)| from < to)
            .collect();
        for (from, to) in gaps {
            match self.map_free(from, to - from, backing) {
                Ok(()) => {}
                Err(BackingError::OutOfMemory) => return Ok(None),
                Err(BackingError::Driver(e)) => return Err(e),
            }
        }
        Ok(self.relocate_lower(block, stream, order))
    }

    /// The granule-aligned range `[lo, hi)` that holds the lowest place below live block `b`
    /// where a block of its size and alignment fits in a run of free blocks eligible for
    /// `stream` and unmapped blocks; `None` when there is none.
    fn lowest_mappable_run(
        &self,
        b: &crate::block::Block,
        stream: StreamSlot,
        order: &dyn StreamOrder,
    ) -> Option<(u64, u64)> {
        let (size, align, limit) = (b.size, 1u64 << b.align_log2, b.offset);
        let g = self.cfg.granularity;
        let mut run_start = None;
        let mut cur = self.first;
        while cur != NIL {
            let c = &self.slab.blocks[cur as usize];
            if c.offset >= limit {
                break;
            }
            let usable = match c.kind {
                Kind::Unmapped => true,
                Kind::Free => self.eligible_kind(c, stream, order).is_some(),
                Kind::Live | Kind::Vacant => false,
            };
            if !usable {
                run_start = None;
            } else {
                let start = align_up(*run_start.get_or_insert(c.offset), align);
                if start + size <= c.end().min(limit) {
                    return Some((align_down(start, g), align_up(start + size, g)));
                }
            }
            cur = c.next;
        }
        None
    }

    /// Turns `[start, start + size)` of free block `idx` (in no index) into a live block for
    /// a request with alignment `align`; the rest on either side stays free with the same tag,
    /// coalesced with its neighbours when `coalesce`. Pass `false` only when `idx` was an
    /// indexed free block: those are maximal (no free neighbour they may merge with), so
    /// neither rest can merge with anything and is indexed as it is. Updates the statistics
    /// and the offset index.
    #[inline]
    pub(crate) fn finish_alloc(
        &mut self,
        idx: u32,
        start: u64,
        size: u64,
        align: u64,
        grant: Grant,
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
        let a = self.make_live(mid, start, size, align, grant);
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
        grant: Grant,
    ) -> Allocation {
        let Grant { reuse, dependency } = grant;
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
    pub(crate) fn commit_cached(
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
            return self.make_live(idx, start, size, align, Grant { reuse, dependency });
        }
        self.remove_free(idx);
        if start == offset && b_size == size {
            // An exact fit (a hole of the request's size): nothing to split off.
            return self.make_live(idx, start, size, align, Grant { reuse, dependency });
        }
        self.finish_alloc(idx, start, size, align, Grant { reuse, dependency }, false)
    }
}
