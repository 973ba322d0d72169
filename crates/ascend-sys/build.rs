//! Build script of `ascend-sys`.
//!
//! Without the `bindgen` feature it does nothing: the crate compiles the committed
//! `src/bindings.rs` and needs neither libclang nor CANN.
//!
//! With the `bindgen` feature it regenerates the bindings from `include/acl/acl.h` (or from
//! `$ASCEND_TOOLKIT_HOME/include/acl/acl.h` when that variable is set) into
//! `$OUT_DIR/bindings.rs`, which the crate then compiles instead of the committed file. When
//! `ASCEND_SYS_BINDINGS_OUT` is set, the generated text is also copied to that path (used by
//! `scripts/check-bindings.sh` to diff it against the committed file).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "bindgen")]
    generate::run();
}

#[cfg(feature = "bindgen")]
mod generate {
    use std::env;
    use std::path::PathBuf;

    /// Every function of the subset (what `include/acl/*.h` declare), allowlisted by exact
    /// name so that generating from the full CANN headers yields the same set of items.
    const FUNCTIONS: &[&str] = &[
        "aclInit",
        "aclFinalize",
        "aclGetRecentErrMsg",
        "aclrtSetDevice",
        "aclrtResetDevice",
        "aclrtGetDevice",
        "aclrtGetDeviceCount",
        "aclrtSynchronizeDevice",
        "aclrtDeviceCanAccessPeer",
        "aclrtDeviceEnablePeerAccess",
        "aclrtDeviceDisablePeerAccess",
        "aclrtCreateContext",
        "aclrtDestroyContext",
        "aclrtSetCurrentContext",
        "aclrtCreateStream",
        "aclrtDestroyStream",
        "aclrtSynchronizeStream",
        "aclrtStreamQuery",
        "aclrtCreateEvent",
        "aclrtDestroyEvent",
        "aclrtRecordEvent",
        "aclrtStreamWaitEvent",
        "aclrtSynchronizeEvent",
        "aclrtQueryEventStatus",
        "aclrtEventElapsedTime",
        "aclrtLaunchHostFunc",
        "aclrtMalloc",
        "aclrtFree",
        "aclrtMallocHost",
        "aclrtFreeHost",
        "aclrtMemcpy",
        "aclrtMemcpyAsync",
        "aclrtMemset",
        "aclrtMemsetAsync",
        "aclrtGetMemInfo",
        "aclrtReserveMemAddress",
        "aclrtReleaseMemAddress",
        "aclrtMallocPhysical",
        "aclrtFreePhysical",
        "aclrtMapMem",
        "aclrtUnmapMem",
        "aclrtMemGetAllocationGranularity",
        "aclrtMemExportToShareableHandle",
        "aclrtMemSetPidToShareableHandle",
        "aclrtMemImportFromShareableHandle",
        "aclrtDeviceGetBareTgid",
        "aclmdlRICaptureBegin",
        "aclmdlRICaptureGetInfo",
        "aclmdlRICaptureEnd",
        "aclmdlRICaptureThreadExchangeMode",
        "aclmdlRIExecuteAsync",
        "aclmdlRIExecute",
        "aclmdlRIDestroy",
        "aclrtMemPoolCreate",
        "aclrtMemPoolDestroy",
        "aclrtMemPoolSetAttr",
        "aclrtMemPoolGetAttr",
        "aclrtMemPoolMallocAsync",
        "aclrtMemPoolFreeAsync",
        "aclrtMemPoolTrimTo",
    ];

    /// Every type of the subset, by exact name.
    const TYPES: &[&str] = &[
        "aclrtStream",
        "aclrtEvent",
        "aclrtContext",
        "aclrtMemPool",
        "aclrtDrvMemHandle",
        "aclrtHostFunc",
        "aclrtMemMallocPolicy",
        "aclrtMemcpyKind",
        "aclrtEventRecordedStatus",
        "aclrtStreamStatus",
        "aclrtMemAttr",
        "aclrtMemLocationType",
        "aclrtMemLocation",
        "aclrtMemAllocationType",
        "aclrtMemHandleType",
        "aclrtPhysicalMemProp",
        "aclrtMemGranularityOptions",
        "aclmdlRI",
        "aclmdlRICaptureMode",
        "aclmdlRICaptureStatus",
        "aclrtMemPoolAttr",
        "aclrtMemPoolProps",
    ];

