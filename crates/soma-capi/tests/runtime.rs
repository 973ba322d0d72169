//! Devices, contexts, streams, events, host functions, memory, copies and VMM through the
//! exported functions, on a two-device runtime.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use ascend_sys::{
    aclrtEventRecordedStatus, aclrtMemAllocationType, aclrtMemAttr, aclrtMemGranularityOptions,
    aclrtMemLocation, aclrtMemLocationType, aclrtMemMallocPolicy, aclrtMemcpyKind,
    aclrtPhysicalMemProp, aclrtStreamStatus, AclError,
};
use ascendcl::*;
use common::*;

const GIB: usize = 1 << 30;
const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
const D2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE;
const H2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_HOST;
const DEFAULT: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEFAULT;

fn setup() {
    init(&[("SOMA_SIM_DEVICES", "2"), ("SOMA_SIM_CAPACITY", "8G")]);
}

fn malloc(size: usize) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtMalloc(&mut p, size, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST) });
    p
}

fn current() -> i32 {
    let mut d = -1;
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtGetDevice(&mut d) });
    d
}

#[test]
fn devices_and_contexts_are_per_thread() {
    setup();
    let mut n = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtGetDeviceCount(&mut n) });
    assert_eq!(n, 2);
    std::thread::spawn(|| {
        assert_eq!(current(), 0, "device 0 is implied");
        ok(aclrtSetDevice(1));
        assert_eq!(current(), 1);
        std::thread::spawn(|| assert_eq!(current(), 0, "per thread")).join().unwrap();
        fails(aclrtSetDevice(2), AclError::ERROR_INVALID_PARAM, "device 2");
        fails(aclrtSetDevice(-1), AclError::ERROR_INVALID_PARAM, "device -1");
        assert_eq!(current(), 1, "a failed set changes nothing");
        ok(aclrtResetDevice(1));
        assert_eq!(current(), 0);
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { aclrtCreateContext(&mut ctx, 1) });
        assert_eq!(current(), 1, "a new context is current");
        ok(aclrtSetDevice(0));
        ok(aclrtSetCurrentContext(ctx));
        assert_eq!(current(), 1);
        // A stream follows the current device: a pool of device 0 refuses it.
        let s = stream();
        let mut pr = props(4 * MIB);
        pr.location.id = 0;
        let pool0 = try_pool(&pr).unwrap();
        fails(try_alloc(512, pool0, s).unwrap_err(), AclError::ERROR_INVALID_PARAM, "cross device");
        pr.location.id = 1;
        let pool1 = try_pool(&pr).unwrap();
        let p = alloc(512, pool1, s);
        ok(free(p, s));
        ok(aclrtSynchronizeStream(s));
        ok(aclrtMemPoolDestroy(pool0));
        ok(aclrtMemPoolDestroy(pool1));
        ok(aclrtDestroyStream(s));
        ok(aclrtDestroyContext(ctx));
        fails(aclrtDestroyContext(ctx), AclError::ERROR_RT_INVALID_HANDLE, "context twice");
        fails(aclrtSetCurrentContext(ctx), AclError::ERROR_RT_INVALID_HANDLE, "dead context");
        fails(aclrtSetCurrentContext(std::ptr::null_mut()), AclError::ERROR_INVALID_PARAM, "null");
    })
    .join()
    .unwrap();
}

#[test]
fn error_messages_are_per_thread() {
    setup();
    fails(aclrtSetDevice(7), AclError::ERROR_INVALID_PARAM, "device 7");
    assert!(msg().starts_with("aclrtSetDevice:"), "{}", msg());
    let other = std::thread::spawn(msg).join().unwrap();
    assert_eq!(other, "", "a fresh thread has no message");
}

static HOST_CALLS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn count_call(arg: *mut c_void) {
    // The argument carries the expected order.
    let want = arg as usize;
    let got = HOST_CALLS.fetch_add(1, Ordering::SeqCst);
    assert_eq!(got, want);
}

