//! The pool API through the exported functions: lifecycle, validation, attributes, reuse,
//! release threshold, trim, frees of aclrtMalloc memory, and a table of bad inputs.

mod common;

use std::ffi::c_void;

use ascend_sys::{
    aclrtMemAllocationType, aclrtMemHandleType, aclrtMemLocationType, aclrtMemPoolAttr,
    aclrtMemPoolProps, aclrtMemcpyKind, AclError,
};
use ascendcl::*;
use common::*;

const GIB: usize = 1 << 30;

/// Starts the runtime and serialises the tests of this file: they share one process-wide
/// runtime, and another test's `aclrtSynchronizeDevice` makes every pending free host-observed
/// (reusable by every stream), which would change the reuse decisions a test asserts.
fn setup() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    init(&[("SOMA_SIM_CAPACITY", "16G")]);
    guard
}

#[test]
fn lifecycle_round_trip_attributes_destroy() {
    let _serial = setup();
    let s = stream();
    let pool = pool(64 * MIB);
    let n = 4096usize;
    let p = alloc(n, pool, s);
    let src: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; n];
    // SAFETY: `src` and `dst` outlive the copies: the stream is synchronized before use.
    unsafe {
        ok(aclrtMemcpyAsync(
            p as *mut c_void,
            n,
            src.as_ptr().cast(),
            n,
            aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
            s,
        ));
        ok(aclrtMemcpyAsync(
            dst.as_mut_ptr().cast(),
            n,
            p as *const c_void,
            n,
            aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
            s,
        ));
    }
    ok(free(p, s));
    ok(aclrtSynchronizeStream(s));
    assert_eq!(src, dst);
    assert_eq!(get(pool, USED), 0);
    assert_eq!(get(pool, USED_HIGH), 4096);
    assert!(get(pool, RESERVED_HIGH) >= 2 * MIB as u64);
    // CANN default threshold 0: the cache went back at the synchronize.
    assert_eq!(get(pool, RESERVED), 0);
    ok(aclrtMemPoolDestroy(pool));
    fails(aclrtMemPoolDestroy(pool), AclError::ERROR_RT_INVALID_HANDLE, "destroy twice");
    fails(
        try_alloc(512, pool, s).unwrap_err(),
        AclError::ERROR_RT_INVALID_HANDLE,
        "alloc after destroy",
    );
    ok(aclrtDestroyStream(s));
}

#[test]
fn create_validation_rules() {
    let _serial = setup();
    let good = props(64 * MIB);
    let mut cases: Vec<(&str, aclrtMemPoolProps)> = Vec::new();
    let mut p = good;
    p.allocType = aclrtMemAllocationType(1);
    cases.push(("allocType", p));
    let mut p = good;
    p.location.type_ = aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_HOST;
    cases.push(("location host", p));
    let mut p = good;
    p.location.type_ = aclrtMemLocationType(9);
    cases.push(("location unknown", p));
    for i in [0, 17, 31] {
        let mut p = good;
        p.reserved[i] = 1;
        cases.push(("reserved byte", p));
    }
    let mut p = good;
    p.location.id = 99;
    cases.push(("device id", p));
    let mut p = good;
    p.handleType = aclrtMemHandleType(7);
    cases.push(("handle type", p));
    let mut p = good;
    p.maxSize = usize::MAX;
    cases.push(("maxSize overflow", p));
    let mut p = good;
    p.maxSize = 16 * GIB + 1;
    cases.push(("maxSize above device", p));
    for (what, p) in cases {
        fails(try_pool(&p).unwrap_err(), AclError::ERROR_INVALID_PARAM, what);
    }
    // SAFETY: null arguments are checked.
    unsafe {
        let mut h = std::ptr::null_mut();
        fails(
            aclrtMemPoolCreate(std::ptr::null_mut(), &good),
            AclError::ERROR_INVALID_PARAM,
            "null out",
        );
        fails(
            aclrtMemPoolCreate(&mut h, std::ptr::null()),
            AclError::ERROR_INVALID_PARAM,
            "null props",
        );
    }
    // Rounded up to the granularity: 1 byte -> 2 MiB.
    let small = try_pool(&props(1)).unwrap();
    ok(set_u64(small, THRESHOLD, 2 * MIB as u64));
    fails(
        set_u64(small, THRESHOLD, 2 * MIB as u64 + 1),
        AclError::ERROR_INVALID_PARAM,
        "threshold",
    );
    let s = stream();
    let p = alloc(2 * MIB, small, s);
    fails(try_alloc(512, small, s).unwrap_err(), AclError::ERROR_RT_MEMORY_ALLOCATION, "full");
    ok(free(p, s));
    fails(
        try_alloc(2 * MIB + 1, small, s).unwrap_err(),
        AclError::ERROR_RT_MEMORY_ALLOCATION,
        "above size",
    );
    ok(aclrtSynchronizeStream(s));
    ok(aclrtMemPoolDestroy(small));
    // 0 = the device's memory; exactly the device's memory is accepted.
    for max in [0, 16 * GIB] {
        let whole = try_pool(&props(max)).unwrap();
        ok(set_u64(whole, THRESHOLD, 16 * GIB as u64));
        fails(
            set_u64(whole, THRESHOLD, 16 * GIB as u64 + 1),
            AclError::ERROR_INVALID_PARAM,
            "whole",
        );
        ok(aclrtMemPoolDestroy(whole));
    }
    ok(aclrtDestroyStream(s));
}

