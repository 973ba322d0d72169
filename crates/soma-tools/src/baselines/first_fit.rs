//! A first-fit free list sorted by offset, merged on every free.

use super::growth::GrowthMapping;
use super::{Allocator, UNIT};
use crate::driver_cost::DriverCalls;
use crate::round_up;

/// A first-fit free list: a list of `(offset, size)` kept sorted by offset, first fit on
/// allocation, and on every free an insertion followed by a merge pass over the whole list.
#[derive(Debug)]
pub struct FirstFit {
    free: Vec<(u64, u64)>,
    growth: GrowthMapping,
}

impl FirstFit {
    /// A pool managing `range` bytes.
    pub fn new(range: u64) -> FirstFit {
        FirstFit { free: vec![(0, range)], growth: GrowthMapping::default() }
    }

    /// A pool whose free list is `free` (sorted, non-adjacent ranges), i.e. the state the
    /// API would reach through a sequence of allocations and frees; lets the benches set up
    /// a million-hole state without the quadratic cost of a million merge passes. Its
    /// mapping up to `high_end` counts as one growth.
    ///
    /// # Panics
    /// `free` is not sorted by offset, overlaps, or holds adjacent ranges.
    pub fn from_free_list(free: Vec<(u64, u64)>, high_end: u64) -> FirstFit {
        for w in free.windows(2) {
            assert!(w[0].0 + w[0].1 < w[1].0, "free list must be sorted and merged");
        }
        let mut growth = GrowthMapping::default();
        growth.note_end(high_end);
        FirstFit { free, growth }
    }

    /// The free list (for tests).
    pub fn free_list(&self) -> &[(u64, u64)] {
        &self.free
    }
}

impl Allocator for FirstFit {
    type Handle = (u64, u64);
    fn name(&self) -> &'static str {
        "first-fit"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<(u64, u64)> {
        let size = round_up(bytes, UNIT);
        let i = self.free.iter().position(|&(_, s)| s >= size)?;
        let (off, s) = self.free[i];
        if s == size {
            self.free.remove(i);
        } else {
            self.free[i] = (off + size, s - size);
        }
        self.growth.note_end(off + size);
        Some((off, size))
    }
    #[inline]
    fn free(&mut self, (off, size): (u64, u64)) {
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, size));
        // The merge pass: one sweep over the whole list, merging adjacent ranges.
        let mut w = 0;
        for r in 1..self.free.len() {
            let (o, s) = self.free[r];
            let last = &mut self.free[w];
            if last.0 + last.1 == o {
                last.1 += s;
            } else {
                w += 1;
                self.free[w] = (o, s);
            }
        }
        self.free.truncate(w + 1);
    }
    fn reserved_high(&self) -> u64 {
        self.growth.mapped()
    }
    fn driver_calls(&self) -> DriverCalls {
        self.growth.calls()
    }
}
