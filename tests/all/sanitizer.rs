//! The stream-order sanitizer over real pools: planted bugs must each be caught, and the pool
//! test suite's stream-ordered patterns must run clean with the sanitizer failing streams.

use std::time::Duration;

use soma::hal::{AccessMode, BufferAccess, DevicePtr, DriverError, KernelLaunch};
use soma::sim::{Npu, ReportKind, SanitizerMode, SimDevice};
use soma::{attr, Error, KernelArg, MemPool, ReusePolicy, Stream};

use crate::common::{wait_device_only, Gate, TestRng};

const MIB: usize = 1 << 20;

fn npu(mode: SanitizerMode) -> Npu {
    Npu::builder().capacity(1 << 30).sanitizer(mode).build().unwrap()
}

fn sim(npu: &Npu) -> std::sync::Arc<SimDevice> {
    npu.sim_device(0).unwrap()
}

fn kinds(npu: &Npu) -> Vec<ReportKind> {
    sim(npu).sanitizer_reports().iter().map(|r| r.kind).collect()
}

/// A raw kernel through the HAL: no use recording, no ordering by the pool.
fn raw_fill(s: &Stream<'_>, ptr: DevicePtr, len: u64, value: u8) {
    s.hal()
        .launch(KernelLaunch {
            name: "raw_fill",
            buffers: vec![BufferAccess { ptr, len, mode: AccessMode::Write }],
            body: Box::new(move |b| {
                b.bytes_mut(0)?.fill(value);
                Ok(())
            }),
        })
        .unwrap();
}

fn fill_u32(s: &Stream<'_>, x: &mut soma::PoolAlloc<'_, u32>, value: u32) {
    s.launch("fill", &[KernelArg::write(x)], move |b| {
        b.write::<u32>(0)?.fill(value);
        Ok(())
    })
    .unwrap();
}

fn sanitizer_failure(result: soma::Result<()>, what: &str) {
    match result {
        Err(Error::Driver(DriverError::TaskFailed { message, .. })) => {
            assert!(message.contains(what), "{message}")
        }
        other => panic!("expected a sanitizer failure ({what}), got {other:?}"),
    }
}

// ---- planted bugs ----------------------------------------------------------------------

#[test]
fn use_after_free_on_the_same_stream() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut x = pool.alloc_async::<u32>(1024, &s).unwrap();
    fill_u32(&s, &mut x, 1);
    let ptr = x.device_ptr();
    drop(x);
    raw_fill(&s, ptr, 4096, 2);
    sanitizer_failure(s.synchronize(), "use after free");
    assert_eq!(kinds(&npu), [ReportKind::UseAfterFree]);
}

#[test]
fn cross_stream_use_without_an_event() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().build(&dev).unwrap();
    let gate = Gate::close(&s1);
    let mut a = pool.alloc_async::<u32>(1024, &s1).unwrap();
    fill_u32(&s1, &mut a, 1); // queued behind the gate
    let ptr = a.device_ptr();
    drop(a);
    let b = pool.alloc_async::<u32>(1024, &s1).unwrap(); // same-stream reuse
    assert_eq!(b.device_ptr(), ptr);
    // The bug: s2 writes b through the raw HAL, bypassing soma's API (which would have made
    // s2 wait for s1's allocation point), so it races with a's queued fill.
    raw_fill(&s2, b.device_ptr(), 4096, 2);
    sanitizer_failure(s2.synchronize(), "not ordered after the allocation");
    gate.open();
    drop(b);
    s1.synchronize().unwrap();
    assert_eq!(kinds(&npu), [ReportKind::NotOrderedAfterAlloc]);
}

#[test]
fn soma_s_api_orders_a_first_use_on_another_stream() {
    // The same program through soma's kernel API is correct: the first use of b on s2 makes
    // s2 wait for s1's allocation point, so a's queued fill lands first.
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().build(&dev).unwrap();
    let gate = Gate::close(&s1);
    let mut a = pool.alloc_async::<u32>(1024, &s1).unwrap();
    fill_u32(&s1, &mut a, 1);
    drop(a);
    let mut b = pool.alloc_async::<u32>(1024, &s1).unwrap();
    fill_u32(&s2, &mut b, 2);
    gate.open();
    let mut out = vec![0u32; 1024];
    s2.copy_to_host(&b, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 2), "s2's write lands after a's queued fill");
    drop(b);
    s1.synchronize().unwrap();
    assert_eq!(kinds(&npu), []);
}

