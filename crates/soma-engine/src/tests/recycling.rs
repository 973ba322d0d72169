//! Recycling on growth: which segments it unmaps, in which order, and when it pauses.

use super::*;
use crate::*;

#[test]
fn recycling_unmaps_complete_free_segments_before_mapping() {
    let mut e = recycling_engine(64 * G);
    e.segments_per_growth = 1;
    let mut b = backing();
    let mut o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 2 * G, 0);
    let guard = alloc(&mut e, &mut b, &o, G, 0);
    free(&mut e, &x, 0, 1);
    assert_eq!(e.reserved(), 3 * G);
    // incomplete: not recycled, reserved grows
    let y = alloc(&mut e, &mut b, &o, 3 * G, 0);
    assert_eq!(e.reserved(), 6 * G);
    assert_eq!(e.stats().unmap_calls, 0);
    free(&mut e, &y, 0, 2);
    // complete: y's block is extended by one granule, and x's segment is recycled for it
    o.complete_bound.insert(0, 3);
    let z = alloc(&mut e, &mut b, &o, 4 * G, 0);
    assert_eq!(z.offset, y.offset);
    assert_eq!(z.reuse, Some(ReuseKind::SameStream));
    assert_eq!(e.stats().unmap_calls, 1);
    assert_eq!(e.reserved(), 5 * G);
    assert_eq!(b.total(), 5 * G);
    free(&mut e, &z, 0, 3);
    // complete, but stream 1 has no rule that lets it reuse stream 0's memory: recycling
    // would hand it z's addresses, so it maps fresh memory instead
    o.complete_bound.insert(0, 4);
    let w1 = alloc(&mut e, &mut b, &o, 5 * G, 1);
    assert_eq!(w1.reuse, None);
    assert_ne!(w1.offset, y.offset);
    assert_eq!(e.stats().unmap_calls, 1);
    free(&mut e, &w1, 1, 1);
    o.complete_bound.insert(1, 2);
    // once the host has observed z's free, a fresh run elsewhere recycles z's segments (y's
    // 6 MiB were mapped as power-of-two aligned segments [6M, 8M) and [8M, 12M)) and lands
    // in the space they left
    o.host_observed.insert(0, 4);
    o.host_observed.insert(1, 2);
    let high = e.stats().reserved_high;
    let w = alloc(&mut e, &mut b, &o, 5 * G, 2);
    // served from cached memory (extended) or recycled: the reserved peak does not grow
    assert_eq!(e.stats().reserved_high, high, "{w:?}");
    assert_eq!(b.total(), e.reserved());
    let _ = guard;
}

#[test]
fn without_recycling_growth_only_maps() {
    for recycle in [true, false] {
        let mut e = recycling_engine(64 * G);
        e.segments_per_growth = 1;
        e.set_recycle_on_growth(recycle);
        let mut b = backing();
        let mut o = TestOrder::default();
        let x = alloc(&mut e, &mut b, &o, 2 * G, 0);
        let guard = alloc(&mut e, &mut b, &o, G, 0);
        free(&mut e, &x, 0, 1);
        o.complete_bound.insert(0, 2);
        // x's two granules are free and complete; a 3-granule request cannot use them
        let y = alloc(&mut e, &mut b, &o, 3 * G, 0);
        if recycle {
            assert_eq!(e.stats().unmap_calls, 1, "x's segment makes room for y");
            assert_eq!(e.stats().reserved_high, 4 * G);
        } else {
            assert_eq!(e.stats().unmap_calls, 0, "growth never unmaps");
            assert_eq!(e.reserved(), 6 * G);
            // x's cached granules are still there for a request that fits
            let maps = e.stats().map_calls;
            let x2 = alloc(&mut e, &mut b, &o, 2 * G, 0);
            assert_eq!(x2.offset, x.offset);
            assert_eq!(x2.reuse, Some(ReuseKind::SameStream));
            assert_eq!(e.stats().map_calls, maps);
        }
        assert_eq!(b.total(), e.reserved());
        let _ = (guard, y);
    }
}