#[test]
fn attributes_defaults_set_get_rules() {
    let _serial = setup();
    let pool = pool(64 * MIB);
    // CANN defaults, and defaults of never-set attributes.
    assert_eq!(snapshot(pool), vec![0; 8]);
    for a in [FOLLOW, OPPORTUNISTIC, INTERNAL] {
        ok(set_u32(pool, a, 7));
        assert_eq!(get(pool, a), 1, "non-zero is stored as 1");
        ok(set_u32(pool, a, 0));
        assert_eq!(get(pool, a), 0);
        ok(set_u32(pool, a, 1));
        ok(set_u32(pool, a, 0));
        assert_eq!(get(pool, a), 0, "last set wins");
    }
    ok(set_u64(pool, THRESHOLD, 3 * MIB as u64));
    ok(set_u64(pool, THRESHOLD, 5 * MIB as u64));
    assert_eq!(get(pool, THRESHOLD), 5 * MIB as u64);
    ok(set_u64(pool, THRESHOLD, 64 * MIB as u64));
    fails(
        set_u64(pool, THRESHOLD, 64 * MIB as u64 + 1),
        AclError::ERROR_INVALID_PARAM,
        "threshold",
    );
    assert_eq!(get(pool, THRESHOLD), 64 * MIB as u64, "a failed set changes nothing");
    for a in [RESERVED, USED] {
        fails(set_u64(pool, a, 0), AclError::ERROR_INVALID_PARAM, "read-only");
    }
    let s = stream();
    let p = alloc(3 * MIB, pool, s);
    ok(free(p, s));
    let q = alloc(MIB, pool, s);
    assert_eq!(get(pool, USED_HIGH), 3 * MIB as u64);
    for a in [RESERVED_HIGH, USED_HIGH] {
        fails(set_u64(pool, a, 1), AclError::ERROR_INVALID_PARAM, "high to non-zero");
        ok(set_u64(pool, a, 0));
    }
    assert_eq!(get(pool, USED_HIGH), get(pool, USED), "reset restarts from current");
    assert_eq!(get(pool, RESERVED_HIGH), get(pool, RESERVED));
    for bad in [0u32, 9, 0x100, u32::MAX] {
        fails(set_u64(pool, aclrtMemPoolAttr(bad), 0), AclError::ERROR_INVALID_PARAM, "set bad id");
        fails(
            try_get(pool, aclrtMemPoolAttr(bad)).unwrap_err(),
            AclError::ERROR_INVALID_PARAM,
            "get bad id",
        );
    }
    for a in ALL_ATTRS {
        // SAFETY: a null value is checked.
        unsafe {
            fails(
                aclrtMemPoolSetAttr(pool, a, std::ptr::null_mut()),
                AclError::ERROR_INVALID_PARAM,
                "set null",
            );
            fails(
                aclrtMemPoolGetAttr(pool, a, std::ptr::null_mut()),
                AclError::ERROR_INVALID_PARAM,
                "get null",
            );
        }
    }
    ok(free(q, s));
    ok(aclrtSynchronizeStream(s));
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
}

