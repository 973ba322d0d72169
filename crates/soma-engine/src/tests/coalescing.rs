//! Coalescing and settling: which free blocks merge, across streams and after a host
//! synchronisation.

use super::*;
use crate::*;

#[test]
fn split_and_coalesce() {
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 4096, 0);
    let y = alloc(&mut e, &mut b, &o, 4096, 0);
    let z = alloc(&mut e, &mut b, &o, 4096, 0);
    assert_eq!((x.offset, y.offset, z.offset), (0, 4096, 8192));
    // 3 live + the fresh tail + unmapped rest
    assert_eq!(e.blocks().count(), 5);
    free(&mut e, &y, 0, 5);
    assert_eq!(e.block(y.block).unwrap().state, BlockState::Free(Some(tag(0, 5))));
    free(&mut e, &x, 0, 3);
    // x absorbed y: pos = max
    let infos: Vec<_> = e.blocks().collect();
    assert_eq!(
        infos[0],
        BlockInfo { offset: 0, size: 8192, state: BlockState::Free(Some(tag(0, 5))) }
    );
    // z merges with both sides, the fresh tail takes the tag
    free(&mut e, &z, 0, 4);
    let infos: Vec<_> = e.blocks().collect();
    assert_eq!(infos.len(), 2);
    assert_eq!(
        infos[0],
        BlockInfo { offset: 0, size: G, state: BlockState::Free(Some(tag(0, 5))) }
    );
    assert_eq!(infos[1].state, BlockState::Unmapped);
    assert_eq!(e.stats().largest_free_block, G);
}

#[test]
fn different_streams_never_merge() {
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 4096, 0);
    let y = alloc(&mut e, &mut b, &o, 4096, 0);
    let z = alloc(&mut e, &mut b, &o, G - 8192, 0);
    free(&mut e, &x, 1, 1);
    free(&mut e, &y, 2, 1);
    free(&mut e, &z, 1, 2);
    let states: Vec<_> = e.blocks().map(|i| (i.offset, i.state)).collect();
    assert_eq!(
        states,
        vec![
            (0, BlockState::Free(Some(tag(1, 1)))),
            (4096, BlockState::Free(Some(tag(2, 1)))),
            (8192, BlockState::Free(Some(tag(1, 2)))),
            (G, BlockState::Unmapped),
        ]
    );
    assert_eq!(e.stats().pending_bytes, G);
    assert_eq!(e.stats().free_bytes, G);
}

#[test]
fn a_block_freed_on_another_stream_never_absorbs_its_neighbour() {
    // Found by the C API state machine: s0 frees 4 MiB; s0 reuses the first 2 MiB; that part
    // is freed onto s2; a small request of s2 must come from its own block, never from s0's
    // leftover next to it (no rule allows s2 to reuse s0's memory).
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let head = alloc(&mut e, &mut b, &o, 168448, 2);
    let big = alloc(&mut e, &mut b, &o, 4 * MIB, 0);
    free(&mut e, &big, 0, 1);
    let part = alloc(&mut e, &mut b, &o, 2 * MIB, 0);
    assert_eq!(part.offset, big.offset);
    let rest = e.blocks().find(|bl| bl.offset == big.offset + 2 * MIB).unwrap();
    assert_eq!(rest.state, BlockState::Free(Some(tag(0, 1))), "the leftover keeps its tag");
    free(&mut e, &part, 2, 1);
    let small = alloc(&mut e, &mut b, &o, 299, 2);
    assert!(
        small.offset < big.offset + 2 * MIB || small.reuse.is_none(),
        "s2 got s0's leftover: {small:?} (big at {})",
        big.offset
    );
    let _ = head;
}

#[test]
fn memory_mapped_between_two_streams_free_blocks_merges_with_one_of_them() {
    // P Q R S at [0, 4G); Q released (a hole at [G, 2G)); P and S freed on stream 0, R on
    // stream 1. Packing maps S's granule into the hole, between P (stream 0) and R
    // (stream 1): the untagged memory joins P only — blocks of two streams never merge.
    let o = TestOrder::complete();
    let mut e = recycling_engine(64 * G);
    let mut b = backing();
    let blocks = granules_around_a_hole(&mut e, &mut b, &o, 4, 1);
    free(&mut e, &blocks[0], 0, 2);
    free(&mut e, &blocks[2], 1, 2);
    free(&mut e, &blocks[3], 0, 2);
    // Stream 2 may reuse neither stream's blocks: it grows above them, after packing.
    let a = alloc(&mut e, &mut b, &o, 4096, 2);
    assert_eq!(a.offset, 3 * G);
    assert_eq!(mapped_ranges(&e), [(0, 4 * G)]);
    assert_eq!(
        free_blocks_below(&e, 3 * G),
        [(0, 2 * G, Some(tag(0, 2))), (2 * G, G, Some(tag(1, 2)))]
    );
}

/// Two halves of the first granule, allocated on streams 1 and 2 and freed there (at
/// positions 5 and 7): two free blocks that never merge on their own.
fn halves_freed_by_two_streams(e: &mut Engine, b: &mut FakeBacking) {
    let o = TestOrder::default();
    let x = alloc(e, b, &o, G / 2, 1);
    let y = alloc(e, b, &o, G / 2, 2);
    assert_eq!((x.offset, y.offset), (0, G / 2));
    free(e, &x, 1, 5);
    free(e, &y, 2, 7);
    assert_eq!(
        free_blocks_below(e, G),
        [(0, G / 2, Some(tag(1, 5))), (G / 2, G / 2, Some(tag(2, 7)))]
    );
}

