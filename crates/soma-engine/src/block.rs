//! Block records: one slab (`Vec`) of records linked by `u32` indices.
//!
//! Every byte of the pool's range belongs to exactly one non-vacant record at all times:
//! the records form a doubly linked list in address order (`prev` / `next`) that starts at
//! offset 0 and ends at the end of the range. Free records are additionally linked into one
//! segregated free list of their [`FreeIndex`](crate::tlsf::FreeIndex) (`prev_free` /
//! `next_free`); vacant records are chained through `next_free` for reuse, so the slab only
//! grows when the number of blocks reaches a new high.

use std::collections::HashMap;
use std::num::NonZeroU64;

use crate::{Engine, FreeTag};

/// The null link.
pub(super) const NIL: u32 = u32::MAX;

/// What a record currently describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Kind {
    /// Not a block: the record is on the vacant list.
    Vacant,
    /// Handed out to the user.
    Live,
    /// Mapped and free (tagged or not, see `tagged`).
    Free,
    /// Not backed by physical memory.
    Unmapped,
}

/// One block record. 56 bytes (see the size test); the bookkeeping target is ≤ 64 bytes per
/// live allocation.
#[derive(Clone, Copy, Debug)]
pub(super) struct Block {
    /// Start of the block in the pool's range.
    pub offset: u64,
    /// Size in bytes (a multiple of the pool's alignment; of the granularity when unmapped).
    pub size: u64,
    /// `FreeTag::pos` when `kind == Free && tagged`.
    pub pos: u64,
    /// Address-order neighbours.
    pub prev: u32,
    pub next: u32,
    /// Free-list links (free blocks); `next_free` also chains vacant records.
    pub prev_free: u32,
    pub next_free: u32,
    /// `FreeTag::stream` when `kind == Free && tagged`.
    pub stream: u32,
    /// Bumped whenever the record becomes live or vacant, so stale `BlockId`s never match.
    pub generation: u32,
    pub kind: Kind,
    /// Free blocks only: carries a `FreeTag` (`stream`, `pos`); untagged = never used, or
    /// `settled`.
    pub tagged: bool,
    /// Untagged free blocks only: memory that was used and whose free the host has observed
    /// since ([`Engine::settle`](crate::Engine::settle)), or the device completed under the
    /// opportunistic rule (`pos` [`SETTLED_ON_COMPLETION`], else 0). Every stream may use it
    /// as memory never used; `stream` keeps the stream that freed it, or
    /// [`SETTLED_BY_SEVERAL`] (a reuse by that stream counts as same-stream, any other as
    /// opportunistic or host-synchronized).
    pub settled: bool,
    /// Live blocks only: log2 of the alignment the block was allocated with.
    pub align_log2: u8,
    /// Indexed free blocks only: the linear size class (`fl * SL + sl`) whose list holds the
    /// block — its own class or the one just below (see `tlsf.rs`); [`BORDER`] for the border
    /// block, which no index holds.
    pub cls: u16,
}

/// `Block::cls` of the *border block*: while recycling on growth is off, the free block
/// directly below the unmapped space that reaches the end of the range (where growth extends
/// the mapped memory). It is in no free index: the engine serves a request from it only when no indexed block fits (see
/// `Engine::find_border`), so that placement does not depend on how much memory above the
/// mapped part of the range has been mapped yet.
pub(super) const BORDER: u16 = u16::MAX;

/// `Block::stream` of a settled block merged from the frees of more than one stream.
pub(super) const SETTLED_BY_SEVERAL: u32 = u32::MAX;

/// `Block::pos` of a settled block that holds memory settled because the device had
/// completed its free, not because the host observed it (`Engine::settle_completed`): its
/// reuse by another stream counts as opportunistic.
pub(super) const SETTLED_ON_COMPLETION: u64 = 1;

impl Block {
    /// One past the last byte.
    #[inline]
    pub fn end(&self) -> u64 {
        self.offset + self.size
    }

    fn vacant() -> Block {
        Block {
            offset: 0,
            size: 0,
            pos: 0,
            prev: NIL,
            next: NIL,
            prev_free: NIL,
            next_free: NIL,
            stream: 0,
            generation: 0,
            kind: Kind::Vacant,
            tagged: false,
            settled: false,
            align_log2: 0,
            cls: 0,
        }
    }
}

/// The slab grows by `len / GROW_DIV` records (at least [`GROW_MIN`]) when full.
const GROW_DIV: usize = 16;
/// Smallest growth of the slab, in records.
const GROW_MIN: usize = 64;

/// The slab of block records.
#[derive(Debug, Default)]
pub(super) struct Slab {
    pub blocks: Vec<Block>,
    /// Head of the vacant-record chain.
    vacant: u32,
    vacant_count: u32,
}

impl Slab {
    pub fn new() -> Slab {
        Slab { blocks: Vec::new(), vacant: NIL, vacant_count: 0 }
    }

    /// Number of vacant records.
    pub fn vacant_count(&self) -> u32 {
        self.vacant_count
    }

    /// Head of the vacant chain (for invariant checks).
    pub fn vacant_head(&self) -> u32 {
        self.vacant
    }

    /// Takes a record (vacant one first) and returns its index; the record's generation is
    /// preserved, every other field is reset.
    ///
    /// # Panics
    ///
    /// If more than `u32::MAX - 1` records would exist (a range of at least 2^32 blocks).
    pub fn take(&mut self) -> u32 {
        self.take_with(Block::vacant())
    }

