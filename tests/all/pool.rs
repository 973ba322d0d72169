//! Pool behaviour on the software NPU: integrity, thresholds, trim, OOM, alignment, bad
//! sizes, attributes, compaction, packing when empty, concurrency.

use soma::{attr, Error, KernelArg, MemPool, ReusePolicy};
use soma_tools::baselines::SomaApi;
use soma_tools::workload::{random_allocations, replay, SEED};

use crate::common::{device_of, npu, npu_with_capacity, wait_device_only, Gate, TestRng};

const MIB: u64 = 1 << 20;

#[test]
fn data_survives_alloc_use_free_without_synchronisation() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut results = Vec::new();
    for round in 0..50u32 {
        let mut a = pool.alloc_async::<u32>(4096, &s).unwrap();
        let mut b = pool.alloc_async::<u32>(4096, &s).unwrap();
        s.copy_from_host(&mut a, &vec![round; 4096]).unwrap();
        s.launch("plus_one", &[KernelArg::read(&a), KernelArg::write(&mut b)], |k| {
            let (a, b) = (k.read::<u32>(0)?, k.write::<u32>(1)?);
            for (b, a) in b.iter_mut().zip(a) {
                *b = a + 1;
            }
            Ok(())
        })
        .unwrap();
        drop(a); // freed while the kernel may still be queued: stream order protects it
        let mut c = pool.alloc_async::<u32>(4096, &s).unwrap(); // likely a's block
        s.memset(&mut c, 0xff).unwrap();
        s.copy(&mut c, &b).unwrap();
        drop(b);
        let mut out = vec![0u32; 4096];
        if round % 10 == 9 {
            s.copy_to_host(&c, &mut out).unwrap();
            results.push((round, out));
        }
        drop(c);
    }
    for (round, out) in results {
        assert!(out.iter().all(|&v| v == round + 1), "round {round}");
    }
    assert!(pool.stats().reuses.same_stream > 0);
}

#[test]
fn release_threshold_applies_at_synchronize() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool =
        MemPool::builder().max_size(64 * MIB).release_threshold(4 * MIB).build(&dev).unwrap();
    let blocks: Vec<_> =
        (0..8).map(|_| pool.alloc_async::<u8>(2 * MIB as usize, &s).unwrap()).collect();
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 16 * MIB);
    drop(blocks);
    // Freed but not synchronised: the cache is kept.
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 16 * MIB);
    assert_eq!(pool.get::<attr::UsedMemCurrent>().unwrap(), 0);
    s.synchronize().unwrap();
    assert!(pool.get::<attr::ReservedMemCurrent>().unwrap() <= 4 * MIB);
    assert!(pool.stats().unmap_calls > 0);
}

#[test]
fn rust_default_threshold_keeps_the_cache() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 * MIB).build(&dev).unwrap();
    assert_eq!(pool.get::<attr::ReleaseThreshold>().unwrap(), 64 * MIB);
    drop(pool.alloc_async::<u8>(8 * MIB as usize, &s).unwrap());
    s.synchronize().unwrap();
    dev.synchronize().unwrap();
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 8 * MIB);
}

#[test]
fn cann_defaults_release_everything_at_synchronize() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 * MIB).cann_defaults().build(&dev).unwrap();
    assert_eq!(pool.reuse_policy(), ReusePolicy::NONE);
    assert_eq!(pool.get::<attr::ReleaseThreshold>().unwrap(), 0);
    drop(pool.alloc_async::<u8>(8 * MIB as usize, &s).unwrap());
    s.synchronize().unwrap();
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0);
}

#[test]
fn trim_never_releases_used_memory() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 * MIB).build(&dev).unwrap();
    let keep = pool.alloc_async::<u8>(4 * MIB as usize, &s).unwrap();
    let free: Vec<_> =
        (0..4).map(|_| pool.alloc_async::<u8>(4 * MIB as usize, &s).unwrap()).collect();
    drop(free);
    s.synchronize().unwrap();
    let released = pool.trim_to(0).unwrap();
    assert_eq!(released, 16 * MIB);
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 4 * MIB);
    assert_eq!(pool.get::<attr::UsedMemCurrent>().unwrap(), 4 * MIB);
    // The live block is still usable.
    let mut out = vec![0u8; 16];
    s.copy_to_host(&keep, &mut out).unwrap();
    assert!(matches!(pool.trim_to(65 * MIB), Err(Error::InvalidArgument(_))));
}

