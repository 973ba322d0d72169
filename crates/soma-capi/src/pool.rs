//! The stream-ordered pool API (`aclrtMemPool*`), served by the soma-core engine.

use std::ffi::c_void;
use std::sync::Arc;

use ascend_sys::{
    aclError, aclrtMemAllocationType, aclrtMemHandleType, aclrtMemLocationType, aclrtMemPool,
    aclrtMemPoolAttr, aclrtMemPoolProps, aclrtStream,
};
use soma_core::attr;
use soma_core::hal::DevicePtr;
use soma_core::MemPool;

use crate::error::{guard, AclErr, AclResult};
use crate::runtime::{out_ptr, rt, write_out, PoolObj, PoolState, StreamObj};

/// Creates a pool on `poolProps->location.id` with CANN's defaults (every reuse switch off,
/// release threshold 0).
///
/// Rejected with `ACL_ERROR_INVALID_PARAM`: a null argument; `allocType` other than
/// `ACL_MEM_ALLOCATION_TYPE_PINNED`; `location.type` other than `ACL_MEM_LOCATION_TYPE_DEVICE`;
/// a `location.id` that is not a device; a `handleType` other than NONE / POSIX; any non-zero
/// byte in `reserved`; a `maxSize` that overflows when rounded up to the granularity or is
/// above the device's memory (`0` = the device's memory rounded down). Off Atlas A2:
/// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`.
///
/// # Safety
/// `memPool` is null or valid for a write; `poolProps` is null or valid for a read.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemPoolCreate(
    memPool: *mut aclrtMemPool,
    poolProps: *const aclrtMemPoolProps,
) -> aclError {
    guard("aclrtMemPoolCreate", || {
        let out = out_ptr(memPool, "memPool")?;
        if poolProps.is_null() {
            return Err(AclErr::param("poolProps is null"));
        }
        // SAFETY: non-null; the caller guarantees it is readable (unaligned reads are fine).
        let props = unsafe { poolProps.read_unaligned() };
        if props.allocType != aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED {
            return Err(AclErr::param(format!(
                "poolProps.allocType {} is not ACL_MEM_ALLOCATION_TYPE_PINNED",
                props.allocType.0
            )));
        }
        if props.location.type_ != aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE {
            return Err(AclErr::param(format!(
                "poolProps.location.type {} is not ACL_MEM_LOCATION_TYPE_DEVICE",
                props.location.type_.0
            )));
        }
        if let Some(i) = props.reserved.iter().position(|&b| b != 0) {
            return Err(AclErr::param(format!(
                "poolProps.reserved[{i}] is {:#x}; every reserved byte must be 0",
                props.reserved[i]
            )));
        }
        if props.handleType != aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE
            && props.handleType != aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_POSIX
        {
            return Err(AclErr::param(format!(
                "unknown poolProps.handleType {}",
                props.handleType.0
            )));
        }
        let rt = rt()?;
        let dev = rt.device(props.location.id.into())?;
        dev.require_pool_support()?;
        let g = dev.granularity();
        let total = dev.total_rounded();
        let max = if props.maxSize == 0 {
            total
        } else {
            (props.maxSize as u64).checked_next_multiple_of(g).ok_or_else(|| {
                AclErr::param(format!(
                    "poolProps.maxSize {} overflows when rounded up to the granularity {g}",
                    props.maxSize
                ))
            })?
        };
        if max > total {
            return Err(AclErr::param(format!(
                "poolProps.maxSize {} (rounded up to {max}) exceeds the memory of device {} \
                 ({total} bytes)",
                props.maxSize, dev.index
            )));
        }
        let pool = MemPool::builder()
            .max_size(max)
            .cann_defaults()
            .raw_pointers(true)
            .build(&dev.device)?;
        let h = rt.pools.insert(PoolObj {
            dev: dev.index,
            pool,
            state: parking_lot::Mutex::new(PoolState::default()),
        });
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// The pool behind `h`. Order of the checks, for every pool function: null arguments
/// (`ACL_ERROR_INVALID_PARAM`, as CANN's API layer checks them), then the product of the
/// current device (`ACL_ERROR_RT_FEATURE_NOT_SUPPORT`), then the handle.
fn pool_of(h: aclrtMemPool) -> AclResult<Arc<PoolObj>> {
    if h.is_null() {
        return Err(AclErr::param("memPool is null"));
    }
    let rt = rt()?;
    rt.current().require_pool_support()?;
    rt.pools.get(h)
}

/// Destroys a pool. A pool with live allocations (or calls in progress) is an error, and
/// stays usable; frees still pending on streams are waited for before its memory goes back.
#[no_mangle]
pub extern "C" fn aclrtMemPoolDestroy(memPool: aclrtMemPool) -> aclError {
    guard("aclrtMemPoolDestroy", || {
        let rt = rt()?;
        let p = pool_of(memPool)?;
        {
            let mut st = p.state.lock();
            if st.destroyed {
                return Err(AclErr::handle(format!("{memPool:p} is already being destroyed")));
            }
            if !st.live.is_empty() {
                let bytes: u64 = st.live.values().sum();
                return Err(AclErr::param(format!(
                    "the pool still has {} live allocation(s) ({bytes} bytes); free them with \
                     aclrtMemPoolFreeAsync first (destroying would pull the memory from under \
                     the application)",
                    st.live.len()
                )));
            }
            if st.in_progress != 0 {
                return Err(AclErr::param(format!(
                    "{} allocation(s) or free(s) of the pool are in progress on other threads",
                    st.in_progress
                )));
            }
            st.destroyed = true;
        }
        rt.pools.remove(memPool)?;
        // The last reference drops the pool without blocking: the device gives back the
        // memory of frees still pending on streams once they complete.
        drop(p);
        Ok(())
    })
}

/// Reads the `uint32_t` value of a reuse switch.
///
/// # Safety
/// `value` is valid for a read of a `u32` (alignment not required).
unsafe fn read_u32(value: *mut c_void) -> u32 {
    // SAFETY: guaranteed by the caller.
    unsafe { value.cast::<u32>().read_unaligned() }
}

/// Reads the `uint64_t` value of a size attribute.
///
/// # Safety
/// `value` is valid for a read of a `u64` (alignment not required).
unsafe fn read_u64(value: *mut c_void) -> u64 {
    // SAFETY: guaranteed by the caller.
    unsafe { value.cast::<u64>().read_unaligned() }
}

fn attr_name(a: aclrtMemPoolAttr) -> String {
    let name = match a.0 {
        0x1 => "ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES",
        0x2 => "ACL_RT_MEM_POOL_REUSE_ALLOW_OPPORTUNISTIC",
        0x3 => "ACL_RT_MEM_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES",
        0x4 => "ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD",
        0x5 => "ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT",
        0x6 => "ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH",
        0x7 => "ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT",
        0x8 => "ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH",
        _ => return format!("unknown attribute {:#x}", a.0),
    };
    name.into()
}

/// Sets an attribute; the last set wins. Reuse switches (0x1–0x3, `uint32_t`) take 0 or
/// non-zero (stored as 0 / 1); the release threshold (0x4, `uint64_t`) at most the pool's
/// size; the `*_HIGH` marks (0x6, 0x8, `uint64_t`) only 0, which resets them; the `*_CURRENT`
/// counters (0x5, 0x7) are read-only. Anything else is `ACL_ERROR_INVALID_PARAM`.
///
/// # Safety
/// `value` is null or points to the attribute's value type.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemPoolSetAttr(
    memPool: aclrtMemPool,
    attr: aclrtMemPoolAttr,
    value: *mut c_void,
) -> aclError {
    guard("aclrtMemPoolSetAttr", || {
        if value.is_null() {
            return Err(AclErr::param("value is null"));
        }
        let p = pool_of(memPool)?;
        let pool = &p.pool;
        match attr.0 {
            0x1..=0x3 => {
                // SAFETY: non-null; the C caller passes a `uint32_t` for the reuse switches.
                let on = unsafe { read_u32(value) } != 0;
                match attr.0 {
                    0x1 => pool.set::<attr::ReuseFollowEventDependencies>(on)?,
                    0x2 => pool.set::<attr::ReuseAllowOpportunistic>(on)?,
                    _ => pool.set::<attr::ReuseAllowInternalDependencies>(on)?,
                }
            }
            0x4 => {
                // SAFETY: non-null; the C caller passes a `uint64_t` for the threshold.
                let v = unsafe { read_u64(value) };
                if v > pool.max_size() {
                    return Err(AclErr::param(format!(
                        "release threshold {v} exceeds the pool's size {}",
                        pool.max_size()
                    )));
                }
                pool.set::<attr::ReleaseThreshold>(v)?
            }
            0x5 | 0x7 => {
                return Err(AclErr::param(format!("{} is read-only", attr_name(attr))));
            }
            0x6 | 0x8 => {
                // SAFETY: non-null; the C caller passes a `uint64_t` for the marks.
                let v = unsafe { read_u64(value) };
                if v != 0 {
                    return Err(AclErr::param(format!(
                        "{} can only be set to 0 (reset), not {v}",
                        attr_name(attr)
                    )));
                }
                if attr.0 == 0x6 {
                    pool.reset::<attr::ReservedMemHigh>()?
                } else {
                    pool.reset::<attr::UsedMemHigh>()?
                }
            }
            _ => return Err(AclErr::param(format!("{} of aclrtMemPoolAttr", attr_name(attr)))),
        }
        Ok(())
    })
}

/// Reads an attribute into `value` (`uint32_t` for 0x1–0x3, `uint64_t` for 0x4–0x8). An
/// attribute never set gives its default (switches 0, threshold 0).
///
/// # Safety
/// `value` is null or valid for a write of the attribute's value type.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemPoolGetAttr(
    memPool: aclrtMemPool,
    attr: aclrtMemPoolAttr,
    value: *mut c_void,
) -> aclError {
    guard("aclrtMemPoolGetAttr", || {
        if value.is_null() {
            return Err(AclErr::param("value is null"));
        }
        let p = pool_of(memPool)?;
        let pool = &p.pool;
        let flag = |b: bool| u32::from(b);
        let v32 = match attr.0 {
            0x1 => Some(flag(pool.get::<attr::ReuseFollowEventDependencies>()?)),
            0x2 => Some(flag(pool.get::<attr::ReuseAllowOpportunistic>()?)),
            0x3 => Some(flag(pool.get::<attr::ReuseAllowInternalDependencies>()?)),
            _ => None,
        };
        if let Some(v) = v32 {
            // SAFETY: non-null; the caller guarantees it is writable as a `uint32_t`.
            unsafe { write_out(value.cast::<u32>(), v) };
            return Ok(());
        }
        let v64 = match attr.0 {
            0x4 => pool.get::<attr::ReleaseThreshold>()?,
            0x5 => pool.get::<attr::ReservedMemCurrent>()?,
            0x6 => pool.get::<attr::ReservedMemHigh>()?,
            0x7 => pool.get::<attr::UsedMemCurrent>()?,
            0x8 => pool.get::<attr::UsedMemHigh>()?,
            _ => return Err(AclErr::param(format!("{} of aclrtMemPoolAttr", attr_name(attr)))),
        };
        // SAFETY: non-null; the caller guarantees it is writable as a `uint64_t`.
        unsafe { write_out(value.cast::<u64>(), v64) };
        Ok(())
    })
}

/// Decrements a pool's count of calls in progress, also on an early return or a panic.
struct InProgress<'a>(&'a PoolObj);

