//! Error codes, the per-thread error message and the boundary guard every exported function
//! runs in.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use ascend_sys::{aclError, AclError};
use soma_core::hal::{CaptureErrorKind, DriverError};

/// `ACL_ERROR_RT_INTERNAL_ERROR` (507899): CANN's code for an internal runtime error, outside
/// the subset (`acl_base.h` declares it, as CANN's does); returned for a failed device task, an
/// injected fault and for a panic caught at the C boundary (which would be a bug of ours).
pub const ACL_ERROR_RT_INTERNAL_ERROR: AclError = AclError(507_899);

/// An error on its way to the C caller: the code it returns and the message
/// `aclGetRecentErrMsg` gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AclErr {
    pub(crate) code: aclError,
    pub(crate) msg: String,
}

pub(crate) type AclResult<T = ()> = Result<T, AclErr>;

impl AclErr {
    pub(crate) fn new(code: aclError, msg: impl Into<String>) -> Self {
        AclErr { code, msg: msg.into() }
    }

    /// `ACL_ERROR_INVALID_PARAM`: an argument outside its documented domain.
    pub(crate) fn param(msg: impl Into<String>) -> Self {
        Self::new(AclError::ERROR_INVALID_PARAM, msg)
    }

    /// `ACL_ERROR_RT_INVALID_HANDLE`: a non-null handle that is not (or no longer) live.
    pub(crate) fn handle(msg: impl Into<String>) -> Self {
        Self::new(AclError::ERROR_RT_INVALID_HANDLE, msg)
    }

    /// `ACL_ERROR_RT_MEMORY_ALLOCATION`: out of device memory.
    pub(crate) fn oom(msg: impl Into<String>) -> Self {
        Self::new(AclError::ERROR_RT_MEMORY_ALLOCATION, msg)
    }

    /// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`: not on this product.
    pub(crate) fn unsupported(msg: impl Into<String>) -> Self {
        Self::new(AclError::ERROR_RT_FEATURE_NOT_SUPPORT, msg)
    }
}

/// Maps a backend error: out of memory → `ACL_ERROR_RT_MEMORY_ALLOCATION`; an address or value
/// the device rejects → `ACL_ERROR_RT_PARAM_INVALID`; an unknown handle →
/// `ACL_ERROR_RT_INVALID_HANDLE`; unsupported → `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`; a broken
/// capture rule → the capture status its kind names ([`capture_code`]); a failed task, an
/// injected fault or a native code → `ACL_ERROR_RT_INTERNAL_ERROR` (507899).
impl From<DriverError> for AclErr {
    fn from(e: DriverError) -> Self {
        let code = match &e {
            DriverError::Capture { kind, .. } => capture_code(*kind),
            DriverError::OutOfMemory { .. } => AclError::ERROR_RT_MEMORY_ALLOCATION,
            DriverError::InvalidAddress { .. } | DriverError::InvalidValue(_) => {
                AclError::ERROR_RT_PARAM_INVALID
            }
            DriverError::InvalidHandle(_) => AclError::ERROR_RT_INVALID_HANDLE,
            DriverError::Unsupported(_) => AclError::ERROR_RT_FEATURE_NOT_SUPPORT,
            _ => ACL_ERROR_RT_INTERNAL_ERROR,
        };
        AclErr::new(code, e.to_string())
    }
}

/// The CANN status of a capture rule.
fn capture_code(kind: CaptureErrorKind) -> aclError {
    match kind {
        CaptureErrorKind::StreamCaptured => AclError::ERROR_RT_STREAM_CAPTURED,
        CaptureErrorKind::EventCaptured => AclError::ERROR_RT_EVENT_CAPTURED,
        CaptureErrorKind::NotCapturable => AclError::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT,
        CaptureErrorKind::NotCapturing => AclError::ERROR_RT_STREAM_NOT_CAPTURED,
        CaptureErrorKind::Unmatched => AclError::ERROR_RT_STREAM_CAPTURE_UNMATCHED,
        CaptureErrorKind::Unjoined => AclError::ERROR_RT_STREAM_UNJOINED,
        CaptureErrorKind::Dependency => AclError::ERROR_RT_CAPTURE_DEPENDENCY,
        CaptureErrorKind::Invalidated => AclError::ERROR_RT_STREAM_CAPTURE_INVALIDATED,
        _ => ACL_ERROR_RT_INTERNAL_ERROR,
    }
}