#[test]
fn without_recycling_memory_pressure_still_releases() {
    let mut e = recycling_engine(64 * G);
    e.segments_per_growth = 1;
    e.set_recycle_on_growth(false);
    let mut b = backing().with_capacity(4 * G);
    let mut o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 2 * G, 0);
    let _guard = alloc(&mut e, &mut b, &o, G, 0);
    free(&mut e, &x, 0, 1);
    o.complete_bound.insert(0, 2);
    // 3 granules mapped, capacity 4: the map of 3 more fails, x's segment is released and
    // the retry fits
    let y = alloc(&mut e, &mut b, &o, 3 * G, 0);
    assert_eq!(y.size, 3 * G);
    assert_eq!(e.stats().unmap_calls, 1);
    assert_eq!(e.reserved(), 4 * G);
}

#[test]
fn frees_split_between_streams_merge_once_observed_instead_of_recycling() {
    let mut e = recycling_engine(64 * G);
    e.segments_per_growth = 1;
    let mut b = backing();
    let mut o = TestOrder::default();
    // one 4 MiB segment holding two 2 MiB blocks, freed on two streams: they never merge
    let x = alloc(&mut e, &mut b, &o, 4 * MIB, 0);
    let guard = alloc(&mut e, &mut b, &o, G, 0);
    free(&mut e, &x, 0, 1);
    let y0 = alloc(&mut e, &mut b, &o, G, 0);
    let y1 = alloc(&mut e, &mut b, &o, G, 0);
    assert_eq!((y0.offset, y1.offset), (0, G));
    free(&mut e, &y0, 1, 5);
    free(&mut e, &y1, 2, 5);
    o.complete_bound.insert(1, 6);
    o.complete_bound.insert(2, 6);
    // complete but not reusable by stream 3 under any rule: not recycled
    let z0 = alloc(&mut e, &mut b, &o, 4 * MIB, 3);
    assert_eq!(z0.reuse, None);
    assert!(b.unmap_log.is_empty());
    // host-observed: before growing, a 4 MiB request on stream 4 settles the two 2 MiB
    // blocks, which merge and serve it: no unmap, no map
    o.host_observed.insert(1, 6);
    o.host_observed.insert(2, 6);
    let maps = b.maps;
    let z = alloc(&mut e, &mut b, &o, 4 * MIB, 4);
    assert_eq!((z.offset, z.reuse), (0, Some(ReuseKind::HostSynchronized)));
    assert!(b.unmap_log.is_empty(), "{:?}", b.unmap_log);
    assert_eq!(b.maps, maps);
    let _ = (z, z0, guard);
}

