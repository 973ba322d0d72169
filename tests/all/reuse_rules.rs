//! The four reuse rules, each on and off, on the software NPU. A block freed on stream S may
//! go to an allocation on stream T when: (1) T is S (always on); (2) following event
//! dependencies, T waited on an event recorded on S after the free; (3) opportunistically,
//! the free has completed on the device; (4) with internal dependencies, the pool makes T
//! wait on an event it records on S after the free. A free the host has observed (a
//! synchronisation, or its stream dropped) is reusable by every stream.
//!
//! A freed block is "reused" when the next allocation of the same size gets the same device
//! pointer; when no rule allows it, the pool must map fresh memory at another address. Frees
//! are kept incomplete with a [`Gate`] so that only the rule under test can justify reuse.

use soma::{MemPool, ReusePolicy};

use crate::common::{device_of, npu, wait_device_only, Gate};

const MIB: usize = 1 << 20;

fn pool_with(dev: &soma::Device, policy: ReusePolicy) -> MemPool<'_> {
    MemPool::builder().max_size(256 << 20).reuse(policy).build(dev).unwrap()
}

#[test]
fn same_stream_reuse_is_always_on_and_touches_no_driver() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let gate = Gate::close(&s);
    let a = pool.alloc_async::<u8>(MIB, &s).unwrap();
    let ptr = a.device_ptr();
    drop(a);
    let maps_before = pool.stats().map_calls;
    let b = pool.alloc_async::<u8>(MIB, &s).unwrap();
    assert_eq!(b.device_ptr(), ptr, "same-stream reuse while the free is still pending");
    assert_eq!(pool.stats().map_calls, maps_before, "reuse must not map");
    assert_eq!(pool.stats().reuses.same_stream, 1);
    gate.open();
}

#[test]
fn other_stream_does_not_reuse_without_a_rule() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let gate = Gate::close(&s1);
    let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
    let ptr = a.device_ptr();
    drop(a);
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    assert_ne!(b.device_ptr(), ptr);
    assert_eq!(pool.stats().reuses.total(), 0);
    gate.open();
}

#[test]
fn follow_event_dependencies_on_and_off() {
    for on in [true, false] {
        let npu = npu();
        let dev = device_of(&npu);
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool = pool_with(&dev, ReusePolicy::new(on, false, false));
        let gate = Gate::close(&s1);
        let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
        let ptr = a.device_ptr();
        drop(a);
        let ev = s1.record_event().unwrap();
        s2.wait_event(&ev).unwrap();
        let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
        assert_eq!(b.device_ptr() == ptr, on, "follow_event_dependencies = {on}");
        assert_eq!(pool.stats().reuses.event_dependency, on as u64);
        gate.open();
    }
}

#[test]
fn event_dependencies_follow_chains_of_streams() {
    for on in [true, false] {
        let npu = npu();
        let dev = device_of(&npu);
        let s1 = dev.create_stream().unwrap();
        let s2 = dev.create_stream().unwrap();
        let s3 = dev.create_stream().unwrap();
        let pool = pool_with(&dev, ReusePolicy::new(on, false, false));
        let gate = Gate::close(&s1);
        let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
        let ptr = a.device_ptr();
        drop(a);
        let e1 = s1.record_event().unwrap();
        s2.wait_event(&e1).unwrap();
        let e2 = s2.record_event().unwrap();
        s3.wait_event(&e2).unwrap();
        let b = pool.alloc_async::<u8>(MIB, &s3).unwrap();
        assert_eq!(b.device_ptr() == ptr, on, "chain s1 -> s2 -> s3, switch {on}");
        gate.open();
    }
}

#[test]
fn an_event_recorded_before_the_free_gives_no_right() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with(&dev, ReusePolicy::new(true, false, false));
    let gate = Gate::close(&s1);
    let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
    let ptr = a.device_ptr();
    let ev = s1.record_event().unwrap();
    drop(a); // freed after the record
    s2.wait_event(&ev).unwrap();
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    assert_ne!(b.device_ptr(), ptr);
    gate.open();
}

#[test]
fn opportunistic_on_and_off() {
    for on in [true, false] {
        let npu = npu();
        let dev = device_of(&npu);
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool = pool_with(&dev, ReusePolicy::new(false, on, false));
        let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
        let ptr = a.device_ptr();
        s1.host_fn(|| std::thread::sleep(std::time::Duration::from_millis(5))).unwrap();
        drop(a);
        wait_device_only(&s1); // completed on the device; the host did not synchronise
        let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
        assert_eq!(b.device_ptr() == ptr, on, "opportunistic = {on}");
        assert_eq!(pool.stats().reuses.opportunistic, on as u64);
    }
}