#[test]
fn trim_keeps_memory_whose_free_is_still_in_flight() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 * MIB).build(&dev).unwrap();
    let gate = Gate::close(&s);
    drop(pool.alloc_async::<u8>(4 * MIB as usize, &s).unwrap());
    assert_eq!(pool.trim_to(0).unwrap(), 0, "the free has not completed: nothing may be unmapped");
    gate.open();
    s.synchronize().unwrap();
    assert_eq!(pool.trim_to(0).unwrap(), 4 * MIB);
}

#[test]
fn out_of_memory_reports_numbers_and_the_pool_recovers() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(16 * MIB).build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(10 * MIB as usize, &s).unwrap();
    let err = pool.alloc_async::<u8>(8 * MIB as usize, &s).unwrap_err();
    let Error::OutOfMemory(oom) = &err else { panic!("expected OOM, got {err}") };
    assert_eq!(oom.requested, 8 * MIB);
    assert_eq!(oom.used, 10 * MIB);
    assert_eq!(oom.max, 16 * MIB);
    let text = err.to_string();
    assert!(text.contains("8.0 MiB") && text.contains("16.0 MiB"), "{text}");
    assert_eq!(pool.stats().ooms, 1);
    assert_eq!(
        pool.get::<attr::UsedMemCurrent>().unwrap(),
        10 * MIB,
        "failed allocation changed nothing"
    );
    drop(a);
    let b = pool.alloc_async::<u8>(8 * MIB as usize, &s).unwrap();
    assert_eq!(b.len(), 8 * MIB as usize);
}

#[test]
fn out_of_memory_waits_for_pending_frees_of_other_streams() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(16 * MIB).reuse(ReusePolicy::NONE).build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(12 * MIB as usize, &s1).unwrap();
    let gate = Gate::close(&s1);
    // Pending on s1 behind the gate, not eligible for s2 by any rule.
    drop(a);
    // The allocation below must wait for s1: open the gate from another thread meanwhile.
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        gate.open();
    });
    let b = pool.alloc_async::<u8>(12 * MIB as usize, &s2).unwrap();
    assert_eq!(pool.stats().oom_retries, 1);
    opener.join().unwrap();
    drop(b);
}

/// Releasing under pressure goes on to every fully free, completed segment when the first,
/// partial release leaves no hole that fits: the pool must not wait for a stream whose frees
/// are already complete.
#[test]
fn out_of_memory_releases_every_free_segment_before_waiting() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder()
        .max_size(8 * MIB)
        .segments_per_growth(1)
        .recycle_on_growth(false)
        .reuse(ReusePolicy::NONE)
        .build(&dev)
        .unwrap();
    let two = 2 * MIB as usize;
    let a = pool.alloc_async::<u8>(two, &s1).unwrap(); // [0, 2) MiB
    let b = pool.alloc_async::<u8>(two, &s1).unwrap(); // [2, 4)
    let live = pool.alloc_async::<u8>(two, &s1).unwrap(); // [4, 6), stays
    let c = pool.alloc_async::<u8>(two, &s1).unwrap(); // [6, 8)
    drop((a, b, c));
    // The three frees are complete; the host has not observed them.
    wait_device_only(&s1);
    // Later work on s1 that a wait for s1 would block on (the gate opens itself after 30 s, so
    // a pool that waits fails below instead of hanging).
    let gate = Gate::close(&s1);
    // Releasing the highest 4 MiB first gives [6, 8) and [2, 4): no 4 MiB hole. Releasing
    // [0, 2) too gives [0, 4).
    let big = pool.alloc_async::<u8>(4 * MIB as usize, &s2).unwrap();
    let st = pool.stats();
    assert_eq!(st.oom_retries, 0, "waited for s1 although its frees were complete");
    assert_eq!(live.device_ptr().offset_from(big.device_ptr()), Some(4 * MIB), "[0, 4) MiB");
    gate.open();
    drop((big, live));
}

