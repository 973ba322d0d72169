//! Stream shards (`MemPoolBuilder::stream_shards`): each stream allocates in its slot's
//! shard, reuse crosses shards under the same rules, and the pool's limit, counters,
//! threshold and trim stay the pool's as a whole.
//!
//! Sizes are whole 2 MiB granules, so that growth leaves no untagged remainder in a shard
//! (untagged free memory is reusable by every stream, in any shard).

use soma::{Error, MemPool, ReusePolicy, Stream};

use crate::common::{self, TestRng};

const MIB: usize = 1 << 20;
const GRANULE: usize = 2 * MIB;

/// Two streams of different shards: with two shards, consecutive stream slots alternate.
fn two_streams(dev: &soma::Device) -> (Stream<'_>, Stream<'_>) {
    (dev.create_stream().unwrap(), dev.create_stream().unwrap())
}

fn sharded(dev: &soma::Device, max: usize, reuse: ReusePolicy) -> MemPool<'_> {
    MemPool::builder().max_size(max as u64).reuse(reuse).stream_shards(2).build(dev).unwrap()
}

#[test]
fn streams_of_different_shards_allocate_in_different_ranges() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = sharded(&dev, 64 * MIB, ReusePolicy::default());
    let a = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
    let b = pool.alloc_async::<u8>(GRANULE, &s2).unwrap();
    let distance = a.device_ptr().addr().abs_diff(b.device_ptr().addr());
    assert!(distance >= 64 * MIB as u64, "one range: {:?} {:?}", a.device_ptr(), b.device_ptr());
    let st = pool.stats();
    assert_eq!((st.used, st.reserved), (2 * GRANULE as u64, 2 * GRANULE as u64));
    // An unsharded pool puts them side by side in one range.
    let one = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let c = one.alloc_async::<u8>(GRANULE, &s1).unwrap();
    let d = one.alloc_async::<u8>(GRANULE, &s2).unwrap();
    assert_eq!(c.device_ptr().addr().abs_diff(d.device_ptr().addr()), GRANULE as u64);
}

#[test]
fn a_block_freed_in_one_shard_is_reused_by_another_streams_shard_after_an_event() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let gate = common::Gate::close(&s1); // s1's free stays pending on the device
    let pool = sharded(&dev, 64 * MIB, ReusePolicy::new(true, false, false));
    let a = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
    let a_ptr = a.device_ptr();
    drop(a);
    s2.wait_stream(&s1).unwrap();
    let c = pool.alloc_async::<u8>(GRANULE, &s2).unwrap();
    assert_eq!(c.device_ptr(), a_ptr, "rule 2 across shards");
    let st = pool.stats();
    assert_eq!(st.reuses.event_dependency, 1);
    assert_eq!((st.fresh_allocations, st.reserved), (1, GRANULE as u64));
    gate.open();
}

#[test]
fn without_a_rule_another_streams_shard_does_not_reuse_a_pending_free() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let gate = common::Gate::close(&s1);
    let pool = sharded(&dev, 64 * MIB, ReusePolicy::NONE);
    let a = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
    let a_ptr = a.device_ptr();
    drop(a);
    s2.wait_stream(&s1).unwrap(); // an event dependency, but rule 2 is off
    let c = pool.alloc_async::<u8>(GRANULE, &s2).unwrap();
    assert_ne!(c.device_ptr(), a_ptr);
    assert_eq!(pool.stats().fresh_allocations, 2);
    gate.open();
    s1.synchronize().unwrap(); // now host-observed: any stream may take it
    let d = pool.alloc_async::<u8>(GRANULE, &s2).unwrap();
    assert_eq!(d.device_ptr(), a_ptr);
    assert_eq!(pool.stats().reuses.host_synchronized, 1);
}

#[test]
fn the_max_size_is_the_pools_and_a_shard_out_of_memory_takes_the_others_idle_memory() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = sharded(&dev, 8 * MIB, ReusePolicy::default());
    let a = pool.alloc_async::<u8>(6 * MIB, &s1).unwrap();
    let err = pool.alloc_async::<u8>(4 * MIB, &s2).unwrap_err();
    let Error::OutOfMemory(oom) = &err else { panic!("expected out of memory, got {err}") };
    assert_eq!((oom.used, oom.reserved), (6 * MIB as u64, 6 * MIB as u64), "{oom}");
    assert_eq!(pool.stats().reserved, 6 * MIB as u64);
    drop(a);
    s1.synchronize().unwrap();
    // 8 MiB fits nowhere cached: s2's shard grows after s1's shard gave its 6 MiB back.
    let b = pool.alloc_async::<u8>(8 * MIB, &s2).unwrap();
    let st = pool.stats();
    assert_eq!(
        (st.used, st.reserved, st.reserved_high),
        (8 * MIB as u64, 8 * MIB as u64, 8 * MIB as u64)
    );
    assert!(st.unmap_calls > 0);
    drop(b);
}

