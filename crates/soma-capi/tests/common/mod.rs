//! Helpers shared by the integration tests: safe wrappers over the exported functions.

#![allow(dead_code)]

use std::ffi::{c_void, CStr};
use std::sync::Once;

use ascend_sys::{
    aclrtEvent, aclrtMemAllocationType, aclrtMemLocation, aclrtMemLocationType, aclrtMemPool,
    aclrtMemPoolAttr, aclrtMemPoolProps, aclrtStream, AclError,
};
use ascendcl::*;

pub const MIB: usize = 1 << 20;

static INIT: Once = Once::new();

/// Sets the given environment variables (once per test binary, before the runtime starts)
/// and calls `aclInit`.
pub fn init(env: &[(&str, &str)]) {
    INIT.call_once(|| {
        for (k, v) in env {
            std::env::set_var(k, v);
        }
    });
    // SAFETY: a null config path is allowed.
    ok(unsafe { aclInit(std::ptr::null()) });
}

/// This thread's last error message.
pub fn msg() -> String {
    // SAFETY: aclGetRecentErrMsg never returns null and the string lives until the next
    // failing call on this thread.
    unsafe { CStr::from_ptr(aclGetRecentErrMsg()) }.to_string_lossy().into_owned()
}

#[track_caller]
pub fn ok(e: AclError) {
    assert_eq!(e, AclError::SUCCESS, "unexpected error: {}", msg());
}

/// Asserts `e` is `want` and that an error message was set by this call.
#[track_caller]
pub fn fails(e: AclError, want: AclError, what: &str) {
    assert_eq!(e, want, "{what}: message {:?}", msg());
    assert!(!msg().is_empty(), "{what}: empty aclGetRecentErrMsg");
}

pub fn props(max: usize) -> aclrtMemPoolProps {
    aclrtMemPoolProps {
        allocType: aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED,
        location: aclrtMemLocation {
            id: 0,
            type_: aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE,
        },
        maxSize: max,
        ..Default::default()
    }
}

pub fn try_pool(p: &aclrtMemPoolProps) -> Result<aclrtMemPool, AclError> {
    let mut h = std::ptr::null_mut();
    // SAFETY: both pointers are valid.
    let e = unsafe { aclrtMemPoolCreate(&mut h, p) };
    if e == AclError::SUCCESS {
        Ok(h)
    } else {
        Err(e)
    }
}

pub fn pool(max: usize) -> aclrtMemPool {
    try_pool(&props(max)).unwrap_or_else(|e| panic!("pool: {e} {}", msg()))
}

pub fn stream() -> aclrtStream {
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtCreateStream(&mut s) });
    s
}

pub fn event() -> aclrtEvent {
    let mut e = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtCreateEvent(&mut e) });
    e
}

pub fn try_alloc(size: usize, pool: aclrtMemPool, s: aclrtStream) -> Result<u64, AclError> {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let e = unsafe { aclrtMemPoolMallocAsync(&mut p, size, pool, s) };
    if e == AclError::SUCCESS {
        Ok(p as u64)
    } else {
        Err(e)
    }
}

pub fn alloc(size: usize, pool: aclrtMemPool, s: aclrtStream) -> u64 {
    try_alloc(size, pool, s).unwrap_or_else(|e| panic!("alloc: {e} {}", msg()))
}

pub fn free(p: u64, s: aclrtStream) -> AclError {
    aclrtMemPoolFreeAsync(p as *mut c_void, s)
}

pub fn is_u32(a: aclrtMemPoolAttr) -> bool {
    (1..=3).contains(&a.0)
}

pub fn try_get(pool: aclrtMemPool, a: aclrtMemPoolAttr) -> Result<u64, AclError> {
    let mut v = 0u64;
    // SAFETY: `v` is valid for a u64 (and so for a u32 at its start, little-endian).
    let e = unsafe { aclrtMemPoolGetAttr(pool, a, (&mut v as *mut u64).cast()) };
    if e == AclError::SUCCESS {
        Ok(if is_u32(a) { v & 0xFFFF_FFFF } else { v })
    } else {
        Err(e)
    }
}

pub fn get(pool: aclrtMemPool, a: aclrtMemPoolAttr) -> u64 {
    try_get(pool, a).unwrap_or_else(|e| panic!("get {a:?}: {e} {}", msg()))
}

pub fn set_u32(pool: aclrtMemPool, a: aclrtMemPoolAttr, v: u32) -> AclError {
    let mut v = v;
    // SAFETY: `v` is a valid u32.
    unsafe { aclrtMemPoolSetAttr(pool, a, (&mut v as *mut u32).cast()) }
}

pub fn set_u64(pool: aclrtMemPool, a: aclrtMemPoolAttr, v: u64) -> AclError {
    let mut v = v;
    // SAFETY: `v` is a valid u64.
    unsafe { aclrtMemPoolSetAttr(pool, a, (&mut v as *mut u64).cast()) }
}

pub const FOLLOW: aclrtMemPoolAttr =
    aclrtMemPoolAttr::ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES;
pub const OPPORTUNISTIC: aclrtMemPoolAttr =
    aclrtMemPoolAttr::ACL_RT_MEM_POOL_REUSE_ALLOW_OPPORTUNISTIC;
pub const INTERNAL: aclrtMemPoolAttr =
    aclrtMemPoolAttr::ACL_RT_MEM_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES;
pub const THRESHOLD: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD;
pub const RESERVED: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT;
pub const RESERVED_HIGH: aclrtMemPoolAttr =
    aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH;
pub const USED: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT;
pub const USED_HIGH: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH;
pub const ALL_ATTRS: [aclrtMemPoolAttr; 8] =
    [FOLLOW, OPPORTUNISTIC, INTERNAL, THRESHOLD, RESERVED, RESERVED_HIGH, USED, USED_HIGH];

/// Every attribute's value.
pub fn snapshot(pool: aclrtMemPool) -> Vec<u64> {
    ALL_ATTRS.iter().map(|&a| get(pool, a)).collect()
}

/// Clears this thread's message by making a call fail with a known text, so that each row
/// of a table proves its own message (an error always replaces the previous text).
pub fn set_message_marker() {
    // SAFETY: a null out-pointer is checked and rejected.
    let _ = unsafe { aclrtGetDeviceCount(std::ptr::null_mut()) };
}
