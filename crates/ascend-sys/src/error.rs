//! [`AclError`]: the `aclError` status code as a `#[must_use]` newtype.

use std::fmt;

/// The status code every AscendCL function returns (`aclError`, a C `int`).
///
/// A `#[repr(transparent)]` newtype over `i32`, ABI-identical to `aclError`: the generated
/// bindings return it directly, so an ignored status is a compiler warning. Every code of the
/// subset has a named constant (the CANN name without its `ACL_` prefix); codes the constants
/// do not cover stay representable and print as `unknown aclError N`.
///
/// ```
/// use ascend_sys::AclError;
///
/// assert!(AclError::SUCCESS.result().is_ok());
/// assert_eq!(AclError(207001), AclError::ERROR_RT_MEMORY_ALLOCATION);
/// assert_eq!(AclError(207001).to_string(), "ACL_ERROR_RT_MEMORY_ALLOCATION (207001)");
/// assert_eq!(AclError(-3).to_string(), "unknown aclError -3");
/// ```
#[repr(transparent)]
#[must_use]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct AclError(pub i32);

impl AclError {
    /// `ACL_SUCCESS` (0): the call succeeded.
    pub const SUCCESS: Self = Self(0);
    /// `ACL_ERROR_INVALID_PARAM` (100000): an argument is invalid.
    pub const ERROR_INVALID_PARAM: Self = Self(100_000);
    /// `ACL_ERROR_UNINITIALIZE` (100001): `aclInit` has not been called.
    pub const ERROR_UNINITIALIZE: Self = Self(100_001);
    /// `ACL_ERROR_BAD_ALLOC` (200000): a memory allocation failed.
    pub const ERROR_BAD_ALLOC: Self = Self(200_000);
    /// `ACL_ERROR_INVALID_RESOURCE_HANDLE` (200005): an invalid resource handle.
    pub const ERROR_INVALID_RESOURCE_HANDLE: Self = Self(200_005);
    /// `ACL_ERROR_FEATURE_UNSUPPORTED` (200006): the feature is not supported.
    pub const ERROR_FEATURE_UNSUPPORTED: Self = Self(200_006);
    /// `ACL_ERROR_RT_PARAM_INVALID` (107000): the runtime rejected a parameter.
    pub const ERROR_RT_PARAM_INVALID: Self = Self(107_000);
    /// `ACL_ERROR_RT_INVALID_HANDLE` (107017): the runtime does not know the handle.
    pub const ERROR_RT_INVALID_HANDLE: Self = Self(107_017);
    /// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000): the device's product does not support the
    /// feature (e.g. the pool API off Atlas A2).
    pub const ERROR_RT_FEATURE_NOT_SUPPORT: Self = Self(207_000);
    /// `ACL_ERROR_RT_MEMORY_ALLOCATION` (207001): out of device memory.
    pub const ERROR_RT_MEMORY_ALLOCATION: Self = Self(207_001);
    /// `ACL_ERROR_RT_WAIT_TIMEOUT` (107019): a wait timed out (`aclmdlRIExecute`).
    pub const ERROR_RT_WAIT_TIMEOUT: Self = Self(107_019);
    /// `ACL_ERROR_RT_CAPTURE_DEPENDENCY` (107024): a dependency a capture cannot hold.
    pub const ERROR_RT_CAPTURE_DEPENDENCY: Self = Self(107_024);
    /// `ACL_ERROR_RT_STREAM_UNJOINED` (107025): streams that joined a capture did not rejoin
    /// its origin stream.
    pub const ERROR_RT_STREAM_UNJOINED: Self = Self(107_025);
    /// `ACL_ERROR_RT_MODEL_CAPTURED` (107026): the model runtime instance is still capturing.
    pub const ERROR_RT_MODEL_CAPTURED: Self = Self(107_026);
    /// `ACL_ERROR_RT_STREAM_CAPTURED` (107027): the stream is capturing.
    pub const ERROR_RT_STREAM_CAPTURED: Self = Self(107_027);
    /// `ACL_ERROR_RT_EVENT_CAPTURED` (107028): the event's latest record was captured.
    pub const ERROR_RT_EVENT_CAPTURED: Self = Self(107_028);
    /// `ACL_ERROR_RT_STREAM_NOT_CAPTURED` (107029): the stream is not capturing.
    pub const ERROR_RT_STREAM_NOT_CAPTURED: Self = Self(107_029);
    /// `ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT` (107030): not allowed while capturing.
    pub const ERROR_RT_CAPTURE_MODE_NOT_SUPPORT: Self = Self(107_030);
    /// `ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT` (107031): the default stream used while a
    /// capture is active.
    pub const ERROR_RT_STREAM_CAPTURE_IMPLICIT: Self = Self(107_031);
    /// `ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED` (107036): the capture was not begun on this
    /// stream (or thread).
    pub const ERROR_RT_STREAM_CAPTURE_UNMATCHED: Self = Self(107_036);
    /// `ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED` (507903): the capture was invalidated.
    pub const ERROR_RT_STREAM_CAPTURE_INVALIDATED: Self = Self(507_903);

