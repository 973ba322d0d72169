//! Graph capture: captured work runs only at launches, in capture order; capture status,
//! forbidden calls and invalidation; the capture modes; streams joining through events and
//! the rejoin check; graph destruction after its launches.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use soma_sim::hal::{
    AccessMode, BufferAccess, CaptureErrorKind, CaptureInfo, CaptureMode, CaptureStatus, DeviceHal,
    DevicePtr, DriverError, MemRef, ReplayableKernel,
};
use soma_sim::SimDevice;

use super::{device, fill_kernel, gate, read, recv, task_failed, MIB};

/// The kind of a capture error.
pub fn capture_kind(e: &DriverError) -> CaptureErrorKind {
    match e {
        DriverError::Capture { kind, .. } => *kind,
        other => panic!("expected a capture error, got {other:?}"),
    }
}

/// A replayable kernel that adds `add` to every byte of `[ptr, ptr + len)`.
fn add_kernel(ptr: DevicePtr, len: u64, add: u8) -> ReplayableKernel {
    ReplayableKernel {
        name: "add",
        buffers: vec![BufferAccess { ptr, len, mode: AccessMode::Write }],
        body: Arc::new(move |b| {
            b.bytes_mut(0)?.iter_mut().for_each(|v| *v = v.wrapping_add(add));
            Ok(())
        }),
    }
}

/// A replayable host function that counts its runs.
fn counter() -> (Arc<AtomicU64>, soma_sim::hal::ReplayableHostFn) {
    let n = Arc::new(AtomicU64::new(0));
    let c = Arc::clone(&n);
    (
        n,
        Arc::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }),
    )
}

fn sync_copy_of(dev: &SimDevice, ptr: DevicePtr) -> Result<(), DriverError> {
    let mut b = [0u8; 4];
    // SAFETY: `b` is valid for 4 bytes of writes during the call.
    unsafe { dev.copy_sync(MemRef::Host(b.as_mut_ptr()), MemRef::Device(ptr), 4) }
}

#[test]
fn captured_work_runs_only_at_launches_in_capture_order() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let (a, b) = (dev.malloc(MIB).unwrap(), dev.malloc(MIB).unwrap());
    s.memset(a, 1, 4096).unwrap();
    s.synchronize().unwrap();
    let before = s.enqueued();
    let (runs, count) = counter();

    s.begin_capture(CaptureMode::Global).unwrap();
    let info = s.capture_info().unwrap();
    assert_eq!(info.status, CaptureStatus::Active);
    s.launch_replayable(add_kernel(a, 4096, 2)).unwrap();
    s.copy_d2d(b, a, 4096).unwrap();
    s.memset(a, 0, 16).unwrap();
    s.host_fn_replayable(count).unwrap();
    assert_eq!(s.enqueued(), before, "captured tasks take no position");
    let graph = s.end_capture().unwrap();
    assert_eq!(graph.id(), info.capture.unwrap());
    assert_eq!(graph.task_count(), 4);
    assert_eq!(s.capture_info().unwrap(), CaptureInfo::NONE);
    s.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran at capture time");
    assert_eq!(read(&dev, a, 4), vec![1; 4]);

    for i in 1..=3u64 {
        assert_eq!(graph.launch(s.as_ref()).unwrap(), before + i, "a launch is one task");
    }
    s.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // Each launch: a += 2, b = a, then a[..16] = 0.
    assert_eq!(read(&dev, a, 17)[15..], [0, 7]);
    assert_eq!(read(&dev, b, 17)[15..], [2, 7], "b was copied before the memset of a");
    drop(graph);
    drop(s);
    dev.free(a).unwrap();
    dev.free(b).unwrap();
}

#[test]
fn each_launch_is_ordered_after_the_previous_one() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    let log = Arc::clone(&seen);
    s.host_fn_replayable(Arc::new(move || {
        std::thread::sleep(Duration::from_millis(20));
        log.lock().push('a');
    }))
    .unwrap();
    let log = Arc::clone(&seen);
    s.host_fn_replayable(Arc::new(move || log.lock().push('b'))).unwrap();
    let graph = s.end_capture().unwrap();
    let (runs, count) = counter();
    graph.launch(s.as_ref()).unwrap();
    s.host_fn_replayable(count).unwrap();
    graph.launch(s.as_ref()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(*seen.lock(), ['a', 'b', 'a', 'b']);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "eager work between launches ran once");
}

