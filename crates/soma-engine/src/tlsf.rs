//! Two-level segregated free lists (TLSF, after rlsf), one [`FreeIndex`] per stream tag.
//!
//! Sizes are counted in *units* of the pool's alignment. A size of `u` units belongs to the
//! class `(fl, sl)`:
//!
//! ```text
//!   u < 32            : fl = 0,              sl = u                  (exact classes)
//!   u ≥ 32, l = ⌊log2 u⌋: fl = l - 4 (1..=59), sl = (u >> (l - 5)) & 31
//!
//!   fl_bitmap (u64):  bit fl set  ⇔  sl_bitmap[fl] != 0
//!   sl_bitmap[fl] (u32): bit sl set ⇔ heads[fl][sl] != NIL
//!
//!   fl:   0        1          2            3     ...
//!       [0,32)  [32,64)   [64,128)     [128,256)
//!        ×1       ×1         ×2           ×4       ← class width in units
//! ```
//!
//! A free block sits in the list of its own class or of the class just below (its record's
//! `cls` names the list): carving the front of a block or merging a neighbour into it keeps
//! the block where it is as long as that holds, so the alloc + free pair of the hot path
//! touches no list and no bitmap even when the block straddles a class boundary. A block in
//! the lower list is larger than that list's class, so every search stays correct (good fit
//! only ever finds blocks that fit); the largest block of an index is in its highest
//! non-empty list or the one below.
//!
//! Each class spans at most 1/32 of its lower bound, so a good-fit search that starts at the
//! class above the request wastes at most ~3 %; the engine additionally scans the request's
//! own class (bounded) to find exact fits such as a just-freed block of the same size.

use crate::block::{Block, NIL};

/// log2 of the number of second-level classes.
pub(super) const SL_LOG2: u32 = 5;
/// Number of second-level classes per first level.
pub(super) const SL: usize = 1 << SL_LOG2;
/// Number of first-level classes (enough for 2^64 units).
pub(super) const FL: usize = 64;

/// The class of a size of `units` (≥ 1) units.
#[inline]
pub(super) fn class_of(units: u64) -> (usize, usize) {
    debug_assert!(units > 0);
    if units < SL as u64 {
        (0, units as usize)
    } else {
        let l = 63 - units.leading_zeros();
        let fl = (l - SL_LOG2 + 1) as usize;
        let sl = ((units >> (l - SL_LOG2)) as usize) & (SL - 1);
        (fl, sl)
    }
}

/// The linear index `fl * SL + sl` of the class of a size of `units` (≥ 1) units; linear
/// indices are in size order.
#[inline]
pub(super) fn class_index(units: u64) -> usize {
    let (fl, sl) = class_of(units);
    fl * SL + sl
}

/// The lowest class whose every member is at least `units` large; `None` on overflow.
#[inline]
pub(super) fn class_at_least(units: u64) -> Option<(usize, usize)> {
    if units < SL as u64 {
        return Some((0, units as usize));
    }
    let l = 63 - units.leading_zeros();
    let add = (1u64 << (l - SL_LOG2)) - 1;
    let rounded = units.checked_add(add)?;
    Some(class_of(rounded))
}

/// The smallest size (in units) of class `(fl, sl)`.
#[cfg(test)]
pub(super) fn class_floor(fl: usize, sl: usize) -> u64 {
    if fl == 0 {
        sl as u64
    } else {
        let l = fl as u32 + SL_LOG2 - 1;
        (1u64 << l) | ((sl as u64) << (l - SL_LOG2))
    }
}

/// The smallest size in bytes of the class with linear index `c` (units of `1 << unit_shift`
/// bytes); `u64::MAX` when that size does not fit in 64 bits. Comparing a size against the
/// floor of a class is cheaper than computing the size's class.
#[inline]
pub(super) fn class_floor_bytes(c: usize, unit_shift: u32) -> u64 {
    // Class (fl, sl) with fl ≥ 1 starts at (32 + sl) << (fl - 1) units (see the module docs).
    let (fl, sl) = ((c >> SL_LOG2) as u32, (c & (SL - 1)) as u64);
    let (base, shift) =
        if fl == 0 { (sl, unit_shift) } else { (SL as u64 + sl, fl - 1 + unit_shift) };
    // base < 64: `base << shift` fits while shift ≤ 58.
    if shift <= 58 {
        base << shift
    } else if base == 0 {
        0
    } else {
        u64::MAX
    }
}

/// [`class_floor_bytes`] of every class (and of the two past the last), precomputed for one
/// unit size: the searches and the in-place carve and merge compare sizes against class
/// floors on every allocation and free, and a load is cheaper than the shifts and the
/// overflow check.
#[derive(Debug)]
pub(super) struct ClassFloors(Box<[u64; FL * SL + 2]>);