/// A reuse switch on never fails what the same program with it off serves: two adjacent
/// blocks freed on two streams, both eligible for a third (their frees completed, or ordered
/// before it by events), are merged for a request that needs both.
#[test]
fn eligible_frees_of_two_streams_merge_when_the_pool_is_out_of_memory() {
    let npu = npu();
    let dev = device_of(&npu);
    for policy in [
        ReusePolicy::NONE,
        ReusePolicy::new(false, true, false),
        ReusePolicy::new(true, false, false),
    ] {
        let (s1, s2, t) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        let pool = MemPool::builder().max_size(6 * MIB).reuse(policy).build(&dev).unwrap();
        let x1 = pool.alloc_async::<u8>(768 << 10, &s1).unwrap();
        let x2 = pool.alloc_async::<u8>(768 << 10, &s2).unwrap();
        let live = pool.alloc_async::<u8>(4608 << 10, &t).unwrap(); // the rest of the pool
        assert_eq!(x1.device_ptr().checked_add(768 << 10), Some(x2.device_ptr()));
        drop((x1, x2));
        wait_device_only(&s1);
        wait_device_only(&s2);
        if policy.follow_event_dependencies {
            t.wait_stream(&s1).unwrap();
            t.wait_stream(&s2).unwrap();
        }
        let both = pool.alloc_async::<u8>(1536 << 10, &t);
        assert!(
            both.is_ok(),
            "{policy:?}: {}",
            both.err().map(|e| e.to_string()).unwrap_or_default()
        );
        drop((both, live));
    }
}

/// Merging eligible frees when out of memory waits for no stream: not the one that took a
/// dropped freeing stream's slot (it never used the pool), not the requesting stream itself.
#[test]
fn merging_eligible_frees_waits_for_no_stream() {
    let npu = npu();
    let dev = device_of(&npu);
    for allocate_on_held in [false, true] {
        let pool = MemPool::builder()
            .max_size(6 * MIB)
            .reuse(ReusePolicy::new(false, true, false))
            .build(&dev)
            .unwrap();
        {
            let u = dev.create_stream().unwrap();
            drop(pool.alloc_async::<u8>(768 << 10, &u).unwrap());
        } // u freed into the pool, then dropped
        let v = dev.create_stream().unwrap(); // takes u's slot, never uses the pool
        let (s1, s2, t) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        let x1 = pool.alloc_async::<u8>(768 << 10, &s1).unwrap();
        let x2 = pool.alloc_async::<u8>(768 << 10, &s2).unwrap();
        let live = pool.alloc_async::<u8>(4608 << 10, &t).unwrap();
        drop((x1, x2));
        wait_device_only(&s1);
        wait_device_only(&s2);
        let requester = if allocate_on_held { &s1 } else { &t };
        let holder = if allocate_on_held { &s1 } else { &v };
        let gate = Gate::close(holder);
        let both = pool.alloc_async::<u8>(1536 << 10, requester);
        assert!(!gate.passed(), "the allocation waited for a held stream");
        assert!(both.is_ok(), "{:?}", both.as_ref().err().map(ToString::to_string));
        gate.open();
        drop((both, live));
    }
}

/// `owns` answers with and without the address index of `raw_pointers`.
#[test]
fn owns_finds_live_blocks_with_or_without_the_address_index() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    for indexed in [false, true] {
        let pool = MemPool::builder().max_size(64 * MIB).raw_pointers(indexed).build(&dev).unwrap();
        let blocks: Vec<_> =
            (1..=40).map(|i| pool.alloc_async::<u8>(i * 1000, &s).unwrap()).collect();
        for (i, b) in blocks.iter().enumerate() {
            let rounded = ((i as u64 + 1) * 1000).next_multiple_of(512);
            assert_eq!(pool.owns(b.device_ptr()), Some(rounded), "indexed {indexed}, block {i}");
            let inside = b.device_ptr().checked_add(512).unwrap();
            assert_eq!(pool.owns(inside), None, "an interior pointer is not a block start");
        }
        let (kept, freed): (Vec<_>, Vec<_>) =
            blocks.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        let freed_ptrs: Vec<_> = freed.iter().map(|(_, b)| b.device_ptr()).collect();
        drop(freed);
        for p in freed_ptrs {
            assert_eq!(pool.owns(p), None, "indexed {indexed}: a freed block is not owned");
        }
        assert!(kept.iter().all(|(_, b)| pool.owns(b.device_ptr()).is_some()));
    }
}