#[test]
fn counters_and_high_water_marks_are_the_pools_as_a_whole() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = sharded(&dev, 64 * MIB, ReusePolicy::default());
    let a = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
    let b = pool.alloc_async::<u8>(2 * GRANULE, &s2).unwrap();
    let st = pool.stats();
    assert_eq!((st.used, st.used_high, st.live_allocations), (6 * MIB as u64, 6 * MIB as u64, 2));
    assert_eq!(pool.get::<soma::attr::UsedMemCurrent>().unwrap(), 6 * MIB as u64);
    assert_eq!(pool.get::<soma::attr::ReservedMemHigh>().unwrap(), 6 * MIB as u64);
    drop(b);
    let st = pool.stats();
    assert_eq!(
        (st.used, st.used_high, st.live_allocations_high),
        (2 * MIB as u64, 6 * MIB as u64, 2)
    );
    assert_eq!(st.allocations, st.fresh_allocations + st.reuses.total());
    pool.reset::<soma::attr::UsedMemHigh>().unwrap();
    assert_eq!(pool.get::<soma::attr::UsedMemHigh>().unwrap(), 2 * MIB as u64);
    drop(a);
    assert_eq!(pool.stats().used, 0);
}

/// A typed free must reach the pool-wide counters at once, even when the next allocation
/// is served by another shard that never looks at the freeing one (a free parked in a
/// per-shard queue would still count as used there and inflate `used_high`).
#[test]
fn a_free_in_one_shard_is_not_counted_as_used_while_another_shard_allocates() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = sharded(&dev, 64 * MIB, ReusePolicy::NONE);
    drop(pool.alloc_async::<u8>(GRANULE, &s2).unwrap()); // cached in s2's shard
    drop(pool.alloc_async::<u8>(GRANULE, &s1).unwrap()); // grows s1's shard, freed there
    let b = pool.alloc_async::<u8>(GRANULE, &s2).unwrap(); // s2's own cache: no other shard
    let st = pool.stats();
    assert_eq!((st.used, st.used_high), (GRANULE as u64, GRANULE as u64), "{st:?}");
    assert_eq!(pool.get::<soma::attr::UsedMemHigh>().unwrap(), GRANULE as u64);
    drop(b);
}

#[test]
fn trim_and_the_release_threshold_cover_every_shard() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = sharded(&dev, 64 * MIB, ReusePolicy::default());
    let (a, b) = (pool.alloc_async::<u8>(GRANULE, &s1), pool.alloc_async::<u8>(GRANULE, &s2));
    drop((a, b));
    dev.synchronize().unwrap();
    assert_eq!(pool.stats().reserved, 2 * GRANULE as u64, "the default threshold keeps it");
    assert_eq!(pool.trim_to(GRANULE as u64).unwrap(), GRANULE as u64);
    assert_eq!(
        pool.stats().reserved,
        GRANULE as u64,
        "trimmed to the pool's target, not per shard"
    );
    assert_eq!(pool.trim_to(0).unwrap(), GRANULE as u64);

    let pool = MemPool::builder().release_threshold(0).stream_shards(2).build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
    drop(pool.alloc_async::<u8>(GRANULE, &s2).unwrap());
    assert_eq!(pool.stats().reserved, 2 * GRANULE as u64);
    dev.synchronize().unwrap();
    assert_eq!(pool.stats().reserved, GRANULE as u64, "only the live block's granule stays");
    drop(a);
    dev.synchronize().unwrap();
    assert_eq!(pool.stats().reserved, 0);
    let sim = npu.sim_device(0).unwrap().stats();
    assert_eq!(sim.physical_bytes, 0);
}

#[test]
fn a_snapshot_shows_every_shard() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = sharded(&dev, 64 * MIB, ReusePolicy::default());
    let a = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
    let b = pool.alloc_async::<u8>(GRANULE, &s2).unwrap();
    let snap = pool.snapshot();
    assert_eq!((snap.used, snap.reserved), (2 * GRANULE as u64, 2 * GRANULE as u64));
    assert_eq!(snap.segments.len(), 2, "one mapped run per shard");
    assert!(snap.segments.iter().all(|seg| seg.offset + seg.size <= snap.max_size));
    drop((a, b));
}

