//! Events: cross-stream ordering, re-recording, timing, records on failed streams, records on
//! idle streams.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use soma_sim::hal::{DeviceHal, KernelError, KernelLaunch};
use soma_sim::{Npu, SanitizerMode};

use super::{device, fill_kernel, gate, read, recv, MIB};

#[test]
fn wait_orders_a_second_stream_after_the_first() {
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let buf = dev.malloc(MIB).unwrap();
    let ev = dev.create_event().unwrap();
    let flag = Arc::new(AtomicU64::new(0));
    let seen_by_b = Arc::new(AtomicU64::new(99));

    let f = Arc::clone(&flag);
    a.host_fn(Box::new(move || {
        std::thread::sleep(Duration::from_millis(100));
        f.store(1, Ordering::SeqCst);
    }))
    .unwrap();
    a.launch(fill_kernel(buf, 4096, 1)).unwrap();
    let pos = a.record(ev.as_ref()).unwrap();
    assert_eq!(pos, 3);

    b.wait(ev.as_ref()).unwrap();
    let (f, seen) = (Arc::clone(&flag), Arc::clone(&seen_by_b));
    b.host_fn(Box::new(move || seen.store(f.load(Ordering::SeqCst), Ordering::SeqCst))).unwrap();
    b.launch(fill_kernel(buf, 4096, 2)).unwrap();
    b.synchronize().unwrap();
    assert_eq!(seen_by_b.load(Ordering::SeqCst), 1, "B ran after A's slow host fn");
    assert_eq!(read(&dev, buf, 4096), vec![2; 4096], "B's write landed after A's");
    assert!(ev.query().unwrap());
    a.synchronize().unwrap();
}

#[test]
fn latest_record_counts() {
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let ev = dev.create_event().unwrap();
    assert!(ev.query().unwrap(), "never recorded: complete");
    ev.synchronize().unwrap();
    b.wait(ev.as_ref()).unwrap(); // never recorded: no-op
    assert_eq!(b.enqueued(), 0);

    assert_eq!(a.record(ev.as_ref()).unwrap(), 1);
    a.synchronize().unwrap();
    assert!(ev.query().unwrap());
    let (tx, rx) = gate();
    a.host_fn(Box::new(move || recv(&rx))).unwrap();
    assert_eq!(a.record(ev.as_ref()).unwrap(), 3);
    assert!(!ev.query().unwrap(), "the re-record is pending");

    b.wait(ev.as_ref()).unwrap();
    let ran = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&ran);
    b.host_fn(Box::new(move || r.store(1, Ordering::SeqCst))).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(ran.load(Ordering::SeqCst), 0, "B waits for the latest record, not the first");
    tx.send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    ev.synchronize().unwrap();
}

#[test]
fn wait_captures_the_record_at_call_time() {
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let ev = dev.create_event().unwrap();
    let (tx, rx) = gate();
    a.record(ev.as_ref()).unwrap();
    a.synchronize().unwrap();
    b.wait(ev.as_ref()).unwrap(); // captures the completed first record
    a.host_fn(Box::new(move || recv(&rx))).unwrap();
    a.record(ev.as_ref()).unwrap(); // later re-record does not affect B's wait
    b.host_fn(Box::new(|| {})).unwrap();
    b.synchronize().unwrap();
    tx.send(()).unwrap();
    a.synchronize().unwrap();
}

#[test]
fn elapsed_time_is_monotonic_and_plausible() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let (start, end) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    assert!(start.elapsed_ms(end.as_ref()).is_err(), "not recorded");
    s.record(start.as_ref()).unwrap();
    s.host_fn(Box::new(|| std::thread::sleep(Duration::from_millis(50)))).unwrap();
    let (tx, rx) = gate();
    s.host_fn(Box::new(move || recv(&rx))).unwrap();
    s.record(end.as_ref()).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    assert!(start.elapsed_ms(end.as_ref()).is_err(), "end not complete");
    tx.send(()).unwrap();
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(end.as_ref()).unwrap();
    assert!((50.0..10_000.0).contains(&ms), "{ms}");
    let back = end.elapsed_ms(start.as_ref()).unwrap();
    assert!(back <= -50.0, "{back}");
    assert_eq!(start.elapsed_ms(start.as_ref()).unwrap(), 0.0);
}

/// A kernel that fails, failing its stream.
fn failing_kernel() -> KernelLaunch {
    KernelLaunch { name: "fails", buffers: vec![], body: Box::new(|_| Err(KernelError::new("no"))) }
}

#[test]
fn record_on_a_failed_stream_completes_with_the_error() {
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let ev = dev.create_event().unwrap();
    let ok = dev.create_event().unwrap();
    a.record(ok.as_ref()).unwrap();
    a.launch(failing_kernel()).unwrap();
    a.record(ev.as_ref()).unwrap();
    b.wait(ev.as_ref()).unwrap();
    b.host_fn(Box::new(|| {})).unwrap();
    b.synchronize().unwrap(); // does not hang, and B's own state is fine
                              // Complete, with the failure: a query reports it as a synchronize does.
    let q = ev.query().unwrap_err();
    assert!(matches!(q, soma_sim::hal::DriverError::TaskFailed { task: 2, .. }), "{q:?}");
    assert!(ok.query().unwrap(), "a record before the failure is fine");
    let e = ev.synchronize().unwrap_err();
    assert!(matches!(e, soma_sim::hal::DriverError::TaskFailed { task: 2, .. }), "{e:?}");
    assert!(ok.elapsed_ms(ev.as_ref()).is_err());
    assert!(a.synchronize().is_err());
}