/// `alloc_raw` blocks never freed go back with the pool, after the work that may use them
/// (released by the device at the synchronisation after it).
#[test]
fn raw_blocks_are_released_when_the_pool_is_dropped() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let free_before = dev.mem_info().unwrap().free;
    for sharded in [false, true] {
        let builder = MemPool::builder().max_size(64 * MIB);
        let pool = if sharded { builder.stream_shards(2) } else { builder }.build(&dev).unwrap();
        let (p, size) = pool.alloc_raw(3 * MIB, &s).unwrap();
        assert_eq!(size, 3 * MIB);
        let gate = Gate::close(&s);
        s.hal().memset(p, 1, 3 * MIB).unwrap();
        let opener = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            gate.open();
        });
        drop(pool); // does not wait: the device releases it after the memset
        opener.join().unwrap();
        s.synchronize().unwrap(); // the memset ran on memory still mapped
        assert_eq!(dev.mem_info().unwrap().free, free_before, "sharded {sharded}: leaked");
    }
}

#[test]
fn device_capacity_is_an_error_not_a_crash() {
    let npu = npu_with_capacity(32 * MIB);
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    assert_eq!(pool.max_size(), 32 * MIB);
    let _a = pool.alloc_async::<u8>(30 * MIB as usize, &s).unwrap();
    assert!(matches!(pool.alloc_async::<u8>(4 * MIB as usize, &s), Err(Error::OutOfMemory(_))));
}

#[test]
fn alignment_is_respected_and_validated() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    for align in [32u64, 512, 4096, 2 * MIB] {
        let pool = MemPool::builder().max_size(64 * MIB).alignment(align).build(&dev).unwrap();
        let allocs: Vec<_> =
            (1..20usize).map(|n| pool.alloc_async::<u8>(n * 37, &s).unwrap()).collect();
        for a in &allocs {
            assert_eq!(a.device_ptr().addr() % align, 0, "alignment {align}");
        }
        let used: u64 = (1..20u64).map(|n| (n * 37).div_ceil(align) * align).sum();
        assert_eq!(pool.get::<attr::UsedMemCurrent>().unwrap(), used);
    }
    for bad in [0u64, 16, 48, 1000, 4 * MIB] {
        let r = MemPool::builder().alignment(bad).build(&dev);
        assert!(matches!(r, Err(Error::InvalidConfig(_))), "alignment {bad} must be rejected");
    }
}

#[test]
fn zero_and_overflowing_sizes_are_errors() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 * MIB).build(&dev).unwrap();
    assert!(matches!(pool.alloc_async::<u8>(0, &s), Err(Error::InvalidSize(_))));
    assert!(matches!(pool.alloc_async::<u64>(usize::MAX, &s), Err(Error::InvalidSize(_))));
    assert!(pool.alloc_async::<u8>(usize::MAX, &s).is_err());
    assert!(matches!(
        pool.alloc_raw(u64::MAX, &s),
        Err(Error::InvalidSize(_) | Error::OutOfMemory(_))
    ));
    assert_eq!(pool.stats().live_allocations, 0);
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0);
}

#[test]
fn builder_rejects_invalid_configurations() {
    let npu = npu_with_capacity(64 * MIB);
    let dev = device_of(&npu);
    assert!(matches!(
        MemPool::builder().max_size(65 * MIB).build(&dev),
        Err(Error::InvalidConfig(_))
    ));
    assert!(matches!(
        MemPool::builder().max_size(8 * MIB).release_threshold(9 * MIB).build(&dev),
        Err(Error::InvalidConfig(_))
    ));
    // max_size rounds up to the granularity; 0 means device memory.
    assert_eq!(MemPool::builder().max_size(1).build(&dev).unwrap().max_size(), 2 * MIB);
    assert_eq!(MemPool::builder().build(&dev).unwrap().max_size(), 64 * MIB);
}

