//! `aclrtMemPoolFreeAsync` of `aclrtMalloc` memory frees it only after the stream's preceding
//! work, measured with `aclrtGetMemInfo` (its own test binary: nothing else allocates here).

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use ascend_sys::{aclrtMemAttr, aclrtMemMallocPolicy, AclError};
use ascendcl::*;
use common::*;

fn free_bytes() -> usize {
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { aclrtGetMemInfo(aclrtMemAttr::ACL_HBM_MEM, &mut free, &mut total) });
    free
}

static RELEASE: AtomicBool = AtomicBool::new(false);

extern "C" fn wait_for_release(_: *mut c_void) {
    while !RELEASE.load(Ordering::Acquire) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn free_async_of_malloc_memory_happens_after_preceding_work() {
    init(&[("SOMA_SIM_CAPACITY", "1G")]);
    let s = stream();
    let baseline = free_bytes();
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtMalloc(&mut p, 64 * MIB, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST) });
    assert_eq!(free_bytes(), baseline - 64 * MIB);
    // The stream is held up until we say so; then it uses the memory.
    // SAFETY: the function ignores its argument.
    ok(unsafe { aclrtLaunchHostFunc(s, Some(wait_for_release), std::ptr::null_mut()) });
    ok(aclrtMemsetAsync(p, 64 * MIB, 1, 64 * MIB, s));
    ok(aclrtMemPoolFreeAsync(p, s));
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(free_bytes(), baseline - 64 * MIB, "freed before the preceding work");
    fails(aclrtMemPoolFreeAsync(p, s), AclError::ERROR_INVALID_PARAM, "second free");
    RELEASE.store(true, Ordering::Release);
    ok(aclrtSynchronizeStream(s));
    assert_eq!(free_bytes(), baseline, "freed once the stream reached the free");
    ok(aclrtDestroyStream(s));
}
