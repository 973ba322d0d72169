//! Fault injection through the software NPU: failing driver calls (physical allocation, map,
//! malloc) and failing tasks, while a mixed workload runs.
//!
//! After every failure the pool's accounting must be exact — with a single pool on the
//! device, the device's mapped and physical bytes equal the pool's reserved bytes — a failed
//! allocation changes nothing (recycling may have unmapped free memory, nothing else), live
//! allocations keep their data, nothing leaks (the device gets everything back after
//! `trim_to(0)` and the pool's drop), and allocations succeed again once faults are cleared.

use soma::sim::{FaultKind, SimDevice};
use soma::{attr, DriverAlloc, Error, MemPool, PoolAlloc, PoolStats, Stream};

use crate::common::{device_of, npu_with_capacity, TestRng};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Pool and device agree on how much memory is held.
#[track_caller]
fn assert_accounting(pool: &MemPool<'_>, sim: &SimDevice) -> PoolStats {
    let st = pool.stats();
    let dev = sim.stats();
    assert_eq!(dev.mapped_bytes, st.reserved, "device mapped bytes vs pool reserved: {st:?}");
    assert_eq!(dev.physical_bytes, st.reserved, "device physical bytes vs pool reserved");
    assert!(st.reserved >= st.used && st.reserved <= st.max_size, "{st:?}");
    assert_eq!(st.free_bytes, st.reserved - st.used, "{st:?}");
    st
}

/// A failed allocation left the pool as it was (recycling may have unmapped free memory).
#[track_caller]
fn assert_unchanged(before: &PoolStats, after: &PoolStats) {
    assert_eq!(after.used, before.used);
    assert_eq!(after.live_allocations, before.live_allocations);
    assert_eq!(after.allocations, before.allocations);
    assert_eq!(after.frees, before.frees);
    assert!(after.reserved <= before.reserved, "a failed allocation grew the pool");
    assert_eq!(after.map_calls, before.map_calls, "a failed allocation kept a mapping");
}

/// An allocation with the byte every element was set to.
struct Tagged<'s> {
    alloc: PoolAlloc<'s, u8>,
    tag: u8,
}

#[track_caller]
fn verify(stream: &Stream<'_>, t: &Tagged<'_>) {
    let n = t.alloc.len().min(4096);
    let mut out = vec![0u8; n];
    stream.copy_to_host(&t.alloc, &mut out).unwrap();
    assert!(out.iter().all(|&b| b == t.tag), "allocation lost its contents");
}

/// Runs a mixed workload (two streams, sizes from 512 B to 9 MiB, frees, synchronisations,
/// trims) with every `k`-th call of `kind` failing; returns how many allocations failed.
fn workload_with_faults(kind: FaultKind, k: u64) -> usize {
    let npu = npu_with_capacity(2 << 30);
    let dev = device_of(&npu);
    let sim = npu.sim_device(0).unwrap();
    let streams = [dev.create_stream().unwrap(), dev.create_stream().unwrap()];
    let pool = MemPool::builder().max_size(512 << 20).build(&dev).unwrap();
    // Small segments: more driver calls, so that every k is reached many times.
    let sizes = [512, 4 * KIB, 100 * KIB, MIB, 2 * MIB, 5 * MIB, 9 * MIB];
    // A reproducible workload for every `k`.
    let mut rng = TestRng::new(k * 31 + kind as u64);
    let mut live: Vec<Vec<Tagged<'_>>> = vec![Vec::new(), Vec::new()];
    let mut failures = 0;
    sim.faults().fail_every(kind, k);
    for step in 0..120u32 {
        let si = rng.index(2);
        let s = &streams[si];
        match rng.below(10) {
            0..=4 => {
                let size = sizes[rng.index(sizes.len())];
                let before = assert_accounting(&pool, &sim);
                match pool.alloc_async::<u8>(size, s) {
                    Ok(mut alloc) => {
                        let tag = (step % 251) as u8 + 1;
                        s.memset(&mut alloc, tag).unwrap();
                        live[si].push(Tagged { alloc, tag });
                    }
                    Err(e) => {
                        assert!(
                            matches!(&e, Error::Driver(_)),
                            "injected {kind:?} fault must surface as a driver error, got {e}"
                        );
                        failures += 1;
                        let after = assert_accounting(&pool, &sim);
                        assert_unchanged(&before, &after);
                    }
                }
            }
            5..=7 => {
                if !live[si].is_empty() {
                    let i = rng.index(live[si].len());
                    let t = live[si].swap_remove(i);
                    if rng.below(4) == 0 {
                        verify(s, &t);
                    }
                    drop(t);
                }
            }
            8 => s.synchronize().unwrap(),
            _ => {
                pool.trim_to((rng.below(4) * 32) << 20).unwrap();
            }
        }
        assert_accounting(&pool, &sim);
    }
    // Faults cleared: allocations succeed again, and what survived kept its data.
    sim.faults().clear(kind);
    for s in &streams {
        for size in [9 * MIB, 2 * MIB, 512] {
            let a = pool.alloc_async::<u8>(size, s).expect("allocation after the faults cleared");
            drop(a);
        }
    }
    for (si, allocs) in live.iter().enumerate() {
        for t in allocs {
            verify(&streams[si], t);
        }
    }
    drop(live);
    dev.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = assert_accounting(&pool, &sim);
    assert_eq!((st.used, st.reserved), (0, 0), "{st:?}");
    drop(pool);
    let dev_stats = sim.stats();
    assert_eq!((dev_stats.mapped_bytes, dev_stats.physical_bytes), (0, 0));
    assert_eq!(dev_stats.calls.reserve, dev_stats.calls.release, "address reservations leak");
    failures
}

