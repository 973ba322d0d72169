//! `aclrtMemPoolMallocAsync` / `aclrtMemPoolFreeAsync` inside a capture: served at capture
//! time from memory kept for the model, valid at every execution, reused inside the capture,
//! kept for the model until `aclmdlRIDestroy`. Each test works on a device of its own.

mod common;

use std::ffi::c_void;

use ascend_sys::{
    aclmdlRI, aclmdlRICaptureMode, aclrtMemPool, aclrtMemPoolAttr, aclrtMemcpyKind, aclrtStream,
    AclError,
};
use ascendcl::*;
use common::*;

const GLOBAL: aclmdlRICaptureMode = aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL;
const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
const D2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE;
const USED: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT;
const RESERVED: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT;
const N: usize = 4096;

/// Starts the runtime with a device per test, makes `device` current on this thread, and
/// creates a pool of `device`.
fn on_device(device: i32) -> aclrtMemPool {
    init(&[("SOMA_SIM_DEVICES", "4"), ("SOMA_SIM_CAPACITY", "1G")]);
    ok(aclrtSetDevice(device));
    let mut p = props(256 * MIB);
    p.location.id = device as u32;
    try_pool(&p).unwrap_or_else(|e| panic!("pool: {e} {}", msg()))
}

fn begin(s: aclrtStream) {
    ok(aclmdlRICaptureBegin(s, GLOBAL));
}

fn end(s: aclrtStream) -> aclmdlRI {
    let mut model = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclmdlRICaptureEnd(s, &mut model) });
    model
}

fn ptr(p: u64) -> *mut c_void {
    p as *mut c_void
}

/// Copies `bytes` into device memory `dst`, synchronously.
fn upload(dst: u64, bytes: &[u8]) {
    // SAFETY: `dst` is a live allocation of at least `bytes.len()` bytes.
    ok(unsafe { aclrtMemcpy(ptr(dst), bytes.len(), bytes.as_ptr().cast(), bytes.len(), H2D) });
}

/// Copies `n` bytes out of device memory `src`, synchronously.
fn download(src: u64, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    // SAFETY: `src` is a live allocation of at least `n` bytes.
    ok(unsafe { aclrtMemcpy(out.as_mut_ptr().cast(), n, ptr(src), n, D2H) });
    out
}

#[test]
fn pool_memory_allocated_in_a_capture_serves_100_executions() {
    let pool = on_device(0);
    let s = stream();
    let input = alloc(N, pool, s);
    begin(s);
    // A temporary, freed inside the capture: the next allocation reuses it.
    let tmp = alloc(N, pool, s);
    // SAFETY: device memory of N bytes, alive while the model lives.
    unsafe { ok(aclrtMemcpyAsync(ptr(tmp), N, ptr(input), N, D2D, s)) };
    ok(aclrtMemsetAsync(ptr(tmp), N, 0xAB, 16, s));
    let out = alloc(N, pool, s);
    // SAFETY: as above.
    unsafe { ok(aclrtMemcpyAsync(ptr(out), N, ptr(tmp), N, D2D, s)) };
    ok(free(tmp, s));
    let again = alloc(N, pool, s);
    assert_eq!(again, tmp, "a free inside the capture serves the stream's next allocation");
    ok(aclrtMemsetAsync(ptr(again), N, 0, N, s));
    ok(free(again, s));
    let model = end(s);
    ok(aclrtSynchronizeStream(s));

    let (used, reserved) = (get(pool, USED), get(pool, RESERVED));
    for step in 1..=100u8 {
        upload(input, &[step; N]);
        ok(aclmdlRIExecuteAsync(model, s));
        ok(aclrtSynchronizeStream(s));
        let host = download(out, N);
        assert_eq!((host[0], host[15], host[16], host[N - 1]), (0xAB, 0xAB, step, step));
    }
    assert_eq!((get(pool, USED), get(pool, RESERVED)), (used, reserved), "no allocation ran");
    ok(aclmdlRIDestroy(model));
    ok(free(out, s));
    ok(free(input, s));
    ok(aclrtSynchronizeStream(s));
    assert_eq!(get(pool, USED), 0);
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
}

#[test]
fn a_free_inside_a_capture_of_memory_allocated_before_it_is_refused() {
    let pool = on_device(1);
    let s = stream();
    let before = alloc(N, pool, s);
    begin(s);
    fails(free(before, s), AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, "not the model's memory");
    let model = end(s);
    assert_eq!(get(pool, USED), N as u64, "still allocated");
    ok(free(before, s));
    ok(aclmdlRIDestroy(model));
    ok(aclrtSynchronizeStream(s));
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
}

#[test]
fn an_output_freed_after_the_capture_stays_the_models_until_it_is_destroyed() {
    let pool = on_device(2);
    let (s, other) = (stream(), stream());
    begin(s);
    let out = alloc(N, pool, s);
    ok(aclrtMemsetAsync(ptr(out), N, 7, N, s));
    let model = end(s);
    ok(aclmdlRIExecuteAsync(model, s));
    ok(aclrtSynchronizeStream(s));
    assert_eq!(download(out, N), vec![7; N]);
    ok(free(out, s));
    ok(aclrtSynchronizeStream(s));
    assert_eq!(get(pool, USED), N as u64, "kept for the model: every execution writes it");
    let x = alloc(N, pool, other);
    assert_ne!(x, out);
    ok(aclmdlRIExecuteAsync(model, s));
    ok(aclmdlRIDestroy(model));
    assert_eq!(get(pool, USED), N as u64, "back in the pool with the model");
    ok(aclrtSynchronizeDevice());
    // Trimming keeps nothing the destroyed model held.
    ok(free(x, other));
    ok(aclrtSynchronizeDevice());
    ok(aclrtMemPoolTrimTo(pool, 0));
    assert_eq!(get(pool, RESERVED), 0);
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
    ok(aclrtDestroyStream(other));
}

#[test]
fn a_live_models_memory_survives_trimming_and_an_invalidated_capture_gives_it_back() {
    let pool = on_device(3);
    let s = stream();
    begin(s);
    let tmp = alloc(2 * MIB, pool, s);
    ok(free(tmp, s));
    let model = end(s);
    ok(aclrtSynchronizeStream(s));
    ok(aclrtMemPoolTrimTo(pool, 0));
    assert!(get(pool, RESERVED) >= 2 * MIB as u64, "the model's memory stays");

    begin(s);
    let kept = alloc(2 * MIB, pool, s);
    ok(free(kept, s));
    let reserved = get(pool, RESERVED);
    // A forbidden call invalidates the capture; it ends without a model.
    assert_ne!(aclrtSynchronizeStream(s), AclError::SUCCESS);
    fails(
        try_alloc(N, pool, s).unwrap_err(),
        AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED,
        "allocation in an invalidated capture",
    );
    let mut none = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    assert_ne!(unsafe { aclmdlRICaptureEnd(s, &mut none) }, AclError::SUCCESS);
    ok(aclrtMemPoolTrimTo(pool, 0));
    assert!(get(pool, RESERVED) < reserved, "the failed capture's memory went back");
    ok(aclmdlRIDestroy(model));
    ok(aclrtMemPoolTrimTo(pool, 0));
    assert_eq!(get(pool, RESERVED), 0);
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
}