#[test]
fn use_before_alloc() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.alloc_async::<u8>(512, &s1).unwrap();
    let next = x.device_ptr().checked_add(512).unwrap(); // mapped, not yet allocated
    let gate = Gate::close(&s2);
    raw_fill(&s2, next, 512, 3); // enqueued on s2 before the allocation below
    let y = pool.alloc_async::<u8>(512, &s1).unwrap();
    assert_eq!(y.device_ptr(), next);
    gate.open();
    sanitizer_failure(s2.synchronize(), "use before the allocation");
    assert_eq!(kinds(&npu), [ReportKind::UseBeforeAlloc]);
    drop((x, y));
}

#[test]
fn out_of_bounds_by_one_element() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.alloc_async::<u32>(1000, &s).unwrap();
    raw_fill(&s, x.device_ptr(), 1001 * 4, 0);
    sanitizer_failure(s.synchronize(), "out-of-bounds");
    assert_eq!(kinds(&npu), [ReportKind::OutOfBounds]);
    let r = &sim(&npu).sanitizer_reports()[0];
    assert_eq!(r.allocation.map(|a| a.size), Some(4000));
}

#[test]
fn free_not_ordered_after_a_raw_cross_stream_use() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.alloc_async::<u32>(1024, &s1).unwrap();
    s2.wait_stream(&s1).unwrap(); // s2 is ordered after the allocation
    raw_fill(&s2, x.device_ptr(), 4096, 4); // raw: the pool does not know of this use
    wait_device_only(&s2);
    drop(x); // the free is not ordered after s2's use
    sanitizer_failure(s1.synchronize(), "free not ordered after a use");
    assert_eq!(kinds(&npu), [ReportKind::FreeNotOrderedAfterUse]);
}

#[test]
fn use_of_a_driver_freed_pointer() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let p = dev.hal().malloc(4096).unwrap();
    raw_fill(&s, p, 4096, 1);
    s.synchronize().unwrap();
    let gate = Gate::close(&s);
    raw_fill(&s, p, 4096, 2);
    dev.hal().free(p).unwrap();
    gate.open();
    sanitizer_failure(s.synchronize(), "use after free");
    assert_eq!(kinds(&npu), [ReportKind::UseAfterFree]);
}

#[test]
fn report_mode_lets_the_task_run() {
    let npu = npu(SanitizerMode::Report);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let x = pool.alloc_async::<u32>(1000, &s).unwrap();
    raw_fill(&s, x.device_ptr(), 4004, 0);
    s.synchronize().unwrap();
    let reports = sim(&npu).take_sanitizer_reports();
    assert_eq!(reports.len(), 1);
    let text = reports[0].to_string();
    assert!(text.contains("out-of-bounds") && text.contains("raw_fill"), "{text}");
}

// ---- no false positives ----------------------------------------------------------------

fn clean(npu: &Npu) {
    let reports = sim(npu).sanitizer_reports();
    assert!(reports.is_empty(), "{}", reports.iter().map(|r| format!("{r}\n")).collect::<String>());
}

#[test]
fn same_stream_reuse_without_synchronisation() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    for round in 0..50u32 {
        let mut a = pool.alloc_async::<u32>(4096, &s).unwrap();
        let mut b = pool.alloc_async::<u32>(4096, &s).unwrap();
        s.copy_from_host(&mut a, &vec![round; 4096]).unwrap();
        s.launch("plus_one", &[KernelArg::read(&a), KernelArg::write(&mut b)], |k| {
            let (a, b) = (k.read::<u32>(0)?, k.write::<u32>(1)?);
            b.iter_mut().zip(a).for_each(|(b, a)| *b = a + 1);
            Ok(())
        })
        .unwrap();
        drop(a);
        let mut c = pool.alloc_async::<u32>(4096, &s).unwrap();
        s.memset(&mut c, 0xff).unwrap();
        s.copy(&mut c, &b).unwrap();
        drop((b, c));
    }
    s.synchronize().unwrap();
    assert!(pool.stats().reuses.same_stream > 0);
    clean(&npu);
}