#[test]
fn streams_events_and_host_functions() {
    setup();
    let (s, e1, e2) = (stream(), event(), event());
    let mut st = aclrtEventRecordedStatus(9);
    // SAFETY: valid out-pointer.
    ok(unsafe { aclrtQueryEventStatus(e1, &mut st) });
    assert_eq!(st, aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE);
    let mut ms = 0f32;
    // SAFETY: valid out-pointer.
    let e = unsafe { aclrtEventElapsedTime(&mut ms, e1, e2) };
    fails(e, AclError::ERROR_RT_PARAM_INVALID, "elapsed of unrecorded events");
    ok(aclrtRecordEvent(e1, s));
    for i in 0..10 {
        // SAFETY: `count_call` may run on any thread.
        ok(unsafe { aclrtLaunchHostFunc(s, Some(count_call), i as *mut c_void) });
    }
    ok(aclrtRecordEvent(e2, s));
    ok(aclrtSynchronizeEvent(e2));
    assert_eq!(HOST_CALLS.load(Ordering::SeqCst), 10);
    // SAFETY: valid out-pointers.
    unsafe {
        ok(aclrtEventElapsedTime(&mut ms, e1, e2));
        assert!(ms >= 0.0);
        let mut ss = aclrtStreamStatus(9);
        ok(aclrtStreamQuery(s, &mut ss));
        assert_eq!(ss, aclrtStreamStatus::ACL_STREAM_STATUS_COMPLETE);
        ok(aclrtStreamQuery(std::ptr::null_mut(), &mut ss));
        fails(aclrtStreamQuery(s, std::ptr::null_mut()), AclError::ERROR_INVALID_PARAM, "null");
        fails(
            aclrtLaunchHostFunc(s, None, std::ptr::null_mut()),
            AclError::ERROR_INVALID_PARAM,
            "null fn",
        );
    }
    // The default stream (null) works everywhere a stream does.
    ok(aclrtRecordEvent(e1, std::ptr::null_mut()));
    ok(aclrtStreamWaitEvent(std::ptr::null_mut(), e1));
    ok(aclrtSynchronizeStream(std::ptr::null_mut()));
    fails(
        aclrtDestroyStream(std::ptr::null_mut()),
        AclError::ERROR_INVALID_PARAM,
        "destroy default",
    );
    ok(aclrtDestroyStream(s));
    fails(aclrtDestroyStream(s), AclError::ERROR_RT_INVALID_HANDLE, "stream twice");
    fails(aclrtRecordEvent(e1, s), AclError::ERROR_RT_INVALID_HANDLE, "dead stream");
    fails(
        aclrtRecordEvent(s, std::ptr::null_mut()),
        AclError::ERROR_RT_INVALID_HANDLE,
        "stream as event",
    );
    ok(aclrtDestroyEvent(e1));
    ok(aclrtDestroyEvent(e2));
    fails(aclrtSynchronizeEvent(e1), AclError::ERROR_RT_INVALID_HANDLE, "dead event");
    ok(aclrtSynchronizeDevice());
}

#[test]
fn copies_and_memset_in_every_direction() {
    setup();
    let n = 8192;
    let (a, b) = (malloc(n), malloc(n));
    let src: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let mut out = vec![0u8; n];
    let mut out2 = vec![0u8; n];
    let s = stream();
    // SAFETY: host buffers outlive every copy (synchronous, or synchronized before use).
    unsafe {
        ok(aclrtMemcpy(a, n, src.as_ptr().cast(), n, H2D));
        ok(aclrtMemcpy(b, n, a, n, D2D));
        ok(aclrtMemcpy(out.as_mut_ptr().cast(), n, b, n, D2H));
        assert_eq!(out, src);
        ok(aclrtMemset(a, n, 0x1ff, 100));
        ok(aclrtMemcpy(out.as_mut_ptr().cast(), n, a, n, DEFAULT));
        assert!(out[..100].iter().all(|&x| x == 0xff) && out[100..] == src[100..]);
        ok(aclrtMemcpy(out2.as_mut_ptr().cast(), n, out.as_ptr().cast(), n, H2H));
        assert_eq!(out, out2);
        // Kinds must match the pointers.
        for (d, sp, k) in [
            (a, src.as_ptr().cast(), D2H),
            (out.as_mut_ptr().cast(), a as *const c_void, H2D),
            (a, b as *const c_void, H2H),
            (out.as_mut_ptr().cast(), src.as_ptr().cast(), D2D),
        ] {
            fails(aclrtMemcpy(d, n, sp, n, k), AclError::ERROR_INVALID_PARAM, "kind mismatch");
        }
        fails(
            aclrtMemcpy(std::ptr::null_mut(), n, a, n, D2H),
            AclError::ERROR_INVALID_PARAM,
            "null dst",
        );
        ok(aclrtMemcpy(a, n, src.as_ptr().cast(), 0, H2D));
        // Async, stream ordered.
        ok(aclrtMemsetAsync(b, n, 7, n, s));
        ok(aclrtMemcpyAsync(a, n, b, n, D2D, s));
        ok(aclrtMemcpyAsync(out.as_mut_ptr().cast(), n, a, n, DEFAULT, s));
        ok(aclrtMemcpyAsync(out2.as_mut_ptr().cast(), n, out.as_ptr().cast(), n, H2H, s));
        ok(aclrtSynchronizeStream(s));
        assert!(out2.iter().all(|&x| x == 7));
        fails(
            aclrtMemsetAsync(out.as_mut_ptr().cast(), n, 0, n, s),
            AclError::ERROR_INVALID_PARAM,
            "host memset async",
        );
    }
    ok(aclrtDestroyStream(s));
    ok(aclrtFree(a));
    ok(aclrtFree(b));
    fails(aclrtFree(a), AclError::ERROR_INVALID_PARAM, "double aclrtFree");
    fails(aclrtFree(std::ptr::null_mut()), AclError::ERROR_INVALID_PARAM, "null aclrtFree");
    // SAFETY: valid out-pointer.
    unsafe {
        let mut p = std::ptr::null_mut();
        fails(
            aclrtMalloc(&mut p, 0, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST),
            AclError::ERROR_INVALID_PARAM,
            "size 0",
        );
        fails(
            aclrtMalloc(&mut p, usize::MAX, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST),
            AclError::ERROR_INVALID_PARAM,
            "SIZE_MAX",
        );
        fails(
            aclrtMalloc(&mut p, 9 * GIB, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST),
            AclError::ERROR_RT_MEMORY_ALLOCATION,
            "above device",
        );
        fails(
            aclrtMalloc(&mut p, 512, aclrtMemMallocPolicy(9)),
            AclError::ERROR_INVALID_PARAM,
            "policy",
        );
    }
}

