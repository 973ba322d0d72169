//! Virtual memory management: reservations, physical allocations and mappings.

use std::ffi::c_void;

use ascend_sys::{
    aclError, aclrtDrvMemHandle, aclrtMemAllocationType, aclrtMemAttr, aclrtMemGranularityOptions,
    aclrtMemHandleType, aclrtMemLocationType, aclrtPhysicalMemProp,
};
use soma_core::hal::DevicePtr;

use crate::error::{guard, AclErr, AclResult};
use crate::runtime::{out_ptr, rt, write_out, DevEntry, PhysObj};

/// Validates a physical memory property: `allocationType` PINNED, `location.type` DEVICE on
/// an existing device, `handleType` NONE or POSIX, `memAttr` one of the subset's values and
/// `reserve` 0. Returns the device.
///
/// # Safety
/// `prop` is null or valid for a read of an `aclrtPhysicalMemProp`.
unsafe fn check_prop(prop: *const aclrtPhysicalMemProp) -> AclResult<&'static DevEntry> {
    if prop.is_null() {
        return Err(AclErr::param("prop is null"));
    }
    // SAFETY: non-null; the caller guarantees it is readable (unaligned reads are fine).
    let p = unsafe { prop.read_unaligned() };
    if p.allocationType != aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED {
        return Err(AclErr::param(format!(
            "prop.allocationType {} is not ACL_MEM_ALLOCATION_TYPE_PINNED",
            p.allocationType.0
        )));
    }
    if p.location.type_ != aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE {
        return Err(AclErr::param(format!(
            "prop.location.type {} is not ACL_MEM_LOCATION_TYPE_DEVICE",
            p.location.type_.0
        )));
    }
    if p.handleType != aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE
        && p.handleType != aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_POSIX
    {
        return Err(AclErr::param(format!("unknown prop.handleType {}", p.handleType.0)));
    }
    if p.memAttr.0 > aclrtMemAttr::ACL_HBM_MEM_NORMAL.0 {
        return Err(AclErr::param(format!("unknown prop.memAttr {}", p.memAttr.0)));
    }
    if p.reserve != 0 {
        return Err(AclErr::param(format!("prop.reserve is {}, must be 0", p.reserve)));
    }
    rt()?.device(p.location.id.into())
}

fn check_flags(flags: u64) -> AclResult {
    if flags == 0 {
        Ok(())
    } else {
        Err(AclErr::param(format!("flags {flags:#x} are reserved and must be 0")))
    }
}

fn check_granular(dev: &DevEntry, size: usize) -> AclResult<u64> {
    let g = dev.granularity();
    let size = size as u64;
    if size == 0 || size % g != 0 {
        return Err(AclErr::param(format!(
            "size {size} is not a non-zero multiple of the allocation granularity {g}"
        )));
    }
    Ok(size)
}

/// The allocation granularity for `prop` (2 MiB, minimum and recommended alike).
///
/// # Safety
/// `prop` is null or valid for a read; `granularity` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemGetAllocationGranularity(
    prop: *mut aclrtPhysicalMemProp,
    option: aclrtMemGranularityOptions,
    granularity: *mut usize,
) -> aclError {
    guard("aclrtMemGetAllocationGranularity", || {
        let out = out_ptr(granularity, "granularity")?;
        // SAFETY: forwarded from the caller.
        let dev = unsafe { check_prop(prop) }?;
        if option != aclrtMemGranularityOptions::ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM
            && option != aclrtMemGranularityOptions::ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED
        {
            return Err(AclErr::param(format!(
                "option {} is neither MINIMUM nor RECOMMENDED",
                option.0
            )));
        }
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, dev.granularity() as usize) };
        Ok(())
    })
}

/// Reserves `size` bytes (a multiple of the granularity) of device address space on the
/// current device. `alignment` is 0 or a power of two up to the granularity (reservations are
/// granularity-aligned); `expectPtr` is a hint that is not honoured; `flags` is 0 (normal
/// pages) or 1 (huge pages), as in CANN — the software NPU's pages are the same either way.
///
/// # Safety
/// `virPtr` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtReserveMemAddress(
    virPtr: *mut *mut c_void,
    size: usize,
    alignment: usize,
    expectPtr: *mut c_void,
    flags: u64,
) -> aclError {
    let _ = expectPtr;
    guard("aclrtReserveMemAddress", || {
        let out = out_ptr(virPtr, "virPtr")?;
        if flags > 1 {
            return Err(AclErr::param(format!(
                "flags {flags:#x}: 0 (normal pages) or 1 (huge pages)"
            )));
        }
        let rt = rt()?;
        let dev = rt.current();
        let size = check_granular(dev, size)?;
        if alignment != 0 && (!alignment.is_power_of_two() || alignment as u64 > dev.granularity())
        {
            return Err(AclErr::param(format!(
                "alignment {alignment} is not 0 or a power of two up to the granularity {}",
                dev.granularity()
            )));
        }
        let base = dev.hal().reserve(size)?;
        {
            let mut mem = rt.mem.lock();
            mem.reservations.insert(base.addr(), (dev.index, size));
            mem.note_device_range(dev.index, base.addr(), size);
        }
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, base.addr() as *mut c_void) };
        Ok(())
    })
}