/// s1: alloc, free; event recorded on s1 after the free; s2 waits on it; s2 allocates.
fn event_reuse(follow: bool, record_before_free: bool, work: bool, size: usize) -> (u64, u64) {
    let pool = pool(64 * MIB);
    ok(set_u32(pool, FOLLOW, u32::from(follow)));
    let (s1, s2, e) = (stream(), stream(), event());
    let p = alloc(size, pool, s1);
    if work {
        // Use the block on s1 before freeing it, so that the free has work to wait for.
        ok(aclrtMemsetAsync(p as *mut c_void, size, 1, size, s1));
    }
    if record_before_free {
        ok(aclrtRecordEvent(e, s1));
    }
    ok(free(p, s1));
    if !record_before_free {
        ok(aclrtRecordEvent(e, s1));
    }
    ok(aclrtStreamWaitEvent(s2, e));
    let q = alloc(size, pool, s2);
    ok(free(q, s2));
    ok(aclrtSynchronizeDevice());
    ok(aclrtMemPoolDestroy(pool));
    for x in [s1, s2] {
        ok(aclrtDestroyStream(x));
    }
    ok(aclrtDestroyEvent(e));
    (p, q)
}

#[test]
fn reuse_follows_event_dependencies_only_when_switched_on() {
    let _serial = setup();
    for _ in 0..10 {
        for work in [true, false] {
            for size in [MIB, 2 * MIB] {
                let case = format!("work {work}, size {size}");
                let (p, q) = event_reuse(true, false, work, size);
                assert_eq!(p, q, "switch on: s2 reuses the block freed on s1 ({case})");
                let (p, q) = event_reuse(false, false, work, size);
                assert_ne!(p, q, "switch off: not reused ({case})");
                let (p, q) = event_reuse(true, true, work, size);
                assert_ne!(p, q, "an event recorded before the free gives no right ({case})");
            }
        }
    }
}

#[test]
fn same_stream_reuse_is_always_on() {
    let _serial = setup();
    let pool = pool(64 * MIB);
    let s = stream();
    let p = alloc(MIB, pool, s);
    ok(free(p, s));
    assert_eq!(alloc(MIB, pool, s), p);
    ok(free(p, s));
    ok(aclrtSynchronizeStream(s));
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
}

#[test]
fn release_threshold_is_applied_at_the_next_synchronisation() {
    let _serial = setup();
    // Stream, event and device synchronisations all apply it.
    for how in 0..3 {
        let pool = pool(256 * MIB);
        let s = stream();
        ok(set_u64(pool, THRESHOLD, 4 * MIB as u64));
        let ptrs: Vec<u64> = (0..8).map(|_| alloc(2 * MIB, pool, s)).collect();
        for &p in &ptrs {
            ok(free(p, s));
        }
        assert!(get(pool, RESERVED) >= 16 * MIB as u64, "lazy: nothing released before a sync");
        match how {
            0 => ok(aclrtSynchronizeStream(s)),
            1 => {
                let e = event();
                ok(aclrtRecordEvent(e, s));
                ok(aclrtSynchronizeEvent(e));
                ok(aclrtDestroyEvent(e));
            }
            _ => ok(aclrtSynchronizeDevice()),
        }
        let r = get(pool, RESERVED);
        assert!(r <= 4 * MIB as u64, "how {how}: reserved {r} above the threshold");
        ok(aclrtMemPoolDestroy(pool));
        ok(aclrtDestroyStream(s));
    }
}

