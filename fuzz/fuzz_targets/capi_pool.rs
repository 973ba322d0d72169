//! Fuzz target: the `aclrtMemPool*` C API of soma-capi (called as Rust functions of its
//! rlib), with bad input mixed in: random pool properties, attributes of any id and value
//! (and null value pointers), sizes of 0 and `usize::MAX`, handles that were destroyed or
//! never existed, frees of interior, foreign and already freed pointers, the null (default)
//! stream.
//!
//! Checked: no call panics (the C boundary catches panics and reports "a panic was caught":
//! that is a crash here), bad input gets an error code, `used <= reserved` for every live
//! pool, and after every input (all freed, device synchronized, pools, streams and events
//! destroyed) the device's free memory is back where it started: nothing leaks.
#![no_main]

use std::ffi::{c_void, CStr};
use std::sync::Once;

use arbitrary::Arbitrary;
use ascend_sys::{
    aclrtMemAllocationType, aclrtMemAttr, aclrtMemHandleType, aclrtMemLocation,
    aclrtMemLocationType, aclrtMemPool, aclrtMemPoolAttr, aclrtMemPoolProps, aclrtStream, AclError,
};
use ascendcl::*;
use libfuzzer_sys::fuzz_target;

const MIB: usize = 1 << 20;
const USED: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT;
const RESERVED: aclrtMemPoolAttr = aclrtMemPoolAttr::ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT;

#[derive(Arbitrary, Debug)]
enum Op {
    CreatePool { max_mib: u16, alloc_type: u8, loc_type: u8, loc_id: u8, handle_type: u8 },
    DestroyPool { which: u8 },
    DestroyBogusPool { addr: u64 },
    SetAttr { pool: u8, attr: u8, value: u64, null: bool },
    GetAttr { pool: u8, attr: u8, null: bool },
    Malloc { pool: u8, stream: u8, size: u32 },
    MallocHuge { pool: u8, stream: u8 },
    MallocBogusPool { addr: u64, size: u16 },
    Free { which: u8, stream: u8 },
    FreeInterior { which: u8, offset: u16 },
    FreeBogus { addr: u64 },
    DoubleFree { stream: u8 },
    Trim { pool: u8, mib: u16 },
    CreateStream,
    DestroyStream { which: u8 },
    SyncStream { stream: u8 },
    RecordWait { from: u8, to: u8 },
    SyncDevice,
}

fn msg() -> String {
    // SAFETY: aclGetRecentErrMsg never returns null; the string lives until the next failing
    // call on this thread.
    unsafe { CStr::from_ptr(aclGetRecentErrMsg()) }.to_string_lossy().into_owned()
}

/// A call's result: success, or an error that is not a caught panic.
#[track_caller]
fn checked(e: AclError) -> AclError {
    if e != AclError::SUCCESS {
        let m = msg();
        assert!(!m.contains("panic was caught"), "a panic reached the C boundary: {m}");
    }
    e
}

fn mem_free() -> usize {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    let e = unsafe { aclrtGetMemInfo(aclrtMemAttr::ACL_HBM_MEM, &mut free, &mut total) };
    assert_eq!(e, AclError::SUCCESS, "{}", msg());
    free
}

fn get(pool: aclrtMemPool, attr: aclrtMemPoolAttr) -> u64 {
    let mut v = 0u64;
    // SAFETY: `v` is valid for 8 bytes.
    let e = checked(unsafe { aclrtMemPoolGetAttr(pool, attr, (&mut v as *mut u64).cast()) });
    assert_eq!(e, AclError::SUCCESS, "get {attr:?}: {}", msg());
    v
}

fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        std::env::set_var("SOMA_SIM_CAPACITY", "2G");
        // SAFETY: a null config path is allowed.
        assert_eq!(unsafe { aclInit(std::ptr::null()) }, AclError::SUCCESS, "{}", msg());
        assert_eq!(aclrtSetDevice(0), AclError::SUCCESS, "{}", msg());
    });
}

