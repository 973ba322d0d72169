//! The `ascend` backend end to end without hardware: our own `soma-capi` library is loaded as
//! if it were CANN's `libascendcl.so`, and the pool runs through the backend — with the
//! soma-core engine over the VMM calls, and with `native()` over `aclrtMemPool*`.

use std::path::PathBuf;
use std::sync::Arc;

use soma::ascend::{devices, Acl};
use soma::{attr, Device, Error, MemPool, ReusePolicy};

/// `libascendcl.so` built from `crates/soma-capi` (a dev-dependency, so cargo builds it into
/// the same `deps/` directory as this test binary). Its runtime, started by the first call,
/// has two devices (for peer access); the other tests use the first.
fn capi_library() -> PathBuf {
    static TWO_DEVICES: std::sync::Once = std::sync::Once::new();
    // Read by the library when its runtime starts, after this (every test loads it here).
    TWO_DEVICES.call_once(|| std::env::set_var("SOMA_SIM_DEVICES", "2"));
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps directory");
    for dir in [deps.to_path_buf(), deps.join("..")] {
        let candidate = dir.join("libascendcl.so");
        if candidate.exists() {
            return candidate;
        }
    }
    panic!("libascendcl.so (soma-capi) not found next to {}", exe.display());
}

/// The tests of this module share one runtime (the library's process-wide state, which no
/// other module loads), whose stream limit counts every test's streams: they run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn device() -> Device {
    let path = capi_library();
    // SAFETY: the library is our own soma-capi, an AscendCL implementation over the software
    // NPU; loading it runs no foreign initialisers.
    let acl = Arc::new(unsafe { Acl::open(&path) }.expect("load soma-capi as libascendcl.so"));
    let first = devices(acl).expect("devices").into_iter().next().expect("one device");
    Device::new(Arc::new(first))
}

#[test]
fn the_engine_runs_on_the_ascend_backend() {
    let _serial = serial();
    let dev = device();
    assert!(dev.info().supports_vmm, "soma-capi serves the VMM calls");
    let s1 = dev.create_stream().unwrap();
    let s2 = dev.create_stream().unwrap();
    let pool = MemPool::builder()
        .max_size(64 << 20)
        .reuse(ReusePolicy::new(true, false, false))
        .build(&dev)
        .unwrap();

    // Data round trip through a pool allocation.
    let mut x = pool.alloc_async::<u32>(1 << 16, &s1).unwrap();
    let host: Vec<u32> = (0..1 << 16).collect();
    s1.copy_from_host(&mut x, &host).unwrap();
    let mut back = vec![0u32; 1 << 16];
    s1.copy_to_host(&x, &mut back).unwrap();
    assert_eq!(back, host);
    let ptr = x.device_ptr();

    // Same-stream reuse, then event-ordered reuse on another stream.
    drop(x);
    let y = pool.alloc_async::<u32>(1 << 16, &s1).unwrap();
    assert_eq!(y.device_ptr(), ptr);
    drop(y);
    let ev = s1.record_event().unwrap();
    s2.wait_event(&ev).unwrap();
    let z = pool.alloc_async::<u32>(1 << 16, &s2).unwrap();
    assert_eq!(z.device_ptr(), ptr, "follow_event_dependencies through the backend");
    drop(z);

    assert!(pool.get::<attr::ReservedMemCurrent>().unwrap() >= 256 << 10);
    s2.synchronize().unwrap();
    s1.synchronize().unwrap();
    assert!(pool.trim_to(0).unwrap() > 0);
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0);
}

