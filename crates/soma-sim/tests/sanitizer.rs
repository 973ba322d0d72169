//! The stream-order sanitizer at the device level: planted bugs (each must be reported) and
//! correct stream-ordered patterns (none may be), with pool annotations made by hand the way
//! a pool makes them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use soma_sim::hal::{
    AccessMode, BufferAccess, DeviceHal, DevicePtr, DriverError, KernelLaunch, MemRef,
    PoolAnnotation, StreamHal,
};
use soma_sim::{Npu, ReportKind, SanitizerMode, SimDevice, SimStream};

const G: u64 = 2 << 20;
const POOL: u64 = 7;

fn device(mode: SanitizerMode) -> Arc<SimDevice> {
    Npu::builder().capacity(64 << 20).sanitizer(mode).build().unwrap().device(0).unwrap()
}

/// A reserved and mapped granule: a pool's range.
fn pool_range(dev: &SimDevice) -> DevicePtr {
    let base = dev.reserve(4 * G).unwrap();
    let h = dev.alloc_physical(G).unwrap();
    dev.map(base, h).unwrap();
    base
}

fn at(p: DevicePtr, off: u64) -> DevicePtr {
    p.checked_add(off).unwrap()
}

fn alloc(dev: &SimDevice, s: &SimStream, ptr: DevicePtr, size: u64) {
    dev.annotate(PoolAnnotation::Alloc {
        pool: POOL,
        ptr,
        size,
        stream: s.id(),
        position: s.enqueued(),
    });
}

fn free(dev: &SimDevice, s: &SimStream, ptr: DevicePtr) {
    dev.annotate(PoolAnnotation::Free { pool: POOL, ptr, stream: s.id(), position: s.enqueued() });
}

fn fill(s: &SimStream, ptr: DevicePtr, len: u64, value: u8) {
    s.launch(KernelLaunch {
        name: "fill",
        buffers: vec![BufferAccess { ptr, len, mode: AccessMode::Write }],
        body: Box::new(move |b| {
            b.bytes_mut(0)?.fill(value);
            Ok(())
        }),
    })
    .unwrap();
}

/// Holds a stream in a host function until the sender is dropped or sent to.
fn gate(s: &SimStream) -> Sender<()> {
    let (tx, rx): (Sender<()>, Receiver<()>) = crossbeam_channel::bounded(1);
    s.host_fn(Box::new(move || {
        let _ = rx.recv_timeout(Duration::from_secs(30));
    }))
    .unwrap();
    tx
}

/// Waits until the stream has run everything, without the host "observing" it.
fn wait_device_only(s: &SimStream) {
    let target = s.enqueued();
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.completed() < target {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn kinds(dev: &SimDevice) -> Vec<ReportKind> {
    dev.sanitizer_reports().iter().map(|r| r.kind).collect()
}

fn failed_with(s: &SimStream, what: &str) -> String {
    match s.synchronize() {
        Err(DriverError::TaskFailed { message, .. }) => {
            assert!(message.contains(what), "{message}");
            message
        }
        other => panic!("expected a sanitizer failure ({what}), got {other:?}"),
    }
}

fn read(dev: &SimDevice, ptr: DevicePtr, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: `v` is valid for writes of `len` bytes during the call.
    unsafe { dev.copy_sync(MemRef::Host(v.as_mut_ptr()), MemRef::Device(ptr), len as u64) }
        .unwrap();
    v
}

#[test]
fn off_means_no_annotations() {
    let dev = device(SanitizerMode::Off);
    assert_eq!(dev.sanitizer_mode(), SanitizerMode::Off);
    assert!(!dev.wants_annotations());
    assert!(device(SanitizerMode::Report).wants_annotations());
}

#[test]
fn use_after_free_on_the_same_stream() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let s = dev.create_sim_stream().unwrap();
    alloc(&dev, &s, base, 4096);
    fill(&s, base, 4096, 1);
    free(&dev, &s, base);
    fill(&s, base, 4096, 2); // the bug
    let msg = failed_with(&s, "use after free");
    assert!(msg.contains("fill"), "{msg}");
    assert_eq!(kinds(&dev), [ReportKind::UseAfterFree]);
    let r = &dev.sanitizer_reports()[0];
    assert_eq!((r.stream, r.position, r.task.as_str()), (s.id(), 2, "fill"));
    let a = r.allocation.unwrap();
    assert_eq!(
        (a.pool, a.ptr, a.size, a.stream, a.position),
        (Some(POOL), base.addr(), 4096, s.id(), 0)
    );
    assert_eq!(r.other.map(|o| (o.stream, o.position)), Some((s.id(), 1)));
    // FailStream: the offending task did not run.
    s.clear_error();
    alloc(&dev, &s, base, 4096);
    s.synchronize().unwrap();
    assert_eq!(read(&dev, base, 4), [1; 4]);
}

#[test]
fn report_mode_runs_the_task_and_collects() {
    let dev = device(SanitizerMode::Report);
    let base = pool_range(&dev);
    let s = dev.create_sim_stream().unwrap();
    alloc(&dev, &s, base, 4096);
    free(&dev, &s, base);
    fill(&s, base, 4096, 9);
    s.synchronize().unwrap();
    let reports = dev.take_sanitizer_reports();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].kind, ReportKind::UseAfterFree);
    assert!(reports[0].to_string().contains("use after free"), "{}", reports[0]);
    assert!(dev.sanitizer_reports().is_empty());
    // The task ran (Report mode); the host copy of freed memory is reported too.
    assert_eq!(read(&dev, base, 2), [9, 9]);
    assert_eq!(kinds(&dev), [ReportKind::UseAfterFree]);
}