#[test]
fn attributes_get_set_and_reset() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 * MIB).build(&dev).unwrap();
    pool.set::<attr::ReuseAllowInternalDependencies>(true).unwrap();
    assert!(pool.get::<attr::ReuseAllowInternalDependencies>().unwrap());
    pool.set::<attr::ReuseFollowEventDependencies>(false).unwrap();
    assert!(!pool.reuse_policy().follow_event_dependencies);
    pool.set::<attr::ReleaseThreshold>(MIB).unwrap();
    assert_eq!(pool.get::<attr::ReleaseThreshold>().unwrap(), MIB);
    assert!(pool.set::<attr::ReleaseThreshold>(65 * MIB).is_err());
    assert_eq!(
        pool.get::<attr::ReleaseThreshold>().unwrap(),
        MIB,
        "a rejected set changes nothing"
    );

    let a = pool.alloc_async::<u8>(3 * MIB as usize, &s).unwrap();
    drop(a);
    assert_eq!(pool.get::<attr::UsedMemHigh>().unwrap(), 3 * MIB);
    // A reset restarts the mark from the current value, so highs never fall below currents.
    pool.reset::<attr::UsedMemHigh>().unwrap();
    assert_eq!(pool.get::<attr::UsedMemHigh>().unwrap(), 0);
    pool.reset::<attr::ReservedMemHigh>().unwrap();
    let reserved = pool.get::<attr::ReservedMemCurrent>().unwrap();
    assert_eq!(pool.get::<attr::ReservedMemHigh>().unwrap(), reserved);
    let _b = pool.alloc_async::<u8>(MIB as usize, &s).unwrap();
    assert_eq!(pool.get::<attr::UsedMemHigh>().unwrap(), MIB);
    assert!(
        pool.get::<attr::ReservedMemHigh>().unwrap()
            >= pool.get::<attr::ReservedMemCurrent>().unwrap()
    );
    assert_eq!(<attr::UsedMemHigh as attr::Attribute>::ID, 0x8);
}

#[test]
fn stats_stay_consistent() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(1 << 30).build(&dev).unwrap();
    let mut live = Vec::new();
    let mut rng = TestRng::new(12345);
    for step in 0..2000 {
        if rng.below(2) == 1 || live.is_empty() {
            let len = 1 + rng.index(3 << 20);
            live.push(pool.alloc_async::<u8>(len, &s).unwrap());
        } else {
            let i = rng.index(live.len());
            drop(live.swap_remove(i));
        }
        if step % 97 == 0 {
            s.synchronize().unwrap();
            pool.trim_to(0).unwrap();
        }
        let st = pool.stats();
        let sum: u64 = live.iter().map(|a| a.byte_len().div_ceil(512) * 512).sum();
        assert_eq!(st.used, sum, "used = sum of live rounded sizes");
        assert!(st.reserved >= st.used);
        assert!(st.used_high >= st.used && st.reserved_high >= st.reserved);
        assert_eq!(st.live_allocations, live.len() as u64);
    }
}

#[test]
fn compaction_makes_room_for_a_large_allocation_and_keeps_data() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(16 * MIB).build(&dev).unwrap();
    // 16 blocks of 1 MiB fill the pool; free every other one: 8 MiB free, in 1 MiB holes.
    let mut blocks: Vec<_> =
        (0..16u32).map(|_| pool.alloc_async::<u32>(256 * 1024, &s).unwrap()).collect();
    for (i, b) in blocks.iter_mut().enumerate() {
        s.copy_from_host(b, &vec![i as u32; 256 * 1024]).unwrap();
    }
    let mut kept = Vec::new();
    for (i, b) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            drop(b);
        } else {
            kept.push((i as u32, b));
        }
    }
    assert!(matches!(pool.alloc_async::<u8>(4 * MIB as usize, &s), Err(Error::OutOfMemory(_))));
    let mut refs: Vec<_> = kept.iter_mut().map(|(_, b)| b).collect();
    let moved = pool.compact(&s, &mut refs).unwrap();
    assert!(moved >= 4, "moved {moved}");
    let big = pool.alloc_async::<u8>(4 * MIB as usize, &s).unwrap();
    for (i, b) in &kept {
        let mut out = vec![0u32; 256 * 1024];
        s.copy_to_host(b, &mut out).unwrap();
        assert!(out.iter().all(|v| v == i), "block {i} moved intact");
    }
    drop(big);
}