#[test]
fn native_pools_delegate_to_aclrt_mem_pool() {
    let _serial = serial();
    let dev = device();
    assert!(dev.info().supports_native_pool, "soma-capi reports an Atlas A2 by default");
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).native().build(&dev).unwrap();
    // The Rust builder's defaults are set on the native pool.
    assert_eq!(pool.get::<attr::ReleaseThreshold>().unwrap(), 64 << 20);
    assert!(pool.get::<attr::ReuseFollowEventDependencies>().unwrap());

    let mut x = pool.alloc_async::<u8>(3 << 20, &s).unwrap();
    s.copy_from_host(&mut x, &vec![7u8; 3 << 20]).unwrap();
    let mut back = vec![0u8; 3 << 20];
    s.copy_to_host(&x, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 7));
    assert!(pool.get::<attr::UsedMemCurrent>().unwrap() >= 3 << 20);
    let ptr = x.device_ptr();
    drop(x);
    let y = pool.alloc_async::<u8>(3 << 20, &s).unwrap();
    assert_eq!(y.device_ptr(), ptr, "same-stream reuse inside CANN's pool");
    drop(y);
    assert_eq!(pool.get::<attr::UsedMemCurrent>().unwrap(), 0);
    pool.set::<attr::ReleaseThreshold>(0).unwrap();
    assert!(pool.set::<attr::ReleaseThreshold>(1 << 40).is_err());
    pool.reset::<attr::UsedMemHigh>().unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        pool.get::<attr::ReservedMemCurrent>().unwrap(),
        0,
        "threshold 0 applied at synchronize"
    );
    assert!(matches!(pool.compact::<u8>(&s, &mut []), Err(Error::Driver(_))));

    // The whole policy reaches the driver's pool, as each switch does.
    pool.set_reuse_policy(ReusePolicy::NONE);
    assert!(!pool.get::<attr::ReuseFollowEventDependencies>().unwrap());
    pool.set_reuse_policy(ReusePolicy::new(false, true, true));
    assert!(!pool.get::<attr::ReuseFollowEventDependencies>().unwrap());
    assert!(pool.get::<attr::ReuseAllowOpportunistic>().unwrap());
    assert!(pool.get::<attr::ReuseAllowInternalDependencies>().unwrap());
    assert_eq!(pool.reuse_policy(), ReusePolicy::new(false, true, true));
}

/// A synchronize that reports an error a `Drop` left behind still drains first: soma-core
/// marks the stream's frees complete after it, so returning early would let another stream
/// reuse a block that queued work still writes.
#[test]
fn synchronize_drains_before_reporting_a_deferred_error() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let _serial = serial();
    let dev = device();
    let s1 = dev.create_stream().unwrap();
    for sync in ["stream", "event", "device"] {
        // A native pool dropped with a live allocation: its error is deferred to the next
        // fallible call of the device.
        let native = MemPool::builder().max_size(8 << 20).native().build(&dev).unwrap();
        let _leaked = native.alloc_raw(4096, &s1).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        s1.host_fn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
        let event = s1.record_event().unwrap();
        drop(native);
        let result = match sync {
            "stream" => s1.synchronize(),
            "event" => event.synchronize(),
            _ => dev.synchronize(),
        };
        assert!(result.is_err(), "{sync}: the deferred error is reported");
        assert!(done.load(Ordering::SeqCst), "{sync} synchronize returned before the wait");
    }
}

/// The stream limit is reported as such on the ascend backend too (the runtime's own limit
/// answers `ACL_ERROR_BAD_ALLOC`, which reads as a device out of memory).
#[test]
fn too_many_streams_is_reported_as_such() {
    let _serial = serial();
    let dev = device();
    let mut streams = Vec::new();
    let error = loop {
        match dev.create_stream() {
            Ok(s) => streams.push(s),
            Err(e) => break e,
        }
        assert!(streams.len() <= 4096, "no stream limit");
    };
    assert!(matches!(error, Error::TooManyStreams { .. }), "{error:?}");
    drop(streams);
    dev.create_stream().expect("streams are available again");
}

