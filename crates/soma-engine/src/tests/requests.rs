//! Requests: validation, rounding, alignment, the reuse rules and their order, block ids,
//! lookup, relocation and the counters.

use super::*;
use crate::*;

#[test]
fn basic_alloc_free_reuse() {
    let mut e = engine(64 * MIB);
    let mut b = backing();
    let o = TestOrder::default();
    let a = e.alloc(1000, 512, 0, &o, &mut b).unwrap();
    assert_eq!(a.offset, 0);
    assert_eq!(a.size, 1024);
    assert_eq!(a.reuse, None);
    assert_eq!(e.reserved(), G);
    assert_eq!(e.used(), 1024);
    e.check_invariants().unwrap();
    e.free(a.block, tag(0, 1)).unwrap();
    e.check_invariants().unwrap();
    let a2 = e.alloc(1000, 512, 0, &o, &mut b).unwrap();
    assert_eq!(a2.offset, 0);
    assert_eq!(a2.reuse, Some(ReuseKind::SameStream));
    e.check_invariants().unwrap();
    assert_eq!(b.maps, 1);
}

#[test]
fn config_validation() {
    let ok = EngineConfig::new(8 * G, G);
    assert!(Engine::new(ok).is_ok());
    assert!(Engine::new(EngineConfig { granularity: 3 * MIB, ..ok }).is_err());
    assert!(Engine::new(EngineConfig { alignment: 16, ..ok }).is_err());
    assert!(Engine::new(EngineConfig { alignment: 1000, ..ok }).is_err());
    assert!(Engine::new(EngineConfig { alignment: 4 * G, ..ok }).is_err());
    assert!(Engine::new(EngineConfig { range_size: 0, ..ok }).is_err());
    assert!(Engine::new(EngineConfig { range_size: G + 512, ..ok }).is_err());
    assert!(Engine::new(EngineConfig { range_size: MAX_RANGE, ..ok }).is_ok());
    assert!(Engine::new(EngineConfig { range_size: MAX_RANGE + G, ..ok }).is_err());
    let e = Engine::new(ok).unwrap();
    assert_eq!(e.config(), &ok);
    e.check_invariants().unwrap();
    assert_eq!(e.blocks().count(), 1);
}

#[test]
fn round_size_rules() {
    let e = engine(8 * G);
    assert_eq!(e.round_size(1, 512), Some(512));
    assert_eq!(e.round_size(512, 512), Some(512));
    assert_eq!(e.round_size(513, 512), Some(1024));
    assert_eq!(e.round_size(513, 4096), Some(4096));
    assert_eq!(e.round_size(100, 1), Some(512));
    assert_eq!(e.round_size(0, 512), None);
    assert_eq!(e.round_size(u64::MAX, 512), None);
    assert_eq!(e.round_size(100, 3), None);
    assert_eq!(e.round_size(100, 0), None);
    assert_eq!(e.round_size(100, 2 * G), None);
}

#[test]
fn bad_sizes_and_alignments() {
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    assert!(matches!(e.alloc(0, 512, 0, &o, &mut b), Err(AllocError::InvalidSize(_))));
    assert!(matches!(e.alloc(u64::MAX, 512, 0, &o, &mut b), Err(AllocError::InvalidSize(_))));
    assert!(matches!(e.alloc(8 * G + 1, 512, 0, &o, &mut b), Err(AllocError::InvalidSize(_))));
    assert!(matches!(e.alloc(1, 3, 0, &o, &mut b), Err(AllocError::InvalidAlignment(_))));
    assert!(matches!(e.alloc(1, 0, 0, &o, &mut b), Err(AllocError::InvalidAlignment(_))));
    assert!(matches!(e.alloc(1, 2 * G, 0, &o, &mut b), Err(AllocError::InvalidAlignment(_))));
    assert_eq!(e.stats().allocs, 0);
    assert_eq!(e.stats().ooms, 0);
    assert_eq!(b.maps, 0);
    // the whole range is allowed
    let a = e.alloc(8 * G, 512, 0, &o, &mut b).unwrap();
    assert_eq!((a.offset, a.size), (0, 8 * G));
    e.check_invariants().unwrap();
}