#[test]
fn event_ordered_reuse_and_chains() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let (s1, s2, s3) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().reuse(ReusePolicy::new(true, false, false)).build(&dev).unwrap();
    let gate = Gate::close(&s1);
    let mut a = pool.alloc_async::<u32>(MIB, &s1).unwrap();
    fill_u32(&s1, &mut a, 1);
    let ptr = a.device_ptr();
    drop(a);
    let e1 = s1.record_event().unwrap();
    s2.wait_event(&e1).unwrap();
    let e2 = s2.record_event().unwrap();
    s3.wait_event(&e2).unwrap();
    let mut b = pool.alloc_async::<u32>(MIB, &s3).unwrap();
    assert_eq!(b.device_ptr(), ptr, "chain s1 -> s2 -> s3");
    fill_u32(&s3, &mut b, 2);
    gate.open();
    let mut out = vec![0u32; MIB];
    s3.copy_to_host(&b, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 2));
    drop(b);
    dev.synchronize().unwrap();
    clean(&npu);
}

#[test]
fn internal_dependencies_and_opportunistic_reuse() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().reuse(ReusePolicy::new(false, false, true)).build(&dev).unwrap();
    let gate = Gate::close(&s1);
    let mut a = pool.alloc_async::<u32>(MIB, &s1).unwrap();
    fill_u32(&s1, &mut a, 1);
    let ptr = a.device_ptr();
    drop(a);
    let mut b = pool.alloc_async::<u32>(MIB, &s2).unwrap();
    assert_eq!(b.device_ptr(), ptr);
    fill_u32(&s2, &mut b, 2);
    gate.open();
    drop(b);
    s2.synchronize().unwrap();
    // Opportunistic: the free has completed on the device, the host did not synchronize.
    pool.set_reuse_policy(ReusePolicy::new(false, true, false));
    let mut c = pool.alloc_async::<u32>(MIB, &s1).unwrap();
    fill_u32(&s1, &mut c, 3);
    let ptr = c.device_ptr();
    drop(c);
    wait_device_only(&s1);
    let mut d = pool.alloc_async::<u32>(MIB, &s2).unwrap();
    assert_eq!(d.device_ptr(), ptr);
    fill_u32(&s2, &mut d, 4);
    drop(d);
    dev.synchronize().unwrap();
    assert!(pool.stats().reuses.opportunistic >= 1);
    clean(&npu);
}

#[test]
fn hand_off_and_automatic_cross_stream_use_recording() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().reuse(ReusePolicy::NONE).build(&dev).unwrap();
    // hand_off
    let mut x = pool.alloc_async::<u32>(256, &s1).unwrap();
    let gate = Gate::close(&s1);
    s1.copy_from_host(&mut x, &[7u32; 256]).unwrap();
    let x = x.hand_off(&s2).unwrap();
    gate.open();
    let mut out = vec![0u32; 256];
    s2.copy_to_host(&x, &mut out).unwrap();
    assert_eq!(out, vec![7u32; 256]);
    drop(x);
    // A use on another stream (ordered after the allocation) is recorded; the free waits.
    let mut y = pool.alloc_async::<u32>(1024, &s1).unwrap();
    s2.wait_stream(&s1).unwrap();
    let gate = Gate::close(&s2);
    fill_u32(&s2, &mut y, 2);
    drop(y);
    let mut z = pool.alloc_async::<u32>(1024, &s1).unwrap();
    fill_u32(&s1, &mut z, 1);
    gate.open();
    s1.copy_to_host(&z, &mut vec![0u32; 1024]).unwrap();
    drop(z);
    dev.synchronize().unwrap();
    clean(&npu);
}