fuzz_target!(|ops: Vec<Op>| {
    init();
    let baseline = mem_free();
    let mut pools: Vec<aclrtMemPool> = Vec::new();
    let mut destroyed: Vec<aclrtMemPool> = Vec::new();
    // Index 0 is the null (default) stream.
    let mut streams: Vec<aclrtStream> = vec![std::ptr::null_mut()];
    let mut live: Vec<(u64, usize, aclrtMemPool)> = Vec::new();
    let mut freed: Vec<u64> = Vec::new();
    let stream = |streams: &Vec<aclrtStream>, i: u8| streams[i as usize % streams.len()];
    for op in ops.iter().take(128) {
        match *op {
            Op::CreatePool { max_mib, alloc_type, loc_type, loc_id, handle_type } => {
                let props = aclrtMemPoolProps {
                    allocType: aclrtMemAllocationType(u32::from(alloc_type % 3)),
                    handleType: aclrtMemHandleType(u32::from(handle_type % 4)),
                    location: aclrtMemLocation {
                        id: u32::from(loc_id % 3),
                        type_: aclrtMemLocationType(u32::from(loc_type % 4)),
                    },
                    maxSize: usize::from(max_mib % 4096) * MIB,
                    ..Default::default()
                };
                let mut h = std::ptr::null_mut();
                // SAFETY: valid pointers.
                if checked(unsafe { aclrtMemPoolCreate(&mut h, &props) }) == AclError::SUCCESS {
                    assert!(!h.is_null());
                    pools.push(h);
                }
            }
            Op::DestroyPool { which } => {
                if pools.is_empty() {
                    continue;
                }
                let i = which as usize % pools.len();
                let has_live = live.iter().any(|l| l.2 == pools[i]);
                let e = checked(aclrtMemPoolDestroy(pools[i]));
                assert_eq!(
                    e == AclError::SUCCESS,
                    !has_live,
                    "destroy with live = {has_live}: {}",
                    msg()
                );
                if e == AclError::SUCCESS {
                    destroyed.push(pools.swap_remove(i));
                    assert_ne!(
                        checked(aclrtMemPoolDestroy(*destroyed.last().unwrap())),
                        AclError::SUCCESS
                    );
                }
            }
            Op::DestroyBogusPool { addr } => {
                let h = addr as aclrtMemPool;
                if !pools.contains(&h) {
                    assert_ne!(checked(aclrtMemPoolDestroy(h)), AclError::SUCCESS);
                }
            }
            Op::SetAttr { pool, attr, value, null } => {
                let h = pick(&pools, &destroyed, pool);
                let attr = aclrtMemPoolAttr(u32::from(attr % 10));
                let mut v = value;
                let ptr: *mut c_void =
                    if null { std::ptr::null_mut() } else { (&mut v as *mut u64).cast() };
                // SAFETY: `ptr` is null or valid for 8 bytes.
                let e = checked(unsafe { aclrtMemPoolSetAttr(h, attr, ptr) });
                if null || h.is_null() {
                    assert_ne!(e, AclError::SUCCESS);
                }
            }
            Op::GetAttr { pool, attr, null } => {
                let h = pick(&pools, &destroyed, pool);
                let attr = aclrtMemPoolAttr(u32::from(attr % 10));
                let mut v = 0u64;
                let ptr: *mut c_void =
                    if null { std::ptr::null_mut() } else { (&mut v as *mut u64).cast() };
                // SAFETY: `ptr` is null or valid for 8 bytes.
                let e = checked(unsafe { aclrtMemPoolGetAttr(h, attr, ptr) });
                if null || h.is_null() || !(1..=8).contains(&attr.0) {
                    assert_ne!(e, AclError::SUCCESS);
                }
            }
            Op::Malloc { pool, stream: si, size } => {
                let h = pick(&pools, &destroyed, pool);
                let s = stream(&streams, si);
                let mut p = std::ptr::null_mut();
                let size = size as usize % (64 * MIB);
                // SAFETY: valid out-pointer.
                let e = checked(unsafe { aclrtMemPoolMallocAsync(&mut p, size, h, s) });
                if e == AclError::SUCCESS {
                    assert!(size > 0 && pools.contains(&h) && !p.is_null());
                    let a = p as u64;
                    assert!(
                        !live.iter().any(|l| a < l.0 + l.1 as u64 && l.0 < a + size as u64),
                        "overlap"
                    );
                    freed.retain(|&f| f != a);
                    live.push((a, size, h));
                }
            }
            Op::MallocHuge { pool, stream: si } => {
                let h = pick(&pools, &destroyed, pool);
                let mut p = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                let e = checked(unsafe {
                    aclrtMemPoolMallocAsync(&mut p, usize::MAX, h, stream(&streams, si))
                });
                assert_ne!(e, AclError::SUCCESS);
            }
            Op::MallocBogusPool { addr, size } => {
                let h = addr as aclrtMemPool;
                if !pools.contains(&h) {
                    let mut p = std::ptr::null_mut();
                    // SAFETY: valid out-pointer.
                    let e = checked(unsafe {
                        aclrtMemPoolMallocAsync(&mut p, usize::from(size) + 1, h, streams[0])
                    });
                    assert_ne!(e, AclError::SUCCESS);
                }
            }
            Op::Free { which, stream: si } => {
                if live.is_empty() {
                    continue;
                }
                let (a, _, _) = live.swap_remove(which as usize % live.len());
                let e = checked(aclrtMemPoolFreeAsync(a as *mut c_void, stream(&streams, si)));
                assert_eq!(e, AclError::SUCCESS, "free of a live block: {}", msg());
                freed.push(a);
            }
            Op::FreeInterior { which, offset } => {
                if live.is_empty() {
                    continue;
                }
                let (a, size, _) = live[which as usize % live.len()];
                let p = a + 1 + u64::from(offset) % size as u64;
                if !live.iter().any(|l| l.0 == p) {
                    assert_ne!(
                        checked(aclrtMemPoolFreeAsync(p as *mut c_void, streams[0])),
                        AclError::SUCCESS
                    );
                }
            }
            Op::FreeBogus { addr } => {
                if !live.iter().any(|l| l.0 == addr) {
                    assert_ne!(
                        checked(aclrtMemPoolFreeAsync(addr as *mut c_void, streams[0])),
                        AclError::SUCCESS
                    );
                }
            }
            Op::DoubleFree { stream: si } => {
                if let Some(&a) = freed.last() {
                    if !live.iter().any(|l| l.0 == a) {
                        let e =
                            checked(aclrtMemPoolFreeAsync(a as *mut c_void, stream(&streams, si)));
                        assert_ne!(e, AclError::SUCCESS, "double free accepted");
                    }
                }
            }
            Op::Trim { pool, mib } => {
                let h = pick(&pools, &destroyed, pool);
                let _ = checked(aclrtMemPoolTrimTo(h, usize::from(mib) * MIB));
            }
            Op::CreateStream => {
                if streams.len() < 5 {
                    let mut s = std::ptr::null_mut();
                    // SAFETY: valid out-pointer.
                    assert_eq!(checked(unsafe { aclrtCreateStream(&mut s) }), AclError::SUCCESS);
                    streams.push(s);
                }
            }
            Op::DestroyStream { which } => {
                if streams.len() > 1 {
                    let i = 1 + which as usize % (streams.len() - 1);
                    let _ = checked(aclrtDestroyStream(streams[i]));
                    streams.swap_remove(i);
                }
            }
            Op::SyncStream { stream: si } => {
                assert_eq!(
                    checked(aclrtSynchronizeStream(stream(&streams, si))),
                    AclError::SUCCESS
                );
            }
            Op::RecordWait { from, to } => {
                let mut ev = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                assert_eq!(checked(unsafe { aclrtCreateEvent(&mut ev) }), AclError::SUCCESS);
                assert_eq!(
                    checked(aclrtRecordEvent(ev, stream(&streams, from))),
                    AclError::SUCCESS
                );
                assert_eq!(
                    checked(aclrtStreamWaitEvent(stream(&streams, to), ev)),
                    AclError::SUCCESS
                );
                assert_eq!(checked(aclrtDestroyEvent(ev)), AclError::SUCCESS);
            }
            Op::SyncDevice => assert_eq!(checked(aclrtSynchronizeDevice()), AclError::SUCCESS),
        }
        for &h in &pools {
            assert!(get(h, USED) <= get(h, RESERVED), "used above reserved");
        }
    }
    for (a, _, _) in live.drain(..) {
        assert_eq!(checked(aclrtMemPoolFreeAsync(a as *mut c_void, streams[0])), AclError::SUCCESS);
    }
    assert_eq!(checked(aclrtSynchronizeDevice()), AclError::SUCCESS);
    for h in pools.drain(..) {
        assert_eq!(checked(aclrtMemPoolDestroy(h)), AclError::SUCCESS, "{}", msg());
    }
    for s in streams.drain(1..) {
        assert_eq!(checked(aclrtDestroyStream(s)), AclError::SUCCESS, "{}", msg());
    }
    assert_eq!(mem_free(), baseline, "device memory leaked by this input");
});

/// A live pool, a destroyed one or null, chosen by `i`.
fn pick(pools: &[aclrtMemPool], destroyed: &[aclrtMemPool], i: u8) -> aclrtMemPool {
    let all = pools.len() + destroyed.len() + 1;
    let k = i as usize % all;
    if k < pools.len() {
        pools[k]
    } else if k < pools.len() + destroyed.len() {
        destroyed[k - pools.len()]
    } else {
        std::ptr::null_mut()
    }
}