#[test]
fn run_once_work_is_refused_and_the_capture_stays_active() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let e = s.launch(fill_kernel(buf, 64, 1)).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    assert!(e.to_string().contains("kernel fill"), "{e}");
    let e = s.host_fn(Box::new(|| ())).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Active);
    s.launch_replayable(add_kernel(buf, 64, 1)).unwrap();
    assert_eq!(s.end_capture().unwrap().task_count(), 1);
    drop(s);
    dev.free(buf).unwrap();
}

#[test]
fn synchronising_a_capturing_stream_drains_it_and_invalidates_the_capture() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let d = Arc::clone(&done);
    s.host_fn(Box::new(move || {
        std::thread::sleep(Duration::from_millis(50));
        d.store(1, Ordering::SeqCst);
    }))
    .unwrap();
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    let e = s.synchronize().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::StreamCaptured);
    assert_eq!(done.load(Ordering::SeqCst), 1, "the work before the capture was drained");
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Invalidated);
    let (_, count) = counter();
    let e = s.host_fn_replayable(count).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::Invalidated);
    let e = s.end_capture().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::Invalidated);
    assert!(e.to_string().contains("synchronize"), "{e}");
    assert_eq!(s.capture_info().unwrap(), CaptureInfo::NONE);
    s.synchronize().unwrap();

    s.begin_capture(CaptureMode::Relaxed).unwrap();
    assert_eq!(capture_kind(&s.query().unwrap_err()), CaptureErrorKind::StreamCaptured);
    assert_eq!(capture_kind(&s.end_capture().unwrap_err()), CaptureErrorKind::Invalidated);
}

#[test]
fn device_and_event_synchronisation_invalidate_the_capture() {
    let dev = device(64 * MIB);
    let (s, other) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    assert_eq!(dev.active_captures(), 1);
    let e = dev.synchronize().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::StreamCaptured);
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Invalidated);
    assert!(s.end_capture().is_err());
    assert_eq!(dev.active_captures(), 0);
    dev.synchronize().unwrap();

    let ev = dev.create_event().unwrap();
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    s.record(ev.as_ref()).unwrap();
    other.synchronize().unwrap(); // another stream: allowed
    let e = ev.query().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::EventCaptured);
    assert_eq!(capture_kind(&s.end_capture().unwrap_err()), CaptureErrorKind::Invalidated);
    let e = ev.synchronize().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::EventCaptured, "ended, never launched");
    assert_eq!(s.capture_info().unwrap(), CaptureInfo::NONE, "nothing left to invalidate");
    s.record(ev.as_ref()).unwrap();
    ev.synchronize().unwrap();
}

/// Whether a synchronous copy on this thread is allowed now (a refusal is a capture error).
fn copy_allowed(dev: &SimDevice, ptr: DevicePtr) -> bool {
    match sync_copy_of(dev, ptr) {
        Ok(()) => true,
        Err(e) => {
            assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable, "{e}");
            false
        }
    }
}

#[test]
fn capture_modes_govern_synchronous_copies() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    // A synchronous copy from another thread, in capture mode `mode`.
    let other_thread_may_copy = |mode: CaptureMode| {
        let d = Arc::clone(&dev);
        std::thread::spawn(move || {
            d.exchange_capture_mode(mode).unwrap();
            copy_allowed(&d, buf)
        })
        .join()
        .unwrap()
    };
    let restart = |mode: CaptureMode| {
        let _ = s.end_capture();
        s.begin_capture(mode).unwrap();
    };

    // Global capture: this thread only in relaxed mode; others unless in global mode. A
    // forbidden copy invalidates the capture.
    s.begin_capture(CaptureMode::Global).unwrap();
    assert!(!copy_allowed(&dev, buf));
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Invalidated);
    restart(CaptureMode::Global);
    assert!(!other_thread_may_copy(CaptureMode::Global));
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Invalidated);
    restart(CaptureMode::Global);
    assert!(other_thread_may_copy(CaptureMode::ThreadLocal));
    assert!(other_thread_may_copy(CaptureMode::Relaxed));
    assert_eq!(dev.exchange_capture_mode(CaptureMode::ThreadLocal).unwrap(), CaptureMode::Global);
    assert!(!copy_allowed(&dev, buf), "thread-local is not enough on the capturing thread");
    restart(CaptureMode::Global);
    dev.exchange_capture_mode(CaptureMode::Relaxed).unwrap();
    assert!(copy_allowed(&dev, buf));
    assert_eq!(dev.exchange_capture_mode(CaptureMode::Global).unwrap(), CaptureMode::Relaxed);
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Active);

    // Thread-local capture: only the capturing thread is restricted.
    restart(CaptureMode::ThreadLocal);
    assert!(other_thread_may_copy(CaptureMode::Global));
    assert!(!copy_allowed(&dev, buf));

    // Relaxed capture: nobody is.
    restart(CaptureMode::Relaxed);
    assert!(copy_allowed(&dev, buf));
    assert!(other_thread_may_copy(CaptureMode::Global));
    assert!(dev.memset_sync(buf, 0, 4).is_ok());
    assert_eq!(s.end_capture().unwrap().task_count(), 0);
    assert_eq!(dev.active_captures(), 0);
    drop(s);
    dev.free(buf).unwrap();
}