/// Uses of one allocation recorded at the same time from several threads (the first of them
/// creates the allocation's use list): the free waits for every one of those streams, so the
/// block's next owner on the allocating stream cannot overwrite it under a pending read.
#[test]
fn uses_recorded_concurrently_from_several_threads_all_order_the_free() {
    const READERS: usize = 4;
    for round in 0..8u32 {
        let npu = npu(SanitizerMode::FailStream);
        let dev = npu.device(0).unwrap();
        let home = dev.create_stream().unwrap();
        let readers: Vec<_> = (0..READERS).map(|_| dev.create_stream().unwrap()).collect();
        let pool = MemPool::builder().reuse(ReusePolicy::NONE).build(&dev).unwrap();
        let mut a = pool.alloc_async::<u32>(4096, &home).unwrap();
        fill_u32(&home, &mut a, round);
        let old = a.device_ptr();
        // Each reader stream holds its read behind a closed gate until the block is reused.
        let gates: Vec<_> = readers.iter().map(Gate::close).collect();
        let barrier = std::sync::Barrier::new(READERS);
        std::thread::scope(|scope| {
            for r in &readers {
                let (a, barrier) = (&a, &barrier);
                scope.spawn(move || {
                    barrier.wait();
                    r.launch("read", &[KernelArg::read(a)], move |b| {
                        assert!(b.read::<u32>(0)?.iter().all(|&v| v == round));
                        Ok(())
                    })
                    .unwrap();
                });
            }
        });
        drop(a);
        let mut b = pool.alloc_async::<u32>(4096, &home).unwrap();
        assert_eq!(b.device_ptr(), old, "the test needs the block reused on its stream");
        fill_u32(&home, &mut b, round + 100);
        drop(gates);
        dev.synchronize().expect("every read ends before the block's next owner writes it");
        clean(&npu);
        drop(b);
    }
}

#[test]
fn the_pool_suites_cross_stream_write_of_a_fresh_block() {
    // The `reuse_rules` module's case: x is written on s2 without an explicit event; soma's
    // API makes that first use wait for the allocation point, so both sanitizer modes accept
    // it.
    for strict in [false, true] {
        let npu = Npu::builder()
            .capacity(1 << 30)
            .sanitizer(SanitizerMode::Report)
            .sanitizer_strict(strict)
            .build()
            .unwrap();
        let dev = npu.device(0).unwrap();
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool = MemPool::builder().reuse(ReusePolicy::NONE).build(&dev).unwrap();
        let mut x = pool.alloc_async::<u32>(1024, &s1).unwrap();
        let gate = Gate::close(&s2);
        fill_u32(&s2, &mut x, 2);
        drop(x);
        let mut y = pool.alloc_async::<u32>(1024, &s1).unwrap();
        fill_u32(&s1, &mut y, 1);
        gate.open();
        let mut out = vec![0u32; 1024];
        s1.copy_to_host(&y, &mut out).unwrap();
        assert!(out.iter().all(|&v| v == 1));
        drop(y);
        dev.synchronize().unwrap();
        // soma orders the first use on s2 after the allocation: clean even in strict mode.
        assert_eq!(kinds(&npu), [], "strict = {strict}");
    }
}

#[test]
fn reuse_after_synchronize_and_stream_drop() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s2 = dev.create_stream().unwrap();
    let pool = MemPool::builder().reuse(ReusePolicy::NONE).build(&dev).unwrap();
    let ptr = {
        let s1 = dev.create_stream().unwrap();
        let mut a = pool.alloc_async::<u32>(MIB, &s1).unwrap();
        fill_u32(&s1, &mut a, 1);
        a.device_ptr()
    }; // s1 dropped: drained
    let mut b = pool.alloc_async::<u32>(MIB, &s2).unwrap();
    assert_eq!(b.device_ptr(), ptr);
    fill_u32(&s2, &mut b, 2);
    drop(b);
    s2.synchronize().unwrap();
    let s3 = dev.create_stream().unwrap();
    let mut c = pool.alloc_async::<u32>(MIB, &s3).unwrap();
    assert_eq!(c.device_ptr(), ptr);
    fill_u32(&s3, &mut c, 3);
    drop(c);
    dev.synchronize().unwrap();
    clean(&npu);
}