#[test]
fn host_memory_and_mem_info() {
    setup();
    let mut h = std::ptr::null_mut();
    // SAFETY: valid out-pointers; `h` is written only inside its 4096 bytes.
    unsafe {
        ok(aclrtMallocHost(&mut h, 4096));
        assert_eq!(h as usize % 4096, 0);
        ok(aclrtMemset(h, 4096, 3, 4096));
        assert_eq!(*h.cast::<u8>().add(4095), 3);
        // In stream order, as CANN's aclrtMemsetAsync accepts host memory from the runtime:
        // behind a host function that holds the stream, nothing is set yet.
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let gate: Box<dyn FnOnce()> = Box::new(move || {
            let _ = gate.recv_timeout(std::time::Duration::from_secs(30));
        });
        extern "C" fn run(args: *mut c_void) {
            // SAFETY: `args` is the boxed closure below, handed over once.
            let f = unsafe { Box::from_raw(args.cast::<Box<dyn FnOnce()>>()) };
            f();
        }
        let s = std::ptr::null_mut();
        ok(aclrtLaunchHostFunc(s, Some(run), Box::into_raw(Box::new(gate)).cast()));
        ok(aclrtMemsetAsync(h, 4096, 9, 100, s));
        assert_eq!(*h.cast::<u8>(), 3, "not before the stream gets there");
        open.send(()).unwrap();
        ok(aclrtSynchronizeStream(s));
        assert_eq!((*h.cast::<u8>().add(99), *h.cast::<u8>().add(100)), (9, 3));
        fails(aclrtMemsetAsync(h, 4096, 9, 4097, s), AclError::ERROR_INVALID_PARAM, "maxCount");
        fails(aclrtMallocHost(&mut h, 0), AclError::ERROR_INVALID_PARAM, "size 0");
        let mut local = 0u64;
        fails(
            aclrtFreeHost((&mut local as *mut u64).cast()),
            AclError::ERROR_INVALID_PARAM,
            "foreign",
        );
        ok(aclrtFreeHost(h));
        fails(aclrtFreeHost(h), AclError::ERROR_INVALID_PARAM, "twice");
        let (mut free, mut total) = (0usize, 0usize);
        ok(aclrtGetMemInfo(aclrtMemAttr::ACL_HBM_MEM, &mut free, &mut total));
        assert_eq!(total, 8 * GIB);
        assert!(free <= total);
        fails(
            aclrtGetMemInfo(aclrtMemAttr(99), &mut free, &mut total),
            AclError::ERROR_INVALID_PARAM,
            "attr",
        );
        fails(
            aclrtGetMemInfo(aclrtMemAttr::ACL_HBM_MEM, std::ptr::null_mut(), &mut total),
            AclError::ERROR_INVALID_PARAM,
            "null",
        );
    }
}

fn phys_prop() -> aclrtPhysicalMemProp {
    aclrtPhysicalMemProp {
        allocationType: aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED,
        location: aclrtMemLocation {
            id: 0,
            type_: aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE,
        },
        memAttr: aclrtMemAttr::ACL_HBM_MEM_HUGE,
        ..Default::default()
    }
}