#[test]
fn every_kth_map_fails_cleanly() {
    for k in 1..=6 {
        let failures = workload_with_faults(FaultKind::Map, k);
        assert!(failures > 0, "k = {k}: the workload never hit an injected map failure");
    }
}

#[test]
fn every_kth_physical_allocation_fails_cleanly() {
    for k in 1..=6 {
        let failures = workload_with_faults(FaultKind::AllocPhysical, k);
        assert!(failures > 0, "k = {k}: the workload never hit an injected allocation failure");
    }
}

/// A growth maps several segments; when a later one fails, the earlier ones are given back.
#[test]
fn a_failure_in_the_middle_of_a_growth_rolls_it_back() {
    for kind in [FaultKind::Map, FaultKind::AllocPhysical] {
        for nth in 1..=4 {
            let npu = npu_with_capacity(1 << 30);
            let dev = device_of(&npu);
            let sim = npu.sim_device(0).unwrap();
            let s = dev.create_stream().unwrap();
            let pool = MemPool::builder().max_size(512 << 20).build(&dev).unwrap();
            let keep = pool.alloc_async::<u8>(3 * MIB, &s).unwrap();
            let before = assert_accounting(&pool, &sim);
            sim.faults().fail_nth(kind, nth);
            // 64 MiB grow in segments of 16 MiB: 4 map calls.
            let err = pool.alloc_async::<u8>(64 * MIB, &s).unwrap_err();
            assert!(matches!(err, Error::Driver(_)), "{kind:?} #{nth}: {err}");
            let after = assert_accounting(&pool, &sim);
            assert_unchanged(&before, &after);
            assert_eq!(after.reserved, before.reserved, "{kind:?} #{nth}");
            // The rule fired once; the next attempt succeeds.
            let big = pool.alloc_async::<u8>(64 * MIB, &s).unwrap();
            assert_accounting(&pool, &sim);
            drop((big, keep));
            s.synchronize().unwrap();
            pool.trim_to(0).unwrap();
            assert_eq!(assert_accounting(&pool, &sim).reserved, 0);
        }
    }
}

/// Reuse of cached memory never calls the driver, so it keeps working while every map fails.
#[test]
fn cached_memory_is_served_while_the_driver_fails() {
    let npu = npu_with_capacity(1 << 30);
    let dev = device_of(&npu);
    let sim = npu.sim_device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(256 << 20).build(&dev).unwrap();
    drop(pool.alloc_async::<u8>(16 * MIB, &s).unwrap());
    sim.faults().fail_every(FaultKind::AllocPhysical, 1);
    for _ in 0..10 {
        let a = pool.alloc_async::<u8>(8 * MIB, &s).unwrap();
        let b = pool.alloc_async::<u8>(8 * MIB, &s).unwrap();
        drop((a, b));
    }
    let before = assert_accounting(&pool, &sim);
    assert!(pool.alloc_async::<u8>(32 * MIB, &s).is_err());
    assert_unchanged(&before, &assert_accounting(&pool, &sim));
    sim.faults().clear(FaultKind::AllocPhysical);
    drop(pool.alloc_async::<u8>(32 * MIB, &s).unwrap());
}

