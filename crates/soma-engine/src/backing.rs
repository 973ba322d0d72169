//! The physical side: what the engine asks of whoever maps memory for it.

use std::fmt;

/// The physical side, implemented by the pool over the driver HAL (and by
/// `testing::FakeBacking` in tests).
///
/// Failures carry the implementation's own error type, so that what the driver reported
/// reaches the engine's caller unchanged (its code, its message), never rebuilt from text.
pub trait Backing {
    /// What a failed call reports: the driver's error for the pool's backing. The engine
    /// only passes it on, so it asks nothing of the type.
    type Error;

    /// Maps physical memory at `[offset, offset + size)` of the pool's range; both are
    /// multiples of the granularity. Returns a token the engine hands back to `unmap`.
    ///
    /// # Errors
    ///
    /// [`BackingError::OutOfMemory`] when no physical memory is left (the engine then gives
    /// back idle memory and retries), [`BackingError::Driver`] for any other failure.
    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError<Self::Error>>;

    /// Unmaps exactly a range previously returned by `map` and frees its physical memory.
    ///
    /// # Errors
    ///
    /// The implementation's error. An unmap has no out-of-memory case the engine could act
    /// on, so it reports the error as it is.
    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), Self::Error>;
}

/// Why [`Backing::map`] failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackingError<E> {
    /// The device has no physical memory left: the engine may release idle memory and retry.
    OutOfMemory,
    /// Any other failure, as the implementation reported it.
    Driver(E),
}

impl<E: fmt::Display> fmt::Display for BackingError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackingError::OutOfMemory => f.write_str("out of physical memory"),
            BackingError::Driver(e) => e.fmt(f),
        }
    }
}

/// Transparent for [`BackingError::Driver`]: the message and source are the driver's own.
impl<E: std::error::Error> std::error::Error for BackingError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BackingError::OutOfMemory => None,
            BackingError::Driver(e) => e.source(),
        }
    }
}