#[test]
fn virtual_memory_management() {
    setup();
    let mut prop = phys_prop();
    let mut g = 0usize;
    // SAFETY: valid pointers throughout; device memory is only touched through the API.
    unsafe {
        ok(aclrtMemGetAllocationGranularity(
            &mut prop,
            aclrtMemGranularityOptions::ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            &mut g,
        ));
        assert_eq!(g, 2 * MIB);
        fails(
            aclrtMemGetAllocationGranularity(&mut prop, aclrtMemGranularityOptions(7), &mut g),
            AclError::ERROR_INVALID_PARAM,
            "option",
        );
        let mut bad = prop;
        bad.location.type_ = aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_HOST;
        fails(
            aclrtMemGetAllocationGranularity(
                &mut bad,
                aclrtMemGranularityOptions::ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
                &mut g,
            ),
            AclError::ERROR_INVALID_PARAM,
            "host location",
        );
        let mut va = std::ptr::null_mut();
        // flags: 0 normal pages, 1 huge pages (as CANN); nothing else.
        ok(aclrtReserveMemAddress(&mut va, 2 * g, 0, std::ptr::null_mut(), 1));
        ok(aclrtReleaseMemAddress(va));
        fails(
            aclrtReserveMemAddress(&mut va, 2 * g, 0, std::ptr::null_mut(), 2),
            AclError::ERROR_INVALID_PARAM,
            "flags 2",
        );
        ok(aclrtReserveMemAddress(&mut va, 4 * g, 0, std::ptr::null_mut(), 0));
        fails(
            aclrtReserveMemAddress(&mut va, g + 1, 0, std::ptr::null_mut(), 0),
            AclError::ERROR_INVALID_PARAM,
            "unaligned size",
        );
        let mut h = std::ptr::null_mut();
        fails(aclrtMallocPhysical(&mut h, g, &prop, 1), AclError::ERROR_INVALID_PARAM, "flags");
        fails(
            aclrtMallocPhysical(&mut h, g / 2, &prop, 0),
            AclError::ERROR_INVALID_PARAM,
            "half granule",
        );
        let mut bad = prop;
        bad.allocationType = aclrtMemAllocationType(3);
        fails(
            aclrtMallocPhysical(&mut h, g, &bad, 0),
            AclError::ERROR_INVALID_PARAM,
            "allocation type",
        );
        bad = prop;
        bad.reserve = 1;
        fails(aclrtMallocPhysical(&mut h, g, &bad, 0), AclError::ERROR_INVALID_PARAM, "reserve");
        ok(aclrtMallocPhysical(&mut h, 2 * g, &prop, 0));
        fails(aclrtMapMem(va, g, 0, h, 0), AclError::ERROR_INVALID_PARAM, "partial size");
        fails(aclrtMapMem(va, 2 * g, g, h, 0), AclError::ERROR_INVALID_PARAM, "offset");
        ok(aclrtMapMem(va, 2 * g, 0, h, 0));
        let data = [42u8; 256];
        let mut back = [0u8; 256];
        ok(aclrtMemcpy(va, 256, data.as_ptr().cast(), 256, H2D));
        ok(aclrtMemcpy(back.as_mut_ptr().cast(), 256, va, 256, DEFAULT));
        assert_eq!(back, data);
        fails(aclrtFreePhysical(h), AclError::ERROR_RT_PARAM_INVALID, "free while mapped");
        fails(aclrtReleaseMemAddress(va), AclError::ERROR_RT_PARAM_INVALID, "release while mapped");
        ok(aclrtUnmapMem(va));
        fails(
            aclrtMemcpy(va, 256, data.as_ptr().cast(), 256, H2D),
            AclError::ERROR_RT_PARAM_INVALID,
            "unmapped",
        );
        // The physical memory kept its contents: mapped again, at another address of the
        // reservation, it reads what was written before the unmap.
        let moved = va.cast::<u8>().wrapping_add(2 * g).cast();
        ok(aclrtMapMem(moved, 2 * g, 0, h, 0));
        back = [0u8; 256];
        ok(aclrtMemcpy(back.as_mut_ptr().cast(), 256, moved, 256, DEFAULT));
        assert_eq!(back, data, "contents survive an unmap");
        ok(aclrtUnmapMem(moved));
        ok(aclrtFreePhysical(h));
        fails(aclrtFreePhysical(h), AclError::ERROR_RT_INVALID_HANDLE, "twice");
        ok(aclrtReleaseMemAddress(va));
        fails(aclrtReleaseMemAddress(va), AclError::ERROR_INVALID_PARAM, "release twice");
    }
}

#[test]
fn runtime_works_before_init_and_after_finalize() {
    setup();
    // SAFETY: a null path is allowed; a repeated aclInit is lenient.
    ok(unsafe { aclInit(std::ptr::null()) });
    ok(aclFinalize());
    let s = stream();
    ok(aclrtSynchronizeStream(s));
    ok(aclrtDestroyStream(s));
}