/// The driver path (`aclrtMalloc`) under injected failures: errors, no leak.
#[test]
fn driver_alloc_fails_cleanly() {
    let npu = npu_with_capacity(1 << 30);
    let dev = device_of(&npu);
    let sim = npu.sim_device(0).unwrap();
    sim.faults().fail_every(FaultKind::Malloc, 2);
    let mut ok = Vec::new();
    let mut failed = 0;
    for _ in 0..8 {
        match DriverAlloc::<u32>::new(&dev, 1 << 16) {
            Ok(a) => ok.push(a),
            Err(e) => {
                assert!(matches!(e, Error::Driver(_)), "{e}");
                failed += 1;
            }
        }
    }
    assert_eq!((ok.len(), failed), (4, 4));
    // The device rounds every malloc up to its granularity.
    assert_eq!(sim.stats().malloc_bytes, 4 * 2 * MIB as u64);
    drop(ok);
    assert_eq!(sim.stats().malloc_bytes, 0);
}

/// A failing task fails its stream (reported by every later synchronize); the pool stays
/// consistent and usable on other streams, and frees onto the failed stream still work.
#[test]
fn a_failed_task_fails_its_stream_not_the_pool() {
    let npu = npu_with_capacity(1 << 30);
    let dev = device_of(&npu);
    let sim = npu.sim_device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(256 << 20).build(&dev).unwrap();
    let mut a = pool.alloc_async::<u32>(MIB, &s1).unwrap();
    let mut b = pool.alloc_async::<u32>(MIB, &s2).unwrap();
    s1.memset(&mut a, 1).unwrap();
    s1.synchronize().unwrap();
    sim.faults().fail_next_task(s1.id());
    s1.memset(&mut a, 2).unwrap(); // fails on the device
    let e1 = s1.synchronize().unwrap_err();
    assert!(matches!(e1, Error::Driver(soma::hal::DriverError::TaskFailed { .. })), "{e1}");
    // The stream stays failed: later work is skipped and reported.
    s1.memset(&mut a, 3).unwrap();
    assert!(s1.synchronize().is_err());
    let mut out = vec![0u32; 16];
    assert!(s1.copy_to_host(&a, &mut out).is_err(), "a copy on a failed stream reports it");
    // The pool is consistent and serves other streams.
    let st = assert_accounting(&pool, &sim);
    assert_eq!(st.used, 8 * MIB as u64);
    s2.copy_from_host(&mut b, &vec![7u32; MIB]).unwrap();
    s2.copy_to_host(&b, &mut out).unwrap();
    assert_eq!(out, vec![7u32; 16]);
    // Frees onto the failed stream: its blocks become reusable once the host observed it.
    drop(a);
    assert!(s1.synchronize().is_err());
    let c = pool.alloc_async::<u32>(MIB, &s2).unwrap();
    assert_eq!(pool.stats().reuses.host_synchronized, 1, "{:?}", pool.stats());
    // An event recorded on the failed stream reports the error; waiting on it does not hang.
    let ev = s1.record_event().unwrap();
    assert!(ev.synchronize().is_err());
    s2.wait_event(&ev).unwrap();
    s2.synchronize().unwrap();
    assert!(pool.get::<attr::UsedMemCurrent>().is_ok(), "the pool holds no sticky error");
    drop((b, c));
    s2.synchronize().unwrap();
    let _ = s1.synchronize();
    pool.trim_to(0).unwrap();
    assert_eq!(assert_accounting(&pool, &sim).reserved, 0);
}

/// A task failure at a chosen position (`fail_task`) in the middle of same-stream reuse: the
/// failing copy does not corrupt the pool, and a fresh stream continues the work.
#[test]
fn a_task_failure_at_a_position_leaves_the_pool_usable() {
    let npu = npu_with_capacity(1 << 30);
    let dev = device_of(&npu);
    let sim = npu.sim_device(0).unwrap();
    let pool = MemPool::builder().max_size(256 << 20).build(&dev).unwrap();
    {
        let s = dev.create_stream().unwrap();
        let pos = s.hal().enqueued();
        sim.faults().fail_task(s.id(), pos + 3);
        for i in 0..6u32 {
            let mut x = pool.alloc_async::<u32>(64 * KIB, &s).unwrap();
            s.copy_from_host(&mut x, &vec![i; 64 * KIB]).unwrap(); // 2 tasks: copy + release
        }
        assert!(s.synchronize().is_err());
        assert_accounting(&pool, &sim);
    } // the failed stream is dropped: it drained, its cache goes to the others
    let s = dev.create_stream().unwrap();
    let mut x = pool.alloc_async::<u32>(64 * KIB, &s).unwrap();
    s.copy_from_host(&mut x, &vec![9u32; 64 * KIB]).unwrap();
    let mut out = vec![0u32; 64 * KIB];
    s.copy_to_host(&x, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 9));
    assert!(pool.stats().reuses.total() >= 1, "{:?}", pool.stats());
    drop(x);
    s.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(assert_accounting(&pool, &sim).reserved, 0);
}
