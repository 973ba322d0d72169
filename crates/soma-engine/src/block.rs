//! Block records: one slab (`Vec`) of records linked by `u32` indices.
//!
//! Every byte of the pool's range belongs to exactly one non-vacant record at all times:
//! the records form a doubly linked list in address order (`prev` / `next`) that starts at
//! offset 0 and ends at the end of the range. Free records are additionally linked into one
//! segregated free list of their [`FreeIndex`](super::tlsf::FreeIndex) (`prev_free` /
//! `next_free`); vacant records are chained through `next_free` for reuse, so the slab only
//! grows when the number of blocks reaches a new high.

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
    /// since ([`Engine::settle`](super::Engine::settle)). Every stream may use it as memory
    /// never used; `stream` keeps the stream that freed it, or [`SETTLED_BY_SEVERAL`] (a
    /// reuse by that stream counts as same-stream, any other as host-synchronized).
    pub settled: bool,
    /// Live blocks only: log2 of the alignment the block was allocated with.
    pub align_log2: u8,
    /// Indexed free blocks only: the linear size class (`fl * SL + sl`) whose list holds the
    /// block — its own class or the one just below (see `tlsf.rs`).
    pub cls: u16,
}

/// `Block::stream` of a settled block merged from the frees of more than one stream.
pub(super) const SETTLED_BY_SEVERAL: u32 = u32::MAX;

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
