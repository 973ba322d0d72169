//! Physical memory shared between processes: `aclrtMemExportToShareableHandle`,
//! `aclrtMemSetPidToShareableHandle`, `aclrtMemImportFromShareableHandle` and
//! `aclrtDeviceGetBareTgid`.
//!
//! An exported handle's memory is served to the processes on its whitelist (or to any process
//! with `ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION`); an importer gets a physical handle of
//! its own, mapped and freed as any other, over the same bytes. Import and export only work
//! across processes, one handle per shareable handle in a process.

use ascend_sys::{
    aclError, aclrtDrvMemHandle, aclrtMemHandleType, ACL_RT_VMM_EXPORT_FLAG_DEFAULT,
    ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
};
use soma_core::hal::ShareableHandle;

use crate::error::{guard, AclErr};
use crate::runtime::{out_ptr, rt, write_out, PhysObj};

/// Exports physical memory of `aclrtMallocPhysical` for other processes. `handleType` is
/// `ACL_MEM_HANDLE_TYPE_NONE` (as CANN requires) or `ACL_MEM_HANDLE_TYPE_POSIX`; `flags` is
/// `ACL_RT_VMM_EXPORT_FLAG_DEFAULT` (whitelist checked) or
/// `ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION`. A handle is exported once; an imported
/// handle is not exported again.
///
/// # Safety
/// `shareableHandle` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemExportToShareableHandle(
    handle: aclrtDrvMemHandle,
    handleType: aclrtMemHandleType,
    flags: u64,
    shareableHandle: *mut u64,
) -> aclError {
    guard("aclrtMemExportToShareableHandle", || {
        let out = out_ptr(shareableHandle, "shareableHandle")?;
        if handleType != aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE
            && handleType != aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_POSIX
        {
            return Err(AclErr::param(format!("unknown handleType {}", handleType.0)));
        }
        let check_pids = match flags {
            f if f == u64::from(ACL_RT_VMM_EXPORT_FLAG_DEFAULT) => true,
            f if f == u64::from(ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION) => false,
            f => return Err(AclErr::param(format!("unknown flags {f:#x}"))),
        };
        let rt = rt()?;
        let p = rt.physical.get(handle)?;
        let shareable = rt.dev(p.dev).hal().export_physical(p.handle, check_pids)?;
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, shareable.0) };
        Ok(())
    })
}

/// Adds `pidNum` process ids from `pid` to the whitelist of a handle this process exported.
///
/// # Safety
/// `pid` is null or valid for reads of `pidNum` ids.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemSetPidToShareableHandle(
    shareableHandle: u64,
    pid: *mut i32,
    pidNum: usize,
) -> aclError {
    guard("aclrtMemSetPidToShareableHandle", || {
        if pid.is_null() || pidNum == 0 {
            return Err(AclErr::param("pid is null or pidNum is 0"));
        }
        // SAFETY: non-null; the caller guarantees `pidNum` readable ids.
        let pids = unsafe { std::slice::from_raw_parts(pid.cast_const(), pidNum) };
        let rt = rt()?;
        Ok(rt.device(0)?.hal().allow_shareable_pids(ShareableHandle(shareableHandle), pids)?)
    })
}

/// Imports memory another process exported as a physical handle of device `deviceId`, to be
/// mapped with `aclrtMapMem` (its size is the exported allocation's) and freed with
/// `aclrtFreePhysical`.
///
/// The memory is shared with the exporting process: the program orders the two processes'
/// accesses (nothing in the runtime does); an unordered race leaves the bytes unspecified.
///
/// # Safety
/// `handle` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemImportFromShareableHandle(
    shareableHandle: u64,
    deviceId: i32,
    handle: *mut aclrtDrvMemHandle,
) -> aclError {
    guard("aclrtMemImportFromShareableHandle", || {
        let out = out_ptr(handle, "handle")?;
        let rt = rt()?;
        let dev = rt.device(deviceId.into())?;
        let h = dev.hal().import_physical(ShareableHandle(shareableHandle), 0)?;
        let size = dev.sim()?.physical_size(h).unwrap_or(0);
        let id = rt.physical.insert(PhysObj { dev: dev.index, handle: h, size });
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, id) };
        Ok(())
    })
}

/// This process's id, as whitelists name it.
///
/// # Safety
/// `pid` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtDeviceGetBareTgid(pid: *mut i32) -> aclError {
    guard("aclrtDeviceGetBareTgid", || {
        let out = out_ptr(pid, "pid")?;
        let id = rt()?.device(0)?.hal().process_id()?;
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, id) };
        Ok(())
    })
}