impl ClassFloors {
    /// The floors for units of `1 << unit_shift` bytes.
    pub fn new(unit_shift: u32) -> ClassFloors {
        let mut floors = Box::new([0u64; FL * SL + 2]);
        for (c, f) in floors.iter_mut().enumerate() {
            *f = class_floor_bytes(c, unit_shift);
        }
        ClassFloors(floors)
    }

    /// [`class_floor_bytes`] of class `c` (`u64::MAX` past the table, as past 64 bits).
    #[inline(always)]
    pub fn get(&self, c: usize) -> u64 {
        self.0.get(c).copied().unwrap_or(u64::MAX)
    }
}

/// The free blocks of one stream tag (or of the untagged, never-used memory).
#[derive(Debug)]
pub(super) struct FreeIndex {
    fl_bitmap: u64,
    sl_bitmap: [u32; FL],
    heads: [u32; FL * SL],
    /// Sum of the sizes of the blocks in this index.
    pub bytes: u64,
    /// Upper bound on the `pos` of the blocks in this index (exact after the index empties:
    /// reset to 0). Lets cross-stream searches skip per-block checks when all are eligible.
    pub max_pos: u64,
    /// Blocks inserted so far (never decreases): lets [`Engine::settle`](crate::Engine)
    /// skip an index that has not changed since it last looked.
    pub inserts: u64,
}

impl FreeIndex {
    /// Whether no block is indexed. O(1).
    pub(super) fn is_empty(&self) -> bool {
        self.fl_bitmap == 0
    }

    /// An empty index (8.5 KiB; boxed by the engine, created on a stream's first free).
    pub fn new() -> FreeIndex {
        FreeIndex {
            fl_bitmap: 0,
            sl_bitmap: [0; FL],
            heads: [NIL; FL * SL],
            bytes: 0,
            max_pos: 0,
            inserts: 0,
        }
    }

    /// Head of the list of the class with linear index `slot`.
    #[inline]
    pub fn head_at(&self, slot: usize) -> u32 {
        self.heads[slot]
    }

    /// Head of the list of class `(fl, sl)`.
    #[inline]
    pub fn head(&self, fl: usize, sl: usize) -> u32 {
        self.heads[fl * SL + sl]
    }

    /// Pushes free block `idx` at the head of its class list.
    ///
    /// # Time Complexity
    ///
    /// O(1).
    #[inline(always)]
    pub fn insert(&mut self, blocks: &mut [Block], idx: u32, unit_shift: u32) {
        let b = &blocks[idx as usize];
        let (fl, sl) = class_of(b.size >> unit_shift);
        let size = b.size;
        let pos = if b.tagged { b.pos } else { 0 };
        let slot = fl * SL + sl;
        let old = self.heads[slot];
        {
            let b = &mut blocks[idx as usize];
            b.prev_free = NIL;
            b.next_free = old;
            b.cls = slot as u16;
        }
        if old != NIL {
            blocks[old as usize].prev_free = idx;
        }
        self.heads[slot] = idx;
        self.sl_bitmap[fl] |= 1 << sl;
        self.fl_bitmap |= 1 << fl;
        self.bytes += size;
        self.inserts += 1;
        self.max_pos = self.max_pos.max(pos);
    }

    /// Unlinks free block `idx` (which must be in this index, in the list of its `cls`).
    ///
    /// # Time Complexity
    ///
    /// O(1).
    #[inline(always)]
    pub fn remove(&mut self, blocks: &mut [Block], idx: u32) {
        let b = &mut blocks[idx as usize];
        let (slot, prev_free, next_free, size) = (b.cls as usize, b.prev_free, b.next_free, b.size);
        b.prev_free = NIL;
        b.next_free = NIL;
        if prev_free != NIL {
            blocks[prev_free as usize].next_free = next_free;
        } else {
            debug_assert_eq!(self.heads[slot], idx);
            self.heads[slot] = next_free;
            if next_free == NIL {
                let (fl, sl) = (slot / SL, slot % SL);
                self.sl_bitmap[fl] &= !(1 << sl);
                if self.sl_bitmap[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                    if self.fl_bitmap == 0 {
                        // Empty: no block bounds `max_pos` any more.
                        self.max_pos = 0;
                    }
                }
            }
        }
        if next_free != NIL {
            blocks[next_free as usize].prev_free = prev_free;
        }
        self.bytes -= size;
    }

    /// Puts unindexed free block `new` at the list position of indexed block `old`, which
    /// leaves the index. The caller guarantees that `old`'s list is a valid one for `new`
    /// (`new`'s own class or the one just below) in this index, and adjusts `bytes` /
    /// `max_pos` itself.
    ///
    /// # Time Complexity
    ///
    /// O(1) (no bitmap change).
    #[inline]
    pub fn replace(&mut self, blocks: &mut [Block], old: u32, new: u32) {
        let o = &mut blocks[old as usize];
        let (prev_free, next_free, cls) = (o.prev_free, o.next_free, o.cls);
        o.prev_free = NIL;
        o.next_free = NIL;
        if prev_free != NIL {
            blocks[prev_free as usize].next_free = new;
        } else {
            debug_assert_eq!(self.heads[cls as usize], old);
            self.heads[cls as usize] = new;
        }
        if next_free != NIL {
            blocks[next_free as usize].prev_free = new;
        }
        let n = &mut blocks[new as usize];
        n.prev_free = prev_free;
        n.next_free = next_free;
        n.cls = cls;
    }

