//! Tests that need no CANN: loading errors, layouts, the error newtype, the function list.

use std::mem::{align_of, offset_of, size_of};

use crate::*;

// ---- loading -------------------------------------------------------------------------------

#[test]
fn open_nonexistent_path_is_an_error_naming_it() {
    let path = "/nonexistent/dir/libascendcl.so";
    // SAFETY: the path does not exist, so no library code runs.
    let err = unsafe { Acl::open(path) }.unwrap_err();
    match &err {
        LoadError::Open { attempts } => {
            assert_eq!(attempts.len(), 1);
            assert_eq!(attempts[0].0, path);
            assert!(!attempts[0].1.is_empty());
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains(path), "{err}");
}

#[test]
fn open_a_library_that_is_not_acl_names_the_missing_symbol() {
    // libc is loaded in every process on the supported targets; opening it again runs no new
    // initialisers.
    // SAFETY: see above; we look symbols up and call nothing.
    let err = unsafe { Acl::open("libc.so.6") }.unwrap_err();
    match &err {
        LoadError::MissingSymbol { symbol, library, .. } => {
            assert_eq!(*symbol, REQUIRED_SYMBOLS[0]);
            assert_eq!(library, "libc.so.6");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("aclInit"), "{err}");
}

#[test]
fn load_reports_every_path_tried() {
    // Only meaningful on hosts without CANN (CI); on a CANN host load() succeeds.
    // SAFETY: if a library is found it is CANN's (the documented install location).
    match unsafe { Acl::load() } {
        Ok(acl) => assert!(acl.missing_symbols().len() < FUNCTIONS.len()),
        Err(LoadError::Open { attempts }) => {
            assert!(attempts.iter().any(|(p, _)| p == LIBRARY_NAME), "{attempts:?}");
            if let Some(home) = std::env::var_os("ASCEND_TOOLKIT_HOME").filter(|h| !h.is_empty()) {
                let expected = std::path::Path::new(&home).join("lib64").join(LIBRARY_NAME);
                assert_eq!(attempts[0].0, expected.to_string_lossy());
            }
        }
        Err(other) => panic!("unexpected {other:?}"),
    }
}

#[test]
fn function_list_matches_the_generated_table() {
    // Every name in FUNCTIONS is a field of AclLib (checked at compile time by the macro);
    // here: no function of the generated table is missing from the list, and no duplicates.
    let generated = include_str!("bindings.rs").matches("    pub unsafe fn acl").count();
    assert_eq!(FUNCTIONS.len(), generated);
    let mut sorted = FUNCTIONS.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), FUNCTIONS.len());
    assert_eq!(FUNCTIONS.len(), 60);
}

// ---- layouts (C rules, LP64: x86_64 and aarch64 Linux) -------------------------------------
//
// enum = 4 bytes, align 4 (all enumerators fit in int); uint32_t 4/4; uint64_t and size_t 8/8;
// a struct is aligned to its most aligned member and padded to a multiple of that.

#[test]
fn layout_mem_location() {
    // { uint32_t id @0; enum type @4 } -> 8 bytes, align 4
    assert_eq!(size_of::<aclrtMemLocation>(), 8);
    assert_eq!(align_of::<aclrtMemLocation>(), 4);
    assert_eq!(offset_of!(aclrtMemLocation, id), 0);
    assert_eq!(offset_of!(aclrtMemLocation, type_), 4);
}

#[test]
fn layout_physical_mem_prop() {
    // handleType @0, allocationType @4, memAttr @8, location (align 4, 8 bytes) @12..20,
    // 4 bytes padding, uint64_t reserve @24 -> 32 bytes, align 8
    assert_eq!(size_of::<aclrtPhysicalMemProp>(), 32);
    assert_eq!(align_of::<aclrtPhysicalMemProp>(), 8);
    assert_eq!(offset_of!(aclrtPhysicalMemProp, handleType), 0);
    assert_eq!(offset_of!(aclrtPhysicalMemProp, allocationType), 4);
    assert_eq!(offset_of!(aclrtPhysicalMemProp, memAttr), 8);
    assert_eq!(offset_of!(aclrtPhysicalMemProp, location), 12);
    assert_eq!(offset_of!(aclrtPhysicalMemProp, reserve), 24);
}