    /// The error codes of the subset, by exact name.
    const VARS: &[&str] = &[
        "ACL_SUCCESS",
        "ACL_ERROR_INVALID_PARAM",
        "ACL_ERROR_UNINITIALIZE",
        "ACL_ERROR_BAD_ALLOC",
        "ACL_ERROR_INVALID_RESOURCE_HANDLE",
        "ACL_ERROR_FEATURE_UNSUPPORTED",
        "ACL_ERROR_RT_PARAM_INVALID",
        "ACL_ERROR_RT_INVALID_HANDLE",
        "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
        "ACL_ERROR_RT_MEMORY_ALLOCATION",
        "ACL_ERROR_RT_WAIT_TIMEOUT",
        "ACL_ERROR_RT_CAPTURE_DEPENDENCY",
        "ACL_ERROR_RT_STREAM_UNJOINED",
        "ACL_ERROR_RT_MODEL_CAPTURED",
        "ACL_ERROR_RT_STREAM_CAPTURED",
        "ACL_ERROR_RT_EVENT_CAPTURED",
        "ACL_ERROR_RT_STREAM_NOT_CAPTURED",
        "ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT",
        "ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT",
        "ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED",
        "ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED",
        "ACL_RT_VMM_EXPORT_FLAG_DEFAULT",
        "ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION",
    ];

    pub fn run() {
        println!("cargo:rerun-if-env-changed=ASCEND_TOOLKIT_HOME");
        println!("cargo:rerun-if-env-changed=ASCEND_SYS_BINDINGS_OUT");
        let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
        let include_dir = match env::var_os("ASCEND_TOOLKIT_HOME") {
            Some(home) if !home.is_empty() => PathBuf::from(home).join("include"),
            _ => manifest_dir.join("include"),
        };
        println!("cargo:rerun-if-changed={}", include_dir.join("acl").display());
        let header = include_dir.join("acl").join("acl.h");

        let mut builder = bindgen::Builder::default()
            .header(header.to_str().expect("header path is not UTF-8"))
            .clang_arg(format!("-I{}", include_dir.display()))
            // Enums become newtypes with associated constants: a value the driver returns is
            // never transmuted into a Rust enum, and unknown values stay representable.
            .default_enum_style(bindgen::EnumVariation::NewType {
                is_bitfield: false,
                is_global: false,
            })
            // `aclError` is the `#[must_use]` newtype `AclError` of `src/error.rs`
            // (`#[repr(transparent)]` over `i32`, so ABI-identical to C's `int`).
            .blocklist_type("aclError")
            .derive_default(true)
            .derive_debug(true)
            .derive_copy(true)
            .derive_eq(true)
            .derive_hash(true)
            .layout_tests(true)
            .wrap_unsafe_ops(true)
            .generate_comments(false)
            .size_t_is_usize(true)
            // Loaded at run time: a struct `AclLib` whose fields are
            // `Result<fn pointer, libloading::Error>`; a missing symbol is an error value.
            .dynamic_library_name("AclLib")
            .dynamic_link_require_all(false)
            // prettyplease, not the rustfmt on PATH: the text depends only on Cargo.lock.
            .formatter(bindgen::Formatter::Prettyplease)
            .rust_target(bindgen::RustTarget::stable(85, 0).expect("supported Rust target"));
        for f in FUNCTIONS {
            builder = builder.allowlist_function(format!("^{f}$"));
        }
        for t in TYPES {
            builder = builder.allowlist_type(format!("^{t}$"));
        }
        for v in VARS {
            builder = builder.allowlist_var(format!("^{v}$"));
        }
        let bindings = builder.generate().expect("bindgen failed on the AscendCL headers");

        let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("bindings.rs");
        bindings.write_to_file(&out).expect("cannot write $OUT_DIR/bindings.rs");
        if let Some(copy) = env::var_os("ASCEND_SYS_BINDINGS_OUT") {
            if !copy.is_empty() {
                std::fs::copy(&out, &copy)
                    .expect("cannot copy bindings to $ASCEND_SYS_BINDINGS_OUT");
            }
        }
    }
}
