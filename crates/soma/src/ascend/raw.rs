//! The `result` level: one thin function per AscendCL call, grouped by the sections of the CANN
//! runtime documentation (`device::set`, `stream::create`, `event::record`, `vmm::map`…).
//!
//! Each function looks its symbol up without panicking, makes the call and turns the status
//! into a [`CallResult`]; on failure it reads `aclGetRecentErrMsg` at once (the message is per
//! thread and the next call overwrites it). Functions that take a handle or a pointer are
//! `unsafe`: the handle must be live and belong to `acl` (and to the calling thread's current
//! device where CANN requires it); pointers must be valid as the C API documents.

use std::ffi::{c_void, CStr};
use std::fmt;

use ascend_sys::{
    acl_fn, aclmdlRI, aclmdlRICaptureMode, aclmdlRICaptureStatus, aclrtDrvMemHandle, aclrtEvent,
    aclrtEventRecordedStatus, aclrtHostFunc, aclrtMemAttr, aclrtMemGranularityOptions,
    aclrtMemMallocPolicy, aclrtMemPool, aclrtMemPoolAttr, aclrtMemPoolProps, aclrtMemcpyKind,
    aclrtPhysicalMemProp, aclrtStream, aclrtStreamStatus, Acl, AclError, LoadError,
};

/// Why a call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CallError {
    /// The function returned a status other than `ACL_SUCCESS`.
    Acl {
        /// The C function.
        call: &'static str,
        /// Its status.
        code: AclError,
        /// `aclGetRecentErrMsg()` right after the call (may be empty).
        message: String,
    },
    /// The library does not export the function.
    Missing(LoadError),
}

impl CallError {
    /// The status, if the call was made.
    pub(crate) fn code(&self) -> Option<AclError> {
        match self {
            CallError::Acl { code, .. } => Some(*code),
            CallError::Missing(_) => None,
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Acl { call, code, message } if message.is_empty() => {
                write!(f, "{call} failed: {code}")
            }
            CallError::Acl { call, code, message } => write!(f, "{call} failed: {code}: {message}"),
            CallError::Missing(e) => write!(f, "{e}"),
        }
    }
}

/// Result of a raw call.
pub(crate) type CallResult<T> = Result<T, CallError>;

macro_rules! sym {
    ($acl:expr, $name:ident) => {
        acl_fn!($acl, $name).map_err(CallError::Missing)
    };
}

/// `Ok(())` for `ACL_SUCCESS`, else the error with the thread's recent message.
fn check(acl: &Acl, call: &'static str, status: AclError) -> CallResult<()> {
    status.result().map_err(|code| CallError::Acl { call, code, message: recent_err_msg(acl) })
}