impl InProgress<'_> {
    fn enter(p: &PoolObj) -> AclResult<InProgress<'_>> {
        let mut st = p.state.lock();
        if st.destroyed {
            return Err(AclErr::handle("the pool is being destroyed"));
        }
        st.in_progress += 1;
        Ok(InProgress(p))
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.state.lock().in_progress -= 1;
    }
}

fn same_device(s: &StreamObj, p: &PoolObj) -> AclResult {
    if s.dev == p.dev {
        Ok(())
    } else {
        Err(AclErr::param(format!(
            "the stream belongs to device {} and the pool to device {}",
            s.dev, p.dev
        )))
    }
}

/// Allocates `size` bytes (rounded up to the pool's 512-byte alignment) from the pool for
/// `stream` (null: the default stream of the current device). On success `*ptr` is usable by
/// work enqueued on `stream` after this call. Size 0 or a size that overflows when rounded:
/// `ACL_ERROR_INVALID_PARAM`; more than the pool can hold: `ACL_ERROR_RT_MEMORY_ALLOCATION`.
///
/// # Safety
/// `ptr` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemPoolMallocAsync(
    ptr: *mut *mut c_void,
    size: usize,
    memPool: aclrtMemPool,
    stream: aclrtStream,
) -> aclError {
    guard("aclrtMemPoolMallocAsync", || {
        let rt = rt()?;
        let out = out_ptr(ptr, "ptr")?;
        if size == 0 {
            return Err(AclErr::param("size is 0"));
        }
        let p = pool_of(memPool)?;
        let s = rt.stream(stream)?;
        same_device(&s, &p)?;
        let align = p.pool.alignment();
        let rounded = (size as u64).checked_next_multiple_of(align).ok_or_else(|| {
            AclErr::param(format!("size {size} overflows when rounded up to {align}"))
        })?;
        if rounded > p.pool.max_size() {
            return Err(AclErr::oom(format!(
                "size {size} (rounded {rounded}) exceeds the pool's size {}",
                p.pool.max_size()
            )));
        }
        let in_progress = InProgress::enter(&p)?;
        let (addr, got) = p.pool.alloc_raw(size as u64, &s.stream)?;
        p.state.lock().live.insert(addr.addr(), got);
        drop(in_progress);
        rt.mem.lock().note_device_range(p.dev, addr.addr(), got);
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, addr.addr() as *mut c_void) };
        Ok(())
    })
}

