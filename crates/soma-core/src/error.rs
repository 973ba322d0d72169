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
    /// Memory of another device used without peer access from the stream's device to it
    /// (see [`Device::enable_peer_access`](crate::Device::enable_peer_access)), or a peer
    /// access call the devices refuse (the device itself, access already enabled or not
    /// enabled).
    #[error("peer access: {0}")]
    PeerAccess(String),
    /// More live streams on one device than the pool's bookkeeping supports.
    #[error("too many live streams on this device (at most {max})")]
    TooManyStreams {
        /// The limit.
        max: usize,
    },
    /// Sharing a pool with another process was refused (see [`IpcErrorKind`] and
    /// `docs/semantics.md`, *IPC*).
    #[error("IPC ({kind:?}): {message}")]
    Ipc {
        /// Which rule or failure.
        kind: IpcErrorKind,
        /// What happened, naming the pool, process or allocation.
        message: String,
    },
    /// The device (or the backend) reported an error.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// Why a cross-process call of a pool failed ([`Error::Ipc`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IpcErrorKind {
    /// The pool was not built with `handle_type(HandleType::Posix)` (or cannot be: a
    /// native, sharded or pass-through pool), or the allocation cannot be exported.
    NotExportable,
    /// The importing process is not on the pool's whitelist (`MemPool::allow_process`).
    NotAllowed,
    /// The pool was dropped, or the allocation freed, by the exporting process.
    Destroyed,
    /// Import and export only work across processes.
    SameProcess,
    /// The pool is already imported in this process (one import per pool and process).
    AlreadyImported,
    /// The exporting process does not answer (it exited, or never exported).
    Unreachable,
    /// A descriptor or pointer that does not parse, or does not belong to the pool or
    /// device it is used with.
    InvalidDescriptor,
}

impl Error {
    /// An [`Error::Ipc`].
    pub(crate) fn ipc(kind: IpcErrorKind, message: impl Into<String>) -> Error {
        Error::Ipc { kind, message: message.into() }
    }
}

/// The numbers behind an out-of-memory error, so that its message explains itself.
///
/// Its `Display` is a short report: the request, the pool's and the device's memory, the
/// frees pending on other streams, the reuse policy, the cause and hints that match the
/// configuration, e.g.:
///
/// ```text
/// out of memory: cannot allocate 4.0 MiB (4.0 MiB rounded) on stream 1
///   pool: used 4.0 MiB, reserved 8.0 MiB, max 8.0 MiB, free in pool 4.0 MiB, largest free block 2.0 MiB
///   device: 63.9 GiB free of 64.0 GiB
///   pending frees: 4.0 MiB on stream 2 (the pool waited for them and retried once)
///   reuse policy: follow_event_dependencies off, opportunistic off, internal_dependencies off
///   cause: 4.0 MiB is free in the pool but the largest free block is 2.0 MiB: the free memory is fragmented
///   hint: 4.0 MiB is cached on stream 2 and not reusable on stream 1: enable follow_event_dependencies …
/// ```
///
/// With the `serde` feature it serializes as an object keyed by the field names (`pending` a
/// list of [`PendingFree`](crate::observe::PendingFree), `reuse` a
/// [`ReusePolicy`](crate::ReusePolicy) object), for an engine's logs and metrics. It is not
/// `Deserialize`: it is the pool's account of one failed allocation, which nothing takes
/// back as input, and reading it back would freeze its fields as an input format.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
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
    /// Free bytes cached on other streams that this request could not use when it first
    /// failed: the sum of [`pending`](Self::pending).
    pub pending_bytes: u64,
    /// Those bytes per stream, largest first. When not empty, the pool waited for those
    /// streams and retried ([`retried`](Self::retried)); the memory is then reusable, but
    /// was not enough.
    pub pending: Vec<crate::observe::PendingFree>,
    /// The pool's reuse policy when the allocation failed.
    pub reuse: crate::ReusePolicy,
    /// Device memory free / total when the allocation failed.
    pub device_free: u64,
    /// Device total memory.
    pub device_total: u64,
    /// Whether the pool waited for other streams' pending frees and retried.
    pub retried: bool,
    /// Why mapping more memory failed, when it did.
    pub cause: Option<String>,
}

impl OutOfMemory {
    /// Mapped bytes not in live allocations (`reserved - used`): cached or never used.
    pub fn free_in_pool(&self) -> u64 {
        self.reserved.saturating_sub(self.used)
    }