#[test]
fn layout_mem_pool_props() {
    // allocType @0, handleType @4, location @8..16, size_t maxSize @16, reserved[32] @24..56
    // -> 56 bytes, align 8 (no tail padding: 56 is a multiple of 8)
    assert_eq!(size_of::<aclrtMemPoolProps>(), 56);
    assert_eq!(align_of::<aclrtMemPoolProps>(), 8);
    assert_eq!(offset_of!(aclrtMemPoolProps, allocType), 0);
    assert_eq!(offset_of!(aclrtMemPoolProps, handleType), 4);
    assert_eq!(offset_of!(aclrtMemPoolProps, location), 8);
    assert_eq!(offset_of!(aclrtMemPoolProps, maxSize), 16);
    assert_eq!(offset_of!(aclrtMemPoolProps, reserved), 24);
}

#[test]
fn enums_and_handles_have_c_sizes() {
    assert_eq!(size_of::<aclrtMemcpyKind>(), 4);
    assert_eq!(size_of::<aclrtMemPoolAttr>(), 4);
    assert_eq!(size_of::<aclrtStreamStatus>(), 4);
    assert_eq!(size_of::<aclError>(), size_of::<std::os::raw::c_int>());
    assert_eq!(align_of::<aclError>(), align_of::<std::os::raw::c_int>());
    assert_eq!(size_of::<aclrtStream>(), 8);
    assert_eq!(size_of::<aclmdlRI>(), 8);
    assert_eq!(size_of::<aclmdlRICaptureMode>(), 4);
    assert_eq!(size_of::<aclrtHostFunc>(), 8); // Option<fn> uses the null niche
}

#[test]
fn struct_defaults_are_zero() {
    let p = aclrtMemPoolProps::default();
    assert_eq!(p.allocType, aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED);
    assert_eq!(p.handleType, aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE);
    assert_eq!(p.location.type_, aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_HOST);
    assert_eq!(p.maxSize, 0);
    assert_eq!(p.reserved, [0u8; 32]);
    let q = aclrtPhysicalMemProp::default();
    assert_eq!(q.memAttr, aclrtMemAttr::ACL_DDR_MEM);
    assert_eq!(q.reserve, 0);
}

#[test]
fn enumerator_values_match_the_subset() {
    assert_eq!(aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE.0, 3);
    assert_eq!(aclrtMemcpyKind::ACL_MEMCPY_DEFAULT.0, 4);
    assert_eq!(aclrtStreamStatus::ACL_STREAM_STATUS_RESERVED.0, 0xFFFF);
    assert_eq!(aclrtMemAttr::ACL_HBM_MEM_NORMAL.0, 5);
    assert_eq!(aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_POSIX.0, 2);
    assert_eq!(aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH.0, 8);
    assert_eq!(aclrtMemGranularityOptions::ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF.0, 0xFFFF);
    assert_eq!(aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL.0, 1);
    assert_eq!(aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_RELAXED.0, 2);
    assert_eq!(aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED.0, 2);
    // An unknown value coming back from a driver is representable.
    let odd = aclrtStreamStatus(42);
    assert_ne!(odd, aclrtStreamStatus::ACL_STREAM_STATUS_COMPLETE);
}

// ---- the error newtype ---------------------------------------------------------------------

