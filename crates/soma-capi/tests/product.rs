//! The product model: on an Atlas 300I Duo (SOMA_SIM_PRODUCT) the pool API answers
//! ACL_ERROR_RT_FEATURE_NOT_SUPPORT; everything else works.

mod common;

use std::ffi::c_void;

use ascend_sys::{aclrtMemMallocPolicy, AclError};
use ascendcl::*;
use common::*;

#[test]
fn pool_api_is_not_supported_off_atlas_a2() {
    init(&[("SOMA_SIM_PRODUCT", "atlas-300i-duo"), ("SOMA_SIM_CAPACITY", "4G")]);
    let ns = AclError::ERROR_RT_FEATURE_NOT_SUPPORT;
    fails(try_pool(&props(64 * MIB)).unwrap_err(), ns, "create");
    fails(try_pool(&props(0)).unwrap_err(), ns, "create with max 0");
    assert!(msg().contains("Atlas A2"), "{}", msg());
    let s = stream();
    let fake = 0x1000 as *mut c_void;
    fails(try_alloc(512, fake, s).unwrap_err(), ns, "malloc");
    fails(try_get(fake, USED).unwrap_err(), ns, "get");
    fails(set_u64(fake, THRESHOLD, 0), ns, "set");
    fails(aclrtMemPoolTrimTo(fake, 0), ns, "trim");
    fails(aclrtMemPoolDestroy(fake), ns, "destroy");
    // Null arguments are checked first, as CANN's API layer does.
    let inv = AclError::ERROR_INVALID_PARAM;
    fails(aclrtMemPoolDestroy(std::ptr::null_mut()), inv, "destroy null");
    fails(try_alloc(0, fake, s).unwrap_err(), inv, "malloc size 0");
    // SAFETY: null pointers are checked.
    unsafe {
        fails(aclrtMemPoolCreate(std::ptr::null_mut(), &props(0)), inv, "create null out");
        fails(aclrtMemPoolGetAttr(fake, USED, std::ptr::null_mut()), inv, "get null value");
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtMalloc(&mut p, 4096, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST) });
    fails(aclrtMemPoolFreeAsync(p, s), ns, "free async");
    // The rest of the runtime works on this product.
    ok(aclrtMemsetAsync(p, 4096, 0, 4096, s));
    ok(aclrtSynchronizeStream(s));
    ok(aclrtFree(p));
    ok(aclrtDestroyStream(s));
    ok(aclFinalize());
}
