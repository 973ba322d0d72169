//! Errors of the typed API.

use std::fmt;

use crate::hal::DriverError;

/// `Result` with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong, in terms a caller can act on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The pool could not serve an allocation; see [`OutOfMemory`] for the numbers.
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// A size of 0, or one that overflows when converted to bytes or rounded.
    #[error("invalid size: {0}")]
    InvalidSize(String),
    /// An argument outside its documented domain.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A pool configuration that `build()` rejects.
    #[error("invalid pool configuration: {0}")]
    InvalidConfig(String),
    /// A stream, event or allocation that belongs to another device or pool.
    #[error("wrong device or pool: {0}")]
    WrongDevice(String),
    /// More live streams on one device than the pool's bookkeeping supports.
    #[error("too many live streams on this device (at most {max})")]
    TooManyStreams {
        /// The limit.
        max: usize,
    },
    /// The device (or the backend) reported an error.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// The numbers behind an out-of-memory error, so that its message explains itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Bytes asked for.
    pub requested: u64,
    /// After rounding to the pool's alignment.
    pub rounded: u64,
    /// Backend id of the requesting stream.
    pub stream: u64,
    /// Bytes in live allocations.
    pub used: u64,
    /// Physical bytes the pool holds.
    pub reserved: u64,
    /// The pool's maximum size.
    pub max: u64,
    /// Largest free block in the pool (any stream).
    pub largest_free_block: u64,
    /// Free bytes cached on other streams that this request could not use.
    pub pending_bytes: u64,
    /// Device memory free / total when the allocation failed.
    pub device_free: u64,
    /// Device total memory.
    pub device_total: u64,
    /// Whether the pool waited for other streams' pending frees and retried.
    pub retried: bool,
    /// Why mapping more memory failed, when it did.
    pub cause: Option<String>,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of memory: requested {} ({} rounded) on stream {}; pool used {}, reserved {}, max {}, \
             largest free block {}; {} cached on other streams not reusable here; device free {} of {}",
            Bytes(self.requested),
            Bytes(self.rounded),
            self.stream,
            Bytes(self.used),
            Bytes(self.reserved),
            Bytes(self.max),
            Bytes(self.largest_free_block),
            Bytes(self.pending_bytes),
            Bytes(self.device_free),
            Bytes(self.device_total),
        )?;
        if self.retried {
            write!(f, " (after waiting for pending frees and retrying)")?;
        }
        if let Some(cause) = &self.cause {
            write!(f, "; cause: {cause}")?;
        }
        if self.pending_bytes >= self.rounded {
            write!(
                f,
                "; hint: enough memory is cached on other streams: enable follow_event_dependencies \
                 and make this stream wait on an event recorded after those frees, or enable \
                 internal_dependencies"
            )?;
        } else if self.max.saturating_sub(self.used) >= self.rounded {
            write!(f, "; hint: free space exists but is fragmented or held by the device: try trim_to or compact")?;
        } else {
            write!(f, "; hint: the pool's max_size is the limit: raise it or free allocations")?;
        }
        Ok(())
    }
}

/// Human-readable byte counts (`1.5 GiB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{value:.1} {}", UNITS[unit])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_display() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1536).to_string(), "1.5 KiB");
        assert_eq!(Bytes(3 << 30).to_string(), "3.0 GiB");
    }
}
