//! Growth: extending free blocks into holes, segment sizes and their refinement, out of
//! memory and failed maps.

use super::*;
use crate::growth::GROWTH_BURST;
use crate::*;

#[test]
fn growth_extends_a_free_block_into_the_hole() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, MIB, 0); // [0, 1M), tail [1M, 2M) fresh
    let y = alloc(&mut e, &mut b, &o, 2 * MIB, 0); // extends the fresh tail: maps [2M, 4M)
    assert_eq!(y.offset, MIB);
    assert_eq!(y.reuse, None);
    assert_eq!(e.reserved(), 2 * G);
    assert_eq!(b.maps, 2);
    // a free tagged own block at the end extends too, reported as same-stream
    free(&mut e, &y, 0, 1);
    let z = alloc(&mut e, &mut b, &o, 4 * MIB, 0);
    assert_eq!(z.offset, MIB);
    assert_eq!(z.reuse, Some(ReuseKind::SameStream));
    assert_eq!(e.reserved(), 3 * G);
    // not eligible (other stream, no rule): a new run instead
    free(&mut e, &z, 5, 1);
    let w = alloc(&mut e, &mut b, &o, 6 * MIB, 0);
    assert_eq!(w.offset, 6 * MIB);
    assert_eq!(w.reuse, None);
    let _ = x;
}

#[test]
fn growth_extends_leftwards_into_a_hole() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::complete();
    let a = alloc(&mut e, &mut b, &o, G, 0);
    let c = alloc(&mut e, &mut b, &o, G, 0);
    let d = alloc(&mut e, &mut b, &o, G, 0);
    // unmap a's granule: release it
    free(&mut e, &a, 0, 1);
    assert_eq!(e.release(0, &o, &mut b).unwrap(), G);
    e.check_invariants().unwrap();
    // c freed: free block at [G, 2G) with a hole before it
    free(&mut e, &c, 0, 2);
    let big = alloc(&mut e, &mut b, &o, G + MIB, 0);
    e.check_invariants().unwrap();
    // either way only one granule is mapped; the lowest address wins the tie
    assert_eq!(e.reserved(), 3 * G);
    // extended leftwards: the block ends where the free block ended
    assert_eq!(big.offset, MIB);
    assert_eq!(big.reuse, Some(ReuseKind::SameStream));
    let _ = d;
}

#[test]
fn out_of_memory_then_recovery() {
    let mut e = engine(64 * G);
    let mut b = backing().with_capacity(4 * G);
    let mut o = TestOrder::default();
    let xs: Vec<_> = (0..4).map(|_| alloc(&mut e, &mut b, &o, G, 0)).collect();
    let before: Vec<_> = e.blocks().collect();
    let err = e.alloc(1, 512, 0, &o, &mut b).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(ref i) if i.requested == 1 && i.rounded == 512));
    assert_eq!(e.blocks().collect::<Vec<_>>(), before);
    e.check_invariants().unwrap();
    // a free on another stream, incomplete: still OOM, and not released
    free(&mut e, &xs[0], 1, 5);
    assert!(matches!(e.alloc(2 * G, 512, 0, &o, &mut b), Err(AllocError::OutOfMemory(_))));
    assert_eq!(e.reserved(), 4 * G);
    // complete: the OOM path releases it and retries
    o.complete_bound.insert(1, 6);
    free(&mut e, &xs[1], 1, 5);
    let y = alloc(&mut e, &mut b, &o, 2 * G, 0);
    assert_eq!(y.reuse, None);
    assert_eq!(e.reserved(), 4 * G);
    assert_eq!(e.stats().ooms, 2);
}

#[test]
fn failed_map_rolls_back() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 3000, 0);
    let before: Vec<_> = e.blocks().collect();
    let stats = e.stats();
    b.fail_next_map = Some(BackingError::Driver(Injected));
    assert_eq!(e.alloc(3 * G, 512, 0, &o, &mut b), Err(AllocError::Backing(Injected)));
    e.check_invariants().unwrap();
    assert_eq!(e.blocks().collect::<Vec<_>>(), before);
    assert_eq!(e.stats(), stats);
    // and it still works
    let y = alloc(&mut e, &mut b, &o, 3 * G, 0);
    assert_eq!(y.offset, 3072);
    let _ = x;
}

