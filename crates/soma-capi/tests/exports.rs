//! Loads the built `libascendcl.so` with `dlopen` (through ascend-sys, as a CANN program's
//! loader would) and checks that it exports every function of the subset and works through
//! the loaded table. This binary does not call the crate's Rust API: that would link a second
//! static copy of the runtime (its own statics and locks) beside the loaded one.

use std::path::PathBuf;

use ascend_sys::{acl_fn, Acl, AclError};

fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test binary directory");
    for dir in [deps, deps.parent().unwrap_or(deps)] {
        let p = dir.join("libascendcl.so");
        if p.exists() {
            return p;
        }
    }
    panic!("libascendcl.so not found next to {}", exe.display());
}

#[test]
fn every_function_of_the_subset_is_exported() {
    // SAFETY: the library is our AscendCL implementation; its initialisers are Rust's.
    let acl = unsafe { Acl::open(cdylib()) }.expect("dlopen libascendcl.so");
    assert_eq!(acl.missing_symbols(), Vec::<&str>::new());
    // SAFETY: signatures from the headers; valid pointers.
    unsafe {
        acl_fn!(acl, aclInit).unwrap()(std::ptr::null()).result().unwrap();
        let mut n = 0u32;
        acl_fn!(acl, aclrtGetDeviceCount).unwrap()(&mut n).result().unwrap();
        assert!(n >= 1);
        let e = acl_fn!(acl, aclrtGetDeviceCount).unwrap()(std::ptr::null_mut());
        assert_eq!(e, AclError::ERROR_INVALID_PARAM);
        let msg = std::ffi::CStr::from_ptr(acl_fn!(acl, aclGetRecentErrMsg).unwrap()());
        assert!(msg.to_string_lossy().contains("count is null"), "{msg:?}");
    }
}