/// `aclGetRecentErrMsg()`, copied; empty when unavailable.
pub(crate) fn recent_err_msg(acl: &Acl) -> String {
    let Ok(f) = acl_fn!(acl, aclGetRecentErrMsg) else { return String::new() };
    // SAFETY: no arguments; the result is null or a NUL-terminated string owned by the runtime
    // and valid until the next AscendCL call on this thread; it is copied before any other call.
    let p = unsafe { f() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated, valid for the duration of this copy (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The error `aclInit` returns when the process is already initialised
/// (`ACL_ERROR_REPEAT_INITIALIZE`, 100002 in CANN). It is not one of the subset's codes, so
/// `ascend-sys` has no constant for it; a repeated `aclInit` is tolerated with it.
pub(crate) const ACL_ERROR_REPEAT_INITIALIZE: AclError = AclError(100_002);

/// Process initialisation (`acl.h`).
pub(crate) mod init {
    use super::*;

    /// `aclInit(NULL)`.
    pub(crate) fn init(acl: &Acl) -> CallResult<()> {
        let f = sym!(acl, aclInit)?;
        // SAFETY: a null config path means "no configuration file".
        check(acl, "aclInit", unsafe { f(std::ptr::null()) })
    }
}

/// Device management.
pub(crate) mod device {
    use super::*;

    /// `aclrtSetDevice(id)`: makes `id` the calling thread's current device.
    pub(crate) fn set(acl: &Acl, id: i32) -> CallResult<()> {
        let f = sym!(acl, aclrtSetDevice)?;
        // SAFETY: no pointers.
        check(acl, "aclrtSetDevice", unsafe { f(id) })
    }

    /// `aclrtGetDeviceCount`.
    pub(crate) fn count(acl: &Acl) -> CallResult<u32> {
        let f = sym!(acl, aclrtGetDeviceCount)?;
        let mut n = 0u32;
        // SAFETY: `n` is a valid out-pointer.
        check(acl, "aclrtGetDeviceCount", unsafe { f(&mut n) })?;
        Ok(n)
    }

    /// `aclrtSynchronizeDevice` (the current device).
    pub(crate) fn synchronize(acl: &Acl) -> CallResult<()> {
        let f = sym!(acl, aclrtSynchronizeDevice)?;
        // SAFETY: no arguments.
        check(acl, "aclrtSynchronizeDevice", unsafe { f() })
    }

    /// `aclrtDeviceCanAccessPeer(device, peer)`: whether `device` can access `peer`'s memory.
    pub(crate) fn can_access_peer(acl: &Acl, device: i32, peer: i32) -> CallResult<bool> {
        let f = sym!(acl, aclrtDeviceCanAccessPeer)?;
        let mut can = 0i32;
        // SAFETY: `can` is a valid out-pointer.
        check(acl, "aclrtDeviceCanAccessPeer", unsafe { f(&mut can, device, peer) })?;
        Ok(can != 0)
    }

    /// `aclrtDeviceEnablePeerAccess(peer, 0)` from the current device.
    pub(crate) fn enable_peer_access(acl: &Acl, peer: i32) -> CallResult<()> {
        let f = sym!(acl, aclrtDeviceEnablePeerAccess)?;
        // SAFETY: no pointers.
        check(acl, "aclrtDeviceEnablePeerAccess", unsafe { f(peer, 0) })
    }

    /// `aclrtDeviceDisablePeerAccess(peer)` from the current device.
    pub(crate) fn disable_peer_access(acl: &Acl, peer: i32) -> CallResult<()> {
        let f = sym!(acl, aclrtDeviceDisablePeerAccess)?;
        // SAFETY: no pointers.
        check(acl, "aclrtDeviceDisablePeerAccess", unsafe { f(peer) })
    }

    /// `aclrtGetMemInfo(attr)` of the current device: `(free, total)`.
    pub(crate) fn mem_info(acl: &Acl, attr: aclrtMemAttr) -> CallResult<(usize, usize)> {
        let f = sym!(acl, aclrtGetMemInfo)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are valid.
        check(acl, "aclrtGetMemInfo", unsafe { f(attr, &mut free, &mut total) })?;
        Ok((free, total))
    }
}

/// Stream management.
pub(crate) mod stream {
    use super::*;

    /// `aclrtCreateStream` on the current device.
    pub(crate) fn create(acl: &Acl) -> CallResult<aclrtStream> {
        let f = sym!(acl, aclrtCreateStream)?;
        let mut s: aclrtStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer.
        check(acl, "aclrtCreateStream", unsafe { f(&mut s) })?;
        Ok(s)
    }

    /// `aclrtDestroyStream`.
    ///
    /// # Safety
    /// `s` is a live stream of `acl`, not used after this call.
    pub(crate) unsafe fn destroy(acl: &Acl, s: aclrtStream) -> CallResult<()> {
        let f = sym!(acl, aclrtDestroyStream)?;
        // SAFETY: the caller guarantees `s`.
        check(acl, "aclrtDestroyStream", unsafe { f(s) })
    }

    /// `aclrtSynchronizeStream`.
    ///
    /// # Safety
    /// `s` is a live stream of `acl` (or null: the default stream).
    pub(crate) unsafe fn synchronize(acl: &Acl, s: aclrtStream) -> CallResult<()> {
        let f = sym!(acl, aclrtSynchronizeStream)?;
        // SAFETY: the caller guarantees `s`.
        check(acl, "aclrtSynchronizeStream", unsafe { f(s) })
    }

    /// `aclrtStreamQuery`.
    ///
    /// # Safety
    /// `s` is a live stream of `acl`.
    pub(crate) unsafe fn query(acl: &Acl, s: aclrtStream) -> CallResult<aclrtStreamStatus> {
        let f = sym!(acl, aclrtStreamQuery)?;
        let mut st = aclrtStreamStatus::ACL_STREAM_STATUS_RESERVED;
        // SAFETY: the caller guarantees `s`; `st` is a valid out-pointer.
        check(acl, "aclrtStreamQuery", unsafe { f(s, &mut st) })?;
        Ok(st)
    }

    /// `aclrtLaunchHostFunc`.
    ///
    /// # Safety
    /// `s` is a live stream of `acl`; `func(args)` is sound to call once on a runtime thread.
    pub(crate) unsafe fn launch_host_func(
        acl: &Acl,
        s: aclrtStream,
        func: aclrtHostFunc,
        args: *mut c_void,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtLaunchHostFunc)?;
        // SAFETY: the caller guarantees `s`, `func` and `args`.
        check(acl, "aclrtLaunchHostFunc", unsafe { f(s, func, args) })
    }
}

/// Event management.
pub(crate) mod event {
    use super::*;

    /// `aclrtCreateEvent`.
    pub(crate) fn create(acl: &Acl) -> CallResult<aclrtEvent> {
        let f = sym!(acl, aclrtCreateEvent)?;
        let mut e: aclrtEvent = std::ptr::null_mut();
        // SAFETY: `e` is a valid out-pointer.
        check(acl, "aclrtCreateEvent", unsafe { f(&mut e) })?;
        Ok(e)
    }

    /// `aclrtDestroyEvent`.
    ///
    /// # Safety
    /// `e` is a live event of `acl`, not used after this call.
    pub(crate) unsafe fn destroy(acl: &Acl, e: aclrtEvent) -> CallResult<()> {
        let f = sym!(acl, aclrtDestroyEvent)?;
        // SAFETY: the caller guarantees `e`.
        check(acl, "aclrtDestroyEvent", unsafe { f(e) })
    }

    /// `aclrtRecordEvent(e, s)`.
    ///
    /// # Safety
    /// `e` and `s` are live handles of `acl`.
    pub(crate) unsafe fn record(acl: &Acl, e: aclrtEvent, s: aclrtStream) -> CallResult<()> {
        let f = sym!(acl, aclrtRecordEvent)?;
        // SAFETY: the caller guarantees both handles.
        check(acl, "aclrtRecordEvent", unsafe { f(e, s) })
    }

    /// `aclrtStreamWaitEvent(s, e)`.
    ///
    /// # Safety
    /// `e` and `s` are live handles of `acl`.
    pub(crate) unsafe fn stream_wait(acl: &Acl, s: aclrtStream, e: aclrtEvent) -> CallResult<()> {
        let f = sym!(acl, aclrtStreamWaitEvent)?;
        // SAFETY: the caller guarantees both handles.
        check(acl, "aclrtStreamWaitEvent", unsafe { f(s, e) })
    }

    /// `aclrtSynchronizeEvent`.
    ///
    /// # Safety
    /// `e` is a live event of `acl`.
    pub(crate) unsafe fn synchronize(acl: &Acl, e: aclrtEvent) -> CallResult<()> {
        let f = sym!(acl, aclrtSynchronizeEvent)?;
        // SAFETY: the caller guarantees `e`.
        check(acl, "aclrtSynchronizeEvent", unsafe { f(e) })
    }

    /// `aclrtQueryEventStatus`.
    ///
    /// # Safety
    /// `e` is a live event of `acl`.
    pub(crate) unsafe fn query_status(
        acl: &Acl,
        e: aclrtEvent,
    ) -> CallResult<aclrtEventRecordedStatus> {
        let f = sym!(acl, aclrtQueryEventStatus)?;
        let mut st = aclrtEventRecordedStatus(u32::MAX);
        // SAFETY: the caller guarantees `e`; `st` is a valid out-pointer.
        check(acl, "aclrtQueryEventStatus", unsafe { f(e, &mut st) })?;
        Ok(st)
    }

    /// `aclrtEventElapsedTime(&ms, start, end)`.
    ///
    /// # Safety
    /// Both are live events of `acl`.
    pub(crate) unsafe fn elapsed_time(
        acl: &Acl,
        start: aclrtEvent,
        end: aclrtEvent,
    ) -> CallResult<f32> {
        let f = sym!(acl, aclrtEventElapsedTime)?;
        let mut ms = 0f32;
        // SAFETY: the caller guarantees both events; `ms` is a valid out-pointer.
        check(acl, "aclrtEventElapsedTime", unsafe { f(&mut ms, start, end) })?;
        Ok(ms)
    }
}

/// Memory management: `aclrtMalloc`, copies, memset.
pub(crate) mod mem {
    use super::*;

    /// `aclrtMalloc(size, policy)` on the current device.
    pub(crate) fn malloc(
        acl: &Acl,
        size: usize,
        policy: aclrtMemMallocPolicy,
    ) -> CallResult<*mut c_void> {
        let f = sym!(acl, aclrtMalloc)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer.
        check(acl, "aclrtMalloc", unsafe { f(&mut p, size, policy) })?;
        Ok(p)
    }

    /// `aclrtFree`.
    ///
    /// # Safety
    /// `p` came from `aclrtMalloc` of `acl`, is not freed yet and no work uses it.
    pub(crate) unsafe fn free(acl: &Acl, p: *mut c_void) -> CallResult<()> {
        let f = sym!(acl, aclrtFree)?;
        // SAFETY: the caller guarantees `p`.
        check(acl, "aclrtFree", unsafe { f(p) })
    }

    /// `aclrtMallocHost`: page-locked host memory.
    pub(crate) fn malloc_host(acl: &Acl, size: usize) -> CallResult<*mut c_void> {
        let f = sym!(acl, aclrtMallocHost)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer.
        check(acl, "aclrtMallocHost", unsafe { f(&mut p, size) })?;
        Ok(p)
    }

    /// `aclrtFreeHost`.
    ///
    /// # Safety
    /// `p` came from `aclrtMallocHost` of `acl`, is not freed yet and nothing uses it.
    pub(crate) unsafe fn free_host(acl: &Acl, p: *mut c_void) -> CallResult<()> {
        let f = sym!(acl, aclrtFreeHost)?;
        // SAFETY: the caller guarantees `p`.
        check(acl, "aclrtFreeHost", unsafe { f(p) })
    }

    /// `aclrtMemcpy(dst, count, src, count, kind)` (synchronous).
    ///
    /// # Safety
    /// Host ends valid for `count` bytes; device ends inside allocated device memory.
    pub(crate) unsafe fn memcpy(
        acl: &Acl,
        dst: *mut c_void,
        src: *const c_void,
        count: usize,
        kind: aclrtMemcpyKind,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtMemcpy)?;
        // SAFETY: the caller guarantees both ends.
        check(acl, "aclrtMemcpy", unsafe { f(dst, count, src, count, kind) })
    }

    /// `aclrtMemcpyAsync(dst, count, src, count, kind, s)`.
    ///
    /// # Safety
    /// As [`memcpy`], until the task completes; `s` is a live stream of `acl`.
    pub(crate) unsafe fn memcpy_async(
        acl: &Acl,
        dst: *mut c_void,
        src: *const c_void,
        count: usize,
        kind: aclrtMemcpyKind,
        s: aclrtStream,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtMemcpyAsync)?;
        // SAFETY: the caller guarantees both ends and the stream.
        check(acl, "aclrtMemcpyAsync", unsafe { f(dst, count, src, count, kind, s) })
    }

    /// `aclrtMemset(p, count, value, count)` (synchronous).
    ///
    /// # Safety
    /// `p..p+count` is allocated device memory.
    pub(crate) unsafe fn memset(
        acl: &Acl,
        p: *mut c_void,
        value: i32,
        count: usize,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtMemset)?;
        // SAFETY: the caller guarantees the range.
        check(acl, "aclrtMemset", unsafe { f(p, count, value, count) })
    }

    /// `aclrtMemsetAsync(p, count, value, count, s)`.
    ///
    /// # Safety
    /// As [`memset`]; `s` is a live stream of `acl`.
    pub(crate) unsafe fn memset_async(
        acl: &Acl,
        p: *mut c_void,
        value: i32,
        count: usize,
        s: aclrtStream,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtMemsetAsync)?;
        // SAFETY: the caller guarantees the range and the stream.
        check(acl, "aclrtMemsetAsync", unsafe { f(p, count, value, count, s) })
    }
}