    /// Why the request failed, from the numbers (after the pool's retry), and what to do.
    fn cause_and_hint(&self) -> (String, &'static str) {
        let free = self.free_in_pool();
        let left = self.max.saturating_sub(self.used);
        if left < self.rounded {
            (
                format!(
                    "live allocations hold {} of the pool's max_size {}; the {} left is less than the request",
                    Bytes(self.used),
                    Bytes(self.max),
                    Bytes(left)
                ),
                "raise max_size or free allocations",
            )
        } else if self.reserved.saturating_add(self.rounded) <= self.max
            && self.device_total > 0
            && self.device_free < self.rounded
        {
            (
                format!(
                    "the pool may grow by {} more, but the device has only {} free: the rest is \
                     held outside this pool",
                    Bytes(self.max - self.reserved),
                    Bytes(self.device_free)
                ),
                "trim other pools (trim_to) or free driver allocations",
            )
        } else if free >= self.rounded {
            (
                format!(
                    "{} is free in the pool but the largest free block is {}: the free memory is fragmented",
                    Bytes(free),
                    Bytes(self.largest_free_block)
                ),
                "compact live allocations (MemPool::compact), or raise max_size so that the pool \
                 can map a contiguous range instead",
            )
        } else {
            (
                format!(
                    "{} is free in the pool and {} is not mapped, but no free or unmapped range of {} \
                     is contiguous: the pool's address range is fragmented",
                    Bytes(free),
                    Bytes(self.max.saturating_sub(self.reserved)),
                    Bytes(self.rounded)
                ),
                "compact live allocations (MemPool::compact), or raise max_size",
            )
        }
    }
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on = |b: bool| if b { "on" } else { "off" };
        writeln!(
            f,
            "out of memory: cannot allocate {} ({} rounded) on stream {}",
            Bytes(self.requested),
            Bytes(self.rounded),
            self.stream
        )?;
        writeln!(
            f,
            "  pool: used {}, reserved {}, max {}, free in pool {}, largest free block {}",
            Bytes(self.used),
            Bytes(self.reserved),
            Bytes(self.max),
            Bytes(self.free_in_pool()),
            Bytes(self.largest_free_block)
        )?;
        writeln!(f, "  device: {} free of {}", Bytes(self.device_free), Bytes(self.device_total))?;
        if self.pending.is_empty() {
            writeln!(f, "  pending frees: none on other streams")?;
        } else {
            write!(f, "  pending frees: ")?;
            for (i, p) in self.pending.iter().enumerate() {
                let sep = if i > 0 { ", " } else { "" };
                write!(f, "{sep}{} on stream {}", Bytes(p.bytes), p.stream)?;
            }
            if self.retried {
                write!(f, " (the pool waited for them and retried once)")?;
            }
            writeln!(f)?;
        }
        writeln!(
            f,
            "  reuse policy: follow_event_dependencies {}, opportunistic {}, internal_dependencies {}",
            on(self.reuse.follow_event_dependencies),
            on(self.reuse.opportunistic),
            on(self.reuse.internal_dependencies)
        )?;
        let (cause, hint) = self.cause_and_hint();
        write!(f, "  cause: {cause}")?;
        if let Some(mapping) = &self.cause {
            write!(f, " (mapping failed: {mapping})")?;
        }
        for p in &self.pending {
            let what = format!(
                "{} is cached on stream {} and not reusable on stream {}",
                Bytes(p.bytes),
                p.stream,
                self.stream
            );
            let r = self.reuse;
            let how = if !r.follow_event_dependencies && !r.internal_dependencies {
                format!(
                    "enable follow_event_dependencies or wait on an event: make stream {} wait on \
                     an event recorded on stream {} after those frees (or enable \
                     internal_dependencies)",
                    self.stream, p.stream
                )
            } else if !r.internal_dependencies {
                format!(
                    "stream {} is not ordered after those frees: record an event on stream {} \
                     after them and make stream {} wait on it (Stream::wait_event), or enable \
                     internal_dependencies",
                    self.stream, p.stream, self.stream
                )
            } else {
                "it is in blocks smaller than this request".to_string()
            };
            write!(f, "\n  hint: {what}: {how}")?;
            if self.retried {
                write!(f, "; this time the pool synchronized stream {} instead", p.stream)?;
            }
        }
        write!(f, "\n  hint: {hint}")?;
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

    fn oom(reuse: crate::ReusePolicy) -> OutOfMemory {
        const MIB: u64 = 1 << 20;
        OutOfMemory {
            requested: 3 * MIB + 100,
            rounded: 3 * MIB + 512,
            stream: 1,
            used: 4 * MIB,
            reserved: 8 * MIB,
            max: 8 * MIB,
            largest_free_block: 2 * MIB,
            pending_bytes: 3 * MIB + 104_858,
            pending: vec![crate::observe::PendingFree { stream: 2, bytes: 3 * MIB + 104_858 }],
            reuse,
            device_free: 60 << 30,
            device_total: 64 << 30,
            retried: true,
            cause: None,
        }
    }