#[test]
fn chained_waits_through_three_streams() {
    let dev = device(64 * MIB);
    let s: Vec<_> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
    let (e1, e2) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    let buf = dev.malloc(MIB).unwrap();
    s[0].host_fn(Box::new(|| std::thread::sleep(Duration::from_millis(50)))).unwrap();
    s[0].launch(fill_kernel(buf, 64, 1)).unwrap();
    s[0].record(e1.as_ref()).unwrap();
    s[1].wait(e1.as_ref()).unwrap();
    s[1].launch(fill_kernel(buf, 64, 2)).unwrap();
    s[1].record(e2.as_ref()).unwrap();
    s[2].wait(e2.as_ref()).unwrap();
    s[2].launch(fill_kernel(buf, 64, 3)).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(read(&dev, buf, 64), vec![3; 64]);
}

/// A record on a stream with nothing in flight is complete when `record` returns (it is
/// completed on the calling thread instead of waking the stream's worker), and waiting on it
/// enqueues nothing; behind pending work a record waits for that work. Positions stay
/// consecutive across both kinds of record. (With the sanitizer on, which
/// `SOMA_SANITIZER=fail` turns on for the other tests, every record goes through the queue.)
#[test]
fn record_on_an_idle_stream_completes_at_once() {
    let npu = Npu::builder().capacity(64 * MIB).sanitizer(SanitizerMode::Off).build().unwrap();
    let dev = npu.device(0).unwrap();
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let ev = dev.create_event().unwrap();
    for pos in 1..=3 {
        assert_eq!(a.record(ev.as_ref()).unwrap(), pos);
        assert!(ev.query().unwrap(), "record {pos} on an idle stream");
        assert_eq!((a.enqueued(), a.completed()), (pos, pos));
    }
    b.wait(ev.as_ref()).unwrap();
    assert_eq!(b.enqueued(), 0, "a wait on a complete record enqueues nothing");

    let (tx, rx) = gate();
    a.host_fn(Box::new(move || recv(&rx))).unwrap();
    assert_eq!(a.record(ev.as_ref()).unwrap(), 5);
    assert!(!ev.query().unwrap(), "a record behind a blocked host fn is pending");
    b.wait(ev.as_ref()).unwrap();
    assert_eq!(b.enqueued(), 1, "a wait on a pending record is a task");
    let ran = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&ran);
    b.host_fn(Box::new(move || r.store(1, Ordering::SeqCst))).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(ran.load(Ordering::SeqCst), 0, "b waits for a's pending record");
    tx.send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert!(ev.query().unwrap());
    a.synchronize().unwrap();
    assert_eq!(a.record(ev.as_ref()).unwrap(), 6, "idle again: positions go on");
    assert!(ev.query().unwrap());

    // Elapsed time between records completed on the host and by the worker is defined.
    let start = dev.create_event().unwrap();
    a.record(start.as_ref()).unwrap();
    let (tx, rx) = gate();
    a.host_fn(Box::new(move || recv(&rx))).unwrap();
    a.record(ev.as_ref()).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    tx.send(()).unwrap();
    ev.synchronize().unwrap();
    let ms = start.elapsed_ms(ev.as_ref()).unwrap();
    assert!((25.0..10_000.0).contains(&ms), "{ms}");
}

/// An armed task fault still hits a record on an idle stream: the record then goes through
/// the queue and completes with the stream's error, as any record of a failed task.
#[test]
fn a_task_fault_hits_a_record_on_an_idle_stream() {
    let dev = device(64 * MIB);
    let a = dev.create_stream().unwrap();
    let ev = dev.create_event().unwrap();
    dev.faults().fail_next_task(a.id());
    assert_eq!(a.record(ev.as_ref()).unwrap(), 1);
    let e = ev.synchronize().unwrap_err();
    assert!(matches!(e, soma_sim::hal::DriverError::TaskFailed { task: 1, .. }), "{e:?}");
    assert!(a.synchronize().is_err(), "the stream failed");
    // A failed stream's records keep going through the queue and carry its error.
    let later = dev.create_event().unwrap();
    a.record(later.as_ref()).unwrap();
    assert!(later.synchronize().is_err());
}

/// A failed stream that was dropped is no longer the device's: a device synchronize does not
/// report its error, although an event recorded on it keeps its state alive.
#[test]
fn a_dropped_failed_stream_does_not_fail_the_device() {
    let dev = device(64 * MIB);
    let a = dev.create_stream().unwrap();
    let ev = dev.create_event().unwrap();
    a.launch(failing_kernel()).unwrap();
    a.record(ev.as_ref()).unwrap();
    assert!(dev.synchronize().is_err(), "while the stream lives, the device reports it");
    drop(a);
    dev.synchronize().unwrap();
    assert!(ev.synchronize().is_err(), "the event still carries the failure");
}
