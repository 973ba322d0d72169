//! Device and host memory, copies, memset and memory information.

use std::alloc::Layout;
use std::ffi::c_void;

use ascend_sys::{aclError, aclrtMemAttr, aclrtMemMallocPolicy, aclrtMemcpyKind, aclrtStream};
use soma_core::hal::{DevicePtr, MemRef};

use crate::error::{guard, AclErr, AclResult};
use crate::runtime::{out_ptr, rt, write_out, DevEntry, MallocRec, Runtime, StreamObj};

/// Alignment of `aclrtMallocHost` blocks (a host page).
const HOST_ALIGN: usize = 4096;

fn device_ptr(p: u64, what: &str) -> AclResult<DevicePtr> {
    DevicePtr::new(p).ok_or_else(|| AclErr::param(format!("{what} is null")))
}

/// Allocates `size` bytes of device memory on the current device (rounded up to the 2 MiB
/// granularity by the device). `policy` must be one of the three `aclrtMemMallocPolicy`
/// values.
///
/// # Safety
/// `devPtr` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(
    devPtr: *mut *mut c_void,
    size: usize,
    policy: aclrtMemMallocPolicy,
) -> aclError {
    guard("aclrtMalloc", || {
        let out = out_ptr(devPtr, "devPtr")?;
        if size == 0 {
            return Err(AclErr::param("size is 0"));
        }
        if policy.0 > aclrtMemMallocPolicy::ACL_MEM_MALLOC_NORMAL_ONLY.0 {
            return Err(AclErr::param(format!("unknown aclrtMemMallocPolicy {}", policy.0)));
        }
        let rt = rt()?;
        let dev = rt.current();
        let g = dev.granularity();
        let rounded = (size as u64)
            .checked_next_multiple_of(g)
            .ok_or_else(|| AclErr::param(format!("size {size} overflows when rounded to {g}")))?;
        if rounded > dev.total_rounded() {
            return Err(AclErr::oom(format!(
                "size {size} exceeds the memory of device {} ({} bytes)",
                dev.index,
                dev.total_rounded()
            )));
        }
        let p = dev.hal().malloc(size as u64)?;
        {
            let mut mem = rt.mem.lock();
            mem.mallocs.insert(p.addr(), MallocRec { dev: dev.index });
            mem.note_device_range(dev.index, p.addr(), rounded);
        }
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, p.addr() as *mut c_void) };
        Ok(())
    })
}

/// Frees memory from `aclrtMalloc`, after the work of its device has completed (the free
/// waits for the device's streams, so queued work never sees the memory vanish).
#[no_mangle]
pub extern "C" fn aclrtFree(devPtr: *mut c_void) -> aclError {
    guard("aclrtFree", || {
        let addr = device_ptr(devPtr as u64, "devPtr")?;
        let rt = rt()?;
        let rec = rt.mem.lock().mallocs.remove(&addr.addr()).ok_or_else(|| {
            AclErr::param(format!(
                "{addr} was not returned by aclrtMalloc, or was already freed (pool memory is \
                 freed with aclrtMemPoolFreeAsync)"
            ))
        })?;
        let dev = rt.dev(rec.dev);
        let _ = dev.hal().synchronize();
        if let Err(e) = dev.hal().free(addr) {
            rt.mem.lock().mallocs.insert(addr.addr(), rec);
            return Err(e.into());
        }
        Ok(())
    })
}

/// Allocates `size` bytes of page-aligned host memory.
///
/// # Safety
/// `hostPtr` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocHost(hostPtr: *mut *mut c_void, size: usize) -> aclError {
    guard("aclrtMallocHost", || {
        let out = out_ptr(hostPtr, "hostPtr")?;
        if size == 0 {
            return Err(AclErr::param("size is 0"));
        }
        let layout = Layout::from_size_align(size, HOST_ALIGN)
            .map_err(|_| AclErr::param(format!("size {size} is too large")))?;
        let rt = rt()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(AclErr::new(
                ascend_sys::AclError::ERROR_BAD_ALLOC,
                format!("host allocation of {size} bytes failed"),
            ));
        }
        rt.host.lock().insert(p as usize, size);
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, p.cast::<c_void>()) };
        Ok(())
    })
}

