//! Graph capture through the typed API, with pools: buffers allocated before the capture and
//! reused by every launch, what pools and vector clocks learn (nothing) from captured work,
//! what is refused while capturing, and the sanitizer's view of launches. Pool allocations
//! made while capturing are in `graph_memory.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use soma::hal::{CaptureErrorKind, DriverError};
use soma::sim::{Npu, ReportKind, SanitizerMode};
use soma::{CaptureMode, CaptureStatus, Error, KernelArg, MemPool, PoolAlloc, ReusePolicy, Stream};

use crate::common::{device_of, npu, Gate};

const MIB: usize = 1 << 20;

/// The kind of a capture error of the typed API.
fn capture_kind(e: &Error) -> CaptureErrorKind {
    match e {
        Error::Driver(DriverError::Capture { kind, .. }) => *kind,
        other => panic!("expected a capture error, got {other:?}"),
    }
}

/// `out[i] = in[i] * 2 + 1`, replayable.
fn affine(s: &Stream<'_>, input: &PoolAlloc<'_, u32>, out: &mut PoolAlloc<'_, u32>) {
    s.launch_replayable("affine", &[KernelArg::read(input), KernelArg::write(out)], |b| {
        let (x, y) = (b.read::<u32>(0)?, b.write::<u32>(1)?);
        y.iter_mut().zip(x).for_each(|(y, x)| *y = x * 2 + 1);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_step_captured_once_replays_over_buffers_allocated_before_it() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut input = pool.alloc_async::<u32>(1024, &s).unwrap();
    let mut hidden = pool.alloc_async::<u32>(1024, &s).unwrap();
    let mut output = pool.alloc_async::<u32>(1024, &s).unwrap();
    let allocations = pool.stats().allocations;

    s.begin_capture(CaptureMode::Global).unwrap();
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Active);
    affine(&s, &input, &mut hidden);
    affine(&s, &hidden, &mut output);
    let graph = s.end_capture().unwrap();
    assert_eq!(graph.task_count(), 2);
    assert_eq!(pool.stats().allocations, allocations, "the capture allocated nothing");

    for step in 0..4u32 {
        s.copy_from_host(&mut input, &[step; 1024]).unwrap();
        graph.launch(&s).unwrap();
        let mut host = vec![0u32; 1024];
        s.copy_to_host(&output, &mut host).unwrap();
        assert_eq!(host, vec![(step * 2 + 1) * 2 + 1; 1024], "step {step}");
    }
    drop(graph);
}

#[test]
fn captured_records_and_waits_teach_the_pool_no_ordering() {
    for capture in [false, true] {
        let npu = npu();
        let dev = device_of(&npu);
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let pool = MemPool::builder()
            .max_size(64 << 20)
            .reuse(ReusePolicy::new(true, false, false))
            .build(&dev)
            .unwrap();
        let gate = Gate::close(&s1);
        let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
        let ptr = a.device_ptr();
        drop(a);
        // More work after the free, so that s1's position is past it when the capture begins.
        s1.host_fn(|| ()).unwrap();
        if capture {
            s1.begin_capture(CaptureMode::Global).unwrap();
        }
        // Fork to s2 and join back: s2 joins the capture when there is one.
        let fork = s1.record_event().unwrap();
        s2.wait_event(&fork).unwrap();
        let joined = s2.capture_info().unwrap();
        assert_eq!(joined.status == CaptureStatus::Active, capture);
        let join = s2.record_event().unwrap();
        s1.wait_event(&join).unwrap();
        let graph = capture.then(|| s1.end_capture().unwrap());
        let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
        // A real wait orders s2 after the free; a captured one does not run now, so reusing
        // the block on s2 would race with s1's pending work.
        assert_eq!(b.device_ptr() == ptr, !capture, "capture = {capture}");
        assert!(!gate.passed());
        gate.open();
        drop((b, graph));
    }
}

#[test]
fn staged_copies_and_once_kernels_refuse_a_capturing_stream() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut x = pool.alloc_async::<u32>(16, &s).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let e = s.copy_from_host(&mut x, &[1; 16]).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    let mut host = [0u32; 16];
    let e = s.copy_to_host(&x, &mut host).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    let e = s.launch("once", &[KernelArg::write(&mut x)], |_| Ok(())).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Active, "nothing invalidated");
    assert_eq!(s.end_capture().unwrap().task_count(), 0);
    s.copy_from_host(&mut x, &[1; 16]).unwrap();
}