#[test]
fn alignment_is_honoured_and_kept() {
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let small = alloc(&mut e, &mut b, &o, 512, 0);
    assert_eq!(small.offset, 0);
    let big = e.alloc(5000, 64 * 1024, 0, &o, &mut b).unwrap();
    e.check_invariants().unwrap();
    assert_eq!(big.offset % (64 * 1024), 0);
    assert_eq!(big.size, 64 * 1024);
    let g = e.alloc(100, G, 0, &o, &mut b).unwrap();
    assert_eq!(g.offset % G, 0);
    assert_eq!(g.size, G);
    let tiny = e.alloc(1, 1, 0, &o, &mut b).unwrap();
    assert_eq!(tiny.size, 512);
    assert_eq!(tiny.offset % 512, 0);
    // free the aligned block, then ask again: the same aligned place is reused
    free(&mut e, &big, 0, 1);
    let again = e.alloc(5000, 64 * 1024, 0, &o, &mut b).unwrap();
    assert_eq!(again.offset % (64 * 1024), 0);
    assert_eq!(again.reuse, Some(ReuseKind::SameStream));
    e.check_invariants().unwrap();
}

#[test]
fn same_stream_hot_path_finds_the_just_freed_block() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    // Many free blocks of assorted sizes around.
    let mut keep = Vec::new();
    let mut holes = Vec::new();
    for i in 0..200u64 {
        let a = alloc(&mut e, &mut b, &o, 512 * (1 + (i * 7) % 97), 0);
        if i % 2 == 0 {
            holes.push(a);
        } else {
            keep.push(a);
        }
    }
    for a in &holes {
        free(&mut e, a, 0, 1);
    }
    let size = 77 * 512 + 100;
    let mut x = alloc(&mut e, &mut b, &o, size, 0);
    let first = x.offset;
    for round in 0..50 {
        free(&mut e, &x, 0, 2 + round);
        x = alloc(&mut e, &mut b, &o, size, 0);
        assert_eq!(x.offset, first, "round {round}");
        assert_eq!(x.reuse, Some(ReuseKind::SameStream));
    }
    assert_eq!(keep.len(), 100);
}

#[test]
fn other_stream_blocks_need_a_rule() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    let _filler = fill_granule(&mut e, &mut b, &o);
    let a = alloc(&mut e, &mut b, &o, G, 1);
    let a_off = a.offset;
    free(&mut e, &a, 1, 10);
    // stream 2, no rule: fresh memory elsewhere
    let x = alloc(&mut e, &mut b, &o, G, 2);
    assert_ne!(x.offset, a_off);
    assert_eq!(x.reuse, None);
    free(&mut e, &x, 2, 1);
    // bound exactly at pos gives no right
    for (field, kind) in [
        (0, ReuseKind::HostSynchronized),
        (1, ReuseKind::EventDependency),
        (2, ReuseKind::Opportunistic),
    ] {
        let mut oo = o.clone();
        let m = match field {
            0 => &mut oo.host_observed,
            1 => &mut oo.event,
            _ => &mut oo.completed,
        };
        m.insert(1, 10);
        let y = alloc(&mut e, &mut b, &oo, G, 3);
        assert_ne!(y.offset, a_off, "{kind:?} at pos == bound");
        free(&mut e, &y, 7, 1);
        let m = match field {
            0 => &mut oo.host_observed,
            1 => &mut oo.event,
            _ => &mut oo.completed,
        };
        m.insert(1, 11);
        let y = alloc(&mut e, &mut b, &oo, G, 3);
        assert_eq!(y.offset, a_off, "{kind:?} above pos");
        assert_eq!(y.reuse, Some(kind));
        assert_eq!(y.dependency, None);
        free(&mut e, &y, 1, 10); // back onto stream 1 at the same pos
                                 // stream 3's own fresh-run block must not be preferred next time
        let own = alloc(&mut e, &mut b, &o, G, 3);
        free(&mut e, &own, 7, 1);
    }
    // precedence of kinds when several rules hold
    o.host_observed.insert(1, 11);
    o.event.insert(1, 11);
    o.completed.insert(1, 11);
    let y = alloc(&mut e, &mut b, &o, G, 3);
    assert_eq!(y.reuse, Some(ReuseKind::HostSynchronized));
    let s = e.stats();
    assert_eq!(s.reuses[ReuseKind::HostSynchronized.index()], 2);
    assert_eq!(s.reuses[ReuseKind::EventDependency.index()], 1);
    assert_eq!(s.reuses[ReuseKind::Opportunistic.index()], 1);
}