#[test]
fn segment_policy() {
    let mut e = engine(1024 * G);
    let mut b = backing();
    let o = TestOrder::complete();
    // 64 MiB: segments of 16 MiB
    let x = alloc(&mut e, &mut b, &o, 64 * MIB, 0);
    assert_eq!(b.mappings().map(|(_, size)| size).collect::<Vec<_>>(), vec![16 * MIB; 4]);
    // capped at one granule
    e.set_max_segment(1);
    let y = alloc(&mut e, &mut b, &o, 8 * MIB, 0);
    assert_eq!(b.mappings().count(), 8);
    // a fully free granule inside a partly used block can be released
    free(&mut e, &y, 0, 1);
    let z = alloc(&mut e, &mut b, &o, MIB, 0);
    assert_eq!(z.offset, y.offset);
    assert_eq!(e.release(0, &o, &mut b).unwrap(), 3 * G);
    e.check_invariants().unwrap();
    assert_eq!(e.reserved(), 64 * MIB + G);
    // a map failure in the middle of a multi-segment growth unmaps what it mapped
    e.set_max_segment(0);
    b.capacity = Some(b.total() + 40 * MIB);
    let before: Vec<_> = e.blocks().collect();
    let maps = b.maps;
    assert!(matches!(e.alloc(64 * MIB, 512, 0, &o, &mut b), Err(AllocError::OutOfMemory(_))));
    assert!(b.maps > maps, "some segments were mapped before the failure");
    assert_eq!(b.total(), e.reserved());
    assert_eq!(e.blocks().collect::<Vec<_>>(), before);
    e.check_invariants().unwrap();
    let _ = (x, z);
}

#[test]
fn segments_are_at_least_a_512th_of_the_reserved_memory() {
    let mut e = engine(16 * 1024 * MIB);
    let mut b = backing();
    let o = TestOrder::default();
    let small = alloc(&mut e, &mut b, &o, 32 * MIB, 0);
    assert_eq!(b.maps, 4, "a small pool maps a growth as four segments");
    let big = alloc(&mut e, &mut b, &o, 8192 * MIB, 0);
    // Requests served from cache, so that the next growth is not part of a burst.
    free(&mut e, &small, 0, 1);
    let pieces: Vec<_> = (0..GROWTH_BURST).map(|_| alloc(&mut e, &mut b, &o, MIB, 0)).collect();
    let maps = b.maps;
    // 8224 MiB reserved: segments of at least 16.06 MiB, so a 64 MiB growth is three
    // segments of whole granules (22, 22 and 20 MiB), not four of 16 MiB.
    let x = alloc(&mut e, &mut b, &o, 64 * MIB, 0);
    assert_eq!(b.maps - maps, 3);
    let sizes: Vec<u64> =
        b.mappings().filter(|&(off, _)| off >= x.offset).map(|(_, size)| size).collect();
    assert_eq!(sizes, [22 * MIB, 22 * MIB, 20 * MIB]);
    assert_eq!(e.stats().mapped_segments, b.mappings().count() as u64);
    let _ = (big, x, pieces);
}

/// What the contract states: a growth of `n` granules is mapped as `min(segments per
/// growth, n)` segments on a pool below 512 granules, whatever its size and alignment —
/// one driver call per growth with one segment per growth.
#[test]
fn a_growth_makes_as_many_map_calls_as_it_has_segments() {
    for (per_growth, mib, calls) in [
        (4, 2, 1),
        (4, 6, 3),
        (4, 10, 4),
        (4, 12, 4),
        (4, 14, 4),
        (4, 24, 4),
        (4, 100, 4),
        (1, 6, 1),
        (1, 10, 1),
        (1, 24, 1),
        (1, 100, 1),
        (1, 1000, 1),
    ] {
        let mut e = engine(1024 * G);
        e.set_segments_per_growth(per_growth);
        let mut b = backing();
        let o = TestOrder::default();
        // An unaligned start: a block of one granule first.
        alloc(&mut e, &mut b, &o, G, 0);
        let before = b.maps;
        alloc(&mut e, &mut b, &o, mib * MIB, 0);
        assert_eq!(b.maps - before, calls, "{mib} MiB with {per_growth} per growth");
        let sizes: Vec<u64> = b.mappings().skip(1).map(|(_, size)| size).collect();
        let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(max - min <= G, "segments of equal size in whole granules: {sizes:?}");
    }
}

#[test]
fn the_consistency_check_catches_stale_segment_boundaries() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    e.segments_per_growth = 4;
    let x = alloc(&mut e, &mut b, &o, 4 * G, 0);
    e.check_invariants().unwrap();
    // A planted bug: a boundary between two of x's segments goes missing.
    e.bounds.clear(1);
    assert!(e.check_invariants().unwrap_err().contains("boundaries"));
    e.bounds.set(1);
    e.bounds.set(7);
    assert!(e.check_invariants().unwrap_err().contains("boundaries"));
    let _ = x;
}

/// A 32 MiB block (four 8 MiB segments) is freed behind a live separator and a 1 MiB block
/// lands at its start: 30 MiB of whole granules are free, but only 24 MiB in whole segments.
/// Then a 40 MiB request grows beyond the high and recycling comes up short.
fn recycling_short_of_whole_segments(e: &mut Engine, b: &mut FakeBacking, o: &TestOrder) {
    let maps = b.maps;
    let a = alloc(e, b, o, 32 * MIB, 0);
    assert_eq!(b.maps - maps, 4, "a growth of 32 MiB is four segments");
    let _separator = alloc(e, b, o, 2 * MIB, 0);
    free(e, &a, 0, 1);
    let p = alloc(e, b, o, MIB, 0);
    assert_eq!(p.offset, a.offset, "best fit puts the small block at the freed block's start");
    alloc(e, b, o, 40 * MIB, 0);
}