#[test]
fn a_free_is_refused_while_a_stream_that_used_the_block_captures() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut x = pool.alloc_async::<u32>(64, &s1).unwrap();
    s2.memset(&mut x, 0).unwrap(); // a use on s2, which the free must be ordered after
    s2.begin_capture(CaptureMode::Global).unwrap();
    let e = x.free().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    assert!(e.to_string().contains("ordering a pool free after a use"), "{e}");
    assert_eq!(s1.capture_info().unwrap().status, CaptureStatus::None, "s1 did not join");
    assert_eq!(s2.end_capture().unwrap().task_count(), 0, "nothing was captured on s2");
}

#[test]
fn synchronising_while_capturing_invalidates_the_capture() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    assert_eq!(capture_kind(&s.synchronize().unwrap_err()), CaptureErrorKind::StreamCaptured);
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Invalidated);
    assert_eq!(capture_kind(&s.end_capture().unwrap_err()), CaptureErrorKind::Invalidated);
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    assert_eq!(capture_kind(&dev.synchronize().unwrap_err()), CaptureErrorKind::StreamCaptured);
    assert_eq!(capture_kind(&s.end_capture().unwrap_err()), CaptureErrorKind::Invalidated);
    s.synchronize().unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn a_graph_launches_on_another_stream_after_its_inputs() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut input = pool.alloc_async::<u32>(256, &s1).unwrap();
    let mut output = pool.alloc_async::<u32>(256, &s1).unwrap();
    s1.begin_capture(CaptureMode::Global).unwrap();
    affine(&s1, &input, &mut output);
    let graph = s1.end_capture().unwrap();
    s1.copy_from_host(&mut input, &[20; 256]).unwrap();
    s2.wait_stream(&s1).unwrap();
    graph.launch(&s2).unwrap();
    s1.wait_stream(&s2).unwrap();
    let mut host = vec![0u32; 256];
    s1.copy_to_host(&output, &mut host).unwrap();
    assert_eq!(host, vec![41; 256]);
}

#[test]
fn the_sanitizer_reports_a_launch_after_the_graph_memory_was_freed() {
    let npu = Npu::builder().capacity(1 << 30).sanitizer(SanitizerMode::Report).build().unwrap();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let input = pool.alloc_async::<u32>(256, &s).unwrap();
    let mut output = pool.alloc_async::<u32>(256, &s).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    affine(&s, &input, &mut output);
    let graph = s.end_capture().unwrap();
    graph.launch(&s).unwrap();
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    let sim = npu.sim_device(0).unwrap();
    assert!(sim.take_sanitizer_reports().is_empty(), "every launch used live memory");

    drop(output);
    graph.launch(&s).unwrap();
    let _ = s.synchronize();
    let reports = sim.take_sanitizer_reports();
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0].kind, ReportKind::UseAfterFree);
    assert_eq!(reports[0].task, "affine");
    assert_eq!(reports[0].position, s.hal().enqueued(), "checked at the launch's position");
    drop((graph, input));
}

#[test]
fn dropping_a_graph_waits_for_its_launches() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let (open_tx, open_rx) = mpsc::channel::<()>();
    let open_rx = Arc::new(std::sync::Mutex::new(open_rx));
    let runs = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&runs);
    s.begin_capture(CaptureMode::Global).unwrap();
    s.host_fn_replayable(move || {
        let _ = open_rx.lock().unwrap().recv_timeout(Duration::from_secs(30));
        r.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let graph = s.end_capture().unwrap();
    graph.launch(&s).unwrap();
    let (dropped_tx, dropped_rx) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            drop(graph);
            dropped_tx.send(()).unwrap();
        });
        assert!(dropped_rx.recv_timeout(Duration::from_millis(150)).is_err(), "returned early");
        open_tx.send(()).unwrap();
        dropped_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the launch ran before the graph was destroyed");
}