#[test]
fn four_threads_four_streams_share_a_pool() {
    let npu = npu();
    let dev = device_of(&npu);
    let pool = MemPool::builder().max_size(512 * MIB).build(&dev).unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let dev = &dev;
            let pool = &pool;
            scope.spawn(move || {
                let s = dev.create_stream().unwrap();
                let mut rng = TestRng::new(u64::from(t));
                let mut live: Vec<(u32, soma::PoolAlloc<'_, u32>)> = Vec::new();
                for i in 0..300u32 {
                    let len = 1 + rng.index(50_000);
                    let sig = (t << 24) | i;
                    let mut a = pool.alloc_async::<u32>(len, &s).unwrap();
                    s.copy_from_host(&mut a, &vec![sig; len]).unwrap();
                    live.push((sig, a));
                    if live.len() > 8 {
                        let (sig, a) = live.remove(rng.index(live.len()));
                        let mut out = vec![0u32; a.len()];
                        s.copy_to_host(&a, &mut out).unwrap();
                        assert!(out.iter().all(|&v| v == sig), "thread {t}: block overwritten");
                    }
                }
                drop(live);
                s.synchronize().unwrap();
            });
        }
    });
    assert_eq!(pool.stats().live_allocations, 0);
}

#[test]
fn streams_of_another_device_are_rejected() {
    let npu = soma::sim::Npu::builder().devices(2).build().unwrap();
    let d0 = npu.device(0).unwrap();
    let d1 = npu.device(1).unwrap();
    let s1 = d1.create_stream().unwrap();
    let pool = MemPool::builder().max_size(8 * MIB).build(&d0).unwrap();
    assert!(matches!(pool.alloc_async::<u8>(16, &s1), Err(Error::WrongDevice(_))));
}

#[test]
fn dropping_the_pool_returns_every_byte_to_the_device() {
    let npu = npu();
    let dev = device_of(&npu);
    let before = dev.mem_info().unwrap().free;
    {
        let s = dev.create_stream().unwrap();
        let pool = MemPool::builder().max_size(64 * MIB).build(&dev).unwrap();
        let a = pool.alloc_async::<u8>(10 * MIB as usize, &s).unwrap();
        let gate = Gate::close(&s);
        drop(a);
        gate.open();
        drop(pool);
    }
    assert_eq!(dev.mem_info().unwrap().free, before);
}

#[test]
fn native_pools_need_a_backend_with_cann_s_pool_api() {
    let npu = npu();
    let dev = device_of(&npu);
    let err = MemPool::builder().native().build(&dev).unwrap_err();
    assert!(
        matches!(&err, Error::Driver(soma::hal::DriverError::Unsupported(msg)) if msg.contains("aclrtMemPool")),
        "{err}"
    );
}

#[test]
fn without_vmm_a_pool_falls_back_to_one_malloc_segment() {
    let npu = soma::sim::Npu::builder().capacity(64 * MIB).vmm(false).build().unwrap();
    let dev = device_of(&npu);
    let sim = npu.sim_device(0).unwrap();
    assert!(!dev.info().supports_vmm);
    let s = dev.create_stream().unwrap();
    let free_before = dev.mem_info().unwrap().free;
    {
        let pool = MemPool::builder().max_size(16 * MIB).build(&dev).unwrap();
        // The whole range is taken at creation with the driver's malloc.
        assert_eq!(free_before - dev.mem_info().unwrap().free, 16 * MIB);
        assert_eq!(sim.stats().calls.map, 0, "no VMM call was made");
        let mut x = pool.alloc_async::<u32>(1 << 18, &s).unwrap();
        s.copy_from_host(&mut x, &vec![5u32; 1 << 18]).unwrap();
        let mut out = vec![0u32; 1 << 18];
        s.copy_to_host(&x, &mut out).unwrap();
        assert!(out.iter().all(|&v| v == 5));
        let ptr = x.device_ptr();
        drop(x);
        let y = pool.alloc_async::<u32>(1 << 18, &s).unwrap();
        assert_eq!(y.device_ptr(), ptr, "same-stream reuse inside the segment");
        assert_eq!(pool.get::<attr::UsedMemCurrent>().unwrap(), MIB);
        assert!(matches!(
            pool.alloc_async::<u8>(16 * MIB as usize, &s),
            Err(Error::OutOfMemory(_))
        ));
        drop(y);
        s.synchronize().unwrap();
        pool.trim_to(0).unwrap();
    }
    assert_eq!(dev.mem_info().unwrap().free, free_before, "dropping the pool frees the segment");
}