/// Mapped runs that meet at a shard boundary (the end of shard 0's range, the start of shard
/// 1's) are two segments: two reservations.
#[test]
fn a_snapshot_keeps_runs_of_adjacent_shards_apart() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = sharded(&dev, 8 * MIB, ReusePolicy::default());
    let a = pool.alloc_async::<u8>(6 * MIB, &s1).unwrap();
    let b = pool.alloc_async::<u8>(2 * MIB, &s1).unwrap(); // the end of shard 0's range
    drop(a);
    s1.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let c = pool.alloc_async::<u8>(MIB, &s2).unwrap(); // the start of shard 1's range
    let snap = pool.snapshot();
    let runs: Vec<_> = snap.segments.iter().map(|seg| (seg.offset, seg.size)).collect();
    let m = 8 * MIB as u64;
    assert_eq!(runs, vec![(m - 2 * MIB as u64, 2 * MIB as u64), (m, 2 * MIB as u64)]);
    drop((b, c));
}

#[test]
fn raw_pointers_of_any_shard_are_found_and_freed_once() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = two_streams(&dev);
    let pool = MemPool::builder().raw_pointers(true).stream_shards(2).build(&dev).unwrap();
    let (p1, _) = pool.alloc_raw(GRANULE as u64, &s1).unwrap();
    let (p2, size) = pool.alloc_raw(GRANULE as u64, &s2).unwrap();
    assert_eq!(pool.owns(p2), Some(size));
    pool.free_raw(p2, &s2).unwrap();
    assert!(matches!(pool.free_raw(p2, &s2), Err(Error::InvalidArgument(_))), "double free");
    pool.free_raw(p1, &s2).unwrap(); // on another stream than the allocation's
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn invalid_shard_settings_are_rejected() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    for builder in [
        MemPool::builder().stream_shards(0),
        MemPool::builder().stream_shards(65),
        MemPool::builder().stream_shards(2).history(16),
        MemPool::builder().stream_shards(2).passthrough(true),
    ] {
        assert!(matches!(builder.build(&dev), Err(Error::InvalidConfig(_))));
    }
    assert!(MemPool::builder().stream_shards(1).history(16).build(&dev).is_ok());
}

/// Four threads, four streams, one sharded pool: random allocations and frees with
/// cross-stream waits; afterwards the counters add up and everything comes back.
#[test]
fn concurrent_streams_on_a_sharded_pool_keep_exact_counters() {
    let npu = common::npu();
    let dev = npu.device(0).unwrap();
    let streams: Vec<Stream<'_>> = (0..4).map(|_| dev.create_stream().unwrap()).collect();
    let pool = MemPool::builder()
        .max_size(512 << 20)
        .reuse(ReusePolicy::new(true, false, true))
        .stream_shards(4)
        .build(&dev)
        .unwrap();
    std::thread::scope(|sc| {
        for (i, s) in streams.iter().enumerate() {
            let (pool, streams) = (&pool, &streams);
            sc.spawn(move || {
                let mut rng = TestRng::new(i as u64);
                let mut live = Vec::new();
                for step in 0..3000 {
                    if live.len() < 32 && rng.below(4) != 0 {
                        let len = 1 + rng.index(3 * MIB);
                        live.push(pool.alloc_async::<u8>(len, s).expect("alloc"));
                    } else if !live.is_empty() {
                        live.swap_remove(rng.index(live.len()));
                    }
                    if step % 50 == 49 {
                        s.wait_stream(&streams[(i + 1) % streams.len()]).unwrap();
                    }
                }
            });
        }
    });
    let st = pool.stats();
    assert_eq!((st.used, st.live_allocations), (0, 0));
    assert_eq!(st.allocations, st.frees);
    assert_eq!(st.allocations, st.fresh_allocations + st.reuses.total());
    assert!(st.reserved <= st.max_size && st.used_high <= st.reserved_high);
    assert!(st.reuses.event_dependency + st.reuses.internal_dependency > 0, "{st:?}");
    dev.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved, 0);
    drop(pool);
    let sim = npu.sim_device(0).unwrap().stats();
    assert_eq!((sim.physical_bytes, sim.mapped_bytes), (0, 0));
}