/// A free whose completion the host learnt through a chain of events (s2 waited on s1's
/// event, and s2's event completed) is released by `trim_to` while s1 still runs later,
/// unrelated work: the backend's check of unmaps against work in flight hears of it from
/// soma-core instead of asking the driver, which only knows that s1 is not idle.
#[test]
fn memory_freed_before_an_event_chain_is_released_while_its_stream_runs() {
    let _serial = serial();
    let dev = device();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut x = pool.alloc_async::<u8>(1 << 20, &s1).unwrap();
    s1.memset(&mut x, 7).unwrap();
    drop(x);
    let first = s1.record_event().unwrap();
    let (open, gate) = std::sync::mpsc::channel::<()>();
    s1.host_fn(move || {
        let _ = gate.recv_timeout(std::time::Duration::from_secs(30));
    })
    .unwrap();
    s2.wait_event(&first).unwrap();
    let second = s2.record_event().unwrap();
    second.synchronize().unwrap();
    assert_eq!(pool.trim_to(0).unwrap(), 2 << 20);
    assert_eq!(pool.stats().reserved, 0);
    open.send(()).unwrap();
    s1.synchronize().unwrap();
}

/// A native pool reports sizes and a full pool as the engine's pools do, and calls the
/// out-of-memory hooks.
#[test]
fn native_pools_report_out_of_memory_as_engine_pools_do() {
    let _serial = serial();
    let dev = device();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(8 << 20).native().build(&dev).unwrap();
    let err = pool.alloc_async::<u8>(9 << 20, &s).unwrap_err();
    assert!(matches!(err, Error::InvalidSize(_)), "{err:?}");
    let mut big = Some(pool.alloc_async::<u8>(8 << 20, &s).unwrap());
    let Error::OutOfMemory(oom) = pool.alloc_async::<u8>(2 << 20, &s).unwrap_err() else {
        panic!("a full native pool is out of memory");
    };
    assert_eq!((oom.requested, oom.max, oom.used), (2 << 20, 8 << 20, 8 << 20));
    let mut calls = 0;
    let x = pool
        .alloc_async_or::<u8>(2 << 20, &s, |_| {
            calls += 1;
            big = None; // evict, then ask for a retry
            soma::OomAction::Retry
        })
        .unwrap();
    assert_eq!(calls, 1);
    drop(x);
}

/// Memory whose free the device has finished is released by `trim_to` and by the threshold
/// at another stream's synchronize, although nothing told the backend that the freeing
/// stream ran it (the pool polls the backend's cached completion first).
#[test]
fn memory_freed_on_an_idle_stream_is_released_without_asking_that_stream() {
    let _serial = serial();
    let dev = device();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let until_released = |what: &str, mut step: Box<dyn FnMut() -> u64 + '_>| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while step() != 0 {
            assert!(std::time::Instant::now() < deadline, "{what}: never released");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut a = pool.alloc_async::<u8>(2 << 20, &s1).unwrap();
    s1.memset(&mut a, 0).unwrap();
    drop(a);
    until_released(
        "trim_to",
        Box::new(|| {
            pool.trim_to(0).unwrap();
            pool.stats().reserved
        }),
    );
    let pool = MemPool::builder().release_threshold(0).build(&dev).unwrap();
    let mut b = pool.alloc_async::<u8>(2 << 20, &s1).unwrap();
    s1.memset(&mut b, 0).unwrap();
    drop(b);
    until_released(
        "threshold",
        Box::new(|| {
            s2.synchronize().unwrap();
            pool.stats().reserved
        }),
    );
}

/// An event recorded after a host function that panicked reports the failure when
/// synchronized, as on the software NPU; one recorded before it does not.
#[test]
fn an_event_recorded_after_a_failed_host_function_reports_it() {
    let _serial = serial();
    let dev = device();
    let s = dev.create_stream().unwrap();
    let before = s.record_event().unwrap();
    s.host_fn(|| panic!("planted")).unwrap();
    let after = s.record_event().unwrap();
    before.synchronize().unwrap();
    assert!(before.query().unwrap());
    let err = after.synchronize().unwrap_err();
    assert!(err.to_string().contains("host_fn") && err.to_string().contains("planted"), "{err}");
    assert!(after.query().is_err(), "a query of the completed record reports the failure too");
}