#[test]
fn trim_releases_now_but_never_memory_in_use() {
    let _serial = setup();
    let pool = pool(256 * MIB);
    let s = stream();
    ok(set_u64(pool, THRESHOLD, 256 * MIB as u64));
    let keep = alloc(MIB, pool, s);
    let ptrs: Vec<u64> = (0..4).map(|_| alloc(4 * MIB, pool, s)).collect();
    for &p in &ptrs {
        ok(free(p, s));
    }
    ok(aclrtSynchronizeStream(s));
    assert!(get(pool, RESERVED) >= 16 * MIB as u64, "threshold = size keeps the cache");
    ok(aclrtMemPoolTrimTo(pool, 0));
    let r = get(pool, RESERVED);
    assert!(r >= get(pool, USED) && r <= 2 * MIB as u64, "reserved {r} after trim");
    fails(
        aclrtMemPoolTrimTo(pool, 256 * MIB + 1),
        AclError::ERROR_INVALID_PARAM,
        "trim above size",
    );
    ok(free(keep, s));
    ok(aclrtSynchronizeStream(s));
    ok(aclrtMemPoolTrimTo(pool, 0));
    assert_eq!(get(pool, RESERVED), 0);
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
}

#[test]
fn trim_and_threshold_keep_what_they_are_told_when_one_allocation_made_the_cache() {
    let _serial = setup();
    // (cached bytes, trim or threshold, reserved after a trim, after the threshold): the
    // cache is the memory of one large allocation, mapped in segments larger than a granule.
    // A trim keeps at least what it is told (rounded up to 2 MiB), the threshold at most.
    let cases = [
        (16 * MIB, 2 * MIB, 2 * MIB, 2 * MIB),
        (16 * MIB, 5 * MIB, 6 * MIB, 4 * MIB),
        (16 * MIB, 6 * MIB, 6 * MIB, 6 * MIB),
        (16 * MIB, 1, 2 * MIB, 0),
        (32 * MIB, 2 * MIB, 2 * MIB, 2 * MIB),
        (32 * MIB, 30 * MIB, 30 * MIB, 30 * MIB),
    ];
    for threshold in [false, true] {
        for (cached, keep, trimmed, below_threshold) in cases {
            let expect = if threshold { below_threshold } else { trimmed };
            let pool = pool(256 * MIB);
            let s = stream();
            ok(set_u64(pool, THRESHOLD, 256 * MIB as u64));
            let p = alloc(cached, pool, s);
            ok(free(p, s));
            ok(aclrtSynchronizeStream(s));
            assert_eq!(get(pool, RESERVED), cached as u64);
            if threshold {
                ok(set_u64(pool, THRESHOLD, keep as u64));
                ok(aclrtSynchronizeStream(s));
            } else {
                ok(aclrtMemPoolTrimTo(pool, keep));
            }
            let r = get(pool, RESERVED);
            assert_eq!(r, expect as u64, "threshold {threshold}: {cached} cached, keep {keep}");
            // What was kept is served without growing.
            if expect > 0 {
                let again = alloc(expect, pool, s);
                assert_eq!(get(pool, RESERVED), r);
                ok(free(again, s));
            }
            ok(aclrtSynchronizeStream(s));
            ok(aclrtMemPoolDestroy(pool));
            ok(aclrtDestroyStream(s));
        }
    }
}

#[test]
fn free_async_of_acl_malloc_memory_waits_for_the_stream() {
    let _serial = setup();
    let s = stream();
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe {
        aclrtMalloc(&mut p, MIB, ascend_sys::aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST)
    });
    // Work before the free that uses the memory: a memset after a slow host function.
    extern "C" fn slow(_: *mut c_void) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // SAFETY: `slow` ignores its argument.
    ok(unsafe { aclrtLaunchHostFunc(s, Some(slow), std::ptr::null_mut()) });
    ok(aclrtMemsetAsync(p, MIB, 0x5a, MIB, s));
    ok(aclrtMemPoolFreeAsync(p, s));
    fails(aclrtMemPoolFreeAsync(p, s), AclError::ERROR_INVALID_PARAM, "double free");
    fails(aclrtFree(p), AclError::ERROR_INVALID_PARAM, "aclrtFree after FreeAsync");
    // The memset ran before the free (a free under it would have failed the stream).
    ok(aclrtSynchronizeStream(s));
    ok(aclrtDestroyStream(s));
}

