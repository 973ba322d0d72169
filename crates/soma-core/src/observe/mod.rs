//! Observability: the pool's event history (an opt-in bounded ring buffer) and what is built
//! from it.
//!
//! | what | from | how |
//! |---|---|---|
//! | [`History`] | [`MemPoolBuilder::history`](crate::MemPoolBuilder::history) | the **last** `capacity` [`Record`]s; older ones are dropped and counted ([`History::dropped`]) |
//! | JSON lines | [`History::to_json_lines`], [`json_lines`] | one JSON object per record |
//! | Chrome trace / Perfetto | [`History::to_chrome_trace`], [`chrome_trace`] | open in `ui.perfetto.dev` or `chrome://tracing` |
//! | replay trace | [`History::to_trace_csv`], [`trace_csv`] | `op,id,bytes,stream`, the format of the allocation traces `soma-replay` reads |
//! | memory timeline picture | [`History::to_svg`], [`timeline_svg`] | an SVG: used / reserved lines and stacked live allocations |
//! | [`Snapshot`] | [`MemPool::snapshot`](crate::MemPool::snapshot) | segments and blocks now, with their state; [`Snapshot::to_json`] |
//!
//! Strings are escaped per RFC 8259 / XML, so the output parses with any JSON or XML reader.
//! Without the `serde` feature everything is written by hand (no serialisation dependency).
//! With it, [`Record`], [`Snapshot`] and their parts implement `serde::Serialize` and
//! `Deserialize`, and the JSON lines and [`Snapshot::to_json`] are written by `serde_json` from
//! those implementations, byte for byte as without the feature. The Chrome trace stays
//! hand-written in both: it is a document built from the records, not one of their values,
//! and its times are fixed-point microseconds (`1234.500`), a number format `serde_json`'s
//! floating-point output does not keep.
//!
//! Because the ring keeps only the last records, an export may start in the middle of an
//! allocation's life: a free whose allocation was dropped from the ring is treated as an
//! allocation live since the first record held (Chrome trace, SVG) or skipped (replay CSV,
//! which needs an allocation line first). Allocations still live at the last record end there.

use std::collections::VecDeque;
use std::panic::Location;

use crate::engine::ReuseKind;

mod export;
mod json;
mod lifetimes;
#[cfg(feature = "serde")]
mod serialize;
mod snapshot;
mod svg;

pub use export::{chrome_trace, json_lines, trace_csv};
pub use snapshot::{BlockStatus, Snapshot, SnapshotBlock, SnapshotSegment};
pub use svg::{timeline_svg, SvgOptions};

/// What happened.
///
/// With the `serde` feature it serializes as its [name in exports](Self::as_str).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum RecordKind {
    /// An allocation was served ([`Record::reuse`] says from where).
    Alloc,
    /// An allocation was freed onto its stream.
    Free,
    /// Physical memory was mapped into the pool's range.
    Map,
    /// Physical memory was unmapped and given back to the device.
    Unmap,
    /// A trim (or a release at the threshold) finished; `size` is the bytes released.
    Trim,
    /// An allocation failed with out of memory.
    Oom,
    /// An allocation failed for another reason (bad size, driver error).
    AllocFailed,
}

impl RecordKind {
    /// The kind's name in exports: `alloc`, `free`, `map`, `unmap`, `trim`, `oom`,
    /// `alloc_failed`.
    pub const fn as_str(self) -> &'static str {
        match self {
            RecordKind::Alloc => "alloc",
            RecordKind::Free => "free",
            RecordKind::Map => "map",
            RecordKind::Unmap => "unmap",
            RecordKind::Trim => "trim",
            RecordKind::Oom => "oom",
            RecordKind::AllocFailed => "alloc_failed",
        }
    }
}

/// The name of a reuse rule in exports: `same_stream`, `event_dependency`, `opportunistic`,
/// `internal_dependency`, `host_synchronized`.
pub const fn reuse_name(kind: ReuseKind) -> &'static str {
    match kind {
        ReuseKind::SameStream => "same_stream",
        ReuseKind::EventDependency => "event_dependency",
        ReuseKind::Opportunistic => "opportunistic",
        ReuseKind::InternalDependency => "internal_dependency",
        ReuseKind::HostSynchronized => "host_synchronized",
    }
}

