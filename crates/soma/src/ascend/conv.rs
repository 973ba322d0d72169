//! Conversions: `aclError` → [`DriverError`], device pointers ↔ C pointers.
//!
//! Each mapping function's doc lists the codes it covers; [`map_call_err`] tries them in order
//! and falls back to [`DriverError::Native`] with the code and `aclGetRecentErrMsg`'s text.

use std::ffi::c_void;

use ascend_sys::AclError;
use soma_core::hal::{CaptureErrorKind, DevicePtr, DriverError};

use super::raw::CallError;

/// Out of device memory: `ACL_ERROR_RT_MEMORY_ALLOCATION` (207001), `ACL_ERROR_BAD_ALLOC`
/// (200000) → [`DriverError::OutOfMemory`] with the bytes asked for and the bytes free
/// (`free` is only called for these codes).
pub(crate) fn map_oom_err(
    code: AclError,
    requested: u64,
    free: impl FnOnce() -> u64,
) -> Option<DriverError> {
    matches!(code, AclError::ERROR_RT_MEMORY_ALLOCATION | AclError::ERROR_BAD_ALLOC)
        .then(|| DriverError::OutOfMemory { requested, free: free() })
}

/// Not supported by the device or the runtime: `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000),
/// `ACL_ERROR_FEATURE_UNSUPPORTED` (200006) → [`DriverError::Unsupported`].
pub(crate) fn map_unsupported_err(code: AclError, what: &str) -> Option<DriverError> {
    matches!(code, AclError::ERROR_RT_FEATURE_NOT_SUPPORT | AclError::ERROR_FEATURE_UNSUPPORTED)
        .then(|| DriverError::Unsupported(what.to_owned()))
}

/// A handle the runtime does not know: `ACL_ERROR_RT_INVALID_HANDLE` (107017),
/// `ACL_ERROR_INVALID_RESOURCE_HANDLE` (200005) → [`DriverError::InvalidHandle`].
pub(crate) fn map_invalid_handle_err(code: AclError, what: &str) -> Option<DriverError> {
    matches!(code, AclError::ERROR_RT_INVALID_HANDLE | AclError::ERROR_INVALID_RESOURCE_HANDLE)
        .then(|| DriverError::InvalidHandle(what.to_owned()))
}

/// An argument the runtime rejects: `ACL_ERROR_INVALID_PARAM` (100000),
/// `ACL_ERROR_RT_PARAM_INVALID` (107000) → [`DriverError::InvalidValue`].
pub(crate) fn map_invalid_value_err(code: AclError, what: &str) -> Option<DriverError> {
    matches!(code, AclError::ERROR_INVALID_PARAM | AclError::ERROR_RT_PARAM_INVALID)
        .then(|| DriverError::InvalidValue(what.to_owned()))
}

/// A capture rule the runtime enforces: its capture status codes →
/// [`DriverError::Capture`] of the matching kind.
pub(crate) fn map_capture_err(code: AclError, what: &str) -> Option<DriverError> {
    let kind = match code {
        AclError::ERROR_RT_STREAM_CAPTURED => CaptureErrorKind::StreamCaptured,
        AclError::ERROR_RT_EVENT_CAPTURED => CaptureErrorKind::EventCaptured,
        AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT
        | AclError::ERROR_RT_STREAM_CAPTURE_IMPLICIT
        | AclError::ERROR_RT_MODEL_CAPTURED => CaptureErrorKind::NotCapturable,
        AclError::ERROR_RT_STREAM_NOT_CAPTURED => CaptureErrorKind::NotCapturing,
        AclError::ERROR_RT_STREAM_CAPTURE_UNMATCHED => CaptureErrorKind::Unmatched,
        AclError::ERROR_RT_STREAM_UNJOINED => CaptureErrorKind::Unjoined,
        AclError::ERROR_RT_CAPTURE_DEPENDENCY => CaptureErrorKind::Dependency,
        AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED => CaptureErrorKind::Invalidated,
        _ => return None,
    };
    Some(DriverError::Capture { kind, message: what.to_owned() })
}

