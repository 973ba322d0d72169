//! Pairs the `Alloc` and `Free` records of a history into allocation lifetimes.

use std::collections::HashMap;

use super::{Record, RecordKind};

/// One allocation's life as far as the records show it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lifetime {
    /// Index of the `Alloc` record; `None` when it was dropped from the ring (the allocation
    /// is then taken as live since the first record).
    pub(crate) alloc: Option<usize>,
    /// Index of the `Free` record; `None` when still live at the last record.
    pub(crate) free: Option<usize>,
    /// Start (the alloc's time, or the first record's).
    pub(crate) start_ns: u64,
    /// End (the free's time, or the last record's).
    pub(crate) end_ns: u64,
    pub(crate) offset: u64,
    pub(crate) size: u64,
    /// Stream of the allocation (of the free when the alloc is not held).
    pub(crate) stream: u64,
}

/// The lifetimes in order of their start (allocation order; those live since before the
/// window first, in the order of their frees).
///
/// Allocations are matched to frees by offset: an offset names one live allocation at a
/// time. An `Alloc` at an offset that is still open (possible only with foreign records)
/// ends the open one there.
pub(crate) fn lifetimes(records: &[Record]) -> Vec<Lifetime> {
    let (Some(first), Some(last)) = (records.first(), records.last()) else {
        return Vec::new();
    };
    let (t0, t1) = (first.t_ns, last.t_ns.max(first.t_ns));
    let mut before: Vec<Lifetime> = Vec::new();
    let mut out: Vec<Lifetime> = Vec::new();
    let mut open: HashMap<u64, usize> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        match r.kind {
            RecordKind::Alloc => {
                if let Some(j) = open.remove(&r.offset) {
                    out[j].end_ns = r.t_ns;
                }
                open.insert(r.offset, out.len());
                out.push(Lifetime {
                    alloc: Some(i),
                    free: None,
                    start_ns: r.t_ns,
                    end_ns: t1,
                    offset: r.offset,
                    size: r.size,
                    stream: r.stream,
                });
            }
            RecordKind::Free => match open.remove(&r.offset) {
                Some(j) => {
                    out[j].free = Some(i);
                    out[j].end_ns = r.t_ns.max(out[j].start_ns);
                }
                None => before.push(Lifetime {
                    alloc: None,
                    free: Some(i),
                    start_ns: t0,
                    end_ns: r.t_ns,
                    offset: r.offset,
                    size: r.size,
                    stream: r.stream,
                }),
            },
            _ => {}
        }
    }
    before.extend(out);
    before
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(t_ns: u64, kind: RecordKind, offset: u64, size: u64) -> Record {
        Record { t_ns, offset, size, stream: 1, ..Record::new(kind) }
    }

    #[test]
    fn pairs_by_offset_and_handles_the_window_edges() {
        let records = [
            rec(10, RecordKind::Alloc, 0, 512),
            rec(20, RecordKind::Free, 4096, 1024), // allocated before the window
            rec(30, RecordKind::Alloc, 512, 512),
            rec(40, RecordKind::Free, 0, 512),
            rec(50, RecordKind::Map, 0, 2 << 20),
        ];
        let l = lifetimes(&records);
        assert_eq!(l.len(), 3);
        assert_eq!((l[0].alloc, l[0].free, l[0].start_ns, l[0].end_ns), (None, Some(1), 10, 20));
        assert_eq!((l[1].alloc, l[1].free, l[1].start_ns, l[1].end_ns), (Some(0), Some(3), 10, 40));
        assert_eq!((l[2].alloc, l[2].free, l[2].end_ns), (Some(2), None, 50));
    }
}