/// A free on one thread while a synchronous memset of the same memory runs on another waits
/// for it (the runtime under the backend would otherwise free memory being written; ours
/// refuses, which is what this test would see).
#[test]
fn a_free_waits_for_a_synchronous_memset_of_the_same_memory() {
    let _serial = serial();
    let dev = device();
    let hal = Arc::clone(dev.hal());
    let len = 512 << 20;
    let p = hal.malloc(len).unwrap();
    let (started_tx, started) = std::sync::mpsc::channel();
    let writer = {
        let hal = Arc::clone(&hal);
        std::thread::spawn(move || {
            started_tx.send(()).unwrap();
            hal.memset_sync(p, 7, len)
        })
    };
    started.recv().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    hal.free(p).expect("the free waits for the memset, then succeeds");
    writer.join().unwrap().expect("the memset ran to its end");
}

#[test]
fn page_locked_transfers_run_on_the_ascend_backend() {
    let _serial = serial();
    let dev = device();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(16 << 20).build(&dev).unwrap();
    let data: Vec<u32> = (0..4096).collect();
    let mut x = pool.alloc_async::<u32>(4096, &s).unwrap();
    let staging = soma::HostBuffer::from_slice(&dev, &data).unwrap();
    let staging = s.copy_from_host_async(&mut x, staging).unwrap().wait().unwrap();
    let back = s.copy_to_host_async(&x, staging).unwrap().wait().unwrap();
    assert_eq!(&back[..], &data[..]);
}

/// Held by `foreign_gate` until set.
static FOREIGN_GATE_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A host function launched on the raw stream, as an operator library would: soma does not
/// see it. It holds the stream until `FOREIGN_GATE_OPEN` is set (30 s at most).
extern "C" fn foreign_gate(_: *mut std::ffi::c_void) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !FOREIGN_GATE_OPEN.load(std::sync::atomic::Ordering::Acquire)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn foreign_work_on_the_raw_stream_delays_the_release_of_its_memory() {
    use soma::ascend::AscendStreamExt as _;
    use std::sync::atomic::Ordering;
    let _serial = serial();
    let path = capi_library();
    // SAFETY: as in `device()`.
    let acl = Arc::new(unsafe { Acl::open(&path) }.expect("load soma-capi"));
    let ascend = devices(Arc::clone(&acl)).unwrap().into_iter().next().unwrap();
    let dev = Device::new(Arc::new(ascend));
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(16 << 20).build(&dev).unwrap();
    let x = pool.alloc_async::<u8>(2 << 20, &s).unwrap();
    let raw = s.as_raw().unwrap();
    FOREIGN_GATE_OPEN.store(false, Ordering::Release);
    // Operators soma does not see: a held host function, then a memset of `x`, both
    // enqueued on the raw stream after everything soma enqueued there (nothing).
    // SAFETY: `raw` is a live stream; `foreign_gate` ignores its argument.
    let rc =
        unsafe { acl.lib().aclrtLaunchHostFunc(raw, Some(foreign_gate), std::ptr::null_mut()) };
    assert_eq!(rc.0, 0);
    // SAFETY: `x` is live device memory of 2 MiB on this device; `raw` is its stream.
    let rc = unsafe {
        acl.lib().aclrtMemsetAsync(x.device_ptr().addr() as *mut _, 2 << 20, 7, 2 << 20, raw)
    };
    assert_eq!(rc.0, 0);
    drop(x);
    // The free is ordered after the foreign memset: releasing memory now keeps the block (the
    // memset is in flight) instead of unmapping it under the device.
    let trimmed = pool.trim_to(0);
    FOREIGN_GATE_OPEN.store(true, Ordering::Release);
    trimmed.unwrap();
    assert!(pool.get::<attr::ReservedMemCurrent>().unwrap() >= 2 << 20);
    s.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0);
}

