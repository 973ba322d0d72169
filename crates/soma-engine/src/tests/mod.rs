//! Engine tests: unit tests per rule, a shadow-model property test and the trace replay.

mod model;
mod traces;
mod unit;

use std::collections::BTreeMap;

use super::{Backing, BackingError, Eligibility, FreeTag, StreamOrder, StreamSlot};

pub(super) const MIB: u64 = 1 << 20;
pub(super) const G: u64 = 2 * MIB;

/// A backing that records mappings, enforces exact unmaps, limits capacity and injects
/// failures.
#[derive(Debug, Default)]
pub(super) struct FakeBacking {
    /// offset → (size, token)
    pub mapped: BTreeMap<u64, (u64, u64)>,
    pub capacity: Option<u64>,
    pub next_token: u64,
    /// Fail the next map with this error.
    pub fail_next_map: Option<BackingError>,
    /// Fail the next unmap with this error.
    pub fail_next_unmap: Option<BackingError>,
    /// Log of unmapped ranges since the last drain.
    pub unmap_log: Vec<(u64, u64)>,
    pub maps: u64,
    pub unmaps: u64,
    /// Granularity that maps must respect (0: [`G`]).
    pub granule: u64,
}

impl FakeBacking {
    pub fn new() -> FakeBacking {
        FakeBacking::default()
    }

    pub fn with_capacity(cap: u64) -> FakeBacking {
        FakeBacking { capacity: Some(cap), ..FakeBacking::default() }
    }

    pub fn total(&self) -> u64 {
        self.mapped.values().map(|v| v.0).sum()
    }
}

impl Backing for FakeBacking {
    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError> {
        let g = if self.granule == 0 { G } else { self.granule };
        assert!(size > 0 && offset % g == 0 && size % g == 0, "unaligned map");
        if let Some(e) = self.fail_next_map.take() {
            return Err(e);
        }
        if let Some(cap) = self.capacity {
            if self.total() + size > cap {
                return Err(BackingError::OutOfMemory);
            }
        }
        // no overlap with existing mappings
        if let Some((&o, &(s, _))) = self.mapped.range(..offset + size).next_back() {
            assert!(o + s <= offset, "map overlaps an existing mapping");
        }
        self.next_token += 1;
        self.mapped.insert(offset, (size, self.next_token));
        self.maps += 1;
        Ok(self.next_token)
    }

    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), BackingError> {
        if let Some(e) = self.fail_next_unmap.take() {
            return Err(e);
        }
        let got = self.mapped.remove(&offset);
        assert_eq!(got, Some((size, token)), "unmap of a range not mapped as such");
        self.unmap_log.push((offset, size));
        self.unmaps += 1;
        Ok(())
    }
}

/// A stream order driven by tables.
#[derive(Debug, Default, Clone)]
pub(super) struct TestOrder {
    pub host_observed: BTreeMap<StreamSlot, u64>,
    pub event: BTreeMap<StreamSlot, u64>,
    pub completed: BTreeMap<StreamSlot, u64>,
    /// `is_complete(tag)` ⇔ `tag.pos < complete_bound[stream]`.
    pub complete_bound: BTreeMap<StreamSlot, u64>,
    pub internal: bool,
    /// Everything complete (for the trace replay).
    pub all_complete: bool,
}

impl TestOrder {
    /// Every free complete, nothing else eligible (the trace replays' order).
    pub fn complete() -> TestOrder {
        TestOrder { all_complete: true, ..TestOrder::default() }
    }
}

impl StreamOrder for TestOrder {
    fn eligibility(&self, s: StreamSlot) -> Eligibility {
        Eligibility {
            host_observed: self.host_observed.get(&s).copied().unwrap_or(0),
            event: self.event.get(&s).copied().unwrap_or(0),
            completed: self.completed.get(&s).copied().unwrap_or(0),
        }
    }

    fn internal_dependencies(&self) -> bool {
        self.internal
    }

    fn is_complete(&self, tag: FreeTag) -> bool {
        self.all_complete || tag.pos < self.complete_bound.get(&tag.stream).copied().unwrap_or(0)
    }
}