#[test]
fn error_constants_match_the_header_constants() {
    let pairs = [
        (AclError::SUCCESS, ACL_SUCCESS),
        (AclError::ERROR_INVALID_PARAM, ACL_ERROR_INVALID_PARAM),
        (AclError::ERROR_UNINITIALIZE, ACL_ERROR_UNINITIALIZE),
        (AclError::ERROR_BAD_ALLOC, ACL_ERROR_BAD_ALLOC),
        (AclError::ERROR_INVALID_RESOURCE_HANDLE, ACL_ERROR_INVALID_RESOURCE_HANDLE),
        (AclError::ERROR_FEATURE_UNSUPPORTED, ACL_ERROR_FEATURE_UNSUPPORTED),
        (AclError::ERROR_RT_PARAM_INVALID, ACL_ERROR_RT_PARAM_INVALID),
        (AclError::ERROR_RT_INVALID_HANDLE, ACL_ERROR_RT_INVALID_HANDLE),
        (AclError::ERROR_RT_FEATURE_NOT_SUPPORT, ACL_ERROR_RT_FEATURE_NOT_SUPPORT),
        (AclError::ERROR_RT_MEMORY_ALLOCATION, ACL_ERROR_RT_MEMORY_ALLOCATION),
        (AclError::ERROR_RT_WAIT_TIMEOUT, ACL_ERROR_RT_WAIT_TIMEOUT),
        (AclError::ERROR_RT_CAPTURE_DEPENDENCY, ACL_ERROR_RT_CAPTURE_DEPENDENCY),
        (AclError::ERROR_RT_STREAM_UNJOINED, ACL_ERROR_RT_STREAM_UNJOINED),
        (AclError::ERROR_RT_MODEL_CAPTURED, ACL_ERROR_RT_MODEL_CAPTURED),
        (AclError::ERROR_RT_STREAM_CAPTURED, ACL_ERROR_RT_STREAM_CAPTURED),
        (AclError::ERROR_RT_EVENT_CAPTURED, ACL_ERROR_RT_EVENT_CAPTURED),
        (AclError::ERROR_RT_STREAM_NOT_CAPTURED, ACL_ERROR_RT_STREAM_NOT_CAPTURED),
        (AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT),
        (AclError::ERROR_RT_STREAM_CAPTURE_IMPLICIT, ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT),
        (AclError::ERROR_RT_STREAM_CAPTURE_UNMATCHED, ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED),
        (AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED, ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED),
    ];
    assert_eq!(pairs.len(), AclError::KNOWN.len());
    for (e, c) in pairs {
        assert_eq!(e.code(), c);
        assert!(AclError::KNOWN.iter().any(|(k, _)| *k == e));
    }
}

#[test]
fn error_display_and_names() {
    for (e, name) in AclError::KNOWN {
        assert_eq!(e.name(), Some(name));
        assert_eq!(e.to_string(), format!("{name} ({})", e.code()));
        assert!(name.starts_with("ACL_"));
    }
    assert_eq!(AclError(207_001).to_string(), "ACL_ERROR_RT_MEMORY_ALLOCATION (207001)");
    assert_eq!(AclError(123).name(), None);
    assert_eq!(AclError(123).to_string(), "unknown aclError 123");
    assert_eq!(AclError(-1).to_string(), "unknown aclError -1");
    assert_eq!(format!("{:?}", AclError::ERROR_BAD_ALLOC), "AclError(ACL_ERROR_BAD_ALLOC)");
    assert_eq!(format!("{:?}", AclError(7)), "AclError(7)");
}

#[test]
fn error_result() {
    assert_eq!(AclError::SUCCESS.result(), Ok(()));
    assert_eq!(AclError(0).result_with(5), Ok(5));
    assert_eq!(AclError::ERROR_BAD_ALLOC.result(), Err(AclError::ERROR_BAD_ALLOC));
    assert_eq!(AclError(99).result_with(5), Err(AclError(99)));
    assert!(AclError::SUCCESS.is_success());
    assert!(!AclError::ERROR_INVALID_PARAM.is_success());
    assert_eq!(i32::from(AclError(3)), 3);
    assert_eq!(AclError::from(207_000), AclError::ERROR_RT_FEATURE_NOT_SUPPORT);
    let boxed: Box<dyn std::error::Error> = Box::new(AclError::ERROR_UNINITIALIZE);
    assert!(boxed.to_string().contains("ACL_ERROR_UNINITIALIZE"));
}

#[test]
fn load_error_display() {
    let e = LoadError::Open {
        attempts: vec![
            ("/a/libascendcl.so".into(), "no such file".into()),
            ("libascendcl.so".into(), "not found".into()),
        ],
    };
    assert_eq!(
        e.to_string(),
        "cannot load the AscendCL library: /a/libascendcl.so: no such file; libascendcl.so: not found"
    );
}

#[test]
fn handles_are_thread_safe() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Acl>();
    send_sync::<AclError>();
    send_sync::<LoadError>();
}