    /// The first non-empty class at or above `(fl, sl)` in size order.
    ///
    /// # Time Complexity
    ///
    /// O(1) (two bit scans).
    #[inline]
    pub fn first_at_or_above(&self, fl: usize, sl: usize) -> Option<(usize, usize)> {
        if fl >= FL {
            return None;
        }
        let sl_bits = if sl >= SL { 0 } else { self.sl_bitmap[fl] & (u32::MAX << sl) };
        if sl_bits != 0 {
            return Some((fl, sl_bits.trailing_zeros() as usize));
        }
        if fl + 1 >= FL {
            return None;
        }
        let fl_bits = self.fl_bitmap & (u64::MAX << (fl + 1));
        if fl_bits == 0 {
            return None;
        }
        let fl = fl_bits.trailing_zeros() as usize;
        Some((fl, self.sl_bitmap[fl].trailing_zeros() as usize))
    }

    /// The highest non-empty class.
    #[inline]
    pub fn highest(&self) -> Option<(usize, usize)> {
        if self.fl_bitmap == 0 {
            return None;
        }
        let fl = 63 - self.fl_bitmap.leading_zeros() as usize;
        let sl = 31 - self.sl_bitmap[fl].leading_zeros() as usize;
        Some((fl, sl))
    }

    /// Whether bit `(fl, sl)` is set (for invariant checks).
    pub fn class_bit(&self, fl: usize, sl: usize) -> bool {
        self.sl_bitmap[fl] & (1 << sl) != 0 && self.fl_bitmap & (1 << fl) != 0
    }

    /// Checks that the bitmaps agree with the list heads.
    pub fn check_bitmaps(&self) -> Result<(), String> {
        for fl in 0..FL {
            let mut expect = 0u32;
            for sl in 0..SL {
                if self.heads[fl * SL + sl] != NIL {
                    expect |= 1 << sl;
                }
            }
            if expect != self.sl_bitmap[fl] {
                return Err(format!("sl_bitmap[{fl}] disagrees with the list heads"));
            }
            if (self.fl_bitmap >> fl) & 1 != u64::from(expect != 0) {
                return Err(format!("fl_bitmap bit {fl} disagrees with sl_bitmap"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_size() {
        // 8 KiB of list heads + bitmaps and counters, once per stream slot that freed memory
        assert_eq!(std::mem::size_of::<FreeIndex>(), 8480);
    }

    #[test]
    fn classes_are_monotonic_and_tight() {
        let mut prev = (0, 0);
        for u in 1..5000u64 {
            let c = class_of(u);
            assert!(c >= prev, "class order at {u}");
            prev = c;
            assert!(class_floor(c.0, c.1) <= u);
            let up = class_at_least(u).unwrap();
            assert!(class_floor(up.0, up.1) >= u, "class_at_least({u})");
            // the class above the request is at most one class above the request's own
            assert!(up >= c);
        }
        for shift in 5..63 {
            let u = 1u64 << shift;
            let (fl, sl) = class_of(u);
            assert_eq!(class_floor(fl, sl), u);
            assert!(fl < FL);
        }
        let (fl, _) = class_of(u64::MAX);
        assert!(fl < FL);
        assert_eq!(class_at_least(u64::MAX), None);
        // floors in bytes agree with the unit floors, saturating past 64 bits
        for c in 0..FL * SL {
            let (fl, sl) = (c / SL, c % SL);
            for shift in [5, 9, 21] {
                let bytes = class_floor_bytes(c, shift);
                if fl + SL_LOG2 as usize - 1 < 64 {
                    let units = class_floor(fl, sl);
                    match units.checked_mul(1 << shift) {
                        Some(b) => assert_eq!(bytes, b, "class {c} shift {shift}"),
                        None => assert_eq!(bytes, u64::MAX),
                    }
                } else {
                    assert_eq!(bytes, u64::MAX);
                }
            }
        }
        // the precomputed floors agree, and past the table there is no class
        for shift in [0, 5, 9, 21, 40] {
            let floors = ClassFloors::new(shift);
            for c in 0..FL * SL + 2 {
                assert_eq!(floors.get(c), class_floor_bytes(c, shift), "class {c} shift {shift}");
            }
            assert_eq!(floors.get(FL * SL + 2), u64::MAX);
        }
        // a size is in class c or above exactly when it reaches c's floor
        for u in 1..5000u64 {
            let c = class_index(u);
            assert!(u << 9 >= class_floor_bytes(c, 9));
            assert!(u << 9 < class_floor_bytes(c + 1, 9));
        }
    }
}
