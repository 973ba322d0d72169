//! What the sanitizer reports: [`SanitizerReport`] and its parts, and how a report reads.

use std::fmt;

use super::HOST;

/// What a [`SanitizerReport`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReportKind {
    /// A use of a range after its free: the free happens before the task (or the task was
    /// enqueued after the free and is not ordered before it, or the memory was freed with
    /// the driver's `free`).
    UseAfterFree,
    /// A use by a stream that is not ordered after the allocation, where that can race with
    /// the block's previous owner (an earlier free of the range is not ordered before the
    /// use); with the strict option, every use not ordered after the allocation.
    NotOrderedAfterAlloc,
    /// A task enqueued before the allocation that covers its range was made.
    UseBeforeAlloc,
    /// An access of pool memory that no allocation covers.
    Unallocated,
    /// An access that starts inside an allocation and runs past its requested size.
    OutOfBounds,
    /// A free that is not ordered after a use of the allocation by another stream (a use
    /// that ran before the free was made), or a use running after the free was made that is
    /// neither ordered before nor after it.
    FreeNotOrderedAfterUse,
    /// A use of a block that its pool handed out while an earlier free of it was neither
    /// ordered before the allocation nor complete, where the use is not ordered after that
    /// free either: it can race with the previous owner's work (a pool bug, or a free made on
    /// a stream not ordered after its allocation).
    UnorderedReuse,
    /// A pool handed out a block that overlaps a live allocation (a pool bug).
    OverlappingAllocation,
}

impl ReportKind {
    fn describe(self) -> &'static str {
        match self {
            ReportKind::UseAfterFree => "use after free",
            ReportKind::NotOrderedAfterAlloc => "use not ordered after the allocation",
            ReportKind::UseBeforeAlloc => "use before the allocation",
            ReportKind::Unallocated => "use of unallocated pool memory",
            ReportKind::OutOfBounds => "out-of-bounds access",
            ReportKind::FreeNotOrderedAfterUse => "free not ordered after a use",
            ReportKind::UnorderedReuse => {
                "use of a block reused before its earlier free is ordered"
            }
            ReportKind::OverlappingAllocation => "allocation overlaps a live allocation",
        }
    }
}

/// The allocation a [`SanitizerReport`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    /// Pool id, or `None` for memory from the driver's `malloc`.
    pub pool: Option<u64>,
    /// First byte.
    pub ptr: u64,
    /// Requested size in bytes.
    pub size: u64,
    /// Stream the allocation was made for ([`HOST`] for `malloc`).
    pub stream: u64,
    /// That stream's enqueued position at the allocation.
    pub position: u64,
}

/// A position on a stream involved in a report (the free or allocation point).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPoint {
    /// What happened there: `"freed"`, `"alloc"`, or the name of the task that used it.
    pub what: &'static str,
    /// Stream id ([`HOST`] for driver calls).
    pub stream: u64,
    /// The stream's enqueued position at that point (the task position for a use).
    pub position: u64,
}

/// One finding of the stream-order sanitizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SanitizerReport {
    /// What is wrong.
    pub kind: ReportKind,
    /// The allocation involved, if any.
    pub allocation: Option<AllocationInfo>,
    /// The accessing stream ([`HOST`] for synchronous copies; the allocating or freeing
    /// stream for reports made at an allocation or a free).
    pub stream: u64,
    /// Position of the task on that stream (the stream's enqueued count for allocation and
    /// free reports).
    pub position: u64,
    /// Task name (kernel name, `copy_h2d`, `memset`…; `alloc` / `free` for pool calls).
    pub task: String,
    /// The other point involved: the free, the allocation, or the unordered use.
    pub other: Option<StreamPoint>,
    /// First byte of the access (the allocation's first byte for allocation / free reports).
    pub addr: u64,
    /// Length of the access in bytes.
    pub len: u64,
    /// Whether the access writes.
    pub write: bool,
}

fn who(stream: u64) -> String {
    if stream == HOST {
        "the host".into()
    } else {
        format!("stream {stream}")
    }
}

impl fmt::Display for SanitizerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream-order sanitizer: {}: ", self.kind.describe())?;
        let verb = if self.write { "writes" } else { "reads" };
        match self.task.as_str() {
            "alloc" | "free" => write!(
                f,
                "{} of {:#x} on {} at position {}",
                self.task,
                self.addr,
                who(self.stream),
                self.position
            )?,
            _ => write!(
                f,
                "{} task {} ({}) {verb} {:#x} (+{} bytes)",
                who(self.stream),
                self.position,
                self.task,
                self.addr,
                self.len
            )?,
        }
        match &self.allocation {
            Some(a) => {
                let pool = a.pool.map_or_else(|| "malloc".to_string(), |p| format!("pool {p}"));
                write!(
                    f,
                    "; allocation {:#x} (+{} bytes, {pool}) allocated on {} at position {}",
                    a.ptr,
                    a.size,
                    who(a.stream),
                    a.position
                )?;
            }
            None => write!(f, "; no allocation covers it")?,
        }
        if let Some(o) = &self.other {
            write!(f, "; {} on {} at position {}", o.what, who(o.stream), o.position)?;
        }
        let why = match self.kind {
            ReportKind::UseAfterFree => " (the task runs after the free)",
            ReportKind::NotOrderedAfterAlloc => {
                " (no event or synchronisation orders the task after the allocation, and an \
                 earlier free of the block is not ordered before it)"
            }
            ReportKind::UseBeforeAlloc => " (the task was enqueued before the allocation)",
            ReportKind::Unallocated => " (freed or never allocated)",
            ReportKind::OutOfBounds => " (the access runs past the requested size)",
            ReportKind::FreeNotOrderedAfterUse => {
                " (the use and the free are not ordered by stream order, events or \
                 synchronisation)"
            }
            ReportKind::UnorderedReuse => {
                " (the earlier free was neither ordered before the allocation nor complete, and \
                 is not ordered before this use)"
            }
            ReportKind::OverlappingAllocation => "",
        };
        f.write_str(why)
    }
}