#[test]
fn compaction_and_threads_run_clean() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(16 << 20).build(&dev).unwrap();
    let mut blocks: Vec<_> =
        (0..16u32).map(|_| pool.alloc_async::<u32>(256 * 1024, &s).unwrap()).collect();
    for (i, b) in blocks.iter_mut().enumerate() {
        s.copy_from_host(b, &vec![i as u32; 256 * 1024]).unwrap();
    }
    let mut kept: Vec<_> = blocks.into_iter().enumerate().filter(|(i, _)| i % 2 == 1).collect();
    let mut refs: Vec<_> = kept.iter_mut().map(|(_, b)| b).collect();
    assert!(pool.compact(&s, &mut refs).unwrap() >= 4);
    for (i, b) in &kept {
        let mut out = vec![0u32; 256 * 1024];
        s.copy_to_host(b, &mut out).unwrap();
        assert!(out.iter().all(|&v| v == *i as u32));
    }
    drop(kept);
    let pool2 = MemPool::builder().max_size(256 << 20).build(&dev).unwrap();
    std::thread::scope(|scope| {
        for t in 0..3u32 {
            let (dev, pool) = (&dev, &pool2);
            scope.spawn(move || {
                let s = dev.create_stream().unwrap();
                for i in 0..100u32 {
                    let len = 1 + (i as usize * 7919 + t as usize * 104729) % 20_000;
                    let mut a = pool.alloc_async::<u32>(len, &s).unwrap();
                    s.copy_from_host(&mut a, &vec![i; len]).unwrap();
                    if i % 10 == 0 {
                        let mut out = vec![0u32; len];
                        s.copy_to_host(&a, &mut out).unwrap();
                        assert!(out.iter().all(|&v| v == i));
                    }
                }
                s.synchronize().unwrap();
            });
        }
    });
    s.synchronize().unwrap();
    clean(&npu);
}

// ---- pass-through mode -----------------------------------------------------------------

#[test]
fn passthrough_maps_every_allocation_and_unmaps_every_completed_free() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().passthrough(true).build(&dev).unwrap();
    assert_eq!(pool.reuse_policy(), ReusePolicy::NONE);
    assert_eq!(pool.get::<attr::ReleaseThreshold>().unwrap(), 0);
    for round in 0..5u32 {
        let mut a = pool.alloc_async::<u32>(MIB, &s).unwrap();
        fill_u32(&s, &mut a, round);
        drop(a);
        // Nothing reuses the block, not even the same stream.
        let mut b = pool.alloc_async::<u32>(MIB, &s).unwrap();
        fill_u32(&s, &mut b, round);
        drop(b);
    }
    assert_eq!(pool.stats().reuses.total(), 0);
    s.synchronize().unwrap();
    assert_eq!(pool.trim_to(0).unwrap(), 0, "everything was released already");
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0);
    assert_eq!(sim(&npu).stats().mapped_bytes, 0);
    // A use after a completed pass-through free hits unmapped memory at once.
    let x = pool.alloc_async::<u32>(1024, &s).unwrap();
    let ptr = x.device_ptr();
    drop(x);
    s.synchronize().unwrap(); // the free completed; the synchronize released it
    let err = s.hal().memset(ptr, 0, 16).unwrap_err();
    assert!(matches!(err, DriverError::InvalidAddress { .. }), "{err:?}");
    s.synchronize().unwrap();
    clean(&npu);
}

#[test]
fn passthrough_frees_wait_for_the_stream() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().passthrough(true).build(&dev).unwrap();
    let gate = Gate::close(&s);
    let mut a = pool.alloc_async::<u32>(MIB, &s).unwrap();
    fill_u32(&s, &mut a, 1);
    drop(a);
    assert_eq!(pool.stats().used, (MIB * 4) as u64, "the free has not completed");
    std::thread::sleep(Duration::from_millis(10));
    assert!(pool.get::<attr::ReservedMemCurrent>().unwrap() >= (MIB * 4) as u64);
    gate.open();
    s.synchronize().unwrap();
    assert_eq!(pool.stats().used, 0);
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0);
    clean(&npu);
}

#[test]
fn passthrough_raw_double_free_is_an_error() {
    let npu = npu(SanitizerMode::FailStream);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().passthrough(true).raw_pointers(true).build(&dev).unwrap();
    let (p, _) = pool.alloc_raw(4096, &s).unwrap();
    let gate = Gate::close(&s);
    pool.free_raw(p, &s).unwrap();
    assert!(pool.free_raw(p, &s).is_err(), "double free while the first is in flight");
    gate.open();
    s.synchronize().unwrap();
    assert!(pool.free_raw(p, &s).is_err(), "double free after the release");
    clean(&npu);
}