/// Virtual memory management (reserve / physical / map).
pub(crate) mod vmm {
    use super::*;

    /// `aclrtMemGetAllocationGranularity(prop, option)`.
    pub(crate) fn granularity(
        acl: &Acl,
        prop: &aclrtPhysicalMemProp,
        option: aclrtMemGranularityOptions,
    ) -> CallResult<usize> {
        let f = sym!(acl, aclrtMemGetAllocationGranularity)?;
        let mut prop = *prop;
        let mut g = 0usize;
        // SAFETY: `prop` and `g` are valid pointers for the call (the C signature takes a
        // non-const prop; we pass a copy).
        check(acl, "aclrtMemGetAllocationGranularity", unsafe { f(&mut prop, option, &mut g) })?;
        Ok(g)
    }

    /// `aclrtReserveMemAddress(size, alignment 0, no expected address, flags 0)`.
    pub(crate) fn reserve(acl: &Acl, size: usize) -> CallResult<*mut c_void> {
        let f = sym!(acl, aclrtReserveMemAddress)?;
        let mut va: *mut c_void = std::ptr::null_mut();
        // SAFETY: `va` is a valid out-pointer; a null expected address is a "no preference" hint.
        check(acl, "aclrtReserveMemAddress", unsafe {
            f(&mut va, size, 0, std::ptr::null_mut(), 0)
        })?;
        Ok(va)
    }