/// Frees memory from `aclrtMallocHost`; any other pointer is an error.
#[no_mangle]
pub extern "C" fn aclrtFreeHost(hostPtr: *mut c_void) -> aclError {
    guard("aclrtFreeHost", || {
        if hostPtr.is_null() {
            return Err(AclErr::param("hostPtr is null"));
        }
        let size = rt()?.host.lock().remove(&(hostPtr as usize)).ok_or_else(|| {
            AclErr::param(format!(
                "{hostPtr:p} was not returned by aclrtMallocHost, or was already freed"
            ))
        })?;
        // The layout was valid at allocation.
        let layout = Layout::from_size_align(size, HOST_ALIGN)
            .map_err(|_| AclErr::param("corrupt host allocation record"))?;
        // SAFETY: `hostPtr` was allocated by `aclrtMallocHost` with this layout and was just
        // removed from the registry, so it is freed exactly once.
        unsafe { std::alloc::dealloc(hostPtr.cast(), layout) };
        Ok(())
    })
}

/// Where the two ends of a copy are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    H2H,
    H2D,
    D2H,
    D2D,
}

/// A validated copy: its kind and the devices of its device ends.
struct Copy {
    kind: Kind,
    dst: Option<u32>,
    src: Option<u32>,
}

impl Copy {
    /// The device that runs a synchronous copy: the device of its device end(s), or, between
    /// two devices, the current device (which needs access to each end it does not own).
    fn runner(&self, rt: &'static Runtime) -> Option<&'static DevEntry> {
        match (self.dst, self.src) {
            (Some(a), Some(b)) if a != b => Some(rt.current()),
            (Some(d), _) | (None, Some(d)) => Some(rt.dev(d)),
            (None, None) => None,
        }
    }
}

fn kind_name(kind: aclrtMemcpyKind) -> &'static str {
    match kind.0 {
        0 => "ACL_MEMCPY_HOST_TO_HOST",
        1 => "ACL_MEMCPY_HOST_TO_DEVICE",
        2 => "ACL_MEMCPY_DEVICE_TO_HOST",
        3 => "ACL_MEMCPY_DEVICE_TO_DEVICE",
        _ => "ACL_MEMCPY_DEFAULT",
    }
}

/// Checks the arguments shared by `aclrtMemcpy` and `aclrtMemcpyAsync`; `None` for a copy of
/// 0 bytes (nothing to do).
fn check_copy(
    rt: &'static Runtime,
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
) -> AclResult<Option<Copy>> {
    if dst.is_null() {
        return Err(AclErr::param("dst is null"));
    }
    if src.is_null() {
        return Err(AclErr::param("src is null"));
    }
    if dest_max < count {
        return Err(AclErr::param(format!("count {count} exceeds destMax {dest_max}")));
    }
    if kind.0 > aclrtMemcpyKind::ACL_MEMCPY_DEFAULT.0 {
        return Err(AclErr::param(format!("unknown aclrtMemcpyKind {}", kind.0)));
    }
    if count == 0 {
        return Ok(None);
    }
    if isize::try_from(count).is_err() {
        return Err(AclErr::param(format!("count {count} exceeds the largest object size")));
    }
    let (dloc, sloc) = {
        let mem = rt.mem.lock();
        (mem.device_of(dst as u64), mem.device_of(src as u64))
    };
    let inferred = match (sloc, dloc) {
        (None, None) => Kind::H2H,
        (None, Some(_)) => Kind::H2D,
        (Some(_), None) => Kind::D2H,
        (Some(_), Some(_)) => Kind::D2D,
    };
    let asked = match kind.0 {
        0 => Kind::H2H,
        1 => Kind::H2D,
        2 => Kind::D2H,
        3 => Kind::D2D,
        _ => inferred,
    };
    if asked != inferred {
        let at = |l: Option<u32>| match l {
            Some(d) => format!("device memory of device {d}"),
            None => "host memory (not device memory known to this runtime)".into(),
        };
        return Err(AclErr::param(format!(
            "kind {} does not match the pointers: dst {dst:p} is {}, src {src:p} is {}",
            kind_name(kind),
            at(dloc),
            at(sloc)
        )));
    }
    Ok(Some(Copy { kind: asked, dst: dloc, src: sloc }))
}

