//! Release to a target, teardown, and packing the mapped memory of an emptied engine.

use super::*;
use crate::*;

#[test]
fn release_respects_live_and_incomplete_memory() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    let segs: Vec<_> = (0..6).map(|_| alloc(&mut e, &mut b, &o, G, 0)).collect();
    let small = alloc(&mut e, &mut b, &o, 4096, 0); // in segment 6, with fresh tail
    for (i, a) in segs.iter().enumerate() {
        if i != 2 {
            free(&mut e, a, (i % 2) as u32, 10 + i as u64);
        }
    }
    // nothing complete: only the untagged tail... which shares a granule with `small`
    assert_eq!(e.release(0, &o, &mut b).unwrap(), 0);
    // stream 0 complete (pos 10, 12, 14), stream 1 not
    o.complete_bound.insert(0, 100);
    let released = e.release(0, &o, &mut b).unwrap();
    e.check_invariants().unwrap();
    // segments 0 and 4 (2 is live); 1, 3, 5 are stream 1
    assert_eq!(released, 2 * G);
    for info in e.blocks() {
        if let BlockState::Free(Some(t)) = info.state {
            assert_eq!(t.stream, 1);
        }
    }
    assert_eq!(e.block(segs[2].block).unwrap().state, BlockState::Live);
    assert_eq!(e.block(small.block).unwrap().state, BlockState::Live);
    assert_eq!(b.total(), e.reserved());
}

#[test]
fn release_goes_highest_first_and_stops_at_the_target() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::complete();
    let segs: Vec<_> = (0..4).map(|_| alloc(&mut e, &mut b, &o, G, 0)).collect();
    let live = alloc(&mut e, &mut b, &o, G, 0);
    for a in &segs {
        free(&mut e, a, 0, 1);
    }
    // the four free granules coalesced into one block, but are four segments
    assert_eq!(e.stats().mapped_segments, 5);
    assert_eq!(e.release(3 * G + 1, &o, &mut b).unwrap(), 2 * G);
    e.check_invariants().unwrap();
    let infos: Vec<_> = e.blocks().collect();
    assert_eq!(
        infos[0],
        BlockInfo { offset: 0, size: 2 * G, state: BlockState::Free(Some(tag(0, 1))) }
    );
    assert_eq!(infos[1], BlockInfo { offset: 2 * G, size: 2 * G, state: BlockState::Unmapped });
    // keep below used: only down to used
    assert_eq!(e.release(0, &o, &mut b).unwrap(), 2 * G);
    assert_eq!(e.reserved(), G);
    assert_eq!(e.release(0, &o, &mut b).unwrap(), 0);
    let _ = live;
}

#[test]
fn release_keeps_the_target_when_one_segment_holds_more() {
    // One 16 MiB allocation mapped as one segment, freed: the cache is that segment.
    let setup = || {
        let mut e = engine(64 * G);
        e.set_segments_per_growth(1);
        let mut b = backing();
        let o = TestOrder::complete();
        let a = alloc(&mut e, &mut b, &o, 8 * G, 0);
        free(&mut e, &a, 0, 1);
        assert_eq!(e.stats().mapped_segments, 1);
        (e, b, o)
    };
    for (keep, kept) in [(G, G), (2 * G + G / 2, 2 * G), (7 * G, 7 * G), (G / 2, 0)] {
        let (mut e, mut b, o) = setup();
        let maps = b.maps;
        assert_eq!(e.release(keep, &o, &mut b).unwrap(), 8 * G - kept, "keep {keep}");
        e.check_invariants().unwrap();
        assert_eq!(e.reserved(), kept, "keep {keep}");
        assert_eq!(b.total(), kept);
        // Unmapped whole, its lowest granules mapped again (in power-of-two segments).
        assert_eq!(b.maps > maps, kept > 0, "keep {keep}");
        if kept > 0 {
            // What stays is never-used memory at the bottom of the range.
            assert_eq!(
                e.blocks().next().unwrap(),
                BlockInfo { offset: 0, size: kept, state: BlockState::Free(None) }
            );
            let remapped = b.maps;
            let again = alloc(&mut e, &mut b, &o, kept, 1);
            assert_eq!((again.offset, b.maps), (0, remapped));
        }
    }
    // Segments that fit go whole, before the one that does not is cut.
    let mut e = engine(64 * G);
    e.set_segments_per_growth(1);
    let mut b = backing();
    let o = TestOrder::complete();
    let all: Vec<_> = [8 * G, G, G].iter().map(|&n| alloc(&mut e, &mut b, &o, n, 0)).collect();
    for a in &all {
        free(&mut e, a, 0, 2);
    }
    assert_eq!(e.stats().mapped_segments, 3);
    let maps = b.maps;
    assert_eq!(e.release(8 * G, &o, &mut b).unwrap(), 2 * G);
    assert_eq!((e.reserved(), b.maps, e.stats().mapped_segments), (8 * G, maps, 1));
    e.check_invariants().unwrap();
}

