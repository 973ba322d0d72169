//! The physical side: what the engine asks of whoever maps memory for it.

/// The physical side, implemented by the pool over the driver HAL (and by fakes in tests).
pub trait Backing {
    /// Maps physical memory at `[offset, offset + size)` of the pool's range; both are
    /// multiples of the granularity. Returns a token the engine hands back to `unmap`.
    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError>;
    /// Unmaps exactly a range previously returned by `map` and frees its physical memory.
    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), BackingError>;
}

/// Why the backing could not map or unmap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackingError {
    /// The device has no physical memory left.
    OutOfMemory,
    /// Anything else (injected faults, driver errors); carried as text.
    Failed(String),
}