#[test]
fn graph_capture_runs_on_the_ascend_backend() {
    use std::sync::atomic::{AtomicU64, Ordering};

    use soma::hal::{CaptureErrorKind, DriverError};
    use soma::{CaptureMode, CaptureStatus};

    let _serial = serial();
    let dev = device();
    let (s, side) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut a = pool.alloc_async::<u8>(4096, &s).unwrap();
    let mut b = pool.alloc_async::<u8>(4096, &s).unwrap();
    s.memset(&mut a, 1).unwrap();
    let enqueued = s.hal().enqueued();
    let runs = Arc::new(AtomicU64::new(0));
    let count = |runs: &Arc<AtomicU64>| {
        let r = Arc::clone(runs);
        move || {
            r.fetch_add(1, Ordering::SeqCst);
        }
    };

    s.begin_capture(CaptureMode::Global).unwrap();
    let info = s.capture_info().unwrap();
    assert_eq!(info.status, CaptureStatus::Active);
    s.host_fn_replayable(count(&runs)).unwrap();
    s.copy(&mut b, &a).unwrap();
    s.memset(&mut a, 7).unwrap();
    let fork = s.record_event().unwrap();
    side.wait_event(&fork).unwrap();
    drop(fork); // an event recorded in the capture goes without harming it
    assert_eq!(side.capture_info().unwrap().capture, info.capture, "joined through the event");
    side.host_fn_replayable(count(&runs)).unwrap();
    let join = side.record_event().unwrap();
    s.wait_event(&join).unwrap();
    match s.host_fn(|| ()) {
        Err(Error::Driver(DriverError::Capture { kind, .. })) => {
            assert_eq!(kind, CaptureErrorKind::NotCapturable)
        }
        other => panic!("a run-once host function was not refused: {other:?}"),
    }
    let graph = s.end_capture().unwrap();
    assert_eq!(graph.id(), info.capture.unwrap());
    assert_eq!(graph.task_count(), 8);
    assert_eq!(side.capture_info().unwrap().status, CaptureStatus::None);
    assert_eq!(s.hal().enqueued(), enqueued, "captured tasks took no position");
    s.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    graph.launch(&s).unwrap();
    let mut host = [0u8; 4096];
    s.copy_to_host(&b, &mut host).unwrap();
    assert_eq!(host, [1; 4096], "b copied a before the memset");
    graph.launch(&s).unwrap();
    s.copy_to_host(&b, &mut host).unwrap();
    assert_eq!(host, [7; 4096]);
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    drop(graph);

    // Forbidden: synchronising the capturing stream invalidates the capture.
    s.begin_capture(CaptureMode::Global).unwrap();
    let kind = |e: Error| match e {
        Error::Driver(DriverError::Capture { kind, .. }) => kind,
        other => panic!("expected a capture error, got {other:?}"),
    };
    assert_eq!(kind(s.synchronize().unwrap_err()), CaptureErrorKind::StreamCaptured);
    assert_eq!(s.capture_info().unwrap().status, CaptureStatus::Invalidated);
    assert_eq!(kind(s.end_capture().unwrap_err()), CaptureErrorKind::Invalidated);
    assert_eq!(dev.exchange_capture_mode(CaptureMode::Relaxed).unwrap(), CaptureMode::Global);
    assert_eq!(dev.exchange_capture_mode(CaptureMode::Global).unwrap(), CaptureMode::Relaxed);
    s.synchronize().unwrap();
    drop((a, b, join));
}

/// `x` allocated and written on `s3`, written again on `s1` (a recorded use), freed on `s3`
/// after `s3` waited for that use; `s1` then stays busy in a host function until the returned
/// sender is dropped or sent to.
fn free_after_a_use_on_a_stream_that_stays_busy(
    pool: &MemPool<'_>,
    s1: &soma::Stream<'_>,
    s3: &soma::Stream<'_>,
) -> std::sync::mpsc::Sender<()> {
    let mut x = pool.alloc_async::<u8>(2 << 20, s3).unwrap();
    s3.memset(&mut x, 1).unwrap();
    s1.wait_stream(s3).unwrap();
    s1.memset(&mut x, 3).unwrap();
    s3.wait_stream(s1).unwrap();
    drop(x);
    let (open, gate) = std::sync::mpsc::channel::<()>();
    s1.host_fn(move || {
        let _ = gate.recv_timeout(std::time::Duration::from_secs(30));
    })
    .unwrap();
    open
}