fn mem_ref(p: *const c_void, device: bool) -> MemRef {
    if device {
        // Non-null: checked by `check_copy`.
        MemRef::Device(DevicePtr::new(p as u64).unwrap_or_else(|| unreachable!()))
    } else {
        MemRef::Host(p.cast_mut().cast())
    }
}

/// Synchronous copy of `count` bytes; `kind` must match the pointers (device memory is what
/// this runtime handed out); `ACL_MEMCPY_DEFAULT` infers the direction from them.
///
/// # Safety
/// Host ends are valid for `count` bytes (reads of `src`, writes of `dst`).
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    destMax: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
) -> aclError {
    guard("aclrtMemcpy", || {
        let rt = rt()?;
        let Some(c) = check_copy(rt, dst, destMax, src, count, kind)? else { return Ok(()) };
        match (c.kind, c.runner(rt)) {
            (Kind::H2H, _) | (_, None) => {
                rt.current().check_unsafe_call("aclrtMemcpy")?;
                // SAFETY: the caller guarantees both host ranges are valid; `copy` allows
                // overlap.
                unsafe { std::ptr::copy(src.cast::<u8>(), dst.cast::<u8>(), count) };
                Ok(())
            }
            (k, Some(dev)) => {
                check_access(rt, dev, &[c.dst, c.src])?;
                let d_ref = mem_ref(dst, matches!(k, Kind::H2D | Kind::D2D));
                let s_ref = mem_ref(src, matches!(k, Kind::D2H | Kind::D2D));
                // SAFETY: the caller guarantees the host end is valid for `count` bytes for
                // the duration of this synchronous call; device ends are checked by the device.
                Ok(unsafe { dev.hal().copy_sync(d_ref, s_ref, count as u64) }?)
            }
        }
    })
}

/// Whether `[addr, addr + count)` lies inside one live `aclrtMallocHost` block.
fn in_host_block(rt: &Runtime, addr: usize, count: usize) -> bool {
    rt.host
        .lock()
        .range(..=addr)
        .next_back()
        .is_some_and(|(&start, &len)| addr.checked_add(count).is_some_and(|end| end <= start + len))
}

/// A memset of `aclrtMallocHost` memory run on a stream's worker (at every launch, when
/// captured).
struct HostMemset {
    dst: *mut u8,
    value: u8,
    len: usize,
}

// SAFETY: the address is only used by the memset task; the C caller keeps the block alive and
// untouched until it completes (the contract of every asynchronous call on host memory; until
// the model is destroyed when the memset was captured).
unsafe impl Send for HostMemset {}
// SAFETY: as above; the task only writes through the address when it runs, and the runs of a
// captured task are ordered (each launch after the previous one on its stream, or the caller
// keeps concurrent launches apart, as for any memory a model writes).
unsafe impl Sync for HostMemset {}

impl HostMemset {
    fn run(&self) {
        // SAFETY: see the `Send` impl: the range lay inside a live aclrtMallocHost block when
        // the task was enqueued, and stays valid until the task completes.
        unsafe { std::ptr::write_bytes(self.dst, self.value, self.len) }
    }
}

/// A host-to-host copy run on a stream's worker (at every launch, when captured).
struct HostCopy {
    dst: *mut u8,
    src: *const u8,
    len: usize,
}

