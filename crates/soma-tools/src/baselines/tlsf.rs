//! A TLSF over an offset space, with out-of-band block records.

use super::growth::GrowthMapping;
use super::{Allocator, UNIT};
use crate::driver_cost::DriverCalls;

const NIL: u32 = u32::MAX;
const TLSF_SL_LOG2: u32 = 4;
const TLSF_SL: usize = 1 << TLSF_SL_LOG2;
const TLSF_FL: usize = 48;

#[derive(Clone, Copy, Debug)]
struct TBlock {
    off: u64,
    size: u64,
    prev_phys: u32,
    next_phys: u32,
    prev_free: u32,
    next_free: u32,
    free: bool,
}

/// A TLSF allocator (rlsf's algorithm: 16 second-level classes, good-fit search from the
/// class above the request, split on allocation, immediate coalescing on free) over an offset
/// space in units of [`UNIT`] bytes. Block headers live in a side table (a slab with a vacant
/// chain), not in the managed memory.
#[derive(Debug)]
pub struct Tlsf {
    blocks: Vec<TBlock>,
    vacant: u32,
    fl_bitmap: u64,
    sl_bitmap: [u16; TLSF_FL],
    heads: Vec<u32>,
    growth: GrowthMapping,
}

#[inline]
fn tlsf_mapping(units: u64) -> (usize, usize) {
    if units < TLSF_SL as u64 {
        (0, units as usize)
    } else {
        let msb = 63 - units.leading_zeros();
        ((msb - TLSF_SL_LOG2 + 1) as usize, ((units >> (msb - TLSF_SL_LOG2)) as usize) - TLSF_SL)
    }
}

impl Tlsf {
    /// A TLSF over `range` bytes.
    pub fn new(range: u64) -> Tlsf {
        let mut t = Tlsf {
            blocks: Vec::new(),
            vacant: NIL,
            fl_bitmap: 0,
            sl_bitmap: [0; TLSF_FL],
            heads: vec![NIL; TLSF_FL * TLSF_SL],
            growth: GrowthMapping::default(),
        };
        let b = t.take(TBlock {
            off: 0,
            size: range / UNIT,
            prev_phys: NIL,
            next_phys: NIL,
            prev_free: NIL,
            next_free: NIL,
            free: true,
        });
        t.link(b);
        t
    }

    fn take(&mut self, b: TBlock) -> u32 {
        if self.vacant != NIL {
            let i = self.vacant;
            self.vacant = self.blocks[i as usize].next_free;
            self.blocks[i as usize] = b;
            i
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    fn give_back(&mut self, i: u32) {
        self.blocks[i as usize].next_free = self.vacant;
        self.vacant = i;
    }

    #[inline]
    fn link(&mut self, i: u32) {
        let (fl, sl) = tlsf_mapping(self.blocks[i as usize].size);
        let slot = fl * TLSF_SL + sl;
        let head = self.heads[slot];
        {
            let b = &mut self.blocks[i as usize];
            b.prev_free = NIL;
            b.next_free = head;
            b.free = true;
        }
        if head != NIL {
            self.blocks[head as usize].prev_free = i;
        }
        self.heads[slot] = i;
        self.sl_bitmap[fl] |= 1 << sl;
        self.fl_bitmap |= 1 << fl;
    }

    #[inline]
    fn unlink(&mut self, i: u32) {
        let b = self.blocks[i as usize];
        let (fl, sl) = tlsf_mapping(b.size);
        if b.prev_free != NIL {
            self.blocks[b.prev_free as usize].next_free = b.next_free;
        } else {
            let slot = fl * TLSF_SL + sl;
            self.heads[slot] = b.next_free;
            if b.next_free == NIL {
                self.sl_bitmap[fl] &= !(1 << sl);
                if self.sl_bitmap[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        if b.next_free != NIL {
            self.blocks[b.next_free as usize].prev_free = b.prev_free;
        }
        self.blocks[i as usize].free = false;
    }

    /// Byte offset and size of the live block `handle` (for tests and tools).
    pub fn range_of(&self, handle: u32) -> (u64, u64) {
        let b = &self.blocks[handle as usize];
        (b.off * UNIT, b.size * UNIT)
    }

    /// The head of the first non-empty class whose every block holds `units`.
    #[inline]
    fn find(&self, units: u64) -> Option<u32> {
        let rounded = if units < TLSF_SL as u64 {
            units
        } else {
            let msb = 63 - units.leading_zeros();
            units.checked_add((1u64 << (msb - TLSF_SL_LOG2)) - 1)?
        };
        let (fl, sl) = tlsf_mapping(rounded);
        if fl >= TLSF_FL {
            return None;
        }
        let sl_bits = u32::from(self.sl_bitmap[fl]) & (u32::MAX << sl);
        let (fl, sl) = if sl_bits != 0 {
            (fl, sl_bits.trailing_zeros() as usize)
        } else {
            let fl_bits = self.fl_bitmap & (u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0));
            if fl_bits == 0 {
                return None;
            }
            let fl = fl_bits.trailing_zeros() as usize;
            (fl, self.sl_bitmap[fl].trailing_zeros() as usize)
        };
        Some(self.heads[fl * TLSF_SL + sl])
    }
}

impl Allocator for Tlsf {
    type Handle = u32;
    fn name(&self) -> &'static str {
        "tlsf"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<u32> {
        let units = bytes.div_ceil(UNIT).max(1);
        let i = self.find(units)?;
        self.unlink(i);
        let b = self.blocks[i as usize];
        if b.size > units {
            let rest = self.take(TBlock {
                off: b.off + units,
                size: b.size - units,
                prev_phys: i,
                next_phys: b.next_phys,
                prev_free: NIL,
                next_free: NIL,
                free: true,
            });
            if b.next_phys != NIL {
                self.blocks[b.next_phys as usize].prev_phys = rest;
            }
            let m = &mut self.blocks[i as usize];
            m.size = units;
            m.next_phys = rest;
            self.link(rest);
        }
        self.growth.note_end((b.off + units) * UNIT);
        Some(i)
    }
    #[inline]
    fn free(&mut self, handle: u32) {
        let mut i = handle;
        let p = self.blocks[i as usize].prev_phys;
        if p != NIL && self.blocks[p as usize].free {
            self.unlink(p);
            let b = self.blocks[i as usize];
            let pb = &mut self.blocks[p as usize];
            pb.size += b.size;
            pb.next_phys = b.next_phys;
            if b.next_phys != NIL {
                self.blocks[b.next_phys as usize].prev_phys = p;
            }
            self.give_back(i);
            i = p;
        }
        let n = self.blocks[i as usize].next_phys;
        if n != NIL && self.blocks[n as usize].free {
            self.unlink(n);
            let nb = self.blocks[n as usize];
            let b = &mut self.blocks[i as usize];
            b.size += nb.size;
            b.next_phys = nb.next_phys;
            if nb.next_phys != NIL {
                self.blocks[nb.next_phys as usize].prev_phys = i;
            }
            self.give_back(n);
        }
        self.link(i);
    }
    fn reserved_high(&self) -> u64 {
        self.growth.mapped()
    }
    fn driver_calls(&self) -> DriverCalls {
        self.growth.calls()
    }
}
