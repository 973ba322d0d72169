//! The border block: the free block below the unmapped space at the top of the range is
//! served last, so that a workload run again on mapped memory places as it did while the
//! pool grew.

use super::*;
use crate::*;

#[test]
fn the_border_block_serves_only_when_no_indexed_block_fits() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    // [0, 3 MiB) live, then a 512 KiB separator: the border block is [3.5 MiB, 4 MiB).
    let x = alloc(&mut e, &mut b, &o, 3 * MIB, 0);
    let _separator = alloc(&mut e, &mut b, &o, MIB / 2, 0);
    free(&mut e, &x, 0, 1);
    // 256 KiB fits both; best fit alone would take the smaller border block.
    let y = alloc(&mut e, &mut b, &o, MIB / 4, 0);
    assert_eq!(y.offset, 0, "the indexed block, not the border block");
    // 3 MiB fits no indexed block any more: the border block, extended by growth.
    let maps = b.maps;
    let z = alloc(&mut e, &mut b, &o, 3 * MIB, 0);
    assert_eq!(z.offset, 3 * MIB + MIB / 2);
    assert!(b.maps > maps);
    // Once mapped memory is large enough, the border block serves without a map.
    free(&mut e, &z, 0, 2);
    let maps = b.maps;
    let w = alloc(&mut e, &mut b, &o, 3 * MIB, 0);
    assert_eq!((w.offset, w.reuse), (z.offset, Some(ReuseKind::SameStream)));
    assert_eq!(b.maps, maps);
    let s = e.stats();
    assert_eq!(s.free_bytes, s.reserved - s.used);
    assert_eq!(s.largest_free_block, 3 * MIB - MIB / 4);
}

#[test]
fn a_free_block_becomes_the_border_block_when_the_memory_above_it_goes() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::complete();
    let lo = alloc(&mut e, &mut b, &o, MIB, 0);
    let hi = alloc(&mut e, &mut b, &o, 2 * G, 0);
    free(&mut e, &lo, 0, 1);
    free(&mut e, &hi, 0, 2);
    // Everything is free: one block, below the top hole.
    assert_eq!(free_blocks_below(&e, 64 * G), vec![(0, 3 * G, Some(tag(0, 2)))]);
    e.check_invariants().unwrap();
    // Released down to one granule: the remaining granule is the border block again, and
    // serves a request that fits it without a map.
    assert_eq!(e.release(G, &o, &mut b).unwrap(), 2 * G);
    e.check_invariants().unwrap();
    let maps = b.maps;
    let a = alloc(&mut e, &mut b, &o, G, 0);
    assert_eq!((a.offset, b.maps), (0, maps));
}

/// 3000 ops from `seed`: an allocation of one of `sizes` plus up to 4 KiB (`Some`), or a free
/// of a live one (`None`, 45 % of the time while any is live).
fn random_sequence(seed: u64, sizes: &[u64]) -> Vec<Option<u64>> {
    let mut rng = TestRng::new(seed);
    let mut ops = Vec::new();
    let mut live = 0usize;
    for _ in 0..3000 {
        if live > 0 && rng.chance(45) {
            ops.push(None);
            live -= 1;
        } else {
            ops.push(Some(sizes[rng.index(sizes.len())] + rng.below(4096)));
            live += 1;
        }
    }
    ops
}

/// Runs `ops` from an empty engine on `stream`, a free at op `k` tagged at `first_pos + k`
/// (a random live block: the same ones every run) and what is left at `end_pos`: the offsets
/// of its allocations and the maps it made.
fn run_sequence(
    e: &mut Engine,
    b: &mut FakeBacking,
    o: &TestOrder,
    ops: &[Option<u64>],
    stream: StreamSlot,
    (first_pos, end_pos): (u64, u64),
) -> (Vec<u64>, u64) {
    let maps = b.maps;
    let mut live: Vec<Allocation> = Vec::new();
    let mut offsets = Vec::new();
    let mut pick = TestRng::new(11);
    for (k, op) in ops.iter().enumerate() {
        match op {
            Some(bytes) => {
                let a = e.alloc(*bytes, 512, stream, o, b).unwrap();
                offsets.push(a.offset);
                live.push(a);
            }
            None => {
                let a = live.swap_remove(pick.index(live.len()));
                e.free(a.block, tag(stream, first_pos + k as u64)).unwrap();
            }
        }
    }
    for a in live {
        e.free(a.block, tag(stream, end_pos)).unwrap();
    }
    e.check_invariants().unwrap();
    (offsets, b.maps - maps)
}