// SAFETY: the addresses are only used by the copy task; the C caller guarantees they stay
// valid until it completes (the documented contract of aclrtMemcpyAsync; until the model is
// destroyed when the copy was captured).
unsafe impl Send for HostCopy {}
// SAFETY: as for `HostMemset`: the task only uses the addresses when it runs.
unsafe impl Sync for HostCopy {}

impl HostCopy {
    fn run(&self) {
        // SAFETY: see the `Send` impl: both ranges are valid for `len` bytes until the task
        // completes.
        unsafe { std::ptr::copy(self.src, self.dst, self.len) }
    }
}

/// Checks that `dev` may use the memory of every device in `ends`: its own, or a peer's it
/// has access to (`aclrtDeviceEnablePeerAccess`).
fn check_access(rt: &'static Runtime, dev: &DevEntry, ends: &[Option<u32>]) -> AclResult {
    for &d in ends.iter().flatten() {
        if !dev.device.has_peer_access(&rt.dev(d).device) {
            return Err(AclErr::param(format!(
                "the memory belongs to device {d} and the work runs on device {}, without peer \
                 access from device {} to device {d} (aclrtDeviceEnablePeerAccess)",
                dev.index, dev.index
            )));
        }
    }
    Ok(())
}

/// [`check_access`] for work on stream `s`.
fn check_stream_access(rt: &'static Runtime, s: &StreamObj, ends: &[Option<u32>]) -> AclResult {
    check_access(rt, rt.dev(s.dev), ends)
}

/// The host ends of an asynchronous copy: on a capturing stream they must be host memory from
/// `aclrtMallocHost` (the copy runs again at every launch); elsewhere pageable host memory
/// makes the copy an unsafe call, which the active captures' modes may forbid.
fn check_host_ends(
    rt: &'static Runtime,
    s: &StreamObj,
    c: &Copy,
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
) -> AclResult {
    let host_ends = match c.kind {
        Kind::H2H => [Some(dst as usize), Some(src as usize)],
        Kind::H2D => [Some(src as usize), None],
        Kind::D2H => [Some(dst as usize), None],
        Kind::D2D => return Ok(()),
    };
    let pageable = host_ends.iter().flatten().any(|&a| !in_host_block(rt, a, count));
    if !pageable {
        return Ok(());
    }
    if s.stream.capture_info()?.capture.is_some() {
        return Err(AclErr::new(
            ascend_sys::AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT,
            "a captured copy's host memory must come from aclrtMallocHost",
        ));
    }
    rt.dev(s.dev).check_unsafe_call("aclrtMemcpyAsync of pageable host memory")
}

/// Stream-ordered copy of `count` bytes on `stream` (null: the default stream).
///
/// # Safety
/// Host ends stay valid (and, for `dst`, untouched) until the copy completes on the stream.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    destMax: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
    stream: aclrtStream,
) -> aclError {
    guard("aclrtMemcpyAsync", || {
        let rt = rt()?;
        let s = rt.stream(stream)?;
        let Some(c) = check_copy(rt, dst, destMax, src, count, kind)? else { return Ok(()) };
        check_stream_access(rt, &s, &[c.dst, c.src])?;
        check_host_ends(rt, &s, &c, dst, src, count)?;
        let hal = s.stream.hal();
        match c.kind {
            Kind::H2H => {
                let task = HostCopy { dst: dst.cast(), src: src.cast(), len: count };
                Ok(s.stream.host_fn_replayable(move || task.run())?)
            }
            Kind::D2D => {
                let (MemRef::Device(d), MemRef::Device(sr)) =
                    (mem_ref(dst, true), mem_ref(src, true))
                else {
                    unreachable!()
                };
                Ok(hal.copy_d2d(d, sr, count as u64)?)
            }
            k => {
                let d_ref = mem_ref(dst, k == Kind::H2D);
                let s_ref = mem_ref(src, k == Kind::D2H);
                // SAFETY: the caller guarantees the host end stays valid until the copy
                // completes on the stream (as CANN documents).
                Ok(unsafe { hal.copy_async(d_ref, s_ref, count as u64) }?)
            }
        }
    })
}