    /// `aclrtReleaseMemAddress`.
    ///
    /// # Safety
    /// `va` is the start of a reservation of `acl` with nothing mapped in it.
    pub(crate) unsafe fn release(acl: &Acl, va: *mut c_void) -> CallResult<()> {
        let f = sym!(acl, aclrtReleaseMemAddress)?;
        // SAFETY: the caller guarantees `va`.
        check(acl, "aclrtReleaseMemAddress", unsafe { f(va) })
    }

    /// `aclrtMallocPhysical(size, prop, flags 0)`.
    pub(crate) fn malloc_physical(
        acl: &Acl,
        size: usize,
        prop: &aclrtPhysicalMemProp,
    ) -> CallResult<aclrtDrvMemHandle> {
        let f = sym!(acl, aclrtMallocPhysical)?;
        let mut h: aclrtDrvMemHandle = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer and `prop` a valid property struct.
        check(acl, "aclrtMallocPhysical", unsafe { f(&mut h, size, prop, 0) })?;
        Ok(h)
    }

    /// `aclrtFreePhysical`.
    ///
    /// # Safety
    /// `h` is a live, unmapped physical allocation of `acl`.
    pub(crate) unsafe fn free_physical(acl: &Acl, h: aclrtDrvMemHandle) -> CallResult<()> {
        let f = sym!(acl, aclrtFreePhysical)?;
        // SAFETY: the caller guarantees `h`.
        check(acl, "aclrtFreePhysical", unsafe { f(h) })
    }