/// The first run mapped; every later one mapped nothing and placed as the first did.
fn assert_later_runs_place_as_the_first(runs: &[(Vec<u64>, u64)]) {
    assert!(runs[0].1 > 0);
    for (r, (offsets, maps)) in runs.iter().enumerate().skip(1) {
        assert_eq!(*maps, 0, "run {r} maps nothing");
        assert!(offsets == &runs[0].0, "run {r} places as the first run");
    }
}

/// Frees on one stream, recycling off: the second run of a sequence from an empty engine
/// places every block where the first run did, and maps nothing.
#[test]
fn a_sequence_run_again_from_empty_places_as_its_first_run() {
    let ops = random_sequence(7, &[512, 4096, 65536, MIB / 2, MIB, 3 * MIB, 7 * MIB]);
    let mut e = engine(4096 * G);
    e.set_recycle_on_growth(false);
    let mut b = backing();
    let o = TestOrder::complete();
    let runs: Vec<_> = (0..3u64)
        .map(|run| {
            let positions = (run * 10_000, run * 10_000 + 9_999);
            run_sequence(&mut e, &mut b, &o, &ops, 0, positions)
        })
        .collect();
    assert_later_runs_place_as_the_first(&runs);
}

/// Streams used in turn (a server running each request on the next of its streams): when a
/// stream takes the previous stream's border block under the opportunistic rule, what that
/// stream freed and the device completed settles, and the new stream's frees next to it
/// merge back into the border block, as one stream's would.
#[test]
fn a_stream_taking_a_completed_border_block_merges_its_frees_back_into_it() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 3 * MIB, 0);
    free(&mut e, &x, 0, 1);
    // Stream 0's free is the border block. Not known complete: stream 1 may not take it.
    assert_eq!(free_blocks_below(&e, 64 * G), vec![(0, 4 * MIB, Some(tag(0, 1)))]);
    o.completed.insert(0, 2);
    let y = alloc(&mut e, &mut b, &o, MIB, 1);
    assert_eq!((y.offset, y.reuse), (0, Some(ReuseKind::Opportunistic)));
    let z = alloc(&mut e, &mut b, &o, MIB, 1);
    assert_eq!((z.offset, z.reuse), (MIB, Some(ReuseKind::Opportunistic)));
    // Stream 1's frees merge with the settled rest of the border block: one free block, the
    // border block, serves the whole mapped memory without a map.
    free(&mut e, &z, 1, 1);
    free(&mut e, &y, 1, 2);
    assert_eq!(free_blocks_below(&e, 64 * G), vec![(0, 4 * MIB, Some(tag(1, 2)))]);
    let maps = b.maps;
    let w = alloc(&mut e, &mut b, &o, 4 * MIB, 1);
    assert_eq!((w.offset, w.reuse, b.maps), (0, Some(ReuseKind::SameStream), maps));
}

/// Only frees the device completed settle: a border block eligible through an event (rule
/// 2) keeps its stream's tag.
#[test]
fn a_border_block_taken_through_an_event_stays_tagged() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 3 * MIB, 0);
    free(&mut e, &x, 0, 1);
    o.event.insert(0, 2);
    let y = alloc(&mut e, &mut b, &o, MIB, 1);
    assert_eq!((y.offset, y.reuse), (0, Some(ReuseKind::EventDependency)));
    assert_eq!(free_blocks_below(&e, 64 * G), vec![(MIB, 3 * MIB, Some(tag(0, 1)))]);
}

/// A sequence run from empty on streams in turn, each run's frees completed before the next
/// run (the opportunistic rule): every run after the first places as the first did and maps
/// nothing, as on one stream.
#[test]
fn a_sequence_run_on_streams_in_turn_places_as_its_first_run() {
    let sizes = [512, 4096, 65536, MIB / 2, MIB, 3 * MIB, 7 * MIB, 19 * MIB];
    let ops = random_sequence(5, &sizes);
    let mut e = engine(4096 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    let mut runs = Vec::new();
    for stream in 0..4 {
        let end = ops.len() as u64 + 1;
        runs.push(run_sequence(&mut e, &mut b, &o, &ops, stream, (1, end)));
        // The device completes the run before the next stream starts.
        o.completed.insert(stream, end + 1);
    }
    assert_later_runs_place_as_the_first(&runs);
}