#[test]
fn streams_join_through_events_and_rejoin_the_origin() {
    let dev = device(64 * MIB);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (fork, join) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    let (a, b) = (dev.malloc(MIB).unwrap(), dev.malloc(MIB).unwrap());
    s1.begin_capture(CaptureMode::Global).unwrap();
    let id = s1.capture_info().unwrap().capture;
    s1.launch_replayable(add_kernel(a, 64, 1)).unwrap();
    s1.record(fork.as_ref()).unwrap();
    assert_eq!(s2.capture_info().unwrap(), CaptureInfo::NONE);
    s2.wait(fork.as_ref()).unwrap();
    let joined = s2.capture_info().unwrap();
    assert_eq!((joined.status, joined.capture), (CaptureStatus::Active, id));
    s2.copy_d2d(b, a, 64).unwrap();
    s2.record(join.as_ref()).unwrap();
    let e = s2.end_capture().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::Unmatched, "only the origin ends it");
    s1.wait(join.as_ref()).unwrap();
    s1.launch_replayable(add_kernel(b, 64, 10)).unwrap();
    let graph = s1.end_capture().unwrap();
    assert_eq!(graph.task_count(), 7);
    assert_eq!(s2.capture_info().unwrap(), CaptureInfo::NONE, "the joined stream left too");
    assert_eq!((s1.enqueued(), s2.enqueued()), (0, 0));

    let launcher = dev.create_stream().unwrap();
    graph.launch(launcher.as_ref()).unwrap();
    graph.launch(launcher.as_ref()).unwrap();
    launcher.synchronize().unwrap();
    // Launch 1: a = 1, b = 1 + 10; launch 2: a = 2, b = 2 + 10.
    assert_eq!(read(&dev, a, 1), [2]);
    assert_eq!(read(&dev, b, 1), [12]);
    // The events were recorded again by the launches: waiting on them waits for a launch.
    assert_eq!(fork.query(), Ok(true));
    assert!(join.synchronize().is_ok());
    drop((s1, s2, launcher));
    dev.free(a).unwrap();
    dev.free(b).unwrap();
}

#[test]
fn streams_that_do_not_rejoin_fail_end_capture() {
    let dev = device(64 * MIB);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (fork, join) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    let (_, count) = counter();

    // s2 joins and never rejoins.
    s1.begin_capture(CaptureMode::Global).unwrap();
    s1.record(fork.as_ref()).unwrap();
    s2.wait(fork.as_ref()).unwrap();
    s2.host_fn_replayable(Arc::clone(&count)).unwrap();
    let e = s1.end_capture().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::Unjoined);
    assert!(e.to_string().contains(&format!("stream {} has 2 captured task(s)", s2.id())), "{e}");
    assert_eq!(s2.capture_info().unwrap(), CaptureInfo::NONE, "ended anyway");
    assert_eq!(dev.active_captures(), 0);

    // s2 rejoins, then captures more work.
    s1.begin_capture(CaptureMode::Global).unwrap();
    s1.record(fork.as_ref()).unwrap();
    s2.wait(fork.as_ref()).unwrap();
    s2.record(join.as_ref()).unwrap();
    s1.wait(join.as_ref()).unwrap();
    s2.host_fn_replayable(count).unwrap();
    let e = s1.end_capture().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::Unjoined);
    assert!(e.to_string().contains(&format!("stream {} has 1 captured task(s)", s2.id())), "{e}");

    // A record of an ended capture is no dependency for anyone.
    let e = s2.wait(fork.as_ref()).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::Dependency);
    assert_eq!(s2.capture_info().unwrap(), CaptureInfo::NONE);
}