/// Checks memset arguments; `None` for 0 bytes.
fn check_memset(dev_ptr: *mut c_void, max_count: usize, count: usize) -> AclResult<Option<()>> {
    if dev_ptr.is_null() {
        return Err(AclErr::param("devPtr is null"));
    }
    if max_count < count {
        return Err(AclErr::param(format!("count {count} exceeds maxCount {max_count}")));
    }
    Ok((count > 0).then_some(()))
}

/// Sets `count` bytes at `devPtr` to `(unsigned char)value`, synchronously. Device memory,
/// or host memory from `aclrtMallocHost`.
#[no_mangle]
pub extern "C" fn aclrtMemset(
    devPtr: *mut c_void,
    maxCount: usize,
    value: i32,
    count: usize,
) -> aclError {
    guard("aclrtMemset", || {
        if check_memset(devPtr, maxCount, count)?.is_none() {
            return Ok(());
        }
        let rt = rt()?;
        let addr = devPtr as usize;
        if in_host_block(rt, addr, count) {
            // Device memsets check themselves in the device; this one never reaches it.
            rt.current().check_unsafe_call("aclrtMemset")?;
            // SAFETY: the range lies inside a live aclrtMallocHost block.
            unsafe { std::ptr::write_bytes(devPtr.cast::<u8>(), value as u8, count) };
            return Ok(());
        }
        let dev = rt.mem.lock().device_of(addr as u64).ok_or_else(|| {
            AclErr::param(format!(
                "{devPtr:p} is neither device memory nor host memory from aclrtMallocHost"
            ))
        })?;
        let p = device_ptr(addr as u64, "devPtr")?;
        Ok(rt.dev(dev).hal().memset_sync(p, value as u8, count as u64)?)
    })
}

/// Stream-ordered memset on `stream` (null: the default stream) of device memory, or of host
/// memory from `aclrtMallocHost` (a task on the stream's worker, as CANN accepts both).
#[no_mangle]
pub extern "C" fn aclrtMemsetAsync(
    devPtr: *mut c_void,
    maxCount: usize,
    value: i32,
    count: usize,
    stream: aclrtStream,
) -> aclError {
    guard("aclrtMemsetAsync", || {
        let rt = rt()?;
        let s = rt.stream(stream)?;
        if check_memset(devPtr, maxCount, count)?.is_none() {
            return Ok(());
        }
        if in_host_block(rt, devPtr as usize, count) {
            let task = HostMemset { dst: devPtr.cast(), value: value as u8, len: count };
            return Ok(s.stream.host_fn_replayable(move || task.run())?);
        }
        let dev = rt.mem.lock().device_of(devPtr as u64).ok_or_else(|| {
            AclErr::param(format!(
                "{devPtr:p} is neither device memory nor host memory from aclrtMallocHost"
            ))
        })?;
        check_stream_access(rt, &s, &[Some(dev)])?;
        let p = device_ptr(devPtr as u64, "devPtr")?;
        Ok(s.stream.hal().memset(p, value as u8, count as u64)?)
    })
}

/// Free and total memory of the current device. Every `aclrtMemAttr` of the subset reports
/// the device's one memory (the software NPU has no separate DDR / huge-page pools).
///
/// # Safety
/// `free` and `total` are null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetMemInfo(
    attr: aclrtMemAttr,
    free: *mut usize,
    total: *mut usize,
) -> aclError {
    guard("aclrtGetMemInfo", || {
        let free_out = out_ptr(free, "free")?;
        let total_out = out_ptr(total, "total")?;
        if attr.0 > aclrtMemAttr::ACL_HBM_MEM_NORMAL.0 {
            return Err(AclErr::param(format!("unknown aclrtMemAttr {}", attr.0)));
        }
        let info = rt()?.current().device.mem_info()?;
        // SAFETY: checked non-null; the caller guarantees both are writable.
        unsafe {
            write_out(free_out, info.free as usize);
            write_out(total_out, info.total as usize);
        }
        Ok(())
    })
}