#[test]
fn internal_dependency_only_when_growth_fails() {
    let mut e = engine(64 * G);
    let mut b = backing().with_capacity(2 * G);
    let mut o = TestOrder::default();
    let _filler = fill_granule(&mut e, &mut b, &o);
    let a = alloc(&mut e, &mut b, &o, G, 1);
    free(&mut e, &a, 1, 7);
    // switch off: out of memory, reported as pending on stream 1
    let err = e.alloc(G, 512, 2, &o, &mut b).unwrap_err();
    let AllocError::OutOfMemory(info) = err else { panic!("{err:?}") };
    assert_eq!(info.pending_bytes, G);
    assert_eq!(info.pending.len(), 1);
    assert_eq!(info.pending[0], PendingFrees { stream: 1, bytes: G, max_pos: 7 });
    assert_eq!(info.largest_free_block, G);
    assert_eq!((info.used, info.reserved, info.max), (G, 2 * G, 64 * G));
    assert_eq!(e.stats().ooms, 1);
    e.check_invariants().unwrap();
    // switch on: the block comes with the dependency
    o.internal = true;
    let y = alloc(&mut e, &mut b, &o, G, 2);
    assert_eq!(y.offset, a.offset);
    assert_eq!(y.reuse, Some(ReuseKind::InternalDependency));
    assert_eq!(y.dependency, Some(tag(1, 7)));
    // with room to grow, growth is preferred over a dependency
    free(&mut e, &y, 1, 8);
    b.capacity = None;
    let z = alloc(&mut e, &mut b, &o, G, 2);
    assert_eq!(z.reuse, None);
    assert_eq!(z.dependency, None);
    // unless asked otherwise
    e.set_dependency_before_growth(true);
    let maps = b.maps;
    let w = alloc(&mut e, &mut b, &o, G, 2);
    assert_eq!(w.offset, a.offset);
    assert_eq!(w.dependency, Some(tag(1, 8)));
    assert_eq!(b.maps, maps);
}