#[test]
fn capture_begin_and_end_rules() {
    let dev = device(64 * MIB);
    let (s, other) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    assert_eq!(capture_kind(&s.end_capture().unwrap_err()), CaptureErrorKind::NotCapturing);
    s.begin_capture(CaptureMode::Global).unwrap();
    let e = s.begin_capture(CaptureMode::Global).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::StreamCaptured);

    // Another capture waiting on this one's record: a dependency no graph can hold.
    let ev = dev.create_event().unwrap();
    s.record(ev.as_ref()).unwrap();
    other.begin_capture(CaptureMode::Relaxed).unwrap();
    assert_eq!(capture_kind(&other.wait(ev.as_ref()).unwrap_err()), CaptureErrorKind::Dependency);
    assert_eq!(other.end_capture().unwrap().task_count(), 0);

    // Ending a global or thread-local capture from another thread is refused.
    let s = Arc::new(s);
    let remote = Arc::clone(&s);
    let e = std::thread::spawn(move || remote.end_capture().map(drop)).join().unwrap();
    assert_eq!(capture_kind(&e.unwrap_err()), CaptureErrorKind::Unmatched);
    assert_eq!(s.end_capture().unwrap().task_count(), 1);
    // A relaxed one may end anywhere.
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    let remote = Arc::clone(&s);
    std::thread::spawn(move || remote.end_capture().map(drop)).join().unwrap().unwrap();
    assert_eq!(dev.active_captures(), 0);
}

#[test]
fn dropping_the_origin_stream_ends_its_capture() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    assert_eq!(dev.active_captures(), 1);
    drop(s);
    assert_eq!(dev.active_captures(), 0);
    let buf = dev.malloc(MIB).unwrap();
    sync_copy_of(&dev, buf).unwrap(); // no global capture left to forbid it
    dev.free(buf).unwrap();
}

#[test]
fn graph_drop_waits_for_its_launches() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let (tx, rx) = gate();
    let rx = Arc::new(Mutex::new(rx));
    s.begin_capture(CaptureMode::Global).unwrap();
    s.host_fn_replayable(Arc::new(move || recv(&rx.lock()))).unwrap();
    let graph = s.end_capture().unwrap();
    graph.launch(s.as_ref()).unwrap();
    let (dropped_tx, dropped_rx) = gate();
    let t = std::thread::spawn(move || {
        drop(graph);
        dropped_tx.send(()).unwrap();
    });
    assert!(
        dropped_rx.recv_timeout(Duration::from_millis(150)).is_err(),
        "the drop returned while its launch was still running"
    );
    tx.send(()).unwrap();
    recv(&dropped_rx);
    t.join().unwrap();
    assert_eq!(s.completed(), s.enqueued());
}

#[test]
fn waits_on_records_made_outside_the_capture_bind_at_launch() {
    let dev = device(64 * MIB);
    let (s, producer) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let ev = dev.create_event().unwrap();
    producer.record(ev.as_ref()).unwrap();
    producer.synchronize().unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let flag = Arc::new(AtomicU64::new(0));

    s.begin_capture(CaptureMode::Global).unwrap();
    s.wait(ev.as_ref()).unwrap();
    let (f, sn) = (Arc::clone(&flag), Arc::clone(&seen));
    s.host_fn_replayable(Arc::new(move || sn.store(f.load(Ordering::SeqCst), Ordering::SeqCst)))
        .unwrap();
    let graph = s.end_capture().unwrap();

    // The producer's new record, behind a gate, is what the launch waits for.
    let (tx, rx) = gate();
    let f = Arc::clone(&flag);
    producer
        .host_fn(Box::new(move || {
            recv(&rx);
            f.store(7, Ordering::SeqCst);
        }))
        .unwrap();
    producer.record(ev.as_ref()).unwrap();
    graph.launch(s.as_ref()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.query(), Ok(false), "the launch waits for the producer");
    tx.send(()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 7);
}