    /// Takes a record (vacant one first), stores `b` in it (keeping the record's generation)
    /// and returns its index. One write of the record: the hot path splits a block per
    /// allocation.
    ///
    /// # Panics
    ///
    /// As [`Slab::take`].
    #[inline]
    pub fn take_with(&mut self, b: Block) -> u32 {
        let idx = self.vacant;
        if let Some(r) = self.blocks.get_mut(idx as usize) {
            self.vacant = r.next_free;
            self.vacant_count -= 1;
            *r = Block { generation: r.generation, ..b };
            idx
        } else {
            self.push(b)
        }
    }

    /// Appends a new record (the vacant chain is empty).
    #[cold]
    #[inline(never)]
    fn push(&mut self, b: Block) -> u32 {
        let idx = u32::try_from(self.blocks.len()).expect("block slab exceeds u32 indices");
        assert!(idx != NIL, "block slab exceeds u32 indices");
        if self.blocks.len() == self.blocks.capacity() {
            // Grow by 1/16 (at least GROW_MIN records) instead of doubling: the slab holds at
            // most ~6 % unused capacity, i.e. ≤ 60 bytes of records per block (still
            // amortised O(1) per record; large reallocations are remaps).
            let extra = (self.blocks.len() / GROW_DIV).max(GROW_MIN);
            self.blocks.reserve_exact(extra);
        }
        self.blocks.push(Block { generation: 0, ..b });
        idx
    }

    /// Returns a record to the vacant chain.
    #[inline]
    pub fn give_back(&mut self, idx: u32) {
        let vacant = self.vacant;
        let b = &mut self.blocks[idx as usize];
        b.kind = Kind::Vacant;
        b.generation = b.generation.wrapping_add(1);
        b.prev = NIL;
        b.next = NIL;
        b.prev_free = NIL;
        b.next_free = vacant;
        self.vacant = idx;
        self.vacant_count += 1;
    }

    /// Splits block `idx` at `at` (strictly inside it): `idx` keeps `[offset, at)`, a new
    /// record with the same kind and tag takes `[at, end)` and is returned. Neither part is
    /// put into a free list.
    #[inline(always)]
    pub fn split(&mut self, idx: u32, at: u64) -> u32 {
        let old = self.blocks[idx as usize];
        debug_assert!(at > old.offset && at < old.end());
        let tail = |generation| Block {
            offset: at,
            size: old.end() - at,
            prev: idx,
            next: old.next,
            prev_free: NIL,
            next_free: NIL,
            generation,
            ..old
        };
        // As `take_with`, writing the record once in place.
        let new = self.vacant;
        let new = match self.blocks.get_mut(new as usize) {
            Some(r) => {
                self.vacant = r.next_free;
                self.vacant_count -= 1;
                *r = tail(r.generation);
                new
            }
            None => self.push(tail(0)),
        };
        let b = &mut self.blocks[idx as usize];
        b.size = at - old.offset;
        b.next = new;
        if old.next != NIL {
            self.blocks[old.next as usize].prev = new;
        }
        new
    }

    /// Merges block `right` (the address-order successor of `left`) into `left` and vacates
    /// `right`. Kinds and tags are the caller's business.
    #[inline]
    pub fn absorb_next(&mut self, left: u32, right: u32) {
        let r = &self.blocks[right as usize];
        debug_assert_eq!(r.prev, left);
        let (r_size, r_next) = (r.size, r.next);
        let l = &mut self.blocks[left as usize];
        debug_assert_eq!(l.next, right);
        l.size += r_size;
        l.next = r_next;
        if r_next != NIL {
            self.blocks[r_next as usize].prev = left;
        }
        self.give_back(right);
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
    pub(crate) fn new(idx: u32, generation: u32) -> BlockId {
        BlockId::from_raw((u64::from(generation) << 32) | u64::from(idx))
    }

    pub(crate) fn index(self) -> u32 {
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

    pub(crate) fn generation(self) -> u32 {
        (self.0.get() >> 32) as u32
    }
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

/// A multiplicative hasher for the offset index (offsets are multiples of the alignment).
#[derive(Default, Clone, Copy)]
pub(crate) struct OffsetHasher(u64);

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

pub(crate) type OffsetMap = HashMap<u64, u32, std::hash::BuildHasherDefault<OffsetHasher>>;

impl Engine {
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

    /// All blocks in address order; together they cover `[0, range_size)` exactly.
    pub fn blocks(&self) -> Blocks<'_> {
        Blocks { engine: self, cur: self.first }
    }

    /// The record index of a valid id.
    pub(crate) fn resolve(&self, block: BlockId) -> Option<u32> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_record_fits_in_64_bytes() {
        assert!(std::mem::size_of::<Block>() <= 64);
        assert_eq!(std::mem::size_of::<Block>(), 56);
    }

    #[test]
    fn split_and_absorb_round_trip() {
        let mut s = Slab::new();
        let a = s.take();
        s.blocks[a as usize].size = 100;
        s.blocks[a as usize].kind = Kind::Free;
        let b = s.split(a, 40);
        assert_eq!(s.blocks[a as usize].size, 40);
        assert_eq!(s.blocks[b as usize].offset, 40);
        assert_eq!(s.blocks[b as usize].size, 60);
        assert_eq!(s.blocks[a as usize].next, b);
        s.absorb_next(a, b);
        assert_eq!(s.blocks[a as usize].size, 100);
        assert_eq!(s.vacant_count(), 1);
        let c = s.take();
        assert_eq!(c, b);
        assert_eq!(s.blocks[c as usize].generation, 1);
    }
}