/// Releases a reservation (its base address); fails while any part of it is mapped.
#[no_mangle]
pub extern "C" fn aclrtReleaseMemAddress(virPtr: *mut c_void) -> aclError {
    guard("aclrtReleaseMemAddress", || {
        let rt = rt()?;
        let addr = virPtr as u64;
        let base = DevicePtr::new(addr).ok_or_else(|| AclErr::param("virPtr is null"))?;
        let (dev, _) = rt.mem.lock().reservations.get(&addr).copied().ok_or_else(|| {
            AclErr::param(format!("{virPtr:p} is not the base of a live reservation"))
        })?;
        rt.dev(dev).hal().release(base)?;
        rt.mem.lock().reservations.remove(&addr);
        Ok(())
    })
}

/// Allocates `size` bytes (a multiple of the granularity) of physical memory on
/// `prop->location.id`. `flags` must be 0.
///
/// # Safety
/// `handle` is null or valid for a write; `prop` is null or valid for a read.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocPhysical(
    handle: *mut aclrtDrvMemHandle,
    size: usize,
    prop: *const aclrtPhysicalMemProp,
    flags: u64,
) -> aclError {
    guard("aclrtMallocPhysical", || {
        let out = out_ptr(handle, "handle")?;
        // SAFETY: forwarded from the caller.
        let dev = unsafe { check_prop(prop) }?;
        check_flags(flags)?;
        let size = check_granular(dev, size)?;
        let h = dev.hal().alloc_physical(size)?;
        let id = rt()?.physical.insert(PhysObj { dev: dev.index, handle: h, size });
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, id) };
        Ok(())
    })
}

/// Frees physical memory; fails while it is mapped.
#[no_mangle]
pub extern "C" fn aclrtFreePhysical(handle: aclrtDrvMemHandle) -> aclError {
    guard("aclrtFreePhysical", || {
        let rt = rt()?;
        let p = rt.physical.get(handle)?;
        rt.dev(p.dev).hal().free_physical(p.handle)?;
        rt.physical.remove(handle)?;
        Ok(())
    })
}

/// Maps the whole of `handle` at `virPtr`, inside a reservation of the same device: `size`
/// must be the handle's size, `offset` 0 (partial mappings are not supported) and `flags` 0.
#[no_mangle]
pub extern "C" fn aclrtMapMem(
    virPtr: *mut c_void,
    size: usize,
    offset: usize,
    handle: aclrtDrvMemHandle,
    flags: u64,
) -> aclError {
    guard("aclrtMapMem", || {
        let rt = rt()?;
        let va = DevicePtr::new(virPtr as u64).ok_or_else(|| AclErr::param("virPtr is null"))?;
        let p = rt.physical.get(handle)?;
        check_flags(flags)?;
        if offset != 0 {
            return Err(AclErr::param(format!(
                "offset {offset}: only whole physical allocations are mapped (offset 0)"
            )));
        }
        if size as u64 != p.size {
            return Err(AclErr::param(format!(
                "size {size} differs from the physical allocation's size {}",
                p.size
            )));
        }
        let (_, dev, _) = rt.mem.lock().reservation_of(va.addr()).ok_or_else(|| {
            AclErr::param(format!(
                "{virPtr:p} is not inside a reservation of aclrtReserveMemAddress"
            ))
        })?;
        if dev != p.dev {
            return Err(AclErr::param(format!(
                "the reservation is on device {dev}, the physical memory on device {}",
                p.dev
            )));
        }
        Ok(rt.dev(dev).hal().map(va, p.handle)?)
    })
}

/// Unmaps the mapping that starts at `virPtr`.
#[no_mangle]
pub extern "C" fn aclrtUnmapMem(virPtr: *mut c_void) -> aclError {
    guard("aclrtUnmapMem", || {
        let rt = rt()?;
        let va = DevicePtr::new(virPtr as u64).ok_or_else(|| AclErr::param("virPtr is null"))?;
        let (_, dev, _) = rt.mem.lock().reservation_of(va.addr()).ok_or_else(|| {
            AclErr::param(format!(
                "{virPtr:p} is not inside a reservation of aclrtReserveMemAddress"
            ))
        })?;
        rt.dev(dev).hal().unmap(va)?;
        Ok(())
    })
}