#[test]
fn release_unmap_error_keeps_state_exact() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::complete();
    let segs: Vec<_> = (0..3).map(|_| alloc(&mut e, &mut b, &o, G, 0)).collect();
    for a in &segs {
        free(&mut e, a, 0, 1);
    }
    b.fail_next_unmap = true;
    assert_eq!(e.release(0, &o, &mut b), Err(Injected));
    e.check_invariants().unwrap();
    assert_eq!(e.reserved(), 3 * G);
    assert_eq!(e.release(0, &o, &mut b).unwrap(), 3 * G);
    e.check_invariants().unwrap();
    assert_eq!(b.total(), 0);
}

#[test]
fn teardown_unmaps_everything() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 3 * G, 0);
    let y = alloc(&mut e, &mut b, &o, 1000, 1);
    assert_eq!(e.teardown(&mut b), Err(TeardownError::LiveBlocks(2)));
    assert_eq!(b.total(), e.reserved());
    free(&mut e, &x, 0, 1);
    free(&mut e, &y, 1, 1);
    e.teardown(&mut b).unwrap();
    e.check_invariants().unwrap();
    assert_eq!(b.total(), 0);
    assert_eq!(e.reserved(), 0);
    assert_eq!(e.blocks().count(), 1);
    // usable afterwards
    let z = alloc(&mut e, &mut b, &o, 1000, 0);
    assert_eq!(z.offset, 0);
}

/// Three granule blocks A, B, C at [0, 3G); A released (a hole at the bottom); then B and C
/// freed at `pos` 2 on stream 0: the engine is empty with 2 granules mapped at [G, 3G) above
/// a hole.
fn empty_above_a_hole(e: &mut Engine, b: &mut FakeBacking, o: &TestOrder) {
    let blocks = granules_around_a_hole(e, b, o, 3, 0);
    for a in &blocks[1..] {
        free(e, a, 0, 2);
    }
    assert_eq!((e.used(), e.reserved()), (0, 2 * G));
}

#[test]
fn an_engine_that_empties_packs_its_mapped_memory_before_the_next_allocation() {
    let o = TestOrder::complete();
    let mut e = recycling_engine(64 * G);
    let mut b = backing();
    empty_above_a_hole(&mut e, &mut b, &o);
    assert_eq!(mapped_ranges(&e), [(G, 3 * G)]);
    let (unmaps, high) = (e.stats().unmap_calls, e.stats().reserved_high);
    let a = alloc(&mut e, &mut b, &o, 4096, 0);
    // The segment above `reserved` moved into the hole: one run from the bottom.
    assert_eq!(mapped_ranges(&e), [(0, 2 * G)]);
    assert_eq!(e.stats().unmap_calls, unmaps + 1);
    assert_eq!((e.reserved(), e.stats().reserved_high), (2 * G, high));
    assert_eq!(b.total(), e.reserved());
    assert_eq!(a.offset, 0, "the next workload starts at the bottom");
    // Nothing was unmapped since: the next emptying does not pack again.
    free(&mut e, &a, 0, 3);
    let maps = e.stats().map_calls;
    alloc(&mut e, &mut b, &o, 4096, 0);
    assert_eq!(e.stats().map_calls, maps);
}

#[test]
fn an_engine_with_live_blocks_does_not_pack() {
    // A B C D at [0, 4G); A released (a hole at the bottom), C and D freed, B live: D lies
    // above `reserved` (3G) and could move, but only an empty engine packs.
    let o = TestOrder::complete();
    let mut e = engine(64 * G);
    let mut b = backing();
    let blocks = granules_around_a_hole(&mut e, &mut b, &o, 4, 0);
    free(&mut e, &blocks[2], 0, 2);
    free(&mut e, &blocks[3], 0, 2);
    alloc(&mut e, &mut b, &o, 4096, 0);
    assert_eq!(mapped_ranges(&e), [(G, 4 * G)], "a live block pins the layout");
}

#[test]
fn packing_moves_only_segments_whose_frees_completed() {
    // B and C were freed at pos 2, which has not completed: the device may still touch them.
    let mut o = TestOrder::default();
    o.complete_bound.insert(0, 2);
    let mut e = engine(64 * G);
    let mut b = backing();
    empty_above_a_hole(&mut e, &mut b, &o);
    let unmaps = e.stats().unmap_calls;
    alloc(&mut e, &mut b, &o, 4096, 0);
    assert_eq!(e.stats().unmap_calls, unmaps);
    assert_eq!(mapped_ranges(&e), [(G, 3 * G)]);
}

#[test]
fn an_engine_without_recycling_never_packs() {
    let o = TestOrder::complete();
    let mut e = engine(64 * G);
    e.set_recycle_on_growth(false);
    let mut b = backing();
    empty_above_a_hole(&mut e, &mut b, &o);
    alloc(&mut e, &mut b, &o, 4096, 0);
    assert_eq!(mapped_ranges(&e), [(G, 3 * G)]);
}