#[test]
fn bad_inputs_give_errors_and_leave_the_pool_unchanged() {
    let _serial = setup();
    let pool = pool(64 * MIB);
    let s = stream();
    ok(set_u64(pool, THRESHOLD, 8 * MIB as u64));
    ok(set_u32(pool, FOLLOW, 1));
    let live = alloc(MIB, pool, s);
    let freed = alloc(4096, pool, s);
    ok(free(freed, s));
    let (dead_stream, dead_pool, an_event) = (stream(), self::common::pool(4 * MIB), event());
    ok(aclrtDestroyStream(dead_stream));
    ok(aclrtMemPoolDestroy(dead_pool));
    let mut host = [0u8; 64];
    let host_ptr = host.as_mut_ptr() as u64;
    let before = snapshot(pool);

    type Row<'a> = (&'a str, Box<dyn Fn() -> AclError + 'a>, AclError);
    let inv = AclError::ERROR_INVALID_PARAM;
    let handle = AclError::ERROR_RT_INVALID_HANDLE;
    let oom = AclError::ERROR_RT_MEMORY_ALLOCATION;
    let alloc_err =
        |size: usize, pool, s| move || try_alloc(size, pool, s).err().unwrap_or(AclError::SUCCESS);
    let rows: Vec<Row<'_>> = vec![
        ("malloc size 0", Box::new(alloc_err(0, pool, s)), inv),
        ("malloc SIZE_MAX", Box::new(alloc_err(usize::MAX, pool, s)), inv),
        (
            "malloc SIZE_MAX-100 (rounding overflow)",
            Box::new(alloc_err(usize::MAX - 100, pool, s)),
            inv,
        ),
        ("malloc above pool size", Box::new(alloc_err(65 * MIB, pool, s)), oom),
        ("malloc null pool", Box::new(alloc_err(512, std::ptr::null_mut(), s)), inv),
        ("malloc destroyed pool", Box::new(alloc_err(512, dead_pool, s)), handle),
        ("malloc event as pool", Box::new(alloc_err(512, an_event, s)), handle),
        ("malloc destroyed stream", Box::new(alloc_err(512, pool, dead_stream)), handle),
        (
            "malloc null out",
            Box::new(|| {
                // SAFETY: a null out-pointer is checked.
                unsafe { aclrtMemPoolMallocAsync(std::ptr::null_mut(), 512, pool, s) }
            }),
            inv,
        ),
        ("free null", Box::new(|| free(0, s)), inv),
        ("free interior", Box::new(|| free(live + 512, s)), inv),
        ("free foreign host pointer", Box::new(|| free(host_ptr, s)), inv),
        ("free twice", Box::new(|| free(freed, s)), inv),
        ("free on destroyed stream", Box::new(|| free(live, dead_stream)), handle),
        ("set attr 0", Box::new(|| set_u64(pool, aclrtMemPoolAttr(0), 0)), inv),
        ("set attr 9", Box::new(|| set_u64(pool, aclrtMemPoolAttr(9), 0)), inv),
        (
            "get attr 0xFFFF",
            Box::new(|| try_get(pool, aclrtMemPoolAttr(0xFFFF)).err().unwrap_or(AclError::SUCCESS)),
            inv,
        ),
        ("set reserved current", Box::new(|| set_u64(pool, RESERVED, 0)), inv),
        ("set used current", Box::new(|| set_u64(pool, USED, 5)), inv),
        ("set used high 5", Box::new(|| set_u64(pool, USED_HIGH, 5)), inv),
        ("set threshold above size", Box::new(|| set_u64(pool, THRESHOLD, u64::MAX)), inv),
        (
            "set null value",
            Box::new(|| {
                // SAFETY: a null value is checked.
                unsafe { aclrtMemPoolSetAttr(pool, THRESHOLD, std::ptr::null_mut()) }
            }),
            inv,
        ),
        (
            "get on destroyed pool",
            Box::new(|| try_get(dead_pool, USED).err().unwrap_or(AclError::SUCCESS)),
            handle,
        ),
        ("trim above size", Box::new(|| aclrtMemPoolTrimTo(pool, usize::MAX)), inv),
        ("trim destroyed pool", Box::new(|| aclrtMemPoolTrimTo(dead_pool, 0)), handle),
        ("destroy with a live allocation", Box::new(|| aclrtMemPoolDestroy(pool)), inv),
        ("destroy null", Box::new(|| aclrtMemPoolDestroy(std::ptr::null_mut())), inv),
        ("destroy a stream handle", Box::new(|| aclrtMemPoolDestroy(s)), handle),
        ("aclrtFree of pool memory", Box::new(|| aclrtFree(live as *mut c_void)), inv),
        ("aclrtFreeHost of pool memory", Box::new(|| aclrtFreeHost(live as *mut c_void)), inv),
        (
            "memcpy destMax < count",
            Box::new(|| {
                // SAFETY: rejected before any access.
                unsafe {
                    aclrtMemcpy(
                        live as *mut c_void,
                        16,
                        host.as_ptr().cast(),
                        64,
                        aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                    )
                }
            }),
            inv,
        ),
        (
            "memcpy wrong kind",
            Box::new(|| {
                // SAFETY: rejected before any access.
                unsafe {
                    aclrtMemcpy(
                        live as *mut c_void,
                        64,
                        host.as_ptr().cast(),
                        64,
                        aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
                    )
                }
            }),
            inv,
        ),
        (
            "memcpy bad kind",
            Box::new(|| {
                // SAFETY: rejected before any access.
                unsafe {
                    aclrtMemcpy(
                        live as *mut c_void,
                        64,
                        host.as_ptr().cast(),
                        64,
                        aclrtMemcpyKind(77),
                    )
                }
            }),
            inv,
        ),
        ("memset maxCount < count", Box::new(|| aclrtMemset(live as *mut c_void, 1, 0, 2)), inv),
        ("record destroyed stream", Box::new(|| aclrtRecordEvent(an_event, dead_stream)), handle),
        ("sync destroyed stream", Box::new(|| aclrtSynchronizeStream(dead_stream)), handle),
        ("destroy stream twice", Box::new(|| aclrtDestroyStream(dead_stream)), handle),
    ];
    for (what, call, want) in &rows {
        set_message_marker();
        let marker = msg();
        let got = call();
        fails(got, *want, what);
        assert_ne!(msg(), marker, "{what}: the call set no message of its own");
        assert_eq!(snapshot(pool), before, "{what}: the pool changed");
    }
    // Still fully usable.
    ok(free(live, s));
    ok(aclrtSynchronizeStream(s));
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtDestroyStream(s));
    ok(aclrtDestroyEvent(an_event));
}