/// Typed frees go through the pool's lock-free free ring; an allocation of the same stream
/// and size takes the block straight back. The counters must stay exact all the same.
#[test]
fn lock_free_frees_and_reuses_keep_the_counters_exact() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let first = pool.alloc_async::<u8>(4096, &s).unwrap();
    let ptr = first.device_ptr();
    drop(first);
    for _ in 0..999 {
        let a = pool.alloc_async::<u8>(4096, &s).unwrap();
        assert_eq!(a.device_ptr(), ptr, "the block just freed on this stream");
        drop(a);
    }
    let st = pool.stats();
    assert_eq!((st.allocations, st.frees), (1000, 1000));
    assert_eq!((st.fresh_allocations, st.reuses.same_stream), (1, 999));
    assert_eq!((st.used, st.live_allocations), (0, 0));
    assert_eq!(st.used_high, 4096);
    assert_eq!(st.map_calls, 1);
}

/// A free is visible to the next thing that looks at the pool, on any thread: attributes,
/// stats, snapshots and other streams' allocations see it done.
#[test]
fn a_free_is_visible_to_the_next_query() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(8192, &s1).unwrap();
    assert_eq!(pool.get::<attr::UsedMemCurrent>().unwrap(), 8192);
    drop(a);
    assert_eq!(pool.get::<attr::UsedMemCurrent>().unwrap(), 0);
    std::thread::scope(|t| {
        t.spawn(|| assert_eq!(pool.stats().used, 0)).join().unwrap();
    });
    let snap = pool.snapshot();
    assert_eq!(snap.used, 0);
    // s2 may reuse the block only through a rule: after an event recorded on s1 after the
    // free (follow event dependencies is on by default).
    let ev = s1.record_event().unwrap();
    s2.wait_event(&ev).unwrap();
    let b = pool.alloc_async::<u8>(8192, &s2).unwrap();
    assert_eq!(pool.stats().reuses.event_dependency, 1);
    drop(b);
}

/// More frees in a row than the ring holds: the overflow takes the lock, nothing is lost.
#[test]
fn a_burst_of_frees_larger_than_the_ring() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let sizes: Vec<usize> = (0..300).map(|i| 512 * (1 + i % 7)).collect();
    let live: Vec<_> = sizes.iter().map(|&n| pool.alloc_async::<u8>(n, &s).unwrap()).collect();
    let used: u64 = sizes.iter().map(|&n| n as u64).sum();
    assert_eq!(pool.stats().used, used);
    drop(live);
    let st = pool.stats();
    assert_eq!((st.used, st.live_allocations, st.frees), (0, 0, 300));
    // all of it is cached on `s` and comes back without mapping
    let maps = st.map_calls;
    let again: Vec<_> = sizes.iter().map(|&n| pool.alloc_async::<u8>(n, &s).unwrap()).collect();
    assert_eq!(pool.stats().map_calls, maps);
    assert_eq!(pool.stats().reuses.total(), 300);
    drop(again);
}

