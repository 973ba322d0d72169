//! Engine tests: unit tests per behaviour (one file per part of the engine), a shadow-model
//! property test and the trace replay.

mod border;
mod coalescing;
mod growth;
mod interleaved;
mod model;
mod private_slots;
mod recycling;
mod release;
mod requests;
mod traces;

pub(super) use crate::testing::{FakeBacking, Injected, TestOrder, TestRng};
use crate::{Allocation, BlockState, Engine, EngineConfig, FreeTag, StreamSlot};

pub(super) const MIB: u64 = 1 << 20;
pub(super) const G: u64 = 2 * MIB;

/// A checked backing with the tests' granule.
pub(super) fn backing() -> FakeBacking {
    FakeBacking::checked(G)
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

/// [`engine`] with recycling on growth (off by default), for the tests of recycling and of
/// what it leaves behind (holes, packing, finer segments).
pub(super) fn recycling_engine(range: u64) -> Engine {
    let mut e = engine(range);
    e.set_recycle_on_growth(true);
    e
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