#[test]
fn opportunistic_never_takes_an_incomplete_free() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with(&dev, ReusePolicy::new(false, true, false));
    let gate = Gate::close(&s1);
    let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
    let ptr = a.device_ptr();
    drop(a);
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    assert_ne!(b.device_ptr(), ptr);
    gate.open();
}

#[test]
fn internal_dependencies_on_and_off() {
    for on in [true, false] {
        let npu = npu();
        let dev = device_of(&npu);
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool = pool_with(&dev, ReusePolicy::new(false, false, on));
        let gate = Gate::close(&s1);
        let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
        let ptr = a.device_ptr();
        drop(a);
        let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
        assert_eq!(b.device_ptr() == ptr, on, "internal_dependencies = {on}");
        if on {
            // The pool made s2 wait for s1: s2 cannot finish while s1 is gated.
            let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let f = flag.clone();
            s2.host_fn(move || f.store(true, std::sync::atomic::Ordering::SeqCst)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(30));
            assert!(
                !flag.load(std::sync::atomic::Ordering::SeqCst),
                "s2 ran before s1 reached the free"
            );
            gate.open();
            s2.synchronize().unwrap();
            assert!(flag.load(std::sync::atomic::Ordering::SeqCst));
            assert_eq!(pool.stats().reuses.internal_dependency, 1);
        } else {
            gate.open();
        }
    }
}

#[test]
fn a_synchronized_free_is_reusable_by_every_stream() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
    let ptr = a.device_ptr();
    drop(a);
    s1.synchronize().unwrap();
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    assert_eq!(b.device_ptr(), ptr);
    assert_eq!(pool.stats().reuses.host_synchronized, 1);
}

/// One MiB on `s1`, then one on `s2`: the two halves of a fresh granule. Returns them and
/// the granule's address.
fn halves<'p: 'a + 'b, 'a, 'b, 'd>(
    pool: &'p MemPool<'d>,
    s1: &'a soma::Stream<'d>,
    s2: &'b soma::Stream<'d>,
) -> (soma::PoolAlloc<'a, u8>, soma::PoolAlloc<'b, u8>, soma::hal::DevicePtr) {
    let a = pool.alloc_async::<u8>(MIB, s1).unwrap();
    let b = pool.alloc_async::<u8>(MIB, s2).unwrap();
    assert_eq!(a.device_ptr().addr().abs_diff(b.device_ptr().addr()), MIB as u64);
    let low = a.device_ptr().min(b.device_ptr());
    (a, b, low)
}

/// The whole granule for `s` once its halves are freed: its address, and the map calls
/// the allocation made.
fn whole_granule(pool: &MemPool<'_>, s: &soma::Stream<'_>) -> (soma::hal::DevicePtr, u64) {
    let maps = pool.stats().map_calls;
    let c = pool.alloc_async::<u8>(2 * MIB, s).unwrap();
    (c.device_ptr(), pool.stats().map_calls - maps)
}

#[test]
fn synchronized_frees_of_different_streams_merge() {
    // Two streams free the halves of a granule; a third asks for the whole granule.
    for synchronize in [false, true] {
        let npu = npu();
        let dev = device_of(&npu);
        let (s1, s2, s3) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        let pool = pool_with(&dev, ReusePolicy::NONE);
        let (a, b, low) = halves(&pool, &s1, &s2);
        drop(a);
        drop(b);
        if synchronize {
            dev.synchronize().unwrap();
        }
        let (ptr, maps) = whole_granule(&pool, &s3);
        if synchronize {
            // Once the host has observed both frees they settle into one block that any
            // stream may use.
            assert_eq!((ptr, maps), (low, 0));
        } else {
            // Free blocks of different streams never merge while their frees are pending
            // (each keeps its stream's ordering), so the third stream maps fresh memory.
            assert!(ptr != low && maps == 1, "{ptr} {maps}");
        }
    }
}

#[test]
fn a_synchronized_free_merges_with_the_next_stream_that_frees_alone() {
    // Stream 1 frees one half of a granule and the host synchronizes: only stream 1 has ever
    // freed, but other streams exist, so its free settles. Stream 2 then frees the other
    // half alone: it joins the settled half, and stream 2 gets the whole granule back.
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let (a, b, low) = halves(&pool, &s1, &s2);
    drop(a);
    dev.synchronize().unwrap();
    drop(b);
    assert_eq!(whole_granule(&pool, &s2), (low, 0));
}

