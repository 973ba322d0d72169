//! Observability: the pool's event history (an opt-in bounded ring buffer) and what is built
//! from it.

use std::collections::VecDeque;
use std::panic::Location;

use crate::engine::ReuseKind;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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

/// One entry of the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    pub location: Option<&'static Location<'static>>,
}

/// A bounded ring buffer of [`Record`]s that keeps the **last** `capacity` records (older
/// ones are dropped and counted). Pushing never allocates once the buffer is created.
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
}

#[cfg(not(feature = "tracing"))]
mod trace_hooks {
    pub(crate) fn trace_pool_created(_: u64, _: u64, _: u64, _: u64) {}
    pub(crate) fn trace_map(_: u64, _: u64, _: u64) {}
    pub(crate) fn trace_trim(_: &'static str, _: u64, _: u64) {}
    pub(crate) fn trace_oom(_: &crate::Error) {}
}

pub(crate) use trace_hooks::{trace_map, trace_oom, trace_pool_created, trace_trim};

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
