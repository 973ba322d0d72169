//! Tests of the ascend backend that need no NPU.
//!
//! * Pure parts: error mapping, range bookkeeping, copy kinds, attribute widths.
//! * The backend end to end over `mock_acl.c`, a deterministic test double of the runtime
//!   (compiled with the system C compiler at test time; the tests that need it are skipped
//!   with a message when there is no `cc`). Each test loads its own copy of the library, so
//!   the double's global state is per test.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use ascend_sys::{aclrtMemPoolAttr, Acl, AclError, LoadError};
use soma_core::hal::{
    CaptureErrorKind, DeviceHal, DevicePtr, DriverError, EventHal, KernelLaunch, MemRef, StreamHal,
};

use super::conv::{is_unsupported, map_alloc_err, map_call_err};
use super::device::copy_args;
use super::ranges::MemState;
use super::raw::CallError;
use super::*;

// ---- pure ----------------------------------------------------------------------------------

fn acl_err(code: AclError) -> CallError {
    CallError::Acl { call: "aclrtTest", code, message: "the message".into() }
}

#[test]
fn error_mapping_table() {
    let oom = map_alloc_err(acl_err(AclError::ERROR_RT_MEMORY_ALLOCATION), 10, || 7);
    assert_eq!(oom, DriverError::OutOfMemory { requested: 10, free: 7 });
    let oom = map_alloc_err(acl_err(AclError::ERROR_BAD_ALLOC), 4, || 3);
    assert_eq!(oom, DriverError::OutOfMemory { requested: 4, free: 3 });
    for code in [AclError::ERROR_RT_FEATURE_NOT_SUPPORT, AclError::ERROR_FEATURE_UNSUPPORTED] {
        match map_call_err(acl_err(code)) {
            DriverError::Unsupported(m) => {
                assert!(m.contains("aclrtTest") && m.contains("the message"), "{m}")
            }
            other => panic!("{code}: {other:?}"),
        }
        assert!(is_unsupported(&acl_err(code)));
    }
    for code in [AclError::ERROR_RT_INVALID_HANDLE, AclError::ERROR_INVALID_RESOURCE_HANDLE] {
        assert!(matches!(map_call_err(acl_err(code)), DriverError::InvalidHandle(_)), "{code}");
    }
    for code in [AclError::ERROR_INVALID_PARAM, AclError::ERROR_RT_PARAM_INVALID] {
        assert!(matches!(map_call_err(acl_err(code)), DriverError::InvalidValue(_)), "{code}");
    }
    for (code, kind) in [
        (AclError::ERROR_RT_STREAM_CAPTURED, CaptureErrorKind::StreamCaptured),
        (AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED, CaptureErrorKind::Invalidated),
        (AclError::ERROR_RT_STREAM_UNJOINED, CaptureErrorKind::Unjoined),
        (AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, CaptureErrorKind::NotCapturable),
    ] {
        match map_call_err(acl_err(code)) {
            DriverError::Capture { kind: k, message } => {
                assert_eq!(k, kind, "{code}");
                assert!(message.contains("the message"), "{message}");
            }
            other => panic!("{code}: {other:?}"),
        }
    }
    for code in [AclError::ERROR_UNINITIALIZE, AclError(507_011), AclError(-1)] {
        match map_call_err(acl_err(code)) {
            DriverError::Native { code: c, message } => {
                assert_eq!(c, code.code());
                assert_eq!(message, "aclrtTest: the message");
            }
            other => panic!("{code}: {other:?}"),
        }
        assert!(!is_unsupported(&acl_err(code)));
    }
    // OOM codes only for allocating calls' free-memory query
    let calls = AtomicUsize::new(0);
    let _ = map_alloc_err(acl_err(AclError::ERROR_INVALID_PARAM), 1, || {
        calls.fetch_add(1, Ordering::Relaxed);
        0
    });
    assert_eq!(calls.load(Ordering::Relaxed), 0);
}