#[test]
fn a_dropped_streams_frees_merge_with_another_streams() {
    // Stream 1 frees one half of a granule and is dropped (which drains it, no
    // synchronisation); stream 2 frees the other half alone and gets the whole granule.
    let npu = npu();
    let dev = device_of(&npu);
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let s2 = dev.create_stream().unwrap();
    let s1 = dev.create_stream().unwrap();
    let (a, b, low) = halves(&pool, &s1, &s2);
    drop(a);
    drop(s1);
    drop(b);
    assert_eq!(whole_granule(&pool, &s2), (low, 0));
}

#[test]
fn out_of_memory_waits_for_pending_frees_and_merges_them() {
    // A full pool (one granule): two streams free its halves behind gates, a third asks for
    // the whole. No rule lets it use their frees, so the pool waits for them before
    // reporting out of memory; once waited for they settle into one block, which serves the
    // request from the cache (without settling it would unmap the granule and map it again).
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2, s3) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(2 << 20).reuse(ReusePolicy::NONE).build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    let low = a.device_ptr().min(b.device_ptr());
    let gates = (Gate::close(&s1), Gate::close(&s2));
    drop(a);
    drop(b);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        gates.0.open();
        gates.1.open();
    });
    let c = pool.alloc_async::<u8>(2 * MIB, &s3).unwrap();
    opener.join().unwrap();
    assert_eq!(c.device_ptr(), low);
    let stats = pool.stats();
    assert_eq!((stats.oom_retries, stats.ooms, stats.map_calls), (1, 0, 1));
}

#[test]
fn a_dropped_stream_leaves_its_cache_to_the_others() {
    let npu = npu();
    let dev = device_of(&npu);
    let s2 = dev.create_stream().unwrap();
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let ptr = {
        let s1 = dev.create_stream().unwrap();
        let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
        a.device_ptr()
    };
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    assert_eq!(b.device_ptr(), ptr);
}

#[test]
fn a_use_on_another_stream_orders_the_free_after_it() {
    // x lives on s1 and is written on s2 behind a gate; s1 frees it and reallocates the same
    // block at once (same-stream reuse) and writes it. The free must wait for s2's write, so
    // s1's value wins; without the recorded use, s2's late write would land last.
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let mut x = pool.alloc_async::<u32>(1024, &s1).unwrap();
    let ptr = x.device_ptr();
    let gate = Gate::close(&s2);
    s2.launch("late_write", &[soma::KernelArg::write(&mut x)], |b| {
        b.write::<u32>(0)?.fill(2);
        Ok(())
    })
    .unwrap();
    drop(x);
    let mut y = pool.alloc_async::<u32>(1024, &s1).unwrap();
    assert_eq!(y.device_ptr(), ptr);
    s1.launch("write", &[soma::KernelArg::write(&mut y)], |b| {
        b.write::<u32>(0)?.fill(1);
        Ok(())
    })
    .unwrap();
    gate.open();
    let mut out = vec![0u32; 1024];
    s1.copy_to_host(&y, &mut out).unwrap();
    s2.synchronize().unwrap();
    assert!(out.iter().all(|&v| v == 1), "s1's write must land after s2's");
}

#[test]
fn hand_off_moves_an_allocation_safely() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with(&dev, ReusePolicy::NONE);
    let mut x = pool.alloc_async::<u32>(256, &s1).unwrap();
    let gate = Gate::close(&s1);
    s1.copy_from_host(&mut x, &[7u32; 256]).unwrap();
    let x = x.hand_off(&s2).unwrap();
    assert_eq!(x.stream().id(), s2.id());
    gate.open();
    let mut out = vec![0u32; 256];
    s2.copy_to_host(&x, &mut out).unwrap();
    assert_eq!(out, vec![7u32; 256], "s2 saw the data s1 wrote before the hand-off");
}