    /// `aclrtMapMem(va, size, offset 0, h, flags 0)`.
    ///
    /// # Safety
    /// `va..va+size` lies in a reservation and is unmapped; `h` is a live, unmapped physical
    /// allocation of `size` bytes.
    pub(crate) unsafe fn map(
        acl: &Acl,
        va: *mut c_void,
        size: usize,
        h: aclrtDrvMemHandle,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtMapMem)?;
        // SAFETY: the caller guarantees the range and the handle.
        check(acl, "aclrtMapMem", unsafe { f(va, size, 0, h, 0) })
    }

    /// `aclrtUnmapMem`.
    ///
    /// # Safety
    /// `va` is the start of a mapping of `acl` that no work in flight uses.
    pub(crate) unsafe fn unmap(acl: &Acl, va: *mut c_void) -> CallResult<()> {
        let f = sym!(acl, aclrtUnmapMem)?;
        // SAFETY: the caller guarantees `va`.
        check(acl, "aclrtUnmapMem", unsafe { f(va) })
    }
}

/// Physical memory shared between processes.
pub(crate) mod ipc {
    use super::*;

    /// `aclrtMemExportToShareableHandle(h, NONE, flags)`: the shareable handle.
    ///
    /// # Safety
    /// `h` is a live physical allocation of `acl`.
    pub(crate) unsafe fn export(acl: &Acl, h: aclrtDrvMemHandle, flags: u64) -> CallResult<u64> {
        let f = sym!(acl, aclrtMemExportToShareableHandle)?;
        let mut shareable = 0u64;
        let none = ascend_sys::aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE;
        // SAFETY: the caller guarantees `h`; `shareable` is a valid out-pointer.
        check(acl, "aclrtMemExportToShareableHandle", unsafe {
            f(h, none, flags, &mut shareable)
        })?;
        Ok(shareable)
    }

    /// `aclrtMemSetPidToShareableHandle(shareable, pids)`.
    pub(crate) fn set_pids(acl: &Acl, shareable: u64, pids: &[i32]) -> CallResult<()> {
        let f = sym!(acl, aclrtMemSetPidToShareableHandle)?;
        let mut pids = pids.to_vec();
        // SAFETY: `pids` is valid for reads of its length (the C signature takes a non-const
        // pointer; we pass a copy).
        check(acl, "aclrtMemSetPidToShareableHandle", unsafe {
            f(shareable, pids.as_mut_ptr(), pids.len())
        })
    }