#[test]
fn missing_symbol_maps_to_unsupported() {
    let e = CallError::Missing(LoadError::MissingSymbol {
        symbol: "aclrtMemPoolCreate",
        library: "libascendcl.so".into(),
        reason: "undefined symbol".into(),
    });
    assert!(is_unsupported(&e));
    match map_call_err(e) {
        DriverError::Unsupported(m) => assert!(m.contains("aclrtMemPoolCreate"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn missing_library_is_an_error() {
    // SAFETY: the path does not exist; nothing is loaded.
    let err = unsafe { Acl::open("/nonexistent/libascendcl.so") }.unwrap_err();
    assert!(matches!(err, LoadError::Open { .. }), "{err:?}");
}

#[test]
fn mem_state_covers_adjacent_regions_only() {
    let mut m = MemState::default();
    m.test_map(0x1000, 0x1000);
    m.test_map(0x2000, 0x1000);
    m.test_malloc(0x3000, 0x100);
    m.pool_insert(0x8000, 0x80, 1);
    assert!(m.covers(0x1000, 0x1000));
    assert!(m.covers(0x1800, 0x1000)); // spans two adjacent mappings
    assert!(m.covers(0x1000, 0x2100)); // mapping, mapping, malloc
    assert!(!m.covers(0x1000, 0x2101)); // one byte past the malloc
    assert!(!m.covers(0x0fff, 2));
    assert!(m.covers(0x8000, 0x80));
    assert!(!m.covers(0x8000, 0x81));
    assert!(!m.covers(u64::MAX - 1, 4)); // overflow
    assert!(m.covers(0x1000, 0)); // empty range inside
    assert!(m.pool_owns(0x8000, 1) && !m.pool_owns(0x8000, 2));
    assert_eq!(m.pool_count(1), 1);
    m.pool_remove(0x8000);
    assert_eq!(m.pool_count(1), 0);
}

#[test]
fn copy_kinds_follow_the_ends() {
    use ascend_sys::aclrtMemcpyKind as K;
    let d = MemRef::Device(DevicePtr::new(0x1000).unwrap());
    let mut x = 0u8;
    let h = MemRef::Host(&raw mut x);
    assert_eq!(copy_args(d, h).2, K::ACL_MEMCPY_HOST_TO_DEVICE);
    assert_eq!(copy_args(h, d).2, K::ACL_MEMCPY_DEVICE_TO_HOST);
    assert_eq!(copy_args(d, d).2, K::ACL_MEMCPY_DEVICE_TO_DEVICE);
    assert_eq!(copy_args(h, h).2, K::ACL_MEMCPY_HOST_TO_HOST);
    assert_eq!(copy_args(d, h).0 as usize, 0x1000);
}

#[test]
fn pool_attribute_widths() {
    for a in 1..=3 {
        assert_eq!(attr_width(aclrtMemPoolAttr(a)), Some(AttrWidth::U32));
    }
    for a in 4..=8 {
        assert_eq!(attr_width(aclrtMemPoolAttr(a)), Some(AttrWidth::U64));
    }
    assert_eq!(attr_width(aclrtMemPoolAttr(0)), None);
    assert_eq!(attr_width(aclrtMemPoolAttr(9)), None);
}

// ---- the backend over the test double ------------------------------------------------------

/// The test double, compiled once per test process; `None` without a C compiler.
fn mock_so() -> Option<&'static PathBuf> {
    static SO: OnceLock<Option<PathBuf>> = OnceLock::new();
    SO.get_or_init(|| {
        let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let src = here.join("src/ascend/tests/mock_acl.c");
        let include = here.join("../ascend-sys/include");
        let dir = std::env::temp_dir().join(format!("soma-ascend-mock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let so = dir.join("libmock_acl.so");
        let out = Command::new("cc")
            .args(["-std=c99", "-D_GNU_SOURCE", "-O1", "-shared", "-fPIC", "-Wall", "-Werror"])
            .arg(format!("-I{}", include.display()))
            .arg(&src)
            .arg("-o")
            .arg(&so)
            .arg("-lpthread")
            .output();
        match out {
            Ok(o) if o.status.success() => Some(so),
            Ok(o) => panic!("mock_acl.c does not compile:\n{}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => {
                eprintln!("no C compiler ({e}): ascend backend tests over the test double skipped");
                None
            }
        }
    })
    .as_ref()
}

/// A private copy of the test double (its own globals), loaded.
fn mock(name: &str) -> Option<Arc<Acl>> {
    let so = mock_so()?;
    let copy = so.with_file_name(format!("libmock_acl_{name}.so"));
    std::fs::copy(so, &copy).expect("copy the test double");
    // SAFETY: the test double implements the subset with the declared signatures.
    Some(Arc::new(unsafe { Acl::open(&copy) }.expect("load the test double")))
}

macro_rules! mock_or_skip {
    ($name:expr) => {
        match mock($name) {
            Some(acl) => acl,
            None => return,
        }
    };
}

fn hook_i(acl: &Acl, name: &'static str) -> i32 {
    // SAFETY: the hooks of mock_acl.c named here are `int f(void)`; used while `acl` lives.
    let f: unsafe extern "C" fn() -> i32 = unsafe { acl.symbol(name) }.unwrap();
    // SAFETY: no arguments.
    unsafe { f() }
}

fn hook_set(acl: &Acl, name: &'static str, v: i32) {
    // SAFETY: the hooks of mock_acl.c named here are `void f(int)`; used while `acl` lives.
    let f: unsafe extern "C" fn(i32) = unsafe { acl.symbol(name) }.unwrap();
    // SAFETY: plain integer argument.
    unsafe { f(v) }
}

fn dev(acl: &Arc<Acl>) -> AscendDevice {
    let mut v = devices(acl.clone()).expect("devices");
    assert_eq!(v.len(), 1);
    v.remove(0)
}

#[test]
fn open_fills_device_info() {
    let acl = mock_or_skip!("info");
    assert!(acl.missing_symbols().is_empty());
    let d = dev(&acl);
    let info = d.info();
    assert_eq!(info.ordinal, 0);
    assert_eq!(info.total_memory, 64 << 30);
    assert_eq!(info.granularity, 2 << 20);
    assert_eq!(info.product, "ascend");
    assert!(info.supports_vmm);
    assert!(!info.supports_native_pool); // the double answers FEATURE_NOT_SUPPORT by default
                                         // A second open through the same library: aclInit is not repeated (or its repeat is
                                         // tolerated), and an ordinal out of range is an error value.
    let again = AscendDevice::open(acl.clone(), 0).expect("second open");
    assert_eq!(again.info(), d.info());
    assert!(matches!(AscendDevice::open(acl.clone(), 1), Err(DriverError::InvalidValue(_))));
    assert_eq!(device_count(&acl), Ok(1));
    let mi = d.mem_info().unwrap();
    assert_eq!(mi.total, 64 << 30);
}

#[test]
fn repeated_acl_init_is_tolerated() {
    let acl = mock_or_skip!("reinit");
    // Another component initialised the process first.
    let f = ascend_sys::acl_fn!(acl, aclInit).unwrap();
    // SAFETY: null config path.
    unsafe { f(std::ptr::null()) }.result().unwrap();
    // A second Acl instance over the same library: soma calls aclInit again and gets
    // ACL_ERROR_REPEAT_INITIALIZE, which it accepts.
    // SAFETY: same test double.
    let acl2 = Arc::new(unsafe { Acl::open(acl.path()) }.unwrap());
    dev(&acl);
    dev(&acl2);
}

#[test]
fn native_pool_probe_sees_support() {
    let acl = mock_or_skip!("probe");
    hook_set(&acl, "mock_set_pool_supported", 1);
    assert!(dev(&acl).info().supports_native_pool);
}

#[test]
fn set_device_is_cached_per_thread() {
    let acl = mock_or_skip!("setdev");
    let d = dev(&acl);
    let before = hook_i(&acl, "mock_set_device_calls");
    for _ in 0..10 {
        d.mem_info().unwrap();
    }
    assert_eq!(hook_i(&acl, "mock_set_device_calls"), before, "no aclrtSetDevice when current");
    let d2 = d.clone();
    std::thread::spawn(move || {
        d2.mem_info().unwrap();
        d2.mem_info().unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(hook_i(&acl, "mock_set_device_calls"), before + 1, "once on the new thread");
    forget_current_device();
    d.mem_info().unwrap();
    d.mem_info().unwrap();
    assert_eq!(hook_i(&acl, "mock_set_device_calls"), before + 2, "again after forgetting");
}

#[test]
fn stream_positions_copies_and_host_functions() {
    let acl = mock_or_skip!("stream");
    let d = dev(&acl);
    let s = d.create_stream().unwrap();
    let buf = d.malloc(64).unwrap();
    let src: Vec<u8> = (0..64).collect();
    let mut back = vec![0u8; 64];
    let ran = Arc::new(AtomicUsize::new(0));

    s.memset(buf, 0xAB, 64).unwrap();
    // SAFETY: `src` and `back` outlive the synchronize below and are not touched before it.
    unsafe {
        s.copy_async(MemRef::Device(buf), MemRef::Host(src.as_ptr().cast_mut()), 32).unwrap();
        s.copy_async(MemRef::Host(back.as_mut_ptr()), MemRef::Device(buf), 64).unwrap();
    }
    let r = ran.clone();
    s.host_fn(Box::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    }))
    .unwrap();
    assert_eq!(s.enqueued(), 4);
    assert_eq!(s.completed(), 0); // the double runs tasks at synchronization
    assert_eq!(s.query(), Ok(false));
    s.synchronize().unwrap();
    assert_eq!(s.completed(), 4);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(&back[..32], &src[..32]);
    assert!(back[32..].iter().all(|&b| b == 0xAB));
    assert_eq!(s.query(), Ok(true));

    // Out-of-range device ends are rejected before reaching the runtime; nothing enqueued.
    let past = buf.checked_add(60).unwrap();
    assert!(matches!(s.memset(past, 0, 8), Err(DriverError::InvalidAddress { .. })));
    assert!(matches!(
        s.copy_d2d(buf, DevicePtr::new(0x10).unwrap(), 4),
        Err(DriverError::InvalidAddress { .. })
    ));
    assert_eq!(s.enqueued(), 4);
    // Kernels as Rust closures: software NPU only.
    let k = KernelLaunch { name: "k", buffers: vec![], body: Box::new(|_| Ok(())) };
    assert!(matches!(s.launch(k), Err(DriverError::Unsupported(_))));
    drop(s);
    assert_eq!(hook_i(&acl, "mock_live_streams"), 0, "drop destroys the stream");
    d.free(buf).unwrap();
}

#[test]
fn host_fn_panic_is_sticky_and_launch_failure_reclaims_the_box() {
    let acl = mock_or_skip!("hostfn");
    let d = dev(&acl);
    let s = d.create_stream().unwrap();
    s.host_fn(Box::new(|| panic!("boom"))).unwrap();
    match s.synchronize() {
        Err(DriverError::TaskFailed { task, message, .. }) => {
            assert_eq!(task, 1);
            assert!(message.contains("boom"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.completed(), 1);
    assert!(matches!(s.query(), Err(DriverError::TaskFailed { .. })), "sticky");

    let token = Arc::new(());
    let held = token.clone();
    hook_set(&acl, "mock_fail_next", AclError::ERROR_RT_PARAM_INVALID.code());
    let err = s.host_fn(Box::new(move || drop(held))).unwrap_err();
    assert!(matches!(err, DriverError::InvalidValue(_)), "{err:?}");
    assert_eq!(Arc::strong_count(&token), 1, "the closure was dropped when the launch failed");
    assert_eq!(s.enqueued(), 1, "a failed call enqueues nothing");
}

#[test]
fn events_record_wait_query_elapsed() {
    let acl = mock_or_skip!("events");
    let d = dev(&acl);
    let s = d.create_stream().unwrap();
    let t = d.create_stream().unwrap();
    let a = d.create_event().unwrap();
    let b = d.create_event().unwrap();
    assert_eq!(a.query(), Ok(true), "never recorded");
    a.synchronize().unwrap();
    t.wait(&*a).unwrap();
    assert_eq!(t.enqueued(), 0, "waiting on a never-recorded event is a no-op");
    assert!(matches!(a.elapsed_ms(&*b), Err(DriverError::InvalidValue(_))));

    assert_eq!(s.record(&*a), Ok(1));
    s.host_fn(Box::new(|| {})).unwrap();
    assert_eq!(s.record(&*b), Ok(3));
    t.wait(&*b).unwrap();
    assert_eq!(t.enqueued(), 1);
    assert_eq!(a.query(), Ok(false));
    assert!(matches!(a.elapsed_ms(&*b), Err(DriverError::InvalidValue(_))), "not complete");
    b.synchronize().unwrap();
    assert_eq!(s.completed(), 3, "a completed event advances its stream");
    assert_eq!(a.query(), Ok(true));
    let ms = a.elapsed_ms(&*b).unwrap();
    assert!(ms > 0.0, "{ms}");
    drop((a, b));
    assert_eq!(hook_i(&acl, "mock_live_events"), 0);

    // An event of another backend is rejected.
    struct Foreign;
    impl EventHal for Foreign {
        fn query(&self) -> soma_core::hal::DriverResult<bool> {
            Ok(true)
        }
        fn synchronize(&self) -> soma_core::hal::DriverResult<()> {
            Ok(())
        }
        fn elapsed_ms(&self, _: &dyn EventHal) -> soma_core::hal::DriverResult<f32> {
            Ok(0.0)
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }
    assert!(matches!(s.record(&Foreign), Err(DriverError::InvalidHandle(_))));
}

#[test]
fn vmm_reserve_map_unmap_release() {
    let acl = mock_or_skip!("vmm");
    let d = dev(&acl);
    let g = d.info().granularity;
    assert!(matches!(d.reserve(g + 1), Err(DriverError::InvalidValue(_))));
    let va = d.reserve(4 * g).unwrap();
    let h1 = d.alloc_physical(g).unwrap();
    let h2 = d.alloc_physical(g).unwrap();
    d.map(va, h1).unwrap();
    let va2 = va.checked_add(g).unwrap();
    assert!(matches!(d.map(va2, h1), Err(DriverError::InvalidValue(_))), "already mapped");
    d.map(va2, h2).unwrap();
    assert!(matches!(d.free_physical(h1), Err(DriverError::InvalidValue(_))), "still mapped");
    assert!(matches!(d.release(va), Err(DriverError::InvalidAddress { .. })), "has mappings");

    // A memset across the two granules is valid; past them it is not.
    let s = d.create_stream().unwrap();
    let mid = va.checked_add(g - 8).unwrap();
    s.memset(mid, 1, 16).unwrap();
    assert!(matches!(s.memset(mid, 1, g + 9), Err(DriverError::InvalidAddress { .. })));
    d.memset_sync(va, 0, 16).unwrap();

    // The memset is in flight (the double runs it at synchronization): unmap refuses.
    assert!(matches!(d.unmap(va2), Err(DriverError::InvalidValue(_))));
    s.synchronize().unwrap();
    assert_eq!(d.unmap(va2), Ok(h2));
    assert_eq!(d.unmap(va), Ok(h1));
    assert!(matches!(d.unmap(va), Err(DriverError::InvalidAddress { .. })));
    d.free_physical(h1).unwrap();
    d.free_physical(h2).unwrap();
    assert!(matches!(d.free_physical(h2), Err(DriverError::InvalidHandle(_))));
    d.release(va).unwrap();
    assert!(matches!(d.memset_sync(va, 0, 1), Err(DriverError::InvalidAddress { .. })));
}

#[test]
fn malloc_free_in_flight_and_oom() {
    let acl = mock_or_skip!("malloc");
    let d = dev(&acl);
    let s = d.create_stream().unwrap();
    let p = d.malloc(1024).unwrap();
    s.memset(p, 0, 1024).unwrap();
    assert!(matches!(d.free(p), Err(DriverError::InvalidValue(_))), "in flight");
    // The check queries the stream; once it reports idle, free succeeds.
    acl_sync_all(&acl);
    d.free(p).unwrap();
    assert!(matches!(d.free(p), Err(DriverError::InvalidAddress { .. })), "double free");
    assert!(matches!(d.malloc(0), Err(DriverError::InvalidValue(_))));

    hook_set(&acl, "mock_fail_next", AclError::ERROR_RT_MEMORY_ALLOCATION.code());
    match d.malloc(4096) {
        Err(DriverError::OutOfMemory { requested, free }) => {
            assert_eq!(requested, 4096);
            assert_eq!(free, 64 << 30);
        }
        other => panic!("{other:?}"),
    }
    hook_set(&acl, "mock_fail_next", AclError::ERROR_BAD_ALLOC.code());
    assert!(matches!(d.alloc_physical(2 << 20), Err(DriverError::OutOfMemory { .. })));
}

/// Runs every queued task of the double (as if the device had caught up), without telling
/// soma: soma must learn completion by querying.
fn acl_sync_all(acl: &Acl) {
    // SAFETY: `void mock_run_all(void)` of the double; used while `acl` lives.
    let f: unsafe extern "C" fn() = unsafe { acl.symbol("mock_run_all") }.unwrap();
    // SAFETY: no arguments.
    unsafe { f() }
}

#[test]
fn device_synchronize_advances_every_stream() {
    let acl = mock_or_skip!("devsync");
    let d = dev(&acl);
    let s = d.create_stream().unwrap();
    let t = d.create_stream().unwrap();
    s.host_fn(Box::new(|| {})).unwrap();
    t.host_fn(Box::new(|| {})).unwrap();
    t.host_fn(Box::new(|| panic!("late"))).unwrap();
    assert!(matches!(d.synchronize(), Err(DriverError::TaskFailed { .. })));
    assert_eq!((s.completed(), t.completed()), (1, 2));
}

#[test]
fn native_pool_unsupported_names_the_product() {
    let acl = mock_or_skip!("pool_off");
    let d = dev(&acl);
    match NativePool::create(&d, 0) {
        Err(DriverError::Unsupported(m)) => {
            assert!(m.contains("does not support CANN's stream-ordered pool API"), "{m}");
            assert!(m.contains("ascend"), "{m}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn native_pool_round_trip() {
    let acl = mock_or_skip!("pool_on");
    hook_set(&acl, "mock_set_pool_supported", 1);
    let d = dev(&acl);
    let s = d.create_ascend_stream().unwrap();
    let pool = NativePool::create(&d, 8 << 20).unwrap();
    let follow = aclrtMemPoolAttr::ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES;
    let threshold = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD;
    let used = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT;
    assert_eq!(pool.get_attr_u32(follow), Ok(0));
    pool.set_attr_u32(follow, 7).unwrap();
    assert_eq!(pool.get_attr_u32(follow), Ok(1));
    pool.set_attr_u64(threshold, 1 << 20).unwrap();
    assert_eq!(pool.get_attr_u64(threshold), Ok(1 << 20));
    assert!(matches!(pool.set_attr_u32(threshold, 1), Err(DriverError::InvalidValue(_))));
    assert!(matches!(pool.get_attr_u64(follow), Err(DriverError::InvalidValue(_))));
    assert!(matches!(pool.get_attr_u64(aclrtMemPoolAttr(0x42)), Err(DriverError::InvalidValue(_))));
    assert!(matches!(pool.set_attr_u64(used, 0), Err(DriverError::InvalidValue(_))));

    assert!(matches!(pool.malloc_async(0, &s), Err(DriverError::InvalidValue(_))));
    let p = pool.malloc_async(256, &s).unwrap();
    assert_eq!(pool.get_attr_u64(used), Ok(1));
    assert_eq!(pool.live_allocations(), 1);
    s.memset(p, 3, 256).unwrap(); // pool memory validates
    assert!(matches!(pool.destroy_check(), Err(DriverError::InvalidValue(_))));
    pool.free_async(p, &s).unwrap();
    assert!(matches!(pool.free_async(p, &s), Err(DriverError::InvalidAddress { .. })));
    assert!(matches!(s.memset(p, 3, 1), Err(DriverError::InvalidAddress { .. })), "freed");
    pool.trim_to(0).unwrap();
    assert!(matches!(pool.trim_to(1 << 40), Err(DriverError::InvalidValue(_))));
    s.synchronize().unwrap();
    pool.destroy().unwrap();
}

#[test]
fn public_types_are_thread_safe() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<AscendDevice>();
    send_sync::<AscendStream>();
    send_sync::<AscendEvent>();
    send_sync::<NativePool>();
}

/// A runtime without stream capture: beginning one is `Unsupported`, the stream stays out
/// of capture and keeps taking positions.
#[test]
fn capture_refused_by_the_runtime_is_unsupported() {
    use soma_core::hal::{CaptureInfo, CaptureMode, StreamHal};
    let acl = mock_or_skip!("capture");
    let d = dev(&acl);
    let s = d.create_ascend_stream().unwrap();
    assert!(matches!(s.begin_capture(CaptureMode::Global), Err(DriverError::Unsupported(_))));
    assert_eq!(s.capture_info(), Ok(CaptureInfo::NONE));
    assert_eq!(s.capture_epoch(), 0);
    assert!(matches!(
        d.exchange_capture_mode(CaptureMode::Relaxed),
        Err(DriverError::Unsupported(_))
    ));
    let before = s.enqueued();
    s.host_fn_replayable(Arc::new(|| ())).unwrap();
    assert_eq!(s.enqueued(), before + 1);
    s.synchronize().unwrap();
}

/// The pool engine of soma-core over this backend (over the test double): the VMM path
/// (reserve, map on demand, unmap at trim), frees in stream order, data through the memory.
#[test]
fn soma_core_pool_runs_on_the_backend() {
    use soma_core::{Device, MemPool};
    let acl = mock_or_skip!("engine");
    let hal = dev(&acl);
    let device = Device::new(Arc::new(hal));
    let stream = device.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&device).unwrap();
    let a = pool.alloc_async::<u32>(1000, &stream).unwrap();
    let b = pool.alloc_async::<u32>(1000, &stream).unwrap();
    assert_ne!(a.device_ptr(), b.device_ptr());
    stream.hal().memset(a.device_ptr(), 7, 4000).unwrap();
    let mut back = vec![0u8; 4000];
    // SAFETY: `back` outlives the synchronize below and is not touched before it.
    unsafe {
        stream
            .hal()
            .copy_async(MemRef::Host(back.as_mut_ptr()), MemRef::Device(a.device_ptr()), 4000)
            .unwrap();
    }
    drop(a);
    drop(b);
    stream.synchronize().unwrap();
    assert!(back.iter().all(|&x| x == 7));
    let st = pool.stats();
    assert_eq!(st.live_allocations, 0);
    assert!(st.reserved >= 2 << 20, "{st:?}");
    // Same-stream reuse needs no driver call.
    let maps = st.map_calls;
    let c = pool.alloc_async::<u32>(1000, &stream).unwrap();
    assert_eq!(pool.stats().map_calls, maps);
    drop(c);
    stream.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved, 0);
}

/// End to end against a real runtime library: CANN's `libascendcl.so` on an NPU host, or
/// soma-capi's `libascendcl.so` (the C API over the software NPU). Portable: no test-double
/// hooks, no timing assumptions.
///
/// `SOMA_ASCEND_LIB=/path/to/libascendcl.so cargo test -p soma --features ascend --lib \
///  ascend::tests::external_library -- --ignored`
#[test]
#[ignore = "needs SOMA_ASCEND_LIB: a CANN runtime or soma-capi library"]
fn external_library() {
    use soma_core::{Device, MemPool};
    let path = std::env::var_os("SOMA_ASCEND_LIB").expect("set SOMA_ASCEND_LIB");
    // SAFETY: the caller names an AscendCL implementation.
    let acl = Arc::new(unsafe { Acl::open(&path) }.expect("load SOMA_ASCEND_LIB"));
    eprintln!("missing functions: {:?}", acl.missing_symbols());
    let all = devices(acl.clone()).expect("devices");
    assert!(!all.is_empty(), "no device");
    let d = all.into_iter().next().unwrap();
    let info = d.info().clone();
    eprintln!("{info:?}");
    assert!(info.granularity.is_power_of_two());
    let mi = d.mem_info().unwrap();
    assert!(mi.free <= mi.total && mi.total > 0);

    // Streams, copies, host functions, events.
    let s = d.create_stream().unwrap();
    let t = d.create_stream().unwrap();
    let buf = d.malloc(1 << 20).unwrap();
    let src: Vec<u8> = (0..=255).cycle().take(1 << 20).collect();
    let mut back = vec![0u8; 1 << 20];
    let ran = Arc::new(AtomicUsize::new(0));
    let e = d.create_event().unwrap();
    s.memset(buf, 0, 1 << 20).unwrap();
    // SAFETY: `src` / `back` outlive the synchronizations below and are not touched before.
    unsafe { s.copy_async(MemRef::Device(buf), MemRef::Host(src.as_ptr().cast_mut()), 1 << 20) }
        .unwrap();
    let p = s.record(&*e).unwrap();
    assert_eq!(p, 3);
    t.wait(&*e).unwrap();
    // SAFETY: as above.
    unsafe { t.copy_async(MemRef::Host(back.as_mut_ptr()), MemRef::Device(buf), 1 << 20) }.unwrap();
    let r = ran.clone();
    t.host_fn(Box::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    }))
    .unwrap();
    t.synchronize().unwrap();
    assert_eq!(t.completed(), t.enqueued());
    assert!(back == src, "the D2H copy after the wait sees the H2D copy before the record");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    e.synchronize().unwrap();
    assert!(s.completed() >= p);
    assert_eq!(e.query(), Ok(true));
    s.synchronize().unwrap();
    assert!(matches!(d.free(buf.checked_add(1).unwrap()), Err(DriverError::InvalidAddress { .. })));
    d.free(buf).unwrap();

    // VMM, when the device has it.
    if info.supports_vmm {
        let g = info.granularity;
        let va = d.reserve(2 * g).unwrap();
        let h = d.alloc_physical(g).unwrap();
        d.map(va, h).unwrap();
        d.memset_sync(va, 1, g).unwrap();
        assert_eq!(d.unmap(va), Ok(h));
        d.free_physical(h).unwrap();
        d.release(va).unwrap();
    }

    // CANN's own pool, when the device has it.
    match NativePool::create(&d, 0) {
        Ok(pool) => {
            assert!(info.supports_native_pool);
            let s = d.create_ascend_stream().unwrap();
            let p = pool.malloc_async(4096, &s).unwrap();
            s.memset(p, 9, 4096).unwrap();
            pool.free_async(p, &s).unwrap();
            s.synchronize().unwrap();
            pool.destroy().unwrap();
        }
        Err(DriverError::Unsupported(m)) => {
            assert!(!info.supports_native_pool, "{m}");
        }
        Err(other) => panic!("{other:?}"),
    }

    // soma's engine on top.
    let device = Device::new(Arc::new(d));
    let stream = device.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&device).unwrap();
    let a = pool.alloc_async::<u32>(1 << 16, &stream).unwrap();
    drop(a);
    stream.synchronize().unwrap();
    pool.trim_to(0).unwrap();
}
