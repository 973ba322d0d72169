//! `aclInit`, `aclFinalize`, `aclGetRecentErrMsg`, devices and contexts.

use std::ffi::{c_char, CStr};
use std::sync::atomic::Ordering;

use ascend_sys::{aclError, aclrtContext};

use crate::error::{guard, message_ptr, AclErr};
use crate::runtime::{current_set, out_ptr, rt, set_current, write_out, ContextObj};

/// Initialises the runtime (the software NPU, configured from `SOMA_SIM_*`).
///
/// `configPath` may be null; a configuration file is accepted and not read. A repeated
/// `aclInit` succeeds (CANN answers `ACL_ERROR_REPEAT_INITIALIZE`, outside the subset).
///
/// # Safety
/// `configPath` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn aclInit(configPath: *const c_char) -> aclError {
    guard("aclInit", || {
        if !configPath.is_null() {
            // SAFETY: the caller passes a NUL-terminated string.
            let path = unsafe { CStr::from_ptr(configPath) };
            if path.to_str().is_err() {
                return Err(AclErr::param("configPath is not valid UTF-8"));
            }
        }
        rt()?.initialized.store(true, Ordering::Release);
        Ok(())
    })
}

/// Waits for the work of every device and marks the runtime finalized. Objects stay valid
/// (the runtime lives as long as the process), so a later call still works.
#[no_mangle]
pub extern "C" fn aclFinalize() -> aclError {
    guard("aclFinalize", || {
        let rt = rt()?;
        let mut first = None;
        for d in &rt.devices {
            if let Err(e) = d.device.synchronize() {
                first.get_or_insert(AclErr::from(e));
            }
        }
        rt.initialized.store(false, Ordering::Release);
        first.map_or(Ok(()), Err)
    })
}

/// The calling thread's most recent error message ("" when no call of this thread failed);
/// valid until the next failing call on this thread. Never null.
#[no_mangle]
pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    std::panic::catch_unwind(message_ptr).unwrap_or_else(|_| c"internal error".as_ptr())
}

/// Makes `deviceId` the calling thread's current device.
#[no_mangle]
pub extern "C" fn aclrtSetDevice(deviceId: i32) -> aclError {
    guard("aclrtSetDevice", || {
        let dev = rt()?.device(deviceId.into())?;
        set_current(Some(dev.index));
        Ok(())
    })
}

/// Waits for the device's work; if it is the calling thread's current device, the thread has
/// no current device afterwards (device 0 is then implied). Streams, events and pools of the
/// device stay valid (CANN destroys them).
#[no_mangle]
pub extern "C" fn aclrtResetDevice(deviceId: i32) -> aclError {
    guard("aclrtResetDevice", || {
        let dev = rt()?.device(deviceId.into())?;
        let result = dev.device.synchronize();
        if current_set() == Some(dev.index) {
            set_current(None);
        }
        Ok(result?)
    })
}

/// The calling thread's current device (0 when none was set: device 0 is implied).
///
/// # Safety
/// `deviceId` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDevice(deviceId: *mut i32) -> aclError {
    guard("aclrtGetDevice", || {
        let out = out_ptr(deviceId, "deviceId")?;
        let dev = rt()?.current();
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, dev.index as i32) };
        Ok(())
    })
}

/// The number of devices (`SOMA_SIM_DEVICES`).
///
/// # Safety
/// `count` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> aclError {
    guard("aclrtGetDeviceCount", || {
        let out = out_ptr(count, "count")?;
        let n = rt()?.devices.len() as u32;
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, n) };
        Ok(())
    })
}

/// Waits for every stream of the current device, then applies the release threshold of its
/// pools.
#[no_mangle]
pub extern "C" fn aclrtSynchronizeDevice() -> aclError {
    guard("aclrtSynchronizeDevice", || Ok(rt()?.current().device.synchronize()?))
}

/// Creates a context on `deviceId` and makes it (its device) current for the calling thread.
///
/// # Safety
/// `context` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateContext(context: *mut aclrtContext, deviceId: i32) -> aclError {
    guard("aclrtCreateContext", || {
        let out = out_ptr(context, "context")?;
        let rt = rt()?;
        let dev = rt.device(deviceId.into())?;
        let h = rt.contexts.insert(ContextObj { dev: dev.index });
        set_current(Some(dev.index));
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Destroys a context. The calling thread's current device is unchanged.
#[no_mangle]
pub extern "C" fn aclrtDestroyContext(context: aclrtContext) -> aclError {
    guard("aclrtDestroyContext", || {
        rt()?.contexts.remove(context)?;
        Ok(())
    })
}

/// Makes `context`'s device the calling thread's current device.
#[no_mangle]
pub extern "C" fn aclrtSetCurrentContext(context: aclrtContext) -> aclError {
    guard("aclrtSetCurrentContext", || {
        let ctx = rt()?.contexts.get(context)?;
        set_current(Some(ctx.dev));
        Ok(())
    })
}