/// The typed free and the same-size allocation after it go through the free ring, not the
/// lock; where every free must reach the engine at once there is no ring.
#[test]
fn typed_pairs_go_through_the_free_ring() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    if std::env::var_os("SOMA_SANITIZER").is_some() {
        // The sanitizer's annotations need every free in the engine at once: no ring.
        assert_eq!(pool.free_ring_tickets(), None);
        println!("skipped: SOMA_SANITIZER is set, pools have no free ring");
        return;
    }
    drop(pool.alloc_async::<u8>(1000, &s).unwrap());
    assert_eq!(pool.free_ring_tickets(), Some((1, 0)));
    let a = pool.alloc_async::<u8>(1000, &s).unwrap(); // same rounded size: from the ring
    assert_eq!(pool.free_ring_tickets(), Some((1, 1)));
    drop(a);
    // another size misses the ring and drains it through the lock
    let b = pool.alloc_async::<u8>(4096, &s).unwrap();
    assert_eq!(pool.free_ring_tickets(), Some((2, 2)));
    let st = pool.stats();
    // b is carved from the granule's free space, which a's free (coalesced) tagged with `s`
    assert_eq!((st.allocations, st.frees, st.reuses.same_stream), (3, 2, 2));
    drop(b);
    assert_eq!(MemPool::builder().history(8).build(&dev).unwrap().free_ring_tickets(), None);
    assert_eq!(MemPool::builder().passthrough(true).build(&dev).unwrap().free_ring_tickets(), None);
}

/// On a recycling pool: A (4 MiB) and X (2 MiB); A freed; B (8 MiB) recycles A's granules
/// and maps above X, leaving a hole where A was. Returns A's address (the bottom of the pool's range).
fn hole_below_b<'s>(
    pool: &'s MemPool<'_>,
    s: &'s soma::Stream<'_>,
) -> (u64, Vec<soma::PoolAlloc<'s, u8>>) {
    let a = pool.alloc_async::<u8>(4 * MIB as usize, s).unwrap();
    let bottom = a.device_ptr().addr();
    let x = pool.alloc_async::<u8>(2 * MIB as usize, s).unwrap();
    drop(a);
    s.synchronize().unwrap();
    let b = pool.alloc_async::<u8>(8 * MIB as usize, s).unwrap();
    assert!(pool.stats().unmap_calls > 0, "B recycled A's granules");
    assert!(b.device_ptr().addr() > x.device_ptr().addr(), "B lies above X");
    (bottom, vec![x, b])
}

#[test]
fn a_pool_that_empties_starts_the_next_workload_from_the_bottom() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().recycle_on_growth(true).build(&dev).unwrap();
    let (bottom, live) = hole_below_b(&pool, &s);
    drop(live);
    s.synchronize().unwrap();
    let before = pool.stats();
    let next = pool.alloc_async::<u8>(MIB as usize, &s).unwrap();
    let after = pool.stats();
    assert_eq!(next.device_ptr().addr(), bottom, "the pool packed its mapped memory");
    assert!(after.unmap_calls > before.unmap_calls && after.map_calls > before.map_calls);
    assert_eq!((after.reserved, after.reserved_high), (before.reserved, before.reserved_high));
}

#[test]
fn a_pool_with_work_in_flight_on_its_freed_memory_does_not_move_it() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().recycle_on_growth(true).build(&dev).unwrap();
    let (_, live) = hole_below_b(&pool, &s);
    // Frees enqueued behind a closed gate: not complete, so nothing may be unmapped.
    let gate = Gate::close(&s);
    drop(live);
    let before = pool.stats();
    let next = pool.alloc_async::<u8>(MIB as usize, &s).unwrap();
    assert_eq!(pool.stats().unmap_calls, before.unmap_calls);
    gate.open();
    drop(next);
}

/// Recycling (opt-in) that has become chronic pauses (more than 64 growths in 512 allocations
/// each recycled), and the pool's statistics show it, sharded or not: RMM's `random_allocations`
/// with sizes up to 32 MiB and 2 GiB live.
#[test]
fn chronic_recycling_pauses_and_the_stats_count_it() {
    let npu = npu_with_capacity(8 << 30);
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let w = random_allocations(1500, 32, 2048, SEED);
    for shards in [1, 2] {
        let pool =
            MemPool::builder().recycle_on_growth(true).stream_shards(shards).build(&dev).unwrap();
        let left = replay(&mut SomaApi::new(&pool, &s), &w.ops, w.slots);
        let st = pool.stats();
        assert!(st.recycling_pauses >= 1, "{shards} shard(s): {st:?}");
        assert!(st.to_string().contains("recycling paused"), "{st}");
        drop(left);
    }
}