#[test]
fn cross_stream_search_is_bounded_per_stream() {
    let mut e = engine(256 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    // 40 blocks of 64 KiB on stream 1, separated by live guards so they cannot coalesce;
    // the oldest (freed first, at pos 0) sits deepest in the LIFO list
    let mut guards = Vec::new();
    let blocks: Vec<_> = (0..40)
        .map(|_| {
            let a = alloc(&mut e, &mut b, &o, 65536, 1);
            guards.push(alloc(&mut e, &mut b, &o, 512, 1));
            a
        })
        .collect();
    for (i, a) in blocks.iter().enumerate() {
        free(&mut e, a, 1, 100 + i as u64);
    }
    // use up the untagged tail so that only stream 1's blocks are cached
    let rest = e.stats().free_bytes - e.stats().pending_bytes;
    let _filler = alloc(&mut e, &mut b, &o, rest, 9);
    // only the first-freed block is eligible for stream 2, behind 39 newer ones
    o.event.insert(1, 101);
    let x = alloc(&mut e, &mut b, &o, 65536, 2);
    assert_eq!(x.reuse, None, "beyond the budget of {CROSS_STREAM_BUDGET}: grows");
    let rest = e.stats().free_bytes - e.stats().pending_bytes;
    let _filler2 = alloc(&mut e, &mut b, &o, rest, 9);
    // with every block eligible (bound above max_pos), the O(1) path finds one at once
    o.event.insert(1, 1000);
    let y = alloc(&mut e, &mut b, &o, 65536, 2);
    assert_eq!(y.reuse, Some(ReuseKind::EventDependency));
    // all but the newest eligible: the second block examined is taken
    o.event.insert(1, 139);
    let z = alloc(&mut e, &mut b, &o, 65536, 2);
    assert_eq!(z.reuse, Some(ReuseKind::EventDependency));
}

#[test]
fn stale_ids_and_double_frees() {
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 4096, 0);
    let y = alloc(&mut e, &mut b, &o, 4096, 0);
    free(&mut e, &y, 0, 1);
    // y's record absorbed the fresh tail and survives: double free = NotLive
    assert_eq!(e.free(y.block, tag(0, 2)), Err(FreeError::NotLive));
    free(&mut e, &x, 0, 2);
    // y's record was merged into x's: unknown now
    assert_eq!(e.free(y.block, tag(0, 3)), Err(FreeError::UnknownBlock));
    assert_eq!(e.block(y.block), None);
    // a new allocation reusing x's record does not answer to x's id
    let x2 = alloc(&mut e, &mut b, &o, 4096, 0);
    assert_eq!(x2.offset, x.offset);
    assert_ne!(x2.block, x.block);
    assert_eq!(e.free(x.block, tag(0, 4)), Err(FreeError::UnknownBlock));
    assert_eq!(e.stats().frees, 2);
    e.check_invariants().unwrap();
}

#[test]
fn block_ids_are_one_word_and_round_trip_through_raw() {
    use crate::block::NIL;
    use crate::BlockId;
    assert_eq!(std::mem::size_of::<BlockId>(), 8);
    assert_eq!(std::mem::size_of::<Option<BlockId>>(), 8);
    for (idx, generation) in [(0, 1), (7, 1), (0, u32::MAX), (NIL - 1, u32::MAX), (NIL, 2)] {
        let id = BlockId::new(idx, generation);
        assert_eq!((id.index(), id.generation()), (idx, generation));
        assert_eq!(BlockId::from_raw(id.to_raw()), id);
        assert_eq!(id.to_raw(), (u64::from(generation) << 32) | u64::from(idx));
    }
    // The word 0 (record 0, generation 0: never a live block's id) names no block, before
    // and after the mapping.
    let none = BlockId::from_raw(0);
    assert_eq!((none.index(), none.generation()), (NIL, 0));
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 4096, 0);
    assert_eq!(e.free(none, tag(0, 1)), Err(FreeError::UnknownBlock));
    assert_eq!(e.block(none), None);
    assert_eq!(e.free(BlockId::from_raw(x.block.to_raw()), tag(0, 2)), Ok(()));
    e.check_invariants().unwrap();
}

#[test]
fn lookup_by_offset() {
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 1000, 0);
    let y = alloc(&mut e, &mut b, &o, 3000, 0);
    assert_eq!(e.lookup(x.offset), Some((x.block, 1024)));
    assert_eq!(e.lookup(y.offset), Some((y.block, 3072)));
    assert_eq!(e.lookup(y.offset + 512), None);
    free(&mut e, &x, 0, 1);
    assert_eq!(e.lookup(x.offset), None);
    let mut cfg = *e.config();
    cfg.index_by_offset = false;
    let mut e2 = Engine::new(cfg).unwrap();
    let z = e2.alloc(1000, 512, 0, &o, &mut backing()).unwrap();
    assert_eq!(e2.lookup(z.offset), None);
}