type Live<'s> = Vec<(u32, soma::PoolAlloc<'s, u32>)>;

/// `steps` random, correct operations: allocations, uses (own stream, and other streams
/// between events), hand-offs, frees, data checks, events and synchronisations.
fn random_steps<'s>(
    seed: u64,
    steps: u32,
    dev: &soma::Device,
    streams: &'s [Stream<'s>],
    pool: &'s MemPool<'s>,
    live: &mut Live<'s>,
) {
    let mut rng = TestRng::new(seed);
    let n = streams.len();
    for step in 0..steps {
        match rng.below(10) {
            0..=2 => {
                let s = &streams[rng.index(n)];
                let len = 1 + rng.index(40_000);
                let mut a = pool.alloc_async::<u32>(len, s).unwrap();
                fill_u32(s, &mut a, step);
                live.push((step, a));
            }
            3 if !live.is_empty() => {
                let i = rng.index(live.len());
                drop(live.swap_remove(i));
            }
            4 if !live.is_empty() => {
                let i = rng.index(live.len());
                let t = &streams[rng.index(n)];
                t.wait_stream(live[i].1.stream()).unwrap();
                fill_u32(t, &mut live[i].1, step);
                live[i].0 = step;
                // Later uses on the owner stream come after this one (no data race).
                live[i].1.stream().wait_stream(t).unwrap();
            }
            5 if !live.is_empty() => {
                let i = rng.index(live.len());
                let (v, a) = live.swap_remove(i);
                let a = a.hand_off(&streams[rng.index(n)]).unwrap();
                live.push((v, a));
            }
            6 if !live.is_empty() => {
                let i = rng.index(live.len());
                let (v, a) = &live[i];
                let mut out = vec![0u32; a.len()];
                a.stream().copy_to_host(a, &mut out).unwrap();
                assert!(out.iter().all(|x| x == v), "seed {seed} step {step}");
            }
            7 => {
                let (a, b) = (rng.index(n), rng.index(n));
                let e = streams[a].record_event().unwrap();
                streams[b].wait_event(&e).unwrap();
                if rng.below(4) == 0 {
                    e.synchronize().unwrap();
                }
            }
            8 => match rng.below(3) {
                0 => streams[rng.index(n)].synchronize().unwrap(),
                1 => dev.synchronize().unwrap(),
                _ => {
                    let _ = streams[rng.index(n)].query().unwrap();
                }
            },
            _ => {
                if let Some((v, a)) = live.last_mut() {
                    let s = a.stream();
                    fill_u32(s, a, step);
                    *v = step;
                }
            }
        }
    }
}

fn policy_of(seed: u64) -> ReusePolicy {
    match seed % 3 {
        0 => ReusePolicy::NONE,
        1 => ReusePolicy::default(),
        _ => ReusePolicy::ALL,
    }
}

#[test]
fn random_correct_programs_run_clean() {
    // Correct programs over three streams and every reuse policy: no report, and every
    // allocation keeps its data.
    for seed in 1..=12u64 {
        let npu = npu(SanitizerMode::FailStream);
        let dev = npu.device(0).unwrap();
        let streams: Vec<Stream<'_>> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
        let pool =
            MemPool::builder().max_size(256 << 20).reuse(policy_of(seed)).build(&dev).unwrap();
        let mut live: Live<'_> = Vec::new();
        random_steps(seed, 600, &dev, &streams, &pool, &mut live);
        for (v, a) in &live {
            let mut out = vec![0u32; a.len()];
            a.stream().copy_to_host(a, &mut out).unwrap();
            assert!(out.iter().all(|x| x == v), "seed {seed} at the end");
        }
        drop(live);
        dev.synchronize().unwrap();
        clean(&npu);
        let st = pool.stats();
        assert!(st.reuses.total() > 0 || policy_of(seed) == ReusePolicy::NONE, "{st:?}");
    }
}

