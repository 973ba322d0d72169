//! The `offset-allocator` crate behind [`Allocator`].

use super::growth::GrowthMapping;
use super::{Allocator, UNIT};
use crate::driver_cost::DriverCalls;

/// The `offset-allocator` crate, in units of [`UNIT`] bytes.
pub struct OffsetAlloc {
    inner: offset_allocator::Allocator<u32>,
    growth: GrowthMapping,
}

impl OffsetAlloc {
    /// An allocator over `range` bytes (at most `u32::MAX` units of 512 B = 2 TiB) with room
    /// for `max_allocs` simultaneous allocations plus free regions.
    pub fn new(range: u64, max_allocs: u32) -> Self {
        let units = u32::try_from(range / UNIT).unwrap_or(u32::MAX - 1);
        OffsetAlloc {
            inner: offset_allocator::Allocator::with_max_allocs(units, max_allocs),
            growth: GrowthMapping::default(),
        }
    }
}

impl std::fmt::Debug for OffsetAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffsetAlloc").field("growth", &self.growth).finish()
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
        self.growth.note_end((u64::from(a.offset) + u64::from(units)) * UNIT);
        Some(a)
    }
    #[inline]
    fn free(&mut self, handle: Self::Handle) {
        self.inner.free(handle);
    }
    fn reserved_high(&self) -> u64 {
        self.growth.mapped()
    }
    fn driver_calls(&self) -> DriverCalls {
        self.growth.calls()
    }
}