/// A use on a stream that was dropped orders nothing: the free must not wait on the stream
/// that took the dropped one's slot (it never touched the block; waiting on it could hang a
/// correct program whose new stream waits for the host).
#[test]
fn a_use_on_a_dropped_stream_does_not_make_the_free_wait_on_its_slots_next_stream() {
    let npu = npu();
    let dev = device_of(&npu);
    let s1 = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.alloc_async::<u32>(1024, &s1).unwrap();
    let mut tmp = pool.alloc_async::<u32>(1024, &s1).unwrap();
    {
        let u = dev.create_stream().unwrap();
        u.copy(&mut tmp, &x).unwrap(); // a use of x on u
        u.synchronize().unwrap();
    } // u dropped (drained); its slot is free
    let v = dev.create_stream().unwrap(); // takes u's slot
    let gate = Gate::close(&v);
    drop(x); // ordered after u's use: complete already, nothing to wait for
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while s1.hal().completed() < s1.hal().enqueued() {
        assert!(std::time::Instant::now() < deadline, "s1 waits on v, which never used x");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    gate.open();
    drop(tmp);
}

/// The stream that took a dropped user's slot and uses the block too is a new user: the free
/// waits for its use.
#[test]
fn a_use_on_the_next_stream_in_a_dropped_users_slot_orders_the_free() {
    let npu = npu();
    let dev = device_of(&npu);
    let s1 = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let y = pool.alloc_async::<u32>(1024, &s1).unwrap();
    let mut tmp = pool.alloc_async::<u32>(1024, &s1).unwrap();
    {
        let u = dev.create_stream().unwrap();
        u.copy(&mut tmp, &y).unwrap();
    } // u dropped
    let w = dev.create_stream().unwrap(); // takes u's slot
    let gate = Gate::close(&w);
    w.copy(&mut tmp, &y).unwrap(); // queued behind the gate
    drop(y); // must wait for w's use
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(s1.hal().completed() < s1.hal().enqueued(), "the free did not wait for w's use");
    gate.open();
    wait_device_only(&s1);
    drop(tmp);
}

/// Each allocation tells which rule served it, as the history records it, whether the
/// handle is borrowed or owned and whether the free ring or the engine handed the block out.
#[test]
fn each_allocation_tells_the_rule_that_served_it() {
    use soma::ReuseKind;
    // Whole granules: no never-used tail shares a block with a free.
    const GRANULE: usize = 2 * MIB;
    for history in [0, 64] {
        let npu = npu();
        let dev = device_of(&npu);
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool = MemPool::builder()
            .max_size(256 << 20)
            .reuse(ReusePolicy::NONE)
            .history(history)
            .build(&dev)
            .unwrap();
        let mut kinds = Vec::new();
        let mut served = |a: &soma::PoolAlloc<'_, u8>| kinds.push(a.reuse_kind());
        let gate = Gate::close(&s1);
        let a = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
        served(&a);
        drop(a);
        // Same stream and size: the free ring's only free when the pool has a ring.
        let b = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
        served(&b);
        drop(b);
        // A pool keeps a ring unless it records (a history, the sanitizer's annotations).
        if let Some((_, consumed)) = pool.free_ring_tickets() {
            assert_eq!(consumed, 1, "the ring handed the block back");
        }
        // Another stream, ordered after the free through an event.
        pool.set_reuse_policy(ReusePolicy::NONE.follow_event_dependencies(true));
        s2.wait_event(&s1.record_event().unwrap()).unwrap();
        let c = pool.alloc_async::<u8>(GRANULE, &s2).unwrap();
        served(&c);
        drop(c);
        // The pool inserts the dependency.
        pool.set_reuse_policy(ReusePolicy::NONE.internal_dependencies(true));
        let d = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
        served(&d);
        drop(d);
        gate.open();
        // The free completed on the device, the host has not seen it.
        wait_device_only(&s1);
        pool.set_reuse_policy(ReusePolicy::NONE.opportunistic(true));
        let e = pool.alloc_async::<u8>(GRANULE, &s2).unwrap();
        served(&e);
        drop(e);
        // The host observed it.
        s2.synchronize().unwrap();
        pool.set_reuse_policy(ReusePolicy::NONE);
        let f = pool.alloc_async::<u8>(GRANULE, &s1).unwrap();
        served(&f);
        drop(f);
        assert_eq!(
            kinds,
            [
                None,
                Some(ReuseKind::SameStream),
                Some(ReuseKind::EventDependency),
                Some(ReuseKind::InternalDependency),
                Some(ReuseKind::Opportunistic),
                Some(ReuseKind::HostSynchronized),
            ],
            "history {history}"
        );
        if history > 0 {
            let (records, _) = pool.history();
            let recorded: Vec<_> = records
                .iter()
                .filter(|r| r.kind == soma::observe::RecordKind::Alloc)
                .map(|r| r.reuse)
                .collect();
            assert_eq!(recorded, kinds, "the history agrees");
        }
    }
}

/// An owned allocation tells its rule as a borrowed one does.
#[test]
fn owned_allocations_tell_the_rule_that_served_them() {
    use soma::ReuseKind;
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_owned_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build_owned(&dev).unwrap();
    let a = pool.alloc_async::<u32>(1024, &s).unwrap();
    assert_eq!(a.reuse_kind(), None);
    drop(a);
    let b = pool.alloc_async::<u32>(1024, &s).unwrap();
    assert_eq!(b.reuse_kind(), Some(ReuseKind::SameStream));
}