/// Any other code (`ACL_ERROR_UNINITIALIZE` and every code outside the subset) →
/// [`DriverError::Native`] with the code and the runtime's message.
pub(crate) fn map_native_err(code: AclError, message: String) -> DriverError {
    DriverError::Native { code: code.code(), message }
}

/// A function the loaded library does not export → [`DriverError::Unsupported`] naming it.
pub(crate) fn map_missing_symbol(e: &ascend_sys::LoadError) -> DriverError {
    DriverError::Unsupported(e.to_string())
}

/// The [`DriverError`] of a failed call that allocates nothing.
pub(crate) fn map_call_err(e: CallError) -> DriverError {
    map_alloc_err(e, 0, || 0)
}

/// The [`DriverError`] of a failed `aclrtCreateStream` / `aclrtCreateEvent`: the runtime's
/// out-of-resource codes (`ACL_ERROR_BAD_ALLOC`, `ACL_ERROR_RT_MEMORY_ALLOCATION`) mean it has
/// no stream or event left, not that device memory ran out → [`DriverError::Native`] saying
/// so; other codes as [`map_call_err`].
pub(crate) fn map_create_err(e: CallError, what: &str) -> DriverError {
    match e {
        CallError::Acl { call, code, message }
            if matches!(code, AclError::ERROR_BAD_ALLOC | AclError::ERROR_RT_MEMORY_ALLOCATION) =>
        {
            map_native_err(code, format!("{call}: the runtime has no {what} left: {message}"))
        }
        e => map_call_err(e),
    }
}

/// The [`DriverError`] of a failed call that allocates `requested` bytes; `free` reports the
/// device's free memory for [`DriverError::OutOfMemory`].
pub(crate) fn map_alloc_err(
    e: CallError,
    requested: u64,
    free: impl FnOnce() -> u64,
) -> DriverError {
    match e {
        CallError::Missing(load) => map_missing_symbol(&load),
        CallError::Acl { call, code, message } => {
            let what = if message.is_empty() {
                format!("{call}: {code}")
            } else {
                format!("{call}: {code}: {message}")
            };
            map_oom_err(code, requested, free)
                .or_else(|| map_unsupported_err(code, &what))
                .or_else(|| map_invalid_handle_err(code, &what))
                .or_else(|| map_invalid_value_err(code, &what))
                .or_else(|| map_capture_err(code, &what))
                .unwrap_or_else(|| {
                    map_native_err(
                        code,
                        if message.is_empty() {
                            call.to_owned()
                        } else {
                            format!("{call}: {message}")
                        },
                    )
                })
        }
    }
}

/// Whether a failed call means "the device or runtime does not offer this": an unsupported
/// code (see [`map_unsupported_err`]) or a missing symbol.
pub(crate) fn is_unsupported(e: &CallError) -> bool {
    match e {
        CallError::Missing(_) => true,
        CallError::Acl { code, .. } => map_unsupported_err(*code, "").is_some(),
    }
}

/// A device address as the C API's `void *`.
pub(crate) fn dev_ptr(p: DevicePtr) -> *mut c_void {
    // Device addresses are not host memory: the pointer is only passed to the runtime.
    p.addr() as usize as *mut c_void
}

/// A `void *` the runtime returned as a device address; `None` for null.
pub(crate) fn to_dev_ptr(p: *mut c_void) -> Option<DevicePtr> {
    DevicePtr::new(p as usize as u64)
}

/// `u64` → `usize` for sizes passed to the runtime.
pub(crate) fn to_usize(n: u64) -> Result<usize, DriverError> {
    usize::try_from(n)
        .map_err(|_| DriverError::InvalidValue(format!("{n} bytes do not fit in size_t")))
}