#[test]
fn relocate_lower_moves_into_eligible_lower_space() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let mut o = TestOrder::default();
    let a = alloc(&mut e, &mut b, &o, 8192, 0);
    let c = alloc(&mut e, &mut b, &o, 8192, 0);
    let d = alloc(&mut e, &mut b, &o, 8192, 0);
    // nothing lower for a
    assert_eq!(e.relocate_lower(a.block, 0, &o), None);
    free(&mut e, &a, 1, 4);
    // a's space is on stream 1, not eligible for stream 0
    assert_eq!(e.relocate_lower(d.block, 0, &o), None);
    o.event.insert(1, 5);
    let r = e.relocate_lower(d.block, 0, &o).unwrap();
    e.check_invariants().unwrap();
    assert_eq!(r.offset, 0);
    assert_eq!(r.size, 8192);
    assert_eq!(r.reuse, Some(ReuseKind::EventDependency));
    free(&mut e, &d, 0, 9);
    // space above is never used
    assert_eq!(e.relocate_lower(c.block, 0, &o), None);
    // not live
    assert_eq!(e.relocate_lower(d.block, 0, &o), None);
    // alignment is kept
    let big = e.alloc(4096, 65536, 0, &o, &mut b).unwrap();
    let filler: Vec<_> = (0..40).map(|_| alloc(&mut e, &mut b, &o, 65536, 0)).collect();
    free(&mut e, &filler[10], 0, 20);
    let moved = e.relocate_lower(filler[30].block, 0, &o).unwrap();
    assert_eq!(moved.offset, filler[10].offset);
    let _ = (big, c);
}

#[test]
fn relocate_lower_mapping_maps_the_unmapped_space_below_and_moves_there() {
    let mut e = engine(8 * G);
    let mut b = backing();
    let o = TestOrder::default();
    // [0, 4G): granule blocks of stream 0, the second released (unmapped).
    let blocks = granules_around_a_hole(&mut e, &mut b, &o, 4, 1);
    let maps = b.maps;
    // Mapped free space below does not fit the last block: only mapping does.
    assert_eq!(e.relocate_lower(blocks[3].block, 0, &o), None);
    let r = e.relocate_lower_mapping(blocks[3].block, 0, &o, &mut b).unwrap().unwrap();
    e.check_invariants().unwrap();
    assert_eq!((r.offset, r.size, r.reuse), (G, G, None));
    assert_eq!(b.maps, maps + 1, "one granule mapped");
    // Nothing below the first block: nothing mapped.
    assert_eq!(e.relocate_lower_mapping(blocks[0].block, 0, &o, &mut b).unwrap(), None);
    assert_eq!(b.maps, maps + 1);

    // Unmapped space next to another stream's free block that is not eligible: the run
    // starts after it.
    let mut e = engine(8 * G);
    let mut b = backing();
    let blocks = granules_around_a_hole(&mut e, &mut b, &o, 4, 1);
    free(&mut e, &blocks[0], 1, 7);
    let r = e.relocate_lower_mapping(blocks[3].block, 0, &o, &mut b).unwrap().unwrap();
    e.check_invariants().unwrap();
    assert_eq!(r.offset, G, "stream 1's free block at 0 is not eligible for stream 0");

    // An eligible free block and the hole after it together.
    let mut e = engine(8 * G);
    let mut b = backing();
    let blocks = granules_around_a_hole(&mut e, &mut b, &o, 4, 1);
    let big = alloc(&mut e, &mut b, &o, 2 * G, 0);
    assert_eq!(big.offset, 4 * G);
    free(&mut e, &blocks[0], 0, 7);
    let r = e.relocate_lower_mapping(big.block, 0, &o, &mut b).unwrap().unwrap();
    e.check_invariants().unwrap();
    assert_eq!((r.offset, r.reuse), (0, Some(ReuseKind::SameStream)));

    // A backing out of memory moves nothing and keeps the engine consistent.
    let mut e = engine(8 * G);
    let mut b = backing();
    let blocks = granules_around_a_hole(&mut e, &mut b, &o, 4, 1);
    b.capacity = Some(3 * G);
    assert_eq!(e.relocate_lower_mapping(blocks[3].block, 0, &o, &mut b).unwrap(), None);
    e.check_invariants().unwrap();
    assert_eq!(e.reserved(), 3 * G);
}