    /// `aclrtMemImportFromShareableHandle(shareable, device)`: a physical handle of `device`.
    pub(crate) fn import(acl: &Acl, shareable: u64, device: i32) -> CallResult<aclrtDrvMemHandle> {
        let f = sym!(acl, aclrtMemImportFromShareableHandle)?;
        let mut h: aclrtDrvMemHandle = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer.
        check(acl, "aclrtMemImportFromShareableHandle", unsafe { f(shareable, device, &mut h) })?;
        Ok(h)
    }

    /// `aclrtDeviceGetBareTgid`: this process's id for whitelists.
    pub(crate) fn bare_tgid(acl: &Acl) -> CallResult<i32> {
        let f = sym!(acl, aclrtDeviceGetBareTgid)?;
        let mut pid = 0i32;
        // SAFETY: `pid` is a valid out-pointer.
        check(acl, "aclrtDeviceGetBareTgid", unsafe { f(&mut pid) })?;
        Ok(pid)
    }
}

/// CANN's stream-ordered memory pool (`aclrtMemPool*`).
pub(crate) mod pool {
    use super::*;

    /// `aclrtMemPoolCreate`.
    pub(crate) fn create(acl: &Acl, props: &aclrtMemPoolProps) -> CallResult<aclrtMemPool> {
        let f = sym!(acl, aclrtMemPoolCreate)?;
        let mut p: aclrtMemPool = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer and `props` a valid property struct.
        check(acl, "aclrtMemPoolCreate", unsafe { f(&mut p, props) })?;
        Ok(p)
    }

    /// `aclrtMemPoolDestroy`.
    ///
    /// # Safety
    /// `p` is a live pool of `acl`, not used after a successful call.
    pub(crate) unsafe fn destroy(acl: &Acl, p: aclrtMemPool) -> CallResult<()> {
        let f = sym!(acl, aclrtMemPoolDestroy)?;
        // SAFETY: the caller guarantees `p`.
        check(acl, "aclrtMemPoolDestroy", unsafe { f(p) })
    }

    /// `aclrtMemPoolSetAttr(p, attr, value)`.
    ///
    /// # Safety
    /// `p` is a live pool of `acl`; `value` points to a readable value of the attribute's type.
    pub(crate) unsafe fn set_attr(
        acl: &Acl,
        p: aclrtMemPool,
        attr: aclrtMemPoolAttr,
        value: *mut c_void,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtMemPoolSetAttr)?;
        // SAFETY: the caller guarantees `p` and `value`.
        check(acl, "aclrtMemPoolSetAttr", unsafe { f(p, attr, value) })
    }

    /// `aclrtMemPoolGetAttr(p, attr, value)`.
    ///
    /// # Safety
    /// `p` is a live pool of `acl`; `value` points to writable storage of the attribute's type.
    pub(crate) unsafe fn get_attr(
        acl: &Acl,
        p: aclrtMemPool,
        attr: aclrtMemPoolAttr,
        value: *mut c_void,
    ) -> CallResult<()> {
        let f = sym!(acl, aclrtMemPoolGetAttr)?;
        // SAFETY: the caller guarantees `p` and `value`.
        check(acl, "aclrtMemPoolGetAttr", unsafe { f(p, attr, value) })
    }

    /// `aclrtMemPoolMallocAsync(size, p, s)`.
    ///
    /// # Safety
    /// `p` is a live pool and `s` a live stream of `acl`.
    pub(crate) unsafe fn malloc_async(
        acl: &Acl,
        size: usize,
        p: aclrtMemPool,
        s: aclrtStream,
    ) -> CallResult<*mut c_void> {
        let f = sym!(acl, aclrtMemPoolMallocAsync)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller guarantees `p` and `s`; `ptr` is a valid out-pointer.
        check(acl, "aclrtMemPoolMallocAsync", unsafe { f(&mut ptr, size, p, s) })?;
        Ok(ptr)
    }

    /// `aclrtMemPoolFreeAsync(ptr, s)`.
    ///
    /// # Safety
    /// `ptr` came from `aclrtMemPoolMallocAsync` and is not freed yet; `s` is a live stream.
    pub(crate) unsafe fn free_async(acl: &Acl, ptr: *mut c_void, s: aclrtStream) -> CallResult<()> {
        let f = sym!(acl, aclrtMemPoolFreeAsync)?;
        // SAFETY: the caller guarantees `ptr` and `s`.
        check(acl, "aclrtMemPoolFreeAsync", unsafe { f(ptr, s) })
    }

    /// `aclrtMemPoolTrimTo(p, bytes)`.
    ///
    /// # Safety
    /// `p` is a live pool of `acl`.
    pub(crate) unsafe fn trim_to(acl: &Acl, p: aclrtMemPool, bytes: usize) -> CallResult<()> {
        let f = sym!(acl, aclrtMemPoolTrimTo)?;
        // SAFETY: the caller guarantees `p`.
        check(acl, "aclrtMemPoolTrimTo", unsafe { f(p, bytes) })
    }
}