/// Frees `ptr` onto `stream` (null: the default stream of the current device), in stream
/// order and without synchronisation: work enqueued on `stream` afterwards may reuse it.
///
/// `ptr` must be the start of a live allocation of a pool, or memory from `aclrtMalloc`
/// (freed by a host function on `stream` once the work enqueued before it completes). Any
/// other pointer — null, interior, foreign, already freed — is `ACL_ERROR_INVALID_PARAM`.
#[no_mangle]
pub extern "C" fn aclrtMemPoolFreeAsync(ptr: *mut c_void, stream: aclrtStream) -> aclError {
    guard("aclrtMemPoolFreeAsync", || {
        let addr = DevicePtr::new(ptr as u64).ok_or_else(|| AclErr::param("ptr is null"))?;
        let rt = rt()?;
        let s = rt.stream(stream)?;
        rt.dev(s.dev).require_pool_support()?;
        // Take the block out of its pool's live set (atomically: a concurrent double free
        // finds nothing), then free it in the engine; put it back if that fails.
        let found = rt.pools.find_map(|p| {
            let mut st = p.state.lock();
            let size = st.live.get(&addr.addr()).copied()?;
            if let Err(e) = same_device(&s, p) {
                return Some(Err(e));
            }
            st.live.remove(&addr.addr());
            st.in_progress += 1;
            Some(Ok(size))
        });
        if let Some((p, taken)) = found {
            let size = taken?;
            let result = {
                // Counted in `find_map`; uncounted when this scope ends, even by a panic.
                let _in_progress = InProgress(&p);
                p.pool.free_raw(addr, &s.stream)
            };
            if let Err(e) = result {
                p.state.lock().live.insert(addr.addr(), size);
                return Err(e.into());
            }
            return Ok(());
        }
        // Not pool memory: memory from aclrtMalloc is freed in stream order.
        let rec = {
            let mut mem = rt.mem.lock();
            match mem.mallocs.get(&addr.addr()).copied() {
                Some(rec) if rec.dev == s.dev => {
                    mem.mallocs.remove(&addr.addr());
                    rec
                }
                Some(rec) => {
                    return Err(AclErr::param(format!(
                        "{ptr:p} is memory of device {} and the stream belongs to device {}",
                        rec.dev, s.dev
                    )))
                }
                None => {
                    return Err(AclErr::param(format!(
                        "{ptr:p} is not the start of a live pool allocation nor memory from \
                         aclrtMalloc (an interior, foreign or already freed pointer)"
                    )))
                }
            }
        };
        let hal = Arc::clone(rt.dev(rec.dev).hal());
        let enqueued = s.stream.host_fn(move || {
            // Nobody to report to from the stream's worker: a failure here would mean the
            // memory is still in use by another stream, and it then stays allocated.
            let _ = hal.free(addr);
        });
        if let Err(e) = enqueued {
            rt.mem.lock().mallocs.insert(addr.addr(), rec);
            return Err(e.into());
        }
        Ok(())
    })
}

/// Releases the pool's free memory now, down to `max(minBytesToKeep, used)`; takes precedence
/// over the release threshold. `minBytesToKeep` above the pool's size is an error.
#[no_mangle]
pub extern "C" fn aclrtMemPoolTrimTo(memPool: aclrtMemPool, minBytesToKeep: usize) -> aclError {
    guard("aclrtMemPoolTrimTo", || {
        let p = pool_of(memPool)?;
        let keep = minBytesToKeep as u64;
        if keep > p.pool.max_size() {
            return Err(AclErr::param(format!(
                "minBytesToKeep {keep} exceeds the pool's size {}",
                p.pool.max_size()
            )));
        }
        p.pool.trim_to(keep)?;
        Ok(())
    })
}