#[test]
fn recycling_short_of_whole_segments_refines_later_growths() {
    let o = TestOrder::complete();
    let mut adaptive = recycling_engine(1 << 30);
    let mut fixed = recycling_engine(1 << 30);
    fixed.set_segments_per_growth(4);
    let (mut maps_of_next_growth, mut boosts) = (Vec::new(), Vec::new());
    for e in [&mut adaptive, &mut fixed] {
        let mut b = backing();
        recycling_short_of_whole_segments(e, &mut b, &o);
        // The three whole free segments were recycled; the partly live one could not be.
        assert_eq!(e.stats().unmap_calls, 3);
        boosts.push(e.split_boost);
        let before = b.maps;
        alloc(e, &mut b, &o, 64 * MIB, 0);
        maps_of_next_growth.push(b.maps - before);
    }
    assert_eq!(boosts, [1, 0], "one shortfall doubles the segments per growth, unless fixed");
    assert!(
        maps_of_next_growth[0] > maps_of_next_growth[1],
        "finer segments after the shortfall: {maps_of_next_growth:?}"
    );
}

#[test]
fn frees_not_complete_do_not_refine_segments() {
    // Nothing freed can be recycled: finer segments would not have helped.
    let o = TestOrder::default();
    let mut e = recycling_engine(1 << 30);
    recycling_short_of_whole_segments(&mut e, &mut backing(), &o);
    assert_eq!(e.stats().unmap_calls, 0);
    assert_eq!(e.split_boost, 0);
}

#[test]
fn segments_are_not_refined_when_the_pool_is_close_to_its_live_bytes() {
    // The same shortfall, next to 2 GiB of live memory: what the growth leaves mapped
    // beyond the live bytes is below 1/64 of them.
    let o = TestOrder::complete();
    let mut e = recycling_engine(8 << 30);
    let mut b = backing();
    alloc(&mut e, &mut b, &o, 2 << 30, 0);
    recycling_short_of_whole_segments(&mut e, &mut b, &o);
    assert_eq!(e.stats().unmap_calls, 3, "recycling fell short as before");
    assert_eq!(e.split_boost, 0);
}

#[test]
fn the_free_block_a_growth_extends_does_not_refine_segments() {
    // The only free granules are in the block the 40 MiB request extends into the hole
    // above it: recycling must not touch them, and finer segments would not change that.
    let o = TestOrder::complete();
    let mut e = recycling_engine(1 << 30);
    let mut b = backing();
    let a = alloc(&mut e, &mut b, &o, 32 * MIB, 0);
    free(&mut e, &a, 0, 1);
    alloc(&mut e, &mut b, &o, MIB, 0);
    let big = alloc(&mut e, &mut b, &o, 40 * MIB, 0);
    assert_eq!(big.offset, MIB, "the free block was extended");
    assert_eq!(e.stats().unmap_calls, 0);
    assert_eq!(e.split_boost, 0);
}

#[test]
fn a_growth_in_a_burst_maps_ahead() {
    let mut e = engine(4096 * G);
    let mut b = backing();
    let o = TestOrder::default();
    // The first growth follows none: exactly what it needs.
    let base = alloc(&mut e, &mut b, &o, 128 * G, 0);
    assert_eq!(e.reserved(), 128 * G);
    // Right after it: at least 1/64 of the reserved high, 2 granules for 1 MiB.
    let x = alloc(&mut e, &mut b, &o, MIB, 0);
    assert_eq!(e.reserved(), 130 * G);
    // The next requests take what was mapped ahead.
    let maps = b.maps;
    let small: Vec<_> = (0..GROWTH_BURST).map(|_| alloc(&mut e, &mut b, &o, MIB / 2, 0)).collect();
    assert_eq!(b.maps, maps);
    // More than GROWTH_BURST allocations after the last growth: exactly what is missing.
    let before = e.reserved();
    let y = alloc(&mut e, &mut b, &o, 3 * G, 0);
    assert!(e.reserved() - before <= 3 * G, "{}", e.reserved() - before);
    let _ = (base, x, small, y);
}

#[test]
fn a_burst_that_the_device_cannot_hold_maps_what_the_request_needs() {
    let mut e = engine(4096 * G);
    let mut b = backing().with_capacity(129 * G);
    let o = TestOrder::default();
    let base = alloc(&mut e, &mut b, &o, 128 * G, 0);
    // A 2-granule chunk does not fit the device; the request's one granule does.
    let x = alloc(&mut e, &mut b, &o, MIB, 0);
    assert_eq!(e.reserved(), 129 * G);
    assert_eq!(e.stats().ooms, 0);
    let _ = (base, x);
}