/// Free bytes cached on another stream that an allocation could not use (see
/// [`OutOfMemory::pending`](crate::OutOfMemory::pending)).
///
/// With the `serde` feature it serializes as `{"stream":…,"bytes":…}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PendingFree {
    /// Backend id of the stream they were freed on (0 when that stream no longer exists).
    pub stream: u64,
    /// How many bytes.
    pub bytes: u64,
}

/// One entry of the history.
///
/// With the `serde` feature it serializes as the object of a line of [`json_lines`] (the
/// field names, in this order; `kind` and `reuse` by name, `location` as
/// `{"file","line","column"}` or `null`). Deserializing reads such an object back with
/// `location: None`: a [`Location`] cannot be built outside the compiler, so the caller's
/// source location is read and dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Record {
    /// Nanoseconds since the pool was created.
    pub t_ns: u64,
    /// What happened.
    pub kind: RecordKind,
    /// Backend id of the stream involved (0 when none, e.g. a release at synchronize).
    pub stream: u64,
    /// Offset in the pool's range (0 when not applicable).
    pub offset: u64,
    /// Bytes: the block's rounded size, or the mapped / unmapped / released bytes.
    pub size: u64,
    /// Bytes asked for (allocations and failures; 0 otherwise).
    pub requested: u64,
    /// The pool's used bytes after the event.
    pub used: u64,
    /// The pool's reserved bytes after the event.
    pub reserved: u64,
    /// For allocations: the reuse rule that served it, `None` for fresh memory.
    pub reuse: Option<ReuseKind>,
    /// The caller's source location, for allocations and frees made through `#[track_caller]`
    /// entry points.
    #[cfg_attr(feature = "serde", serde(with = "serialize::location"))]
    pub location: Option<&'static Location<'static>>,
}

/// A bounded ring buffer of [`Record`]s that keeps the **last** `capacity` records (older
/// ones are dropped and counted). Pushing never allocates once the buffer is created.
///
/// A pool keeps one when built with [`MemPoolBuilder::history`](crate::MemPoolBuilder::history)
/// ([`MemPool::history_log`](crate::MemPool::history_log) clones it); a program can also fill
/// one itself with [`push`](Self::push), e.g. to draw the allocations of another allocator
/// with [`to_svg`](Self::to_svg). The exports read the records held, oldest first; see the
/// [module docs](self) for how a window that starts mid-life is handled.
///
/// ```
/// use soma_core::observe::{History, Record, RecordKind};
/// let mut h = History::new(2);
/// for t in 0..3 {
///     h.push(Record { t_ns: t, ..Record::new(RecordKind::Map) });
/// }
/// assert_eq!((h.len(), h.dropped()), (2, 1)); // the last 2 are kept
/// assert!(h.to_chrome_trace().contains("\"traceEvents\""));
/// ```
#[derive(Clone, Debug)]
pub struct History {
    records: VecDeque<Record>,
    capacity: usize,
    dropped: u64,
}

impl History {
    /// An empty history holding at most `capacity` records (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        History { records: VecDeque::with_capacity(capacity), capacity, dropped: 0 }
    }

    /// Appends a record, dropping the oldest when full. O(1).
    pub fn push(&mut self, record: Record) {
        if self.records.len() == self.capacity {
            self.records.pop_front();
            self.dropped += 1;
        }
        self.records.push_back(record);
    }

    /// Records held, oldest first.
    pub fn records(&self) -> impl ExactSizeIterator<Item = &Record> + '_ {
        self.records.iter()
    }

    /// Number of records held.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Most records held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records dropped because the buffer was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The records held, oldest first, as a vector.
    pub fn to_vec(&self) -> Vec<Record> {
        self.records.iter().copied().collect()
    }

    /// The records as JSON lines ([`json_lines`]).
    pub fn to_json_lines(&self) -> String {
        json_lines(&self.records.make_contiguous_ref())
    }

    /// The records as a Chrome trace / Perfetto JSON document ([`chrome_trace`]); the number
    /// of dropped records is in `otherData.dropped_records`.
    pub fn to_chrome_trace(&self) -> String {
        export::chrome_trace_with(&self.records.make_contiguous_ref(), self.dropped)
    }

    /// The allocations and frees as a replay trace ([`trace_csv`]).
    pub fn to_trace_csv(&self) -> String {
        trace_csv(&self.records.make_contiguous_ref())
    }

    /// A memory timeline picture ([`timeline_svg`]).
    pub fn to_svg(&self, options: &SvgOptions) -> String {
        timeline_svg(&self.records.make_contiguous_ref(), options)
    }
}