#[test]
fn stats_track_highs_and_counters() {
    let mut e = engine(64 * G);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 3 * G, 0);
    let y = alloc(&mut e, &mut b, &o, 512, 0);
    free(&mut e, &x, 0, 1);
    let s = e.stats();
    assert_eq!(s.used, 512);
    assert_eq!(s.used_high, 3 * G + 512);
    assert_eq!(s.reserved, 4 * G);
    assert_eq!(s.reserved_high, 4 * G);
    assert_eq!(s.live_blocks, 1);
    assert_eq!(s.live_blocks_high, 2);
    assert_eq!((s.allocs, s.frees, s.fresh_allocs), (2, 1, 2));
    // 3 granules as segments of max(6 MiB / 4, 2 MiB) = 2 MiB, then one more granule
    assert_eq!(s.map_calls, 4);
    assert_eq!(s.mapped_segments, 4);
    assert_eq!(s.bytes_mapped_total, 4 * G);
    assert_eq!(s.free_bytes, 4 * G - 512);
    assert_eq!(s.pending_bytes, 3 * G);
    assert_eq!(s.largest_free_block, 3 * G);
    e.reset_used_high();
    assert_eq!(e.stats().used_high, 512);
    e.reset_reserved_high();
    assert_eq!(e.stats().reserved_high, 4 * G);
    let _ = y;
}

#[test]
fn engine_is_send() {
    fn is_send<T: Send>() {}
    is_send::<Engine>();
}

/// Rough host cost of the hot paths (run with `--release --ignored --nocapture`).
#[test]
#[ignore = "timing, not a check"]
fn hot_path_timing() {
    for index in [true, false] {
        hot_path_timing_with(index);
    }
}

fn hot_path_timing_with(index: bool) {
    let mut e =
        Engine::new(EngineConfig { index_by_offset: index, ..EngineConfig::new(1024 * G, G) })
            .unwrap();
    let mut b = backing();
    let o = TestOrder::default();
    let keep: Vec<_> =
        (0..1000).map(|i| e.alloc(512 * (1 + i % 300), 512, 0, &o, &mut b).unwrap()).collect();
    for a in keep.iter().step_by(2) {
        e.free(a.block, tag(0, 1)).unwrap();
    }
    let n = 1_000_000u64;
    let t = std::time::Instant::now();
    for i in 0..n {
        let a = e.alloc(4096, 512, 0, &o, &mut b).unwrap();
        e.free(a.block, tag(0, i + 2)).unwrap();
    }
    let same = t.elapsed().as_nanos() as f64 / n as f64;
    let t = std::time::Instant::now();
    let mut ring = std::collections::VecDeque::new();
    for i in 0..n {
        let size = 512 * (1 + (i * 7919) % 4000);
        ring.push_back(e.alloc(size, 512, (i % 4) as u32, &o, &mut b).unwrap());
        if ring.len() > 64 {
            let a = ring.pop_front().unwrap();
            e.free(a.block, tag((i % 4) as u32, i + 2)).unwrap();
        }
    }
    let mixed = t.elapsed().as_nanos() as f64 / n as f64;
    e.check_invariants().unwrap();
    println!(
        "index_by_offset {index}: same-size alloc+free {same:.1} ns; \
         mixed sizes on 4 streams alloc+free {mixed:.1} ns"
    );
    println!("{:?}", e.stats());
}