/// The free on `s3` is ordered after the use on `s1` through events, so once `s3` has run it
/// the use is complete although `s1` is still busy: `trim_to` releases the memory (the
/// backend's check of unmaps against work in flight learns it from the event chain).
#[test]
fn trim_releases_memory_used_on_another_stream_that_is_still_busy() {
    let _serial = serial();
    let dev = device();
    let (s1, s3) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let open = free_after_a_use_on_a_stream_that_stays_busy(&pool, &s1, &s3);
    // The device has run s3's work; the host has not observed it.
    while !s3.is_complete_unobserved().unwrap() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(pool.trim_to(0).unwrap(), 2 << 20, "the use on s1 completed before the free");
    assert_eq!(pool.stats().reserved, 0);
    drop(open);
    s1.synchronize().unwrap();
}

/// With CANN's defaults (release threshold 0) the synchronisation of the freeing stream
/// releases that memory, and no error is left behind for an unrelated later call.
#[test]
fn the_release_threshold_leaves_no_error_after_a_use_on_a_busy_stream() {
    let _serial = serial();
    let dev = device();
    let (s1, s3) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).cann_defaults().build(&dev).unwrap();
    let open = free_after_a_use_on_a_stream_that_stays_busy(&pool, &s1, &s3);
    s3.synchronize().unwrap();
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0, "released at the threshold");
    drop(open);
    s1.synchronize().unwrap();
}

/// A use the pool was not told of (a memset straight through the backend on another stream,
/// not ordered before the free) keeps the memory mapped: the threshold at a synchronisation
/// releases what it can, leaves no error behind for a later call, and releases the rest at a
/// synchronisation after the use.
#[test]
fn the_release_threshold_keeps_memory_whose_last_use_is_running() {
    let _serial = serial();
    let dev = device();
    let (s1, s3) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).cann_defaults().build(&dev).unwrap();
    let x = pool.alloc_async::<u8>(2 << 20, &s3).unwrap();
    let (open, gate) = std::sync::mpsc::channel::<()>();
    s1.host_fn(move || {
        let _ = gate.recv_timeout(std::time::Duration::from_secs(30));
    })
    .unwrap();
    s1.hal().memset(x.device_ptr(), 0, 2 << 20).unwrap();
    drop(x);
    s3.synchronize().unwrap();
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 2 << 20, "still in use on s1");
    assert!(pool.trim_to(0).is_err(), "trim_to reports what the backend refused");
    drop(open);
    s1.synchronize().unwrap();
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 0, "released after the use");
}

/// Dropping a pool whose free waits behind a busy stream returns at once; the device
/// releases the memory at the synchronisation after the work (the backend's check of unmaps
/// against work in flight never refuses it).
#[test]
fn a_dropped_pool_leaves_its_memory_to_the_device_until_the_work_completes() {
    let _serial = serial();
    let dev = device();
    let s = dev.create_stream().unwrap();
    let before = dev.mem_info().unwrap().free;
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let (open, gate) = std::sync::mpsc::channel::<()>();
    s.host_fn(move || {
        let _ = gate.recv_timeout(std::time::Duration::from_secs(30));
    })
    .unwrap();
    let mut x = pool.alloc_async::<u8>(2 << 20, &s).unwrap();
    s.memset(&mut x, 5).unwrap();
    drop(x);
    drop(pool);
    assert!(dev.mem_info().unwrap().free < before, "held until the memset has run");
    drop(open);
    s.synchronize().unwrap();
    assert_eq!(dev.mem_info().unwrap().free, before);
    dev.synchronize().unwrap(); // no error was left behind
}