#[test]
fn recycling_takes_segments_of_the_smallest_free_blocks_first() {
    let mut e = recycling_engine(64 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    // [0, 2G) S: one 2-granule segment | guard | [3G, 7G) B: four 1-granule segments | guard
    // | [8G, 13G) T, at the end of the mapped space
    e.segments_per_growth = 1;
    let s = alloc(&mut e, &mut b, &o, 2 * G, 0);
    let g1 = alloc(&mut e, &mut b, &o, G, 0);
    e.segments_per_growth = 4;
    let big = alloc(&mut e, &mut b, &o, 4 * G, 0);
    e.segments_per_growth = 1;
    let g2 = alloc(&mut e, &mut b, &o, G, 0);
    let t = alloc(&mut e, &mut b, &o, 5 * G, 0);
    assert_eq!((s.offset, big.offset, t.offset), (0, 3 * G, 8 * G));
    free(&mut e, &s, 0, 1);
    free(&mut e, &big, 0, 2);
    free(&mut e, &t, 0, 3);
    o.complete_bound.insert(0, 4);
    assert_eq!(e.reserved(), 13 * G);
    // Fits no free block: T is extended by one granule, and one granule must be recycled.
    // The smallest segment that covers it is one of B's; the smallest free block is S.
    let maps = e.stats().map_calls;
    let x = alloc(&mut e, &mut b, &o, 5 * G + G / 2, 0);
    assert_eq!(x.offset, t.offset);
    assert_eq!(b.unmap_log, [(0, 2 * G)], "S is recycled, B stays whole");
    assert_eq!(e.reserved(), 12 * G);
    assert_eq!(e.stats().map_calls, maps + 1);
    // B still serves its size from the cache, without a driver call.
    let y = alloc(&mut e, &mut b, &o, 4 * G, 0);
    assert_eq!((y.offset, y.reuse), (big.offset, Some(ReuseKind::SameStream)));
    assert_eq!(e.stats().map_calls, maps + 1);
    let _ = (g1, g2);
}

proptest::proptest! {
    /// Recycling ends its scan early (one free list after the candidates cover the excess)
    /// and makes the same choices as scanning every list: random sequences of allocations and
    /// frees on several streams, every free complete and host-observed, replayed on two
    /// engines (most cases recycle dozens of segments). Ending the scan without regard to the
    /// excess fails it at once.
    #[test]
    fn recycling_ends_its_scan_early_without_changing_a_choice(
        ops in proptest::collection::vec((0u8..4, 1u64..(12 * MIB), 0u8..3), 1..250),
    ) {
        let mut engines = [recycling_engine(64 * G), recycling_engine(64 * G)];
        engines[1].recycle_scan_all = true;
        let mut backings = [backing(), backing()];
        let mut o = TestOrder::complete();
        for s in 0..3 {
            o.host_observed.insert(s, u64::MAX);
        }
        let mut live: [Vec<(Allocation, StreamSlot)>; 2] = [Vec::new(), Vec::new()];
        for (i, &(kind, bytes, stream)) in ops.iter().enumerate() {
            let s = StreamSlot::from(stream);
            for k in 0..2 {
                if kind == 0 && !live[k].is_empty() {
                    let (a, s) = live[k].swap_remove(bytes as usize % live[k].len());
                    engines[k].free(a.block, tag(s, i as u64 + 1)).unwrap();
                } else if let Ok(a) = engines[k].alloc(bytes, 512, s, &o, &mut backings[k]) {
                    live[k].push((a, s));
                }
            }
            proptest::prop_assert_eq!(&backings[0].unmap_log, &backings[1].unmap_log);
            proptest::prop_assert_eq!(
                live[0].iter().map(|(a, _)| a.offset).collect::<Vec<_>>(),
                live[1].iter().map(|(a, _)| a.offset).collect::<Vec<_>>()
            );
        }
        engines[0].check_invariants().unwrap();
    }
}

#[test]
fn recycling_pauses_beyond_one_growth_in_eight() {
    use crate::recycle::{RecycleRate, RECYCLE_BURST, RECYCLE_PAUSE, RECYCLE_WINDOW};
    let burst = RECYCLE_BURST as u64;
    let spacing = RECYCLE_WINDOW / burst;
    let mut r = RecycleRate::default();
    // `burst + 1` recycling growths spanning the whole window: not a burst.
    let mut t = 0;
    for i in 0..10 * burst {
        t = i * spacing;
        assert!(!r.record(t), "growth {i} at {t}");
        assert!(!r.paused(t));
    }
    // One allocation sooner: the last `burst + 1` fall within the window.
    t += spacing - 1;
    assert!(r.record(t));
    assert!(r.paused(t) && r.paused(t + RECYCLE_PAUSE - 1));
    assert!(!r.paused(t + RECYCLE_PAUSE));
    // After a pause the count starts again.
    let t0 = t + RECYCLE_PAUSE;
    for i in 0..burst {
        assert!(!r.record(t0 + i));
    }
    assert!(r.record(t0 + burst));
}

/// RMM's `random_allocations` on one stream (every free complete), small: sizes uniform in
/// `1..=max` bytes, allocating with probability 73 % while the live bytes stay under `cap`,
/// else freeing a random live allocation. Calls `each(engine, recycled)` after every
/// allocation with whether it unmapped memory to grow (an allocation on an empty engine may
/// also unmap to pack, see `pack_idle`: those count as not recycled).
fn random_churn(
    e: &mut Engine,
    b: &mut FakeBacking,
    allocs: usize,
    max: u64,
    cap: u64,
    mut each: impl FnMut(&Engine, bool),
) {
    let o = TestOrder::complete();
    let mut rng = TestRng::default();
    let (mut live, mut bytes, mut pos, mut done) = (Vec::new(), 0, 0, 0);
    while done < allocs {
        let size = rng.below(max) + 1;
        if rng.chance(73) && bytes + size <= cap {
            let (unmaps, empty) = (e.stats().unmap_calls, live.is_empty());
            let a = e.alloc(size, 512, 0, &o, b).unwrap();
            each(e, !empty && e.stats().unmap_calls > unmaps);
            bytes += a.size;
            live.push(a);
            done += 1;
        } else if !live.is_empty() {
            let a = live.swap_remove(rng.index(live.len()));
            pos += 1;
            e.free(a.block, tag(0, pos)).unwrap();
            bytes -= a.size;
        }
    }
    e.check_invariants().unwrap();
}

#[test]
fn chronic_recycling_pauses_and_the_reserved_high_rises() {
    use crate::recycle::{RECYCLE_BURST, RECYCLE_PAUSE, RECYCLE_WINDOW};
    let mut e = recycling_engine(1 << 40);
    let mut b = backing();
    // The allocation counts of the growths that recycled; when recycling paused, and the
    // reserved high-water mark then.
    let mut recycled_at = Vec::new();
    let mut paused: Option<(u64, u64)> = None;
    let mut churn = |e: &mut Engine, max: u64, recycled_at: &mut Vec<u64>| {
        random_churn(e, &mut b, 6000, max, 1024 * G, |e, recycled| {
            let now = e.stats().allocs - 1;
            if let Some((p, _)) = paused {
                assert!(!(recycled && now < p + RECYCLE_PAUSE), "recycled at {now}, paused at {p}");
            }
            if recycled {
                recycled_at.push(now);
            }
            if paused.is_none() && e.stats().recycling_pauses == 1 {
                paused = Some((now, e.stats().reserved_high));
            }
        });
        paused
    };
    let (p, high_at_pause) = churn(&mut e, 16 * G, &mut recycled_at).expect("recycling paused");
    // It paused at the first growth that ended a burst, not before.
    let before: Vec<u64> = recycled_at.iter().copied().take_while(|&t| t <= p).collect();
    let ends_burst =
        |i: usize| i >= RECYCLE_BURST && before[i] - before[i - RECYCLE_BURST] < RECYCLE_WINDOW;
    assert_eq!(before.last(), Some(&p));
    assert!(ends_burst(before.len() - 1));
    assert!(!(0..before.len() - 1).any(ends_burst));
    // Paused, growth mapped above the mark recycling had held.
    assert!(e.stats().reserved_high > high_at_pause);
    // The pause ends: the same churn on larger blocks (beside the live ones left) grows
    // above the new mark and recycles again.
    let recycled_before = recycled_at.len();
    churn(&mut e, 32 * G, &mut recycled_at);
    assert!(recycled_at[recycled_before..].iter().any(|&t| t >= p + RECYCLE_PAUSE));
    e.check_invariants().unwrap();
}

#[test]
fn paused_recycling_still_releases_under_memory_pressure() {
    // A backing 12 % larger than the live bytes: once recycling pauses, growth runs into the
    // capacity and releases idle memory anywhere (as without recycling), so every
    // allocation still succeeds.
    let mut e = recycling_engine(1 << 40);
    let mut b = backing().with_capacity(1150 * G);
    random_churn(&mut e, &mut b, 6000, 16 * G, 1024 * G, |_, _| {});
    assert!(e.stats().recycling_pauses >= 1, "{:?}", e.stats());
    assert_eq!(e.stats().ooms, 0);
    // Paused, growth ran into the capacity (unconstrained it reaches about 1.2x the live
    // bytes, see `chronic_recycling_pauses_and_the_reserved_high_rises`).
    assert_eq!(e.stats().reserved_high, 1150 * G);
}