/// Model runtime instances built by stream capture (`aclmdlRI*`).
pub(crate) mod mdl {
    use super::*;

    /// `aclmdlRICaptureBegin(s, mode)`.
    ///
    /// # Safety
    /// `s` is a live stream of `acl`.
    pub(crate) unsafe fn capture_begin(
        acl: &Acl,
        s: aclrtStream,
        mode: aclmdlRICaptureMode,
    ) -> CallResult<()> {
        let f = sym!(acl, aclmdlRICaptureBegin)?;
        // SAFETY: the caller guarantees `s`.
        check(acl, "aclmdlRICaptureBegin", unsafe { f(s, mode) })
    }

    /// `aclmdlRICaptureGetInfo(s)`: the status and the model the stream captures into.
    ///
    /// # Safety
    /// `s` is a live stream of `acl`.
    pub(crate) unsafe fn capture_get_info(
        acl: &Acl,
        s: aclrtStream,
    ) -> CallResult<(aclmdlRICaptureStatus, aclmdlRI)> {
        let f = sym!(acl, aclmdlRICaptureGetInfo)?;
        let mut status = aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_NONE;
        let mut model: aclmdlRI = std::ptr::null_mut();
        // SAFETY: the caller guarantees `s`; both out-pointers are valid.
        check(acl, "aclmdlRICaptureGetInfo", unsafe { f(s, &mut status, &mut model) })?;
        Ok((status, model))
    }

    /// `aclmdlRICaptureEnd(s)`: the captured model.
    ///
    /// # Safety
    /// `s` is a live stream of `acl`.
    pub(crate) unsafe fn capture_end(acl: &Acl, s: aclrtStream) -> CallResult<aclmdlRI> {
        let f = sym!(acl, aclmdlRICaptureEnd)?;
        let mut model: aclmdlRI = std::ptr::null_mut();
        // SAFETY: the caller guarantees `s`; `model` is a valid out-pointer.
        check(acl, "aclmdlRICaptureEnd", unsafe { f(s, &mut model) })?;
        Ok(model)
    }

    /// `aclmdlRICaptureThreadExchangeMode`: sets the calling thread's mode, returns the old one.
    pub(crate) fn exchange_mode(
        acl: &Acl,
        mode: aclmdlRICaptureMode,
    ) -> CallResult<aclmdlRICaptureMode> {
        let f = sym!(acl, aclmdlRICaptureThreadExchangeMode)?;
        let mut m = mode;
        // SAFETY: `m` is valid for a read and a write.
        check(acl, "aclmdlRICaptureThreadExchangeMode", unsafe { f(&mut m) })?;
        Ok(m)
    }

    /// `aclmdlRIExecuteAsync(m, s)`.
    ///
    /// # Safety
    /// `m` is a live model and `s` a live stream of `acl`.
    pub(crate) unsafe fn execute_async(acl: &Acl, m: aclmdlRI, s: aclrtStream) -> CallResult<()> {
        let f = sym!(acl, aclmdlRIExecuteAsync)?;
        // SAFETY: the caller guarantees `m` and `s`.
        check(acl, "aclmdlRIExecuteAsync", unsafe { f(m, s) })
    }

    /// `aclmdlRIDestroy(m)`.
    ///
    /// # Safety
    /// `m` is a live model of `acl` with no execution in flight, not used afterwards.
    pub(crate) unsafe fn destroy(acl: &Acl, m: aclmdlRI) -> CallResult<()> {
        let f = sym!(acl, aclmdlRIDestroy)?;
        // SAFETY: the caller guarantees `m`.
        check(acl, "aclmdlRIDestroy", unsafe { f(m) })
    }
}