#[test]
fn peer_access_runs_on_the_ascend_backend() {
    use soma::hal::{DeviceHal, DriverError};
    let _serial = serial();
    let path = capi_library();
    // SAFETY: as in `device()`.
    let acl = Arc::new(unsafe { Acl::open(&path) }.expect("load soma-capi"));
    let mut ascend = devices(acl).unwrap().into_iter();
    let (a0, a1) = (Arc::new(ascend.next().unwrap()), Arc::new(ascend.next().unwrap()));
    let (d0, d1) = (Device::new(a0.clone()), Device::new(a1.clone()));
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (p0, p1) = (
        MemPool::builder().max_size(16 << 20).build(&d0).unwrap(),
        MemPool::builder().max_size(16 << 20).build(&d1).unwrap(),
    );
    let weights = p0.upload(&[5u32; 1024], &s0).unwrap();
    let mut local = p1.alloc_zeros::<u32>(1024, &s1).unwrap();

    // The backend itself refuses device 0's memory on device 1's stream without access.
    let raw = s1.hal().copy_d2d(local.device_ptr(), weights.device_ptr(), 4096);
    assert!(matches!(raw, Err(DriverError::InvalidAddress { .. })), "{raw:?}");
    assert!(d1.can_access_peer(&d0).unwrap());
    assert!(matches!(s1.copy(&mut local, &weights), Err(Error::PeerAccess(_))));

    d1.enable_peer_access(&d0).unwrap();
    assert!(a1.peer_access_enabled(&*a0) && !a0.peer_access_enabled(&*a1));
    assert!(matches!(d1.enable_peer_access(&d0), Err(Error::PeerAccess(_))));
    s1.copy(&mut local, &weights).unwrap();
    // The free on device 0 waits for device 1's copy (an event of device 1 waited on there).
    drop(weights);
    assert_eq!(s1.download(&local).unwrap(), vec![5; 1024]);
    s0.synchronize().unwrap();
    assert!(p0.trim_to(0).unwrap() > 0, "the freed block went back once device 1's copy ran");

    d1.disable_peer_access(&d0).unwrap();
    assert!(!a1.peer_access_enabled(&*a0));
    let other = p0.upload(&[1u32; 16], &s0).unwrap();
    let before = s1.hal().enqueued();
    let raw = s1.hal().copy_d2d(local.device_ptr(), other.device_ptr(), 64);
    assert!(matches!(raw, Err(DriverError::InvalidAddress { .. })), "{raw:?}");
    assert_eq!(s1.hal().enqueued(), before, "a refused copy enqueues nothing");
}

/// A shareable pool on the ascend backend: its segments are exported through
/// `aclrtMemExportToShareableHandle` when an importer asks, the process id is
/// `aclrtDeviceGetBareTgid`'s, and the calls refuse what CANN refuses.
#[test]
fn shareable_pools_run_on_the_ascend_backend() {
    use soma::hal::{DriverError, ShareableHandle};
    use soma::{HandleType, IpcErrorKind};
    let _serial = serial();
    let dev = device();
    assert_eq!(dev.process_id().unwrap(), std::process::id() as i32);
    let s = dev.create_stream().unwrap();
    let pool =
        MemPool::builder().handle_type(HandleType::Posix).max_size(64 << 20).build(&dev).unwrap();
    let desc = pool.export().unwrap();
    pool.allow_process(1).unwrap();
    let a = pool.alloc_async::<u8>(4096, &s).unwrap();
    let p = a.export_pointer().unwrap();
    assert_eq!((p.pool_id(), p.byte_len()), (desc.pool_id(), 4096));
    let own = MemPool::import(&desc, &dev).unwrap_err();
    assert!(matches!(own, Error::Ipc { kind: IpcErrorKind::SameProcess, .. }));
    let hal = dev.hal();
    let h = hal.alloc_physical(2 << 20).unwrap();
    let shareable = hal.export_physical(h, true).unwrap();
    assert!(hal.export_physical(h, true).is_err(), "one shareable handle per handle");
    hal.allow_shareable_pids(shareable, &[1]).unwrap();
    let unsized_import = hal.import_physical(ShareableHandle(shareable.0), 0);
    assert!(matches!(unsized_import, Err(DriverError::InvalidValue(m)) if m.contains("size")));
    let same = hal.import_physical(shareable, 2 << 20);
    assert!(same.is_err(), "import and export only across processes");
    hal.free_physical(h).unwrap();
    drop(a);
}
