//! Model runtime instances built by stream capture, through the exported functions. Each
//! test works on a device of its own: a capture restricts the default stream and, in global
//! mode, the unsafe calls of every thread on its device.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ascend_sys::{
    aclmdlRI, aclmdlRICaptureMode, aclmdlRICaptureStatus, aclrtMemMallocPolicy, aclrtMemcpyKind,
    aclrtStream, AclError,
};
use ascendcl::*;
use common::*;

const GLOBAL: aclmdlRICaptureMode = aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL;
const RELAXED: aclmdlRICaptureMode = aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
const NONE: aclmdlRICaptureStatus = aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_NONE;
const ACTIVE: aclmdlRICaptureStatus = aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE;
const INVALIDATED: aclmdlRICaptureStatus =
    aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED;
const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;

/// Starts the runtime with a device per test and makes `device` current on this thread.
fn on_device(device: i32) {
    init(&[("SOMA_SIM_DEVICES", "5"), ("SOMA_SIM_CAPACITY", "1G")]);
    ok(aclrtSetDevice(device));
}

fn malloc(size: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtMalloc(&mut p, size, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST) });
    p
}

fn malloc_host(size: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtMallocHost(&mut p, size) });
    p
}

fn info(s: aclrtStream) -> (aclmdlRICaptureStatus, aclmdlRI) {
    let (mut status, mut model) = (aclmdlRICaptureStatus(9), std::ptr::null_mut());
    // SAFETY: valid out-pointers.
    ok(unsafe { aclmdlRICaptureGetInfo(s, &mut status, &mut model) });
    (status, model)
}

fn end(s: aclrtStream) -> Result<aclmdlRI, AclError> {
    let mut model = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let e = unsafe { aclmdlRICaptureEnd(s, &mut model) };
    if e == AclError::SUCCESS {
        Ok(model)
    } else {
        Err(e)
    }
}