#[test]
fn concurrent_threads_share_one_pool() {
    let _serial = setup();
    let pool = pool(256 * MIB) as usize;
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let pool = pool as *mut c_void;
                let s = stream();
                let mut ptrs = Vec::new();
                for i in 0..200 {
                    ptrs.push(alloc(512 * (1 + (i + t) % 7), pool, s));
                    if i % 3 == 0 {
                        ok(free(ptrs.swap_remove(0), s));
                    }
                }
                for p in ptrs {
                    ok(free(p, s));
                }
                ok(aclrtSynchronizeStream(s));
                ok(aclrtDestroyStream(s));
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let pool = pool as *mut c_void;
    assert_eq!(get(pool, USED), 0);
    ok(aclrtMemPoolDestroy(pool));
}

#[test]
fn destroy_waits_for_pending_frees() {
    let _serial = setup();
    extern "C" fn slow(_: *mut c_void) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let pool = pool(64 * MIB);
    let s = stream();
    let p = alloc(4 * MIB, pool, s);
    // SAFETY: `slow` ignores its argument.
    ok(unsafe { aclrtLaunchHostFunc(s, Some(slow), std::ptr::null_mut()) });
    ok(aclrtMemsetAsync(p as *mut c_void, 4 * MIB, 9, 4 * MIB, s));
    ok(free(p, s));
    // The memset is still queued: the destroy must not unmap under it.
    ok(aclrtMemPoolDestroy(pool));
    ok(aclrtSynchronizeStream(s));
    ok(aclrtDestroyStream(s));
}