#[test]
fn planted_bugs_after_random_programs_are_always_caught() {
    // After a random correct prefix, plant one bug; it must be reported, with its kind.
    for seed in 1..=9u64 {
        for bug in 0..4 {
            let npu = npu(SanitizerMode::Report);
            let dev = npu.device(0).unwrap();
            let streams: Vec<Stream<'_>> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
            let pool =
                MemPool::builder().max_size(256 << 20).reuse(policy_of(seed)).build(&dev).unwrap();
            let mut live: Live<'_> = Vec::new();
            random_steps(seed, 200, &dev, &streams, &pool, &mut live);
            let s = &streams[0];
            let mut x = pool.alloc_async::<u32>(1000, s).unwrap();
            fill_u32(s, &mut x, 1);
            let expected = match bug {
                0 => {
                    let p = x.device_ptr();
                    drop(x);
                    raw_fill(s, p, 4000, 0);
                    ReportKind::UseAfterFree
                }
                1 => {
                    raw_fill(s, x.device_ptr(), 4004, 0);
                    drop(x);
                    ReportKind::OutOfBounds
                }
                2 => {
                    let t = &streams[1];
                    t.wait_stream(s).unwrap();
                    raw_fill(t, x.device_ptr(), 4000, 0);
                    wait_device_only(t);
                    drop(x);
                    ReportKind::FreeNotOrderedAfterUse
                }
                _ => {
                    let p = x.device_ptr();
                    drop(x);
                    s.synchronize().unwrap();
                    let t = &streams[2];
                    raw_fill(t, p, 4000, 0);
                    ReportKind::UseAfterFree
                }
            };
            drop(live);
            dev.synchronize().unwrap();
            assert_eq!(kinds(&npu), [expected], "seed {seed} bug {bug}");
        }
    }
}

#[test]
fn a_use_enqueued_right_after_a_synchronize_is_not_ordered_before_a_free() {
    // The test above in one of its timings (seed 1, bug 2, about 1 run in 30), made
    // deterministic: the prefix ends with a synchronize of `t` and `t.wait_stream(s)` needs
    // no wait task (the record has completed), so the raw fill takes the position just past
    // the host's observation of `t`. That position is not observed (the sanitizer's bounds
    // are exclusive; an inclusive comparison would count it), and the unordered free must be
    // reported.
    let npu = npu(SanitizerMode::Report);
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut x = pool.alloc_async::<u32>(1000, &s).unwrap();
    fill_u32(&s, &mut x, 1);
    t.wait_stream(&s).unwrap();
    t.synchronize().unwrap(); // the host observes everything enqueued on t so far
    raw_fill(&t, x.device_ptr(), 4000, 0); // t's next task: not observed by anyone
    wait_device_only(&t);
    drop(x); // the free is not ordered after t's use
    dev.synchronize().unwrap();
    assert_eq!(kinds(&npu), [ReportKind::FreeNotOrderedAfterUse]);
}

#[test]
fn a_raw_free_on_an_unordered_stream_lets_a_reuse_race_with_the_previous_owner() {
    // A program of the `state_machine` property test under the sanitizer. Block B is used and
    // freed on s1 (its work still queued), reused on s1 (same stream), then that allocation is
    // freed raw onto s2, which is not ordered after s1. The pool tags the block with s2's
    // free only, so s3 (ordered after s2 by an event) gets it, while s1's first owner may
    // still be running: the sanitizer reports s3's use.
    let npu = npu(SanitizerMode::Report);
    let dev = npu.device(0).unwrap();
    let (s1, s2, s3) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder()
        .reuse(ReusePolicy::new(true, false, false))
        .raw_pointers(true)
        .build(&dev)
        .unwrap();
    let gate = Gate::close(&s1);
    let (p, _) = pool.alloc_raw(4096, &s1).unwrap();
    raw_fill(&s1, p, 4096, 1); // the first owner's work, queued behind the gate
    pool.free_raw(p, &s1).unwrap();
    let (q, _) = pool.alloc_raw(4096, &s1).unwrap();
    assert_eq!(q, p, "same-stream reuse");
    pool.free_raw(q, &s2).unwrap(); // s2 is not ordered after s1
    s3.wait_stream(&s2).unwrap();
    let (r, _) = pool.alloc_raw(4096, &s3).unwrap();
    assert_eq!(r, p, "reused through s2's free");
    raw_fill(&s3, r, 4096, 3);
    s3.synchronize().unwrap();
    gate.open();
    dev.synchronize().unwrap();
    assert_eq!(kinds(&npu), [ReportKind::UnorderedReuse]);
}
