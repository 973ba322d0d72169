//! Streams used op by op (each allocation and free on the next stream, frees handed off
//! through events): while several streams free, an allocation first settles what completed
//! on the device, the requesting stream's frees included, so that memory freed by different
//! streams merges as one stream's frees would — and what is still pending stays apart.

use super::*;
use crate::ReuseKind;

/// Blocks of 1, 1, 1, 4 and 1 MiB at [0, 8 MiB) on stream 0: the first two are the adjacent
/// pair, the fourth the larger block elsewhere that also fits the pair's size; the third and
/// fifth stay live around it. The pair is freed on `pair_streams` and the larger block on
/// stream 3, each at position 1; `order` says what completed.
fn pair_freed_on(
    pair_streams: [StreamSlot; 2],
    order: &TestOrder,
) -> (Engine, FakeBacking, [Allocation; 5]) {
    let mut e = engine(64 * G);
    let mut b = backing();
    let sizes = [MIB, MIB, MIB, 4 * MIB, MIB];
    let blocks = sizes.map(|s| alloc(&mut e, &mut b, order, s, 0));
    let offsets = blocks.map(|a| a.offset);
    assert_eq!(offsets, [0, MIB, 2 * MIB, 3 * MIB, 7 * MIB]);
    free(&mut e, &blocks[3], 3, 1);
    free(&mut e, &blocks[0], pair_streams[0], 1);
    free(&mut e, &blocks[1], pair_streams[1], 1);
    (e, b, blocks)
}

/// A [`TestOrder`] in which the frees at position 1 of `streams` completed.
fn completed_on(streams: &[StreamSlot]) -> TestOrder {
    let mut o = TestOrder::default();
    for &s in streams {
        o.completed.insert(s, 2);
    }
    o
}

#[test]
fn completed_frees_of_several_streams_merge_before_the_next_allocation() {
    let o = completed_on(&[0, 1, 3]);
    let (mut e, mut b, _) = pair_freed_on([0, 1], &o);
    let maps = b.maps;
    let a = alloc(&mut e, &mut b, &o, 2 * MIB, 2);
    // The pair, merged: an exact fit, where without settling the 4 MiB block was the only
    // one that fitted.
    assert_eq!((a.offset, a.reuse, b.maps), (0, Some(ReuseKind::Opportunistic), maps));
    assert_eq!(free_blocks_below(&e, 7 * MIB), vec![(3 * MIB, 4 * MIB, None)]);
}

/// The same for a search of cached memory alone (a sharded pool asks every shard first).
#[test]
fn a_search_of_cached_memory_settles_too() {
    let o = completed_on(&[0, 1, 3]);
    let (mut e, _, _) = pair_freed_on([0, 1], &o);
    let a = e.alloc_cached(2 * MIB, 512, 2, &o, false).unwrap().unwrap();
    assert_eq!((a.offset, a.reuse), (0, Some(ReuseKind::Opportunistic)));
}

#[test]
fn the_requesting_streams_own_completed_frees_merge_too() {
    let o = completed_on(&[1, 2, 3]);
    let (mut e, mut b, _) = pair_freed_on([2, 1], &o);
    let a = alloc(&mut e, &mut b, &o, 2 * MIB, 2);
    assert_eq!((a.offset, a.reuse), (0, Some(ReuseKind::Opportunistic)));
}

#[test]
fn a_free_still_pending_stays_out_of_the_merge() {
    // Stream 0's free has not completed.
    let mut o = completed_on(&[1, 3]);
    let (mut e, mut b, _) = pair_freed_on([0, 1], &o);
    let a = alloc(&mut e, &mut b, &o, 3 * MIB, 2);
    assert_eq!(a.offset, 3 * MIB, "not over stream 0's pending free");
    let below_the_pair = free_blocks_below(&e, 2 * MIB);
    assert_eq!(below_the_pair, vec![(0, MIB, Some(tag(0, 1))), (MIB, MIB, None)]);
    // Once it completes, the next allocation while several streams free merges it.
    o.completed.insert(0, 2);
    let z = alloc(&mut e, &mut b, &o, 512, 3);
    free(&mut e, &z, 3, 2);
    free(&mut e, &a, 1, 2);
    let w = alloc(&mut e, &mut b, &o, 2 * MIB, 2);
    assert_eq!((w.offset, w.reuse), (0, Some(ReuseKind::Opportunistic)));
}

/// With the opportunistic rule off, only the host's observations settle.
#[test]
fn without_the_opportunistic_rule_nothing_settles_on_completion() {
    let o = TestOrder { all_complete: true, ..TestOrder::default() };
    let (mut e, mut b, _) = pair_freed_on([0, 1], &o);
    let a = e.alloc(2 * MIB, 512, 2, &o, &mut b).unwrap();
    assert_ne!(a.offset, 0);
    let pair = free_blocks_below(&e, 2 * MIB);
    assert_eq!(pair, vec![(0, MIB, Some(tag(0, 1))), (MIB, MIB, Some(tag(1, 1)))]);
}

/// Settling looks again at every block still pending, so while many stay pending an
/// allocation settles only once enough frees followed the last settle (`SETTLE_SPACING`):
/// here 17 pending blocks make the next settle due after 4 frees.
#[test]
fn many_pending_frees_space_the_settles_out() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, MIB, 0);
    let y = alloc(&mut e, &mut b, &o, MIB, 0);
    let larger = alloc(&mut e, &mut b, &o, 4 * MIB, 0);
    let small: Vec<_> = (0..33).map(|_| alloc(&mut e, &mut b, &o, 4096, 0)).collect();
    assert_eq!((x.offset, y.offset, larger.offset), (0, MIB, 2 * MIB));
    // 17 frees of stream 0 that stay pending, apart from each other (the device completed
    // stream 0's earlier work: settling looks at them).
    for s in small.iter().step_by(2) {
        free(&mut e, s, 0, 5);
    }
    free(&mut e, &small[1], 1, 1);
    o.completed.insert(0, 2);
    o.completed.insert(1, 2);
    // Several streams freed: this allocation settles, and 17 blocks stay pending.
    let _ = alloc(&mut e, &mut b, &o, 512, 3);
    // Three frees: not yet due.
    free(&mut e, &x, 1, 2);
    free(&mut e, &y, 2, 1);
    free(&mut e, &larger, 3, 1);
    o.completed.insert(1, 3);
    o.completed.insert(2, 2);
    let a = alloc(&mut e, &mut b, &o, 2 * MIB, 3);
    assert_eq!(a.offset, 2 * MIB, "x and y are still apart");
    // The fourth free makes it due: x and y merge, an exact fit.
    free(&mut e, &a, 3, 2);
    let a = alloc(&mut e, &mut b, &o, 2 * MIB, 3);
    assert_eq!((a.offset, a.reuse), (0, Some(ReuseKind::Opportunistic)));
}