#[test]
fn destroy_racing_with_allocations_never_crashes() {
    let _serial = setup();
    for _ in 0..20 {
        let pool = pool(64 * MIB) as usize;
        let worker = std::thread::spawn(move || {
            let pool = pool as *mut c_void;
            let s = stream();
            loop {
                match try_alloc(4096, pool, s) {
                    Ok(p) => ok(free(p, s)),
                    Err(e) => {
                        assert_eq!(e, AclError::ERROR_RT_INVALID_HANDLE, "{}", msg());
                        break;
                    }
                }
            }
            ok(aclrtSynchronizeStream(s));
            ok(aclrtDestroyStream(s));
        });
        loop {
            match aclrtMemPoolDestroy(pool as *mut c_void) {
                AclError::SUCCESS => break,
                e => assert_eq!(e, AclError::ERROR_INVALID_PARAM, "{}", msg()),
            }
        }
        worker.join().unwrap();
    }
}

#[test]
fn null_stream_is_the_default_stream() {
    let _serial = setup();
    let pool = pool(16 * MIB);
    let null = std::ptr::null_mut();
    let p = alloc(MIB, pool, null);
    ok(aclrtMemsetAsync(p as *mut c_void, MIB, 0, MIB, null));
    ok(free(p, null));
    assert_eq!(alloc(MIB, pool, null), p, "same stream: the default stream");
    ok(free(p, null));
    ok(aclrtSynchronizeStream(null));
    assert_eq!(get(pool, RESERVED), 0);
    ok(aclrtMemPoolDestroy(pool));
}

/// Blocks a stream until `release` is set by another thread.
extern "C" fn block_until(arg: *mut c_void) {
    // SAFETY: the argument is a `&'static AtomicBool` (see the callers).
    let flag = unsafe { &*(arg as *const std::sync::atomic::AtomicBool) };
    while !flag.load(std::sync::atomic::Ordering::Acquire) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn opportunistic_reuse_after_the_free_completed_on_the_device() {
    let _serial = setup();
    for opportunistic in [1, 0] {
        let pool = pool(64 * MIB);
        ok(set_u32(pool, OPPORTUNISTIC, opportunistic));
        let (s1, s2) = (stream(), stream());
        let p = alloc(MIB, pool, s1);
        ok(aclrtMemsetAsync(p as *mut c_void, MIB, 1, MIB, s1));
        ok(free(p, s1));
        // Let the device finish without the host observing it (no synchronize, no query).
        std::thread::sleep(std::time::Duration::from_millis(50));
        let q = alloc(MIB, pool, s2);
        if opportunistic == 1 {
            assert_eq!(p, q, "opportunistic: the completed free is reused on s2");
        } else {
            assert_ne!(p, q, "all switches off: not reused");
        }
        ok(free(q, s2));
        ok(aclrtSynchronizeDevice());
        ok(aclrtMemPoolDestroy(pool));
        ok(aclrtDestroyStream(s1));
        ok(aclrtDestroyStream(s2));
    }
}

#[test]
fn internal_dependencies_reuse_without_waiting_on_the_host() {
    let _serial = setup();
    static RELEASE: [std::sync::atomic::AtomicBool; 2] =
        [std::sync::atomic::AtomicBool::new(false), std::sync::atomic::AtomicBool::new(false)];
    for (i, internal) in [1u32, 0].into_iter().enumerate() {
        // A full pool: s2's request can only be served by s1's pending block.
        let pool = pool(2 * MIB);
        ok(set_u32(pool, INTERNAL, internal));
        let (s1, s2) = (stream(), stream());
        let p = alloc(2 * MIB, pool, s1);
        let flag = &RELEASE[i] as *const _ as *mut c_void;
        // SAFETY: `block_until` reads the static flag, which outlives the stream.
        ok(unsafe { aclrtLaunchHostFunc(s1, Some(block_until), flag) });
        ok(free(p, s1));
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            RELEASE[i].store(true, std::sync::atomic::Ordering::Release);
        });
        let t = std::time::Instant::now();
        let q = alloc(2 * MIB, pool, s2);
        let waited = t.elapsed();
        assert_eq!(p, q);
        if internal == 1 {
            assert!(waited.as_millis() < 200, "internal dependency: no host wait ({waited:?})");
        } else {
            assert!(waited.as_millis() >= 250, "switch off: the host waited ({waited:?})");
        }
        ok(free(q, s2));
        ok(aclrtSynchronizeDevice());
        releaser.join().unwrap();
        ok(aclrtMemPoolDestroy(pool));
        ok(aclrtDestroyStream(s1));
        ok(aclrtDestroyStream(s2));
    }
}