/// `VecDeque::make_contiguous` needs `&mut`; the exports only read, so they take a copy when
/// the ring has wrapped.
trait ContiguousRef {
    fn make_contiguous_ref(&self) -> std::borrow::Cow<'_, [Record]>;
}

impl ContiguousRef for VecDeque<Record> {
    fn make_contiguous_ref(&self) -> std::borrow::Cow<'_, [Record]> {
        match self.as_slices() {
            (a, []) => std::borrow::Cow::Borrowed(a),
            _ => std::borrow::Cow::Owned(self.iter().copied().collect()),
        }
    }
}

impl Record {
    /// A record of `kind` at time 0 with every other field 0 / `None`; fill the rest with
    /// struct update syntax (`Record { t_ns, size, ..Record::new(kind) }`).
    pub const fn new(kind: RecordKind) -> Record {
        Record {
            t_ns: 0,
            kind,
            stream: 0,
            offset: 0,
            size: 0,
            requested: 0,
            used: 0,
            reserved: 0,
            reuse: None,
            location: None,
        }
    }
}

/// `tracing` events (feature `tracing`); no-ops without it. None is on the hot path.
#[cfg(feature = "tracing")]
mod trace_hooks {
    pub(crate) fn trace_pool_created(id: u64, max_size: u64, threshold: u64, alignment: u64) {
        tracing::info!(
            pool = id,
            max_size,
            release_threshold = threshold,
            alignment,
            "soma pool created"
        );
    }
    pub(crate) fn trace_map(offset: u64, size: u64, reserved: u64) {
        tracing::debug!(offset, size, reserved, "soma pool grew (map)");
    }
    pub(crate) fn trace_trim(cause: &'static str, released: u64, reserved: u64) {
        tracing::debug!(cause, released, reserved, "soma pool released memory");
    }
    pub(crate) fn trace_oom(error: &crate::Error) {
        tracing::warn!(%error, "soma pool out of memory");
    }
    pub(crate) fn trace_release_failed(cause: &'static str, error: &crate::hal::DriverError) {
        tracing::debug!(cause, %error, "soma pool kept memory the backend would not release");
    }
}

#[cfg(not(feature = "tracing"))]
mod trace_hooks {
    pub(crate) fn trace_pool_created(_: u64, _: u64, _: u64, _: u64) {}
    pub(crate) fn trace_map(_: u64, _: u64, _: u64) {}
    pub(crate) fn trace_trim(_: &'static str, _: u64, _: u64) {}
    pub(crate) fn trace_oom(_: &crate::Error) {}
    pub(crate) fn trace_release_failed(_: &'static str, _: &crate::hal::DriverError) {}
}

pub(crate) use trace_hooks::{
    trace_map, trace_oom, trace_pool_created, trace_release_failed, trace_trim,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(t: u64) -> Record {
        Record {
            t_ns: t,
            kind: RecordKind::Alloc,
            stream: 1,
            offset: 0,
            size: 512,
            requested: 100,
            used: 512,
            reserved: 2 << 20,
            reuse: None,
            location: None,
        }
    }

    #[test]
    fn keeps_the_last_records_and_counts_the_dropped() {
        let mut h = History::new(3);
        for t in 0..10 {
            h.push(rec(t));
        }
        assert_eq!(h.len(), 3);
        assert_eq!(h.dropped(), 7);
        assert_eq!(h.records().map(|r| r.t_ns).collect::<Vec<_>>(), vec![7, 8, 9]);
        assert_eq!(h.records.capacity(), h.records.capacity().max(3));
    }
}