#[test]
fn out_of_bounds_by_one_element() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let s = dev.create_sim_stream().unwrap();
    alloc(&dev, &s, base, 1024 * 4);
    fill(&s, base, 1024 * 4, 1);
    s.synchronize().unwrap();
    fill(&s, base, 1025 * 4, 1);
    failed_with(&s, "out-of-bounds");
    assert_eq!(kinds(&dev), [ReportKind::OutOfBounds]);
}

#[test]
fn cross_stream_use_of_a_reused_block_without_an_event() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    let g = gate(&s1);
    alloc(&dev, &s1, base, 4096);
    fill(&s1, base, 4096, 1); // the previous owner's work, still queued
    free(&dev, &s1, base);
    alloc(&dev, &s1, base, 4096); // same-stream reuse: fine on s1
    fill(&s2, base, 4096, 2); // the bug: s2 is not ordered after the allocation
    failed_with(&s2, "not ordered after the allocation");
    drop(g);
    s1.synchronize().unwrap();
    assert_eq!(kinds(&dev), [ReportKind::NotOrderedAfterAlloc]);
}

#[test]
fn cross_stream_use_after_an_event_is_clean() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    let g = gate(&s1);
    alloc(&dev, &s1, base, 4096);
    fill(&s1, base, 4096, 1);
    free(&dev, &s1, base);
    alloc(&dev, &s1, base, 4096);
    let e = dev.create_event().unwrap();
    s1.record(&*e).unwrap();
    s2.wait(&*e).unwrap();
    fill(&s2, base, 4096, 2);
    drop(g);
    s2.synchronize().unwrap();
    assert_eq!(kinds(&dev), []);
    assert_eq!(read(&dev, base, 1), [2]);
}

#[test]
fn strict_mode_reports_unordered_use_of_a_fresh_block() {
    for strict in [false, true] {
        let dev = Npu::builder()
            .capacity(64 << 20)
            .sanitizer(SanitizerMode::Report)
            .sanitizer_strict(strict)
            .build()
            .unwrap()
            .device(0)
            .unwrap();
        let base = pool_range(&dev);
        let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
        alloc(&dev, &s1, base, 4096);
        fill(&s2, base, 4096, 2);
        s2.synchronize().unwrap();
        let expected: &[ReportKind] =
            if strict { &[ReportKind::NotOrderedAfterAlloc] } else { &[] };
        assert_eq!(kinds(&dev), expected, "strict = {strict}");
    }
}

