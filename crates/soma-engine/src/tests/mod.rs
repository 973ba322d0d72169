//! Engine tests: unit tests per behaviour (one file per part of the engine), a shadow-model
//! property test and the trace replay.

mod coalescing;
mod growth;
mod model;
mod recycling;
mod release;
mod requests;
mod traces;

use std::collections::BTreeMap;

use crate::{
    Allocation, Backing, BackingError, BlockState, Eligibility, Engine, EngineConfig, FreeTag,
    StreamOrder, StreamSlot,
};

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
    pub fail_next_map: Option<BackingError<&'static str>>,
    /// Fail the next unmap with this error.
    pub fail_next_unmap: Option<&'static str>,
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
    type Error = &'static str;

    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError<&'static str>> {
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

    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), &'static str> {
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

pub(super) fn engine(range: u64) -> Engine {
    Engine::new(EngineConfig {
        range_size: range,
        granularity: G,
        alignment: 512,
        index_by_offset: true,
    })
    .unwrap()
}

pub(super) fn tag(stream: StreamSlot, pos: u64) -> FreeTag {
    FreeTag { stream, pos }
}

pub(super) fn alloc(
    e: &mut Engine,
    b: &mut FakeBacking,
    o: &TestOrder,
    bytes: u64,
    s: StreamSlot,
) -> Allocation {
    let a = e.alloc(bytes, 512, s, o, b).unwrap();
    e.check_invariants().unwrap();
    a
}

pub(super) fn free(e: &mut Engine, a: &Allocation, s: StreamSlot, pos: u64) {
    e.free(a.block, tag(s, pos)).unwrap();
    e.check_invariants().unwrap();
}

/// Fills the first granule so that later requests cannot use fresh tail memory.
pub(super) fn fill_granule(e: &mut Engine, b: &mut FakeBacking, o: &TestOrder) -> Allocation {
    alloc(e, b, o, G, 9)
}

/// `n` granule blocks at [0, nG) on stream 0, block `hole` freed (at `pos` 1) and released:
/// an unmapped hole between mapped memory, as recycling leaves them. Returns the blocks
/// (`hole`'s is stale).
pub(super) fn granules_around_a_hole(
    e: &mut Engine,
    b: &mut FakeBacking,
    o: &TestOrder,
    n: u64,
    hole: usize,
) -> Vec<Allocation> {
    let blocks: Vec<_> = (0..n).map(|_| alloc(e, b, o, G, 0)).collect();
    free(e, &blocks[hole], 0, 1);
    let all = TestOrder::complete();
    assert_eq!(e.release((n - 1) * G, &all, b).unwrap(), G);
    blocks
}

/// The free blocks of `[0, end)`: (offset, size, tag).
pub(super) fn free_blocks_below(e: &Engine, end: u64) -> Vec<(u64, u64, Option<FreeTag>)> {
    e.blocks()
        .filter(|i| i.offset < end)
        .filter_map(|i| match i.state {
            BlockState::Free(t) => Some((i.offset, i.size, t)),
            _ => None,
        })
        .collect()
}

/// The mapped ranges, in address order.
pub(super) fn mapped_ranges(e: &Engine) -> Vec<(u64, u64)> {
    e.blocks()
        .filter(|i| i.state != BlockState::Unmapped)
        .map(|i| (i.offset, i.offset + i.size))
        .fold(Vec::new(), |mut v: Vec<(u64, u64)>, (s, t)| {
            match v.last_mut() {
                Some(last) if last.1 == s => last.1 = t,
                _ => v.push((s, t)),
            }
            v
        })
}