#[test]
fn a_failing_task_fails_the_launch_and_completes_its_records() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    let ev = dev.create_event().unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    s.launch_replayable(ReplayableKernel {
        name: "broken",
        buffers: vec![BufferAccess { ptr: buf, len: 8, mode: AccessMode::Read }],
        body: Arc::new(|_| Err(soma_sim::hal::KernelError::new("bad input"))),
    })
    .unwrap();
    s.record(ev.as_ref()).unwrap();
    let graph = s.end_capture().unwrap();
    let pos = graph.launch(s.as_ref()).unwrap();
    let (stream, task, name, msg) = task_failed(&s.synchronize().unwrap_err());
    assert_eq!((stream, task, name.as_str()), (s.id(), pos, "graph_launch"));
    assert!(msg.contains("broken (task 0 of graph"), "{msg}");
    assert!(msg.contains("bad input"), "{msg}");
    let (_, _, _, record_msg) = task_failed(&ev.synchronize().unwrap_err());
    assert_eq!(record_msg, msg, "the record after the failure completed with the error");
    drop(s);
    dev.free(buf).unwrap();
}

#[test]
fn captured_host_copies_read_the_host_memory_at_each_launch() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    let mut host = vec![1u8; 8];
    s.begin_capture(CaptureMode::Global).unwrap();
    // SAFETY: `host` outlives the graph, and is only changed while no launch runs.
    unsafe { s.copy_async(MemRef::Device(buf), MemRef::Host(host.as_mut_ptr()), 8) }.unwrap();
    s.launch_replayable(add_kernel(buf, 8, 1)).unwrap();
    let graph = s.end_capture().unwrap();
    for value in [1u8, 5, 9] {
        host.fill(value);
        graph.launch(s.as_ref()).unwrap();
        s.synchronize().unwrap();
        assert_eq!(read(&dev, buf, 8), vec![value + 1; 8]);
    }
    drop(graph);
    drop(s);
    dev.free(buf).unwrap();
}

#[test]
fn a_graph_launch_pays_the_launch_cost_once() {
    let cost = Duration::from_millis(30);
    let dev = soma_sim::Npu::builder()
        .latency(soma_sim::LatencyModel::none().with_launch(cost))
        .build()
        .unwrap()
        .device(0)
        .unwrap();
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    for i in 0..6 {
        s.memset(buf, i, 64).unwrap();
    }
    let graph = s.end_capture().unwrap();
    let t = std::time::Instant::now();
    graph.launch(s.as_ref()).unwrap();
    s.synchronize().unwrap();
    let replay = t.elapsed();
    let t = std::time::Instant::now();
    for i in 0..6 {
        s.memset(buf, i, 64).unwrap();
    }
    s.synchronize().unwrap();
    let eager = t.elapsed();
    assert!(replay >= cost, "{replay:?}");
    assert!(eager >= 6 * cost, "{eager:?}");
    assert!(replay < 4 * cost, "six tasks paid one launch: {replay:?}");
    drop(graph);
    drop(s);
    dev.free(buf).unwrap();
}

#[test]
fn launching_on_a_capturing_stream_is_refused() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let graph = s.end_capture().unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let e = graph.launch(s.as_ref()).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    assert_eq!(s.end_capture().unwrap().task_count(), 0);
    let other = device(64 * MIB).create_stream().unwrap();
    assert!(matches!(graph.launch(other.as_ref()), Err(DriverError::InvalidHandle(_))));
}

#[test]
fn the_sanitizer_checks_every_launch_at_its_position() {
    let dev = soma_sim::Npu::builder()
        .sanitizer(soma_sim::SanitizerMode::Report)
        .build()
        .unwrap()
        .device(0)
        .unwrap();
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    s.launch_replayable(add_kernel(buf, 64, 1)).unwrap();
    let graph = s.end_capture().unwrap();
    graph.launch(s.as_ref()).unwrap();
    s.synchronize().unwrap();
    assert!(dev.take_sanitizer_reports().is_empty());

    dev.free(buf).unwrap();
    let pos = graph.launch(s.as_ref()).unwrap();
    let (_, _, name, msg) = task_failed(&s.synchronize().unwrap_err());
    assert_eq!(name, "graph_launch");
    assert!(msg.contains("add (task 0 of graph"), "{msg}");
    let reports = dev.take_sanitizer_reports();
    assert_eq!(reports.len(), 1, "{reports:?}");
    let r = &reports[0];
    assert_eq!(r.kind, soma_sim::ReportKind::UseAfterFree);
    assert_eq!((r.stream, r.position, r.task.as_str()), (s.id(), pos, "add"));
    assert_eq!(r.addr, buf.addr());
}