#[test]
fn use_before_the_allocation() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    alloc(&dev, &s1, base, 512);
    let g = gate(&s2);
    fill(&s2, at(base, 512), 512, 3); // enqueued before the allocation below
    alloc(&dev, &s1, at(base, 512), 512);
    drop(g);
    failed_with(&s2, "use before the allocation");
    assert_eq!(kinds(&dev), [ReportKind::UseBeforeAlloc]);
}

#[test]
fn unallocated_pool_memory() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let s = dev.create_sim_stream().unwrap();
    alloc(&dev, &s, base, 512);
    fill(&s, at(base, 8192), 16, 1);
    failed_with(&s, "unallocated");
    assert_eq!(kinds(&dev), [ReportKind::Unallocated]);
    // Memory outside any pool range (a reservation no pool annotated) is not checked.
    let other = pool_range(&dev);
    s.clear_error();
    fill(&s, other, 16, 1);
    s.synchronize().unwrap();
    assert_eq!(dev.sanitizer_reports().len(), 1);
}

#[test]
fn free_not_ordered_after_a_raw_cross_stream_use() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    alloc(&dev, &s1, base, 4096);
    let e = dev.create_event().unwrap();
    s1.record(&*e).unwrap();
    s2.wait(&*e).unwrap();
    fill(&s2, base, 4096, 5); // ordered after the allocation: fine
                              // 2, or 1 when the record had completed before the wait (no wait task then).
    let fill_pos = s2.enqueued();
    wait_device_only(&s2); // it ran; nothing orders the free below after it
    free(&dev, &s1, base);
    failed_with(&s1, "free not ordered after a use");
    let r = &dev.sanitizer_reports()[0];
    assert_eq!(r.kind, ReportKind::FreeNotOrderedAfterUse);
    assert_eq!(r.other.map(|o| (o.what, o.stream, o.position)), Some(("fill", s2.id(), fill_pos)));
}

#[test]
fn a_use_running_concurrently_with_the_free_is_reported() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    alloc(&dev, &s1, base, 4096);
    let e = dev.create_event().unwrap();
    s1.record(&*e).unwrap();
    s2.wait(&*e).unwrap();
    let g = gate(&s2);
    fill(&s2, base, 4096, 5);
    free(&dev, &s1, base); // not ordered after s2's fill, which has not run yet
    drop(g);
    failed_with(&s2, "free not ordered after a use");
    assert_eq!(kinds(&dev), [ReportKind::FreeNotOrderedAfterUse]);
}

#[test]
fn a_free_ordered_after_the_use_is_clean() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    alloc(&dev, &s1, base, 4096);
    let e = dev.create_event().unwrap();
    s1.record(&*e).unwrap();
    s2.wait(&*e).unwrap();
    let g = gate(&s2);
    fill(&s2, base, 4096, 5);
    let back = dev.create_event().unwrap();
    s2.record(&*back).unwrap();
    s1.wait(&*back).unwrap(); // what the pool does for recorded uses
    free(&dev, &s1, base);
    drop(g);
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert_eq!(kinds(&dev), []);
}

#[test]
fn use_of_a_driver_freed_pointer() {
    let dev = device(SanitizerMode::FailStream);
    let s = dev.create_sim_stream().unwrap();
    let p = dev.malloc(4096).unwrap();
    fill(&s, p, 4096, 1); // fine: malloc memory is usable by every stream at once
    s.synchronize().unwrap();
    let g = gate(&s);
    fill(&s, p, 4096, 2);
    dev.free(p).unwrap(); // the queued fill has not started
    drop(g);
    let msg = failed_with(&s, "use after free");
    assert!(msg.contains("malloc"), "{msg}");
    assert_eq!(kinds(&dev), [ReportKind::UseAfterFree]);
}

#[test]
fn malloc_memory_is_bounds_checked() {
    let dev = device(SanitizerMode::Report);
    let s = dev.create_sim_stream().unwrap();
    let p = dev.malloc(100).unwrap();
    fill(&s, p, 100, 1);
    fill(&s, p, 101, 1);
    s.synchronize().unwrap();
    assert_eq!(kinds(&dev), [ReportKind::OutOfBounds]);
    drop(s);
    dev.free(p).unwrap();
}

