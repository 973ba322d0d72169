//! What a pool that maps on demand at the top of its used space would ask the driver for.

use crate::driver_cost::DriverCalls;
use crate::{round_up, GRANULE};

/// The mapping of a pure offset allocator's high-water growth: whenever an allocation ends
/// beyond the mapped end, one physical allocation and one map extend the mapping to that end,
/// rounded up to [`GRANULE`]s (one call for the whole extension, as soma's engine maps a
/// growth). Nothing is ever unmapped: the pure offset allocators never give memory back.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GrowthMapping {
    mapped_end: u64,
    growths: u64,
}

impl GrowthMapping {
    /// Notes an allocation ending at byte offset `end`.
    #[inline]
    pub(crate) fn note_end(&mut self, end: u64) {
        if end > self.mapped_end {
            self.grow(end);
        }
    }

    #[cold]
    fn grow(&mut self, end: u64) {
        self.mapped_end = round_up(end, GRANULE);
        self.growths += 1;
    }

    /// Bytes mapped (the high-water end offset, rounded up to granules).
    pub(crate) fn mapped(&self) -> u64 {
        self.mapped_end
    }

    /// The driver calls of the growths so far.
    pub(crate) fn calls(&self) -> DriverCalls {
        DriverCalls::growths(self.growths)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MIB;

    #[test]
    fn maps_only_beyond_the_mapped_end_in_granules() {
        let mut g = GrowthMapping::default();
        g.note_end(1);
        g.note_end(2 * MIB);
        assert_eq!((g.mapped(), g.calls().map), (2 * MIB, 1));
        g.note_end(2 * MIB + 1);
        g.note_end(5 * MIB);
        g.note_end(3 * MIB);
        assert_eq!((g.mapped(), g.calls().map, g.calls().alloc_physical), (6 * MIB, 3, 3));
        assert_eq!(g.calls().unmap, 0);
    }
}
