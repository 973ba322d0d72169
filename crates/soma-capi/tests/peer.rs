//! Peer access through the exported functions, on a three-device runtime: the three calls
//! with the codes CANN documents, copies and event waits between devices with access and
//! without it. One test: peer access is process-wide state.

mod common;

use std::ffi::c_void;

use ascend_sys::{aclrtMemMallocPolicy, aclrtMemcpyKind, AclError};
use ascendcl::*;
use common::*;

const D2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE;
const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
const N: usize = 4096;

fn malloc_on(device: i32) -> *mut c_void {
    ok(aclrtSetDevice(device));
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtMalloc(&mut p, N, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST) });
    p
}

fn can_access(device: i32, peer: i32) -> Result<i32, AclError> {
    let mut can = -1;
    // SAFETY: valid out-pointer.
    let e = unsafe { aclrtDeviceCanAccessPeer(&mut can, device, peer) };
    if e == AclError::SUCCESS {
        Ok(can)
    } else {
        Err(e)
    }
}

fn download(p: *const c_void) -> Vec<u8> {
    let mut out = vec![0u8; N];
    // SAFETY: `out` is valid for N bytes during the synchronous copy.
    ok(unsafe { aclrtMemcpy(out.as_mut_ptr().cast(), N, p, N, D2H) });
    out
}

#[test]
fn peer_access_between_devices() {
    init(&[("SOMA_SIM_DEVICES", "3"), ("SOMA_SIM_CAPACITY", "1G")]);
    let (a, b) = (malloc_on(0), malloc_on(1));
    // SAFETY: the host buffer outlives the synchronous copy.
    ok(unsafe { aclrtMemcpy(b, N, [9u8; N].as_ptr().cast(), N, H2D) });

    // aclrtDeviceCanAccessPeer: 1 for two devices; the same device, an unknown device or a
    // null out-pointer is ACL_ERROR_INVALID_PARAM.
    assert_eq!(can_access(0, 1), Ok(1));
    assert_eq!(can_access(2, 0), Ok(1));
    assert_eq!(can_access(1, 1), Err(AclError::ERROR_INVALID_PARAM));
    assert_eq!(can_access(0, 3), Err(AclError::ERROR_INVALID_PARAM));
    assert_eq!(can_access(-1, 0), Err(AclError::ERROR_INVALID_PARAM));
    // SAFETY: a null out-pointer is checked.
    let null = unsafe { aclrtDeviceCanAccessPeer(std::ptr::null_mut(), 0, 1) };
    fails(null, AclError::ERROR_INVALID_PARAM, "null canAccessPeer");

    // Without access, device 0's stream may not copy device 1's memory: nothing is enqueued.
    ok(aclrtSetDevice(0));
    let s0 = stream();
    // SAFETY: no host end.
    let refused = unsafe { aclrtMemcpyAsync(a, N, b, N, D2D, s0) };
    fails(refused, AclError::ERROR_INVALID_PARAM, "copy without peer access");
    assert!(msg().contains("aclrtDeviceEnablePeerAccess"), "{}", msg());
    // SAFETY: no host end.
    let refused = unsafe { aclrtMemcpy(a, N, b, N, D2D) };
    fails(refused, AclError::ERROR_INVALID_PARAM, "synchronous copy without peer access");
    fails(aclrtMemsetAsync(b, N, 0, N, s0), AclError::ERROR_INVALID_PARAM, "peer memset");

    // aclrtDeviceEnablePeerAccess from the current device (0): flags must be 0, the peer must
    // be another valid device, and enabling twice is refused.
    fails(aclrtDeviceEnablePeerAccess(1, 1), AclError::ERROR_FEATURE_UNSUPPORTED, "flags");
    fails(aclrtDeviceEnablePeerAccess(0, 0), AclError::ERROR_INVALID_PARAM, "itself");
    fails(aclrtDeviceEnablePeerAccess(3, 0), AclError::ERROR_INVALID_PARAM, "unknown peer");
    fails(aclrtDeviceDisablePeerAccess(1), AclError::ERROR_INVALID_PARAM, "not enabled");
    ok(aclrtDeviceEnablePeerAccess(1, 0));
    fails(aclrtDeviceEnablePeerAccess(1, 0), AclError::ERROR_INVALID_PARAM, "twice");

    // Device 0 pulls device 1's memory, asynchronously and synchronously.
    // SAFETY: no host end.
    ok(unsafe { aclrtMemcpyAsync(a, N, b, N, D2D, s0) });
    ok(aclrtSynchronizeStream(s0));
    assert_eq!(download(a), vec![9; N]);
    ok(aclrtMemsetAsync(b, N, 4, N, s0));
    ok(aclrtSynchronizeStream(s0));
    // SAFETY: no host end.
    ok(unsafe { aclrtMemcpy(a, N, b, N, D2D) });
    assert_eq!(download(a), vec![4; N]);

    // Per ordered pair: device 1 has no access to device 0.
    ok(aclrtSetDevice(1));
    let s1 = stream();
    // SAFETY: no host end.
    let refused = unsafe { aclrtMemcpyAsync(b, N, a, N, D2D, s1) };
    fails(refused, AclError::ERROR_INVALID_PARAM, "the other direction");

    // Streams of linked devices wait on each other's events; unlinked ones may not.
    let ev1 = event();
    ok(aclrtRecordEvent(ev1, s1));
    ok(aclrtStreamWaitEvent(s0, ev1));
    ok(aclrtSetDevice(2));
    let s2 = stream();
    fails(aclrtStreamWaitEvent(s2, ev1), AclError::ERROR_INVALID_PARAM, "unlinked wait");

    // Disabling from device 0 ends the access.
    ok(aclrtSetDevice(0));
    ok(aclrtDeviceDisablePeerAccess(1));
    fails(aclrtDeviceDisablePeerAccess(1), AclError::ERROR_INVALID_PARAM, "disabled twice");
    // SAFETY: no host end.
    let refused = unsafe { aclrtMemcpyAsync(a, N, b, N, D2D, s0) };
    fails(refused, AclError::ERROR_INVALID_PARAM, "copy after disable");

    for s in [s0, s1, s2] {
        ok(aclrtSynchronizeStream(s));
        ok(aclrtDestroyStream(s));
    }
    ok(aclrtDestroyEvent(ev1));
    ok(aclrtFree(a));
    ok(aclrtFree(b));
}