#[test]
fn reuse_orderings_are_clean() {
    // Same-stream reuse without synchronisation, reuse after a stream synchronize, after an
    // event chain s1 -> s2 -> s3, and after completion on the device (opportunistic).
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let s1 = dev.create_sim_stream().unwrap();
    let s2 = dev.create_sim_stream().unwrap();
    let s3 = dev.create_sim_stream().unwrap();
    for round in 0..20u8 {
        alloc(&dev, &s1, base, 4096);
        fill(&s1, base, 4096, round);
        free(&dev, &s1, base);
    }
    // Host synchronize: every stream may reuse.
    s1.synchronize().unwrap();
    alloc(&dev, &s2, base, 4096);
    fill(&s2, base, 4096, 1);
    free(&dev, &s2, base);
    // Chain s2 -> s1 -> s3.
    let e1 = dev.create_event().unwrap();
    s2.record(&*e1).unwrap();
    s1.wait(&*e1).unwrap();
    let e2 = dev.create_event().unwrap();
    s1.record(&*e2).unwrap();
    s3.wait(&*e2).unwrap();
    alloc(&dev, &s3, base, 4096);
    fill(&s3, base, 4096, 2);
    free(&dev, &s3, base);
    // Opportunistic: complete on the device, no host observation.
    wait_device_only(&s3);
    alloc(&dev, &s1, base, 4096);
    fill(&s1, base, 4096, 3);
    free(&dev, &s1, base);
    // Event synchronize observes the record's clock.
    let e3 = dev.create_event().unwrap();
    s1.record(&*e3).unwrap();
    e3.synchronize().unwrap();
    alloc(&dev, &s2, base, 4096);
    fill(&s2, base, 4096, 4);
    dev.synchronize().unwrap();
    assert_eq!(kinds(&dev), []);
    assert_eq!(read(&dev, base, 1), [4]);
}

#[test]
fn a_reuse_before_the_free_is_ordered_is_reported() {
    let dev = device(SanitizerMode::Report);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    let g = gate(&s1);
    alloc(&dev, &s1, base, 4096);
    fill(&s1, base, 4096, 1);
    free(&dev, &s1, base);
    alloc(&dev, &s2, base, 4096); // a buggy pool: s2 is not ordered after the free
    assert_eq!(kinds(&dev), [], "reported at the first use, not at the allocation");
    fill(&s2, base, 4096, 2);
    s2.synchronize().unwrap();
    assert_eq!(kinds(&dev), [ReportKind::UnorderedReuse]);
    drop(g);
    s1.synchronize().unwrap();
    // Once s2 is ordered after the earlier free, its uses are clean.
    let e = dev.create_event().unwrap();
    s1.record(&*e).unwrap();
    s2.wait(&*e).unwrap();
    fill(&s2, base, 4096, 3);
    s2.synchronize().unwrap();
    assert_eq!(kinds(&dev), [ReportKind::UnorderedReuse]);
}

#[test]
fn freed_memory_is_poisoned_when_the_free_completes() {
    let dev = Npu::builder()
        .capacity(64 << 20)
        .sanitizer(SanitizerMode::Report)
        .sanitizer_poison(Some(0xA5))
        .build()
        .unwrap()
        .device(0)
        .unwrap();
    let base = pool_range(&dev);
    let s = dev.create_sim_stream().unwrap();
    alloc(&dev, &s, base, 4096);
    let g = gate(&s);
    fill(&s, base, 4096, 1);
    let before = s.enqueued();
    free(&dev, &s, base);
    assert_eq!(s.enqueued(), before, "poisoning adds no task");
    alloc(&dev, &s, at(base, 8192), 64); // keep the range tracked
    drop(g);
    s.synchronize().unwrap();
    dev.take_sanitizer_reports();
    // Read it back through a fresh allocation of the block (not a use after free).
    alloc(&dev, &s, base, 4096);
    assert_eq!(read(&dev, base, 4096), vec![0xA5; 4096]);
    assert_eq!(kinds(&dev), []);
}