    /// Every named code, with its CANN name.
    pub const KNOWN: [(Self, &'static str); 21] = [
        (Self::SUCCESS, "ACL_SUCCESS"),
        (Self::ERROR_INVALID_PARAM, "ACL_ERROR_INVALID_PARAM"),
        (Self::ERROR_UNINITIALIZE, "ACL_ERROR_UNINITIALIZE"),
        (Self::ERROR_BAD_ALLOC, "ACL_ERROR_BAD_ALLOC"),
        (Self::ERROR_INVALID_RESOURCE_HANDLE, "ACL_ERROR_INVALID_RESOURCE_HANDLE"),
        (Self::ERROR_FEATURE_UNSUPPORTED, "ACL_ERROR_FEATURE_UNSUPPORTED"),
        (Self::ERROR_RT_PARAM_INVALID, "ACL_ERROR_RT_PARAM_INVALID"),
        (Self::ERROR_RT_INVALID_HANDLE, "ACL_ERROR_RT_INVALID_HANDLE"),
        (Self::ERROR_RT_FEATURE_NOT_SUPPORT, "ACL_ERROR_RT_FEATURE_NOT_SUPPORT"),
        (Self::ERROR_RT_MEMORY_ALLOCATION, "ACL_ERROR_RT_MEMORY_ALLOCATION"),
        (Self::ERROR_RT_WAIT_TIMEOUT, "ACL_ERROR_RT_WAIT_TIMEOUT"),
        (Self::ERROR_RT_CAPTURE_DEPENDENCY, "ACL_ERROR_RT_CAPTURE_DEPENDENCY"),
        (Self::ERROR_RT_STREAM_UNJOINED, "ACL_ERROR_RT_STREAM_UNJOINED"),
        (Self::ERROR_RT_MODEL_CAPTURED, "ACL_ERROR_RT_MODEL_CAPTURED"),
        (Self::ERROR_RT_STREAM_CAPTURED, "ACL_ERROR_RT_STREAM_CAPTURED"),
        (Self::ERROR_RT_EVENT_CAPTURED, "ACL_ERROR_RT_EVENT_CAPTURED"),
        (Self::ERROR_RT_STREAM_NOT_CAPTURED, "ACL_ERROR_RT_STREAM_NOT_CAPTURED"),
        (Self::ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, "ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT"),
        (Self::ERROR_RT_STREAM_CAPTURE_IMPLICIT, "ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT"),
        (Self::ERROR_RT_STREAM_CAPTURE_UNMATCHED, "ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED"),
        (Self::ERROR_RT_STREAM_CAPTURE_INVALIDATED, "ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED"),
    ];

    /// The raw code.
    pub const fn code(self) -> i32 {
        self.0
    }

    /// Whether this is `ACL_SUCCESS`.
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }

    /// `Ok(())` for `ACL_SUCCESS`, else `Err(self)`.
    ///
    /// # Errors
    /// `self` when it is not `ACL_SUCCESS`.
    pub const fn result(self) -> Result<(), AclError> {
        if self.is_success() {
            Ok(())
        } else {
            Err(self)
        }
    }

    /// `Ok(value)` for `ACL_SUCCESS`, else `Err(self)`.
    ///
    /// # Errors
    /// `self` when it is not `ACL_SUCCESS`.
    pub fn result_with<T>(self, value: T) -> Result<T, AclError> {
        self.result().map(|()| value)
    }

    /// The CANN name of a named code (`"ACL_ERROR_BAD_ALLOC"`), `None` for other codes.
    pub fn name(self) -> Option<&'static str> {
        Self::KNOWN.iter().find(|(e, _)| *e == self).map(|(_, n)| *n)
    }
}

impl fmt::Display for AclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "unknown aclError {}", self.0),
        }
    }
}

impl fmt::Debug for AclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "AclError({name})"),
            None => write!(f, "AclError({})", self.0),
        }
    }
}

impl std::error::Error for AclError {}

impl From<AclError> for i32 {
    fn from(e: AclError) -> i32 {
        e.0
    }
}

impl From<i32> for AclError {
    fn from(code: i32) -> Self {
        Self(code)
    }
}