    #[test]
    fn oom_report_gives_numbers_and_hints_that_match_the_policy() {
        let msg = oom(crate::ReusePolicy::NONE).to_string();
        assert!(
            msg.starts_with(
                "out of memory: cannot allocate 3.0 MiB (3.0 MiB rounded) on stream 1\n"
            ),
            "{msg}"
        );
        for part in [
            "used 4.0 MiB, reserved 8.0 MiB, max 8.0 MiB, free in pool 4.0 MiB, largest free block 2.0 MiB",
            "device: 60.0 GiB free of 64.0 GiB",
            "pending frees: 3.1 MiB on stream 2 (the pool waited for them and retried once)",
            "follow_event_dependencies off, opportunistic off, internal_dependencies off",
            "cause: 4.0 MiB is free in the pool but the largest free block is 2.0 MiB",
            "hint: 3.1 MiB is cached on stream 2 and not reusable on stream 1: enable follow_event_dependencies or wait on an event",
            "hint: compact live allocations",
        ] {
            assert!(msg.contains(part), "missing {part:?} in:\n{msg}");
        }
        let msg = oom(crate::ReusePolicy::default()).to_string();
        assert!(
            msg.contains("stream 1 is not ordered after those frees: record an event on stream 2"),
            "{msg}"
        );
        let mut full = oom(crate::ReusePolicy::default());
        full.used = 7 * MIB_;
        full.pending.clear();
        let msg = full.to_string();
        assert!(msg.contains("pending frees: none on other streams"), "{msg}");
        assert!(msg.contains("the 1.0 MiB left is less than the request"), "{msg}");
        assert!(msg.contains("hint: raise max_size or free allocations"), "{msg}");
    }

    const MIB_: u64 = 1 << 20;

    /// The lines of `report` that start with `  hint: `, without that prefix.
    fn hints(report: &str) -> Vec<&str> {
        report.lines().filter_map(|l| l.strip_prefix("  hint: ")).collect()
    }

    /// No line of a report has a run of blanks after its indentation (a broken line
    /// continuation in a format string leaves one).
    fn assert_no_blank_runs(report: &str) {
        for line in report.lines() {
            assert!(!line.trim_start().contains("  "), "a run of blanks in {line:?} of:\n{report}");
        }
    }

    #[test]
    fn every_pending_free_hint_reads_as_one_sentence() {
        let cached = "3.1 MiB is cached on stream 2 and not reusable on stream 1";
        let waited = "; this time the pool synchronized stream 2 instead";
        let cases = [
            (
                crate::ReusePolicy::NONE,
                "enable follow_event_dependencies or wait on an event: make stream 1 wait on an \
                 event recorded on stream 2 after those frees (or enable internal_dependencies)",
            ),
            (
                crate::ReusePolicy::NONE.follow_event_dependencies(true),
                "stream 1 is not ordered after those frees: record an event on stream 2 after \
                 them and make stream 1 wait on it (Stream::wait_event), or enable \
                 internal_dependencies",
            ),
            (
                crate::ReusePolicy::NONE.internal_dependencies(true),
                "it is in blocks smaller than this request",
            ),
            (crate::ReusePolicy::ALL, "it is in blocks smaller than this request"),
        ];
        for (policy, how) in cases {
            for retried in [true, false] {
                let report = OutOfMemory { retried, ..oom(policy) }.to_string();
                assert_no_blank_runs(&report);
                let suffix = if retried { waited } else { "" };
                assert_eq!(
                    hints(&report),
                    [
                        format!("{cached}: {how}{suffix}").as_str(),
                        "compact live allocations \
                     (MemPool::compact), or raise max_size so that the pool can map a \
                     contiguous range instead"
                    ],
                    "{policy:?}, retried {retried}"
                );
            }
        }
    }

    #[test]
    fn every_cause_has_its_own_hint() {
        let fragmented = oom(crate::ReusePolicy::ALL);
        let max_reached = OutOfMemory { used: 7 * MIB_, ..fragmented.clone() };
        let held_elsewhere = OutOfMemory {
            reserved: 4 * MIB_,
            device_free: MIB_,
            pending: Vec::new(),
            ..fragmented.clone()
        };
        let range_fragmented = OutOfMemory {
            used: 4 * MIB_,
            reserved: 6 * MIB_,
            largest_free_block: MIB_,
            pending: Vec::new(),
            ..fragmented.clone()
        };
        let cases = [
            (
                fragmented,
                "cause: 4.0 MiB is free in the pool but the largest free block is 2.0 MiB: the \
                 free memory is fragmented",
                "compact live allocations (MemPool::compact), or raise max_size so that the \
                 pool can map a contiguous range instead",
            ),
            (
                max_reached,
                "cause: live allocations hold 7.0 MiB of the pool's max_size 8.0 MiB; the 1.0 \
                 MiB left is less than the request",
                "raise max_size or free allocations",
            ),
            (
                held_elsewhere,
                "cause: the pool may grow by 4.0 MiB more, but the device has only 1.0 MiB \
                 free: the rest is held outside this pool",
                "trim other pools (trim_to) or free driver allocations",
            ),
            (
                range_fragmented,
                "cause: 2.0 MiB is free in the pool and 2.0 MiB is not mapped, but no free or \
                 unmapped range of 3.0 MiB is contiguous: the pool's address range is \
                 fragmented",
                "compact live allocations (MemPool::compact), or raise max_size",
            ),
        ];
        for (oom, cause, hint) in cases {
            let report = oom.to_string();
            assert_no_blank_runs(&report);
            assert!(report.lines().any(|l| l == format!("  {cause}")), "{cause:?} in:\n{report}");
            assert_eq!(hints(&report).last(), Some(&hint), "{report}");
        }
    }

    #[test]
    fn bytes_display() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1536).to_string(), "1.5 KiB");
        assert_eq!(Bytes(3 << 30).to_string(), "3.0 GiB");
    }
}