/// Maps an error of the typed layer: out of memory → `ACL_ERROR_RT_MEMORY_ALLOCATION`; bad
/// sizes, arguments, configurations and cross-device mixes → `ACL_ERROR_INVALID_PARAM`; too
/// many streams → `ACL_ERROR_BAD_ALLOC`; backend errors as above.
impl From<soma_core::Error> for AclErr {
    fn from(e: soma_core::Error) -> Self {
        use soma_core::Error as E;
        match e {
            E::Driver(d) => d.into(),
            E::OutOfMemory(_) => AclErr::oom(e.to_string()),
            E::TooManyStreams { .. } => AclErr::new(AclError::ERROR_BAD_ALLOC, e.to_string()),
            other => AclErr::param(other.to_string()),
        }
    }
}

thread_local! {
    static LAST_MESSAGE: RefCell<CString> = RefCell::new(CString::default());
}

/// Stores `msg` as this thread's most recent error message.
pub(crate) fn set_message(msg: &str) {
    // Interior NULs cannot be represented in a C string; they never occur in our messages,
    // but a foreign string (a path) could carry one.
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; the message is then dropped.
    let _ = LAST_MESSAGE.try_with(|m| *m.borrow_mut() = c);
}

/// This thread's most recent error message, valid until the next failing call on this thread.
pub(crate) fn message_ptr() -> *const c_char {
    LAST_MESSAGE.try_with(|m| m.borrow().as_ptr()).unwrap_or_else(|_| c"thread is exiting".as_ptr())
}

/// Runs the body of an exported function: a returned error becomes its code and this
/// thread's message (prefixed with the function's name); a panic is caught (it never unwinds
/// into C) and becomes `ACL_ERROR_RT_INTERNAL_ERROR` with a message.
pub(crate) fn guard(name: &str, body: impl FnOnce() -> AclResult) -> aclError {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => AclError::SUCCESS,
        Ok(Err(e)) => {
            set_message(&format!("{name}: {}", e.msg));
            e.code
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            set_message(&format!("{name}: internal error (a panic was caught): {what}"));
            ACL_ERROR_RT_INTERNAL_ERROR
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_maps_errors_and_panics() {
        assert_eq!(guard("f", || Ok(())), AclError::SUCCESS);
        let e = guard("f", || Err(AclErr::param("bad x")));
        assert_eq!(e, AclError::ERROR_INVALID_PARAM);
        // SAFETY: the message is a valid C string owned by this thread.
        let msg = unsafe { std::ffi::CStr::from_ptr(message_ptr()) };
        assert_eq!(msg.to_str(), Ok("f: bad x"));
        let e = guard("g", || panic!("boom"));
        assert_eq!(e, ACL_ERROR_RT_INTERNAL_ERROR);
        // SAFETY: as above.
        let msg = unsafe { std::ffi::CStr::from_ptr(message_ptr()) };
        assert!(msg.to_string_lossy().contains("boom"), "{msg:?}");
    }

    #[test]
    fn driver_errors_map_to_codes() {
        let oom = DriverError::OutOfMemory { requested: 1, free: 0 };
        assert_eq!(AclErr::from(oom).code, AclError::ERROR_RT_MEMORY_ALLOCATION);
        let h = DriverError::InvalidHandle("x".into());
        assert_eq!(AclErr::from(h).code, AclError::ERROR_RT_INVALID_HANDLE);
        let size = soma_core::Error::InvalidSize("0".into());
        assert_eq!(AclErr::from(size).code, AclError::ERROR_INVALID_PARAM);
    }
}