#[test]
fn settling_merges_the_observed_frees_of_different_streams() {
    let mut e = engine(64 * G);
    let mut b = backing();
    halves_freed_by_two_streams(&mut e, &mut b);
    let mut observed = TestOrder::default();
    observed.host_observed.insert(1, 6);
    observed.host_observed.insert(2, 8);
    e.settle(&observed);
    e.check_invariants().unwrap();
    assert_eq!(free_blocks_below(&e, G), [(0, G, None)]);
    assert_eq!(e.stats().pending_bytes, 0);
    // A third stream takes the whole granule with nothing eligible by any rule now: the
    // frees were host-observed when they settled. No growth.
    let maps = b.maps;
    let z = alloc(&mut e, &mut b, &TestOrder::default(), G, 3);
    assert_eq!((z.offset, z.reuse), (0, Some(ReuseKind::HostSynchronized)));
    assert_eq!(b.maps, maps);
}

#[test]
fn settling_leaves_frees_the_host_has_not_observed() {
    let mut e = engine(64 * G);
    let mut b = backing();
    halves_freed_by_two_streams(&mut e, &mut b);
    // Stream 2's free (at 7) is not below its observed bound: it stays tagged, and apart from
    // the settled half (merged, the settled memory would wait for stream 2's free too).
    let mut observed = TestOrder::default();
    observed.host_observed.insert(1, 6);
    observed.host_observed.insert(2, 7);
    e.settle(&observed);
    e.check_invariants().unwrap();
    assert_eq!(free_blocks_below(&e, G), [(0, G / 2, None), (G / 2, G / 2, Some(tag(2, 7)))]);
    let z = alloc(&mut e, &mut b, &TestOrder::default(), G, 3);
    assert_eq!((z.offset, z.reuse), (G, None), "stream 3 may not use stream 2's free");
    let h = alloc(&mut e, &mut b, &TestOrder::default(), G / 2, 3);
    assert_eq!((h.offset, h.reuse), (0, Some(ReuseKind::HostSynchronized)));
}

#[test]
fn settled_memory_merges_with_the_frees_of_a_stream_freeing_alone() {
    // Stream 1's half settles; then stream 2 alone frees the other half: it coalesces with
    // the settled memory (as on one stream). After frees of two streams it would not.
    for other_stream_frees_first in [false, true] {
        let mut e = engine(64 * G);
        let mut b = backing();
        let o = TestOrder::default();
        let x = alloc(&mut e, &mut b, &o, G / 2, 1);
        let y = alloc(&mut e, &mut b, &o, G / 2, 2);
        let _elsewhere = alloc(&mut e, &mut b, &o, G, 3);
        let w = alloc(&mut e, &mut b, &o, G, 3);
        free(&mut e, &x, 1, 5);
        let mut observed = TestOrder::default();
        observed.host_observed.insert(1, 6);
        e.settle(&observed);
        if other_stream_frees_first {
            free(&mut e, &w, 3, 1);
        }
        free(&mut e, &y, 2, 7);
        let expected: &[_] = if other_stream_frees_first {
            &[(0, G / 2, None), (G / 2, G / 2, Some(tag(2, 7)))]
        } else {
            &[(0, G, Some(tag(2, 7)))]
        };
        assert_eq!(free_blocks_below(&e, G), expected, "{other_stream_frees_first}");
    }
}

#[test]
fn a_settled_block_is_a_same_stream_reuse_for_the_stream_that_freed_it() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let _filler = fill_granule(&mut e, &mut b, &o);
    let x = alloc(&mut e, &mut b, &o, G, 1);
    let _live_above = alloc(&mut e, &mut b, &o, G, 1);
    free(&mut e, &x, 1, 3);
    let mut observed = TestOrder::default();
    observed.host_observed.insert(1, 4);
    e.settle(&observed);
    assert_eq!(free_blocks_below(&e, 2 * G), [(G, G, None)]);
    let x2 = alloc(&mut e, &mut b, &o, G, 1);
    assert_eq!((x2.offset, x2.reuse), (G, Some(ReuseKind::SameStream)));
    free(&mut e, &x2, 1, 3);
    e.settle(&observed);
    let x3 = alloc(&mut e, &mut b, &o, G, 4);
    assert_eq!((x3.offset, x3.reuse), (G, Some(ReuseKind::HostSynchronized)));
}

#[test]
fn settling_again_at_the_same_bound_takes_the_frees_made_since() {
    // A free after a synchronisation with nothing enqueued since has a position below the
    // bound that did not move: the next settle must not skip its stream.
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let _filler = fill_granule(&mut e, &mut b, &o);
    let x = alloc(&mut e, &mut b, &o, G, 1);
    let _gap = alloc(&mut e, &mut b, &o, G, 9);
    let y = alloc(&mut e, &mut b, &o, G, 1);
    let mut observed = TestOrder::default();
    observed.host_observed.insert(1, 6);
    free(&mut e, &x, 1, 5);
    e.settle(&observed);
    assert_eq!(e.stats().pending_bytes, 0);
    free(&mut e, &y, 1, 5);
    assert_eq!(e.stats().pending_bytes, G);
    e.settle(&observed);
    e.check_invariants().unwrap();
    assert_eq!(e.stats().pending_bytes, 0);
}