#[test]
fn many_generations_are_pruned_and_checks_stay_exact() {
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    for i in 0..2000u64 {
        let p = at(base, (i % 64) * 4096);
        alloc(&dev, &s1, p, 4096);
        fill(&s1, p, 4096, i as u8);
        free(&dev, &s1, p);
        if i % 100 == 99 {
            s1.synchronize().unwrap();
        }
    }
    s1.synchronize().unwrap();
    alloc(&dev, &s2, base, 4096);
    fill(&s2, base, 4096, 1);
    free(&dev, &s2, base);
    fill(&s2, base, 4096, 1); // still caught
    assert!(s2.synchronize().is_err());
    assert_eq!(dev.sanitizer_reports().len(), 1);
}

#[test]
fn generations_stay_bounded_without_host_synchronisation() {
    // A long same-stream loop never synchronized (and a second stream that never waits):
    // freed generations superseded by newer ones at the same place are pruned.
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let (s1, _s2) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
    for i in 0..5000u64 {
        let p = at(base, (i % 8) * 4096);
        alloc(&dev, &s1, p, 4096);
        fill(&s1, p, 4096, i as u8);
        free(&dev, &s1, p);
        if i % 500 == 499 {
            // Keep the worker's lag bounded on a loaded machine (pruning needs completed
            // frees) without a host synchronisation: watch the device counter only.
            while s1.completed() < s1.enqueued() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    let (live, freed) = dev.sanitizer_generations();
    assert_eq!(live, 0);
    assert!(freed <= 1024, "{freed} freed generations kept");
    // Still exact: a use after the last frees is caught.
    fill(&s1, base, 16, 0);
    assert!(s1.synchronize().is_err());
    assert_eq!(kinds(&dev), [ReportKind::UseAfterFree]);
}

/// Whether `counts` stay bounded: a count that grows with the number of steps is about
/// twice as large at the end as half-way; a bounded one (a sawtooth, as batches are
/// forgotten or pruned) peaks as high in the first half as in the second.
fn flat(counts: &[usize]) -> bool {
    let (first, second) = counts.split_at(counts.len() / 2);
    let peak = |c: &[usize]| c.iter().copied().max().unwrap_or(0);
    2 * peak(second) < 3 * peak(first)
}

#[test]
fn dropped_streams_are_forgotten() {
    // A stream per request: each allocates a block no later request reuses (no newer
    // generation supersedes its free), fills it, frees it and is dropped. Neither the
    // streams the sanitizer keeps state for nor its generations grow with the requests.
    let dev = device(SanitizerMode::FailStream);
    let base = pool_range(&dev);
    let long_lived = dev.create_sim_stream().unwrap();
    let (mut streams, mut generations) = (Vec::new(), Vec::new());
    let block = 512;
    let requests = G / block;
    for i in 0..requests {
        let s = dev.create_sim_stream().unwrap();
        let p = at(base, i * block);
        alloc(&dev, &s, p, block);
        fill(&s, p, block, i as u8);
        free(&dev, &s, p);
        drop(s);
        streams.push(dev.sanitizer_tracked_streams());
        let (live, freed) = dev.sanitizer_generations();
        generations.push(live + freed);
    }
    assert!(flat(&streams), "tracked streams: {streams:?}");
    assert!(flat(&generations), "generations: {generations:?}");
    // Still exact: a use of the last freed block is a use after free.
    fill(&long_lived, at(base, (requests - 1) * block), 16, 0);
    assert!(long_lived.synchronize().is_err());
    assert_eq!(kinds(&dev), [ReportKind::UseAfterFree]);
}

#[test]
fn dropped_streams_running_host_functions_are_forgotten() {
    let dev = device(SanitizerMode::FailStream);
    let tracked: Vec<usize> = (0..512)
        .map(|_| {
            let s = dev.create_sim_stream().unwrap();
            s.host_fn(Box::new(|| {})).unwrap();
            drop(s);
            dev.sanitizer_tracked_streams()
        })
        .collect();
    assert!(flat(&tracked), "tracked streams: {tracked:?}");
}
