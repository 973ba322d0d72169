//! The `offset-allocator` crate behind [`Allocator`].

use super::{Allocator, UNIT};
use crate::{round_up, GRANULE};

/// The `offset-allocator` crate, in units of [`UNIT`] bytes.
pub struct OffsetAlloc {
    inner: offset_allocator::Allocator<u32>,
    high_end_units: u64,
}

impl OffsetAlloc {
    /// An allocator over `range` bytes (at most `u32::MAX` units of 512 B = 2 TiB) with room
    /// for `max_allocs` simultaneous allocations plus free regions.
    pub fn new(range: u64, max_allocs: u32) -> Self {
        let units = u32::try_from(range / UNIT).unwrap_or(u32::MAX - 1);
        OffsetAlloc {
            inner: offset_allocator::Allocator::with_max_allocs(units, max_allocs),
            high_end_units: 0,
        }
    }
}

impl std::fmt::Debug for OffsetAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffsetAlloc").field("high_end_units", &self.high_end_units).finish()
    }
}

impl Allocator for OffsetAlloc {
    type Handle = offset_allocator::Allocation<u32>;
    fn name(&self) -> &'static str {
        "offset-allocator"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<Self::Handle> {
        let units = u32::try_from(bytes.div_ceil(UNIT)).ok()?;
        let a = self.inner.allocate(units)?;
        self.high_end_units = self.high_end_units.max(u64::from(a.offset) + u64::from(units));
        Some(a)
    }
    #[inline]
    fn free(&mut self, handle: Self::Handle) {
        self.inner.free(handle);
    }
    fn reserved_high(&self) -> u64 {
        round_up(self.high_end_units * UNIT, GRANULE)
    }
}