extern "C" fn count_run(args: *mut c_void) {
    // SAFETY: the tests pass a pointer to an `AtomicU32` that outlives the model.
    unsafe { &*args.cast::<AtomicU32>() }.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn wait_for_flag(args: *mut c_void) {
    // SAFETY: as above.
    let flag = unsafe { &*args.cast::<AtomicU32>() };
    for _ in 0..30_000 {
        if flag.load(Ordering::SeqCst) != 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn single_stream_capture_replays_the_captured_tasks() {
    on_device(0);
    let s = stream();
    let n = 4096;
    let (host_in, host_out) = (malloc_host(n), malloc_host(n));
    let dev = malloc(n);
    let runs = AtomicU32::new(0);
    // SAFETY: `host_in` is an aclrtMallocHost block of `n` bytes.
    unsafe { std::ptr::write_bytes(host_in.cast::<u8>(), 3, n) };

    ok(aclmdlRICaptureBegin(s, GLOBAL));
    let (status, model) = info(s);
    assert_eq!(status, ACTIVE);
    assert!(!model.is_null(), "the model exists from the start of the capture");
    // SAFETY: pinned host memory and device memory of `n` bytes, alive until the model is gone.
    unsafe {
        ok(aclrtMemcpyAsync(dev, n, host_in, n, H2D, s));
        ok(aclrtLaunchHostFunc(s, Some(count_run), std::ptr::from_ref(&runs).cast_mut().cast()));
        ok(aclrtMemsetAsync(dev, n, 9, 16, s));
        ok(aclrtMemcpyAsync(host_out, n, dev, n, D2H, s));
    }
    assert_eq!(end(s), Ok(model), "the same handle");
    assert_eq!(info(s), (NONE, std::ptr::null_mut()));
    ok(aclrtSynchronizeStream(s));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran at capture time");

    for launch in 1..=3u8 {
        // SAFETY: no launch is running (the stream was synchronised).
        unsafe { std::ptr::write_bytes(host_in.cast::<u8>(), launch, n) };
        ok(aclmdlRIExecuteAsync(model, s));
        ok(aclrtSynchronizeStream(s));
        // SAFETY: the copy into `host_out` has completed.
        let out = unsafe { std::slice::from_raw_parts(host_out.cast::<u8>(), n) };
        assert_eq!((out[0], out[15], out[16], out[n - 1]), (9, 9, launch, launch));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    ok(aclmdlRIDestroy(model));
    fails(aclmdlRIDestroy(model), AclError::ERROR_RT_INVALID_HANDLE, "destroyed twice");
    fails(aclmdlRIExecuteAsync(model, s), AclError::ERROR_RT_INVALID_HANDLE, "destroyed");
    ok(aclrtDestroyStream(s));
    ok(aclrtFree(dev));
    ok(aclrtFreeHost(host_in));
    ok(aclrtFreeHost(host_out));
}

#[test]
fn forbidden_calls_fail_and_invalidate_the_capture() {
    on_device(1);
    let s = stream();
    let dev = malloc(4096);
    let mut pageable = vec![0u8; 64];

    ok(aclmdlRICaptureBegin(s, GLOBAL));
    let (_, model) = info(s);
    fails(aclrtSynchronizeDevice(), AclError::ERROR_RT_STREAM_CAPTURED, "device sync");
    assert_eq!(info(s).0, INVALIDATED);
    fails(end(s).unwrap_err(), AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED, "end");
    assert!(msg().contains("synchronize"), "{}", msg());
    fails(aclmdlRIDestroy(model), AclError::ERROR_RT_INVALID_HANDLE, "no model was made");

    ok(aclmdlRICaptureBegin(s, GLOBAL));
    // SAFETY: `pageable` is valid for 64 bytes.
    let e = unsafe { aclrtMemcpy(pageable.as_mut_ptr().cast(), 64, dev, 64, D2H) };
    fails(e, AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, "a synchronous copy");
    fails(end(s).unwrap_err(), AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED, "end");

    ok(aclmdlRICaptureBegin(s, GLOBAL));
    // SAFETY: as above.
    let e = unsafe { aclrtMemcpyAsync(dev, 64, pageable.as_ptr().cast(), 64, H2D, s) };
    fails(e, AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, "pageable memory in a capture");
    fails(
        aclrtSynchronizeStream(std::ptr::null_mut()),
        AclError::ERROR_RT_STREAM_CAPTURE_IMPLICIT,
        "default stream",
    );
    let e = aclrtMemsetAsync(dev, 64, 0, 64, std::ptr::null_mut());
    fails(e, AclError::ERROR_RT_STREAM_CAPTURE_IMPLICIT, "default stream");
    fails(aclmdlRICaptureBegin(s, GLOBAL), AclError::ERROR_RT_STREAM_CAPTURED, "begun twice");
    fails(
        aclmdlRICaptureBegin(std::ptr::null_mut(), GLOBAL),
        AclError::ERROR_INVALID_PARAM,
        "null",
    );
    fails(
        aclmdlRICaptureBegin(stream(), aclmdlRICaptureMode(3)),
        AclError::ERROR_INVALID_PARAM,
        "mode",
    );
    let (status, model) = info(s);
    assert_eq!(status, ACTIVE, "refused calls did not invalidate it");
    fails(aclmdlRIExecuteAsync(model, stream()), AclError::ERROR_RT_MODEL_CAPTURED, "capturing");
    fails(aclmdlRIDestroy(model), AclError::ERROR_RT_MODEL_CAPTURED, "capturing");
    let mut st = ascend_sys::aclrtStreamStatus(0);
    // SAFETY: valid out-pointer.
    let e = unsafe { aclrtStreamQuery(s, &mut st) };
    fails(e, AclError::ERROR_RT_STREAM_CAPTURED, "query");
    fails(end(s).unwrap_err(), AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED, "end");
    fails(end(s).unwrap_err(), AclError::ERROR_RT_STREAM_NOT_CAPTURED, "ended already");
    ok(aclrtSynchronizeStream(std::ptr::null_mut()));
    ok(aclrtDestroyStream(s));
    ok(aclrtFree(dev));
}

#[test]
fn thread_capture_modes_exchange() {
    on_device(2);
    let s = stream();
    let dev = malloc(4096);
    let mut host = [0u8; 16];
    let mut mode = RELAXED;
    // SAFETY: valid pointer.
    ok(unsafe { aclmdlRICaptureThreadExchangeMode(&mut mode) });
    assert_eq!(mode, GLOBAL, "every thread starts in global mode");
    ok(aclmdlRICaptureBegin(s, GLOBAL));
    // SAFETY: `host` is valid for 16 bytes.
    ok(unsafe { aclrtMemcpy(host.as_mut_ptr().cast(), 16, dev, 16, D2H) });
    assert_eq!(info(s).0, ACTIVE, "a relaxed thread may copy");
    // SAFETY: valid pointer.
    ok(unsafe { aclmdlRICaptureThreadExchangeMode(&mut mode) });
    assert_eq!(mode, RELAXED);
    let mut bad = aclmdlRICaptureMode(7);
    // SAFETY: valid pointer.
    let e = unsafe { aclmdlRICaptureThreadExchangeMode(&mut bad) };
    fails(e, AclError::ERROR_INVALID_PARAM, "mode 7");
    // SAFETY: null is rejected.
    let e = unsafe { aclmdlRICaptureThreadExchangeMode(std::ptr::null_mut()) };
    fails(e, AclError::ERROR_INVALID_PARAM, "null");
    let model = end(s).unwrap();
    ok(aclmdlRIDestroy(model));
    ok(aclrtDestroyStream(s));
    ok(aclrtFree(dev));
}

#[test]
fn cross_stream_capture_joins_and_rejoins_through_events() {
    on_device(3);
    let (s1, s2) = (stream(), stream());
    let (fork, join) = (event(), event());
    let runs = AtomicU32::new(0);
    let arg = std::ptr::from_ref(&runs).cast_mut().cast::<c_void>();

    ok(aclmdlRICaptureBegin(s1, GLOBAL));
    let (_, model) = info(s1);
    ok(aclrtRecordEvent(fork, s1));
    ok(aclrtStreamWaitEvent(s2, fork));
    assert_eq!(info(s2), (ACTIVE, model), "s2 joined the capture");
    // SAFETY: `runs` outlives the model.
    ok(unsafe { aclrtLaunchHostFunc(s2, Some(count_run), arg) });
    ok(aclrtRecordEvent(join, s2));
    fails(end(s2).unwrap_err(), AclError::ERROR_RT_STREAM_CAPTURE_UNMATCHED, "not the origin");
    ok(aclrtStreamWaitEvent(s1, join));
    assert_eq!(end(s1), Ok(model));
    assert_eq!(info(s2).0, NONE);
    ok(aclmdlRIExecuteAsync(model, s1));
    ok(aclmdlRIExecuteAsync(model, s2));
    ok(aclrtSynchronizeStream(s1));
    ok(aclrtSynchronizeStream(s2));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    ok(aclmdlRIDestroy(model));

    // s2 never rejoins.
    ok(aclmdlRICaptureBegin(s1, GLOBAL));
    ok(aclrtRecordEvent(fork, s1));
    ok(aclrtStreamWaitEvent(s2, fork));
    // SAFETY: as above.
    ok(unsafe { aclrtLaunchHostFunc(s2, Some(count_run), arg) });
    fails(end(s1).unwrap_err(), AclError::ERROR_RT_STREAM_UNJOINED, "unjoined");
    assert_eq!(info(s2).0, NONE);
    // The fork's latest record belongs to a capture that ended without a model.
    fails(aclrtStreamWaitEvent(s2, fork), AclError::ERROR_RT_CAPTURE_DEPENDENCY, "ended capture");
    fails(aclrtSynchronizeEvent(fork), AclError::ERROR_RT_EVENT_CAPTURED, "captured record");
    ok(aclrtRecordEvent(fork, s1));
    ok(aclrtSynchronizeEvent(fork));
    for s in [s1, s2] {
        ok(aclrtDestroyStream(s));
    }
    ok(aclrtDestroyEvent(fork));
    ok(aclrtDestroyEvent(join));
}

#[test]
fn synchronous_execution_waits_up_to_its_timeout() {
    on_device(4);
    let s = stream();
    let flag = AtomicU32::new(0);
    ok(aclmdlRICaptureBegin(s, RELAXED));
    // SAFETY: `flag` outlives the model.
    ok(unsafe {
        aclrtLaunchHostFunc(s, Some(wait_for_flag), std::ptr::from_ref(&flag).cast_mut().cast())
    });
    let model = end(s).unwrap();
    fails(aclmdlRIExecute(model, 0), AclError::ERROR_INVALID_PARAM, "timeout 0");
    let t = std::time::Instant::now();
    fails(aclmdlRIExecute(model, 50), AclError::ERROR_RT_WAIT_TIMEOUT, "blocked run");
    assert!(t.elapsed() >= Duration::from_millis(50));
    flag.store(1, Ordering::SeqCst);
    ok(aclmdlRIExecute(model, -1));
    ok(aclmdlRIExecute(model, 10_000));
    ok(aclmdlRIDestroy(model));
    ok(aclrtDestroyStream(s));
}
