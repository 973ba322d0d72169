//! Text exports of a history: JSON lines, Chrome trace (Perfetto), replay CSV.

use std::collections::HashMap;
use std::fmt::Write;

use super::json::{self, Object};
use super::lifetimes::{lifetimes, Lifetime};
use super::{reuse_name, Record, RecordKind};
use crate::error::Bytes;

/// The records as [JSON lines](https://jsonlines.org): one object per record, oldest first,
/// each line ending in `\n`.
///
/// Fields: `t_ns` (ns since the pool was created), `kind` ([`RecordKind::as_str`]),
/// `stream` (backend stream id, 0 = none), `offset`, `size`, `requested`, `used`,
/// `reserved` (bytes, after the event), `reuse` ([`reuse_name`] or `null`), `location`
/// (`{"file","line","column"}` or `null`). Every number is an unsigned integer.
///
/// With the `serde` feature each line is `serde_json`'s output for the [`Record`].
pub fn json_lines(records: &[Record]) -> String {
    #[cfg(feature = "serde")]
    {
        super::serialize::json_lines(records)
    }
    #[cfg(not(feature = "serde"))]
    {
        json_lines_by_hand(records)
    }
}

/// [`json_lines`] without `serde`; with it, the reference its output is tested against.
#[cfg(any(test, not(feature = "serde")))]
pub(crate) fn json_lines_by_hand(records: &[Record]) -> String {
    let mut out = String::with_capacity(records.len() * 160);
    for r in records {
        let mut o = Object::new(&mut out);
        o.u64("t_ns", r.t_ns)
            .str("kind", r.kind.as_str())
            .u64("stream", r.stream)
            .u64("offset", r.offset)
            .u64("size", r.size)
            .u64("requested", r.requested)
            .u64("used", r.used)
            .u64("reserved", r.reserved)
            .opt_str("reuse", r.reuse.map(reuse_name))
            .raw("location", |out| json::location(out, r.location))
            .finish();
        out.push('\n');
    }
    out
}

/// The records as a [Chrome trace event] JSON document, which `ui.perfetto.dev` and
/// `chrome://tracing` open.
///
/// - a counter (`"ph":"C"`) named `memory` with `used` and `reserved` in bytes, at every
///   record that changes them;
/// - each allocation as a complete slice (`"ph":"X"`) from its `Alloc` to its `Free` record,
///   on a track of its stream (`stream <id>`; allocations that overlap in time go to further
///   tracks of the same stream, `stream <id> (2)`…, so that slices never overlap on one
///   track), with offset, sizes, reuse rule, location and freeing stream in `args`;
/// - map, unmap, trim, OOM and failed allocations as instant events (`"ph":"i"`) on the
///   `pool events` track;
/// - `"ph":"M"` metadata naming the process and tracks.
///
/// Times (`ts`, `dur`) are microseconds since the pool was created; `pid` is 1, `tid` 0 is
/// the pool's own track. See the [module docs](super) for the edges of the window.
///
/// [Chrome trace event]: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
pub fn chrome_trace(records: &[Record]) -> String {
    chrome_trace_with(records, 0)
}

pub(crate) fn chrome_trace_with(records: &[Record], dropped: u64) -> String {
    let lives = lifetimes(records);
    let lanes = assign_lanes(&lives);
    let mut out = String::with_capacity(256 + records.len() * 200);
    out.push_str("{\"displayTimeUnit\":\"ms\",\"otherData\":");
    Object::new(&mut out)
        .str("producer", "soma")
        .u64("records", records.len() as u64)
        .u64("dropped_records", dropped)
        .finish();
    out.push_str(",\"traceEvents\":[\n");
    let mut first = true;
    let mut event = |out: &mut String, f: &mut dyn FnMut(&mut Object<'_>)| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        let mut o = Object::new(out);
        f(&mut o);
        o.finish();
    };
    let meta = |o: &mut Object<'_>, name: &str, tid: u64| {
        o.str("ph", "M").str("name", name).u64("pid", 1).u64("tid", tid);
    };
    event(&mut out, &mut |o| {
        meta(o, "process_name", 0);
        o.raw("args", |s| Object::new(s).str("name", "soma pool").finish());
    });
    event(&mut out, &mut |o| {
        meta(o, "thread_name", 0);
        o.raw("args", |s| Object::new(s).str("name", "pool events").finish());
    });
    for (tid, &(stream, lane)) in lanes.tracks.iter().enumerate() {
        let tid = tid as u64 + 1;
        let name = if lane == 0 {
            format!("stream {stream}")
        } else {
            format!("stream {stream} ({})", lane + 1)
        };
        event(&mut out, &mut |o| {
            meta(o, "thread_name", tid);
            o.raw("args", |s| Object::new(s).str("name", &name).finish());
        });
        event(&mut out, &mut |o| {
            meta(o, "thread_sort_index", tid);
            o.raw("args", |s| Object::new(s).u64("sort_index", tid).finish());
        });
    }
    let mut last_counter = None;
    for r in records {
        if last_counter != Some((r.used, r.reserved)) {
            last_counter = Some((r.used, r.reserved));
            event(&mut out, &mut |o| {
                o.str("ph", "C").str("name", "memory").u64("pid", 1).u64("tid", 0);
                o.micros("ts", r.t_ns);
                o.raw("args", |s| {
                    Object::new(s).u64("used", r.used).u64("reserved", r.reserved).finish()
                });
            });
        }
        let name = match r.kind {
            RecordKind::Alloc | RecordKind::Free => continue,
            RecordKind::Map => format!("map {}", Bytes(r.size)),
            RecordKind::Unmap => format!("unmap {}", Bytes(r.size)),
            RecordKind::Trim => format!("trim: released {}", Bytes(r.size)),
            RecordKind::Oom => {
                format!("out of memory: {} on stream {}", Bytes(r.requested), r.stream)
            }
            RecordKind::AllocFailed => {
                format!("allocation failed: {} on stream {}", Bytes(r.requested), r.stream)
            }
        };
        event(&mut out, &mut |o| {
            o.str("ph", "i").str("s", "t").str("name", &name).str("cat", r.kind.as_str());
            o.u64("pid", 1).u64("tid", 0).micros("ts", r.t_ns);
            o.raw("args", |s| {
                Object::new(s)
                    .u64("stream", r.stream)
                    .u64("offset", r.offset)
                    .u64("size", r.size)
                    .u64("requested", r.requested)
                    .u64("used", r.used)
                    .u64("reserved", r.reserved)
                    .raw("location", |s| json::location(s, r.location))
                    .finish()
            });
        });
    }
    for (l, &tid) in lives.iter().zip(&lanes.tid_of) {
        let alloc = l.alloc.map(|i| &records[i]);
        let free = l.free.map(|i| &records[i]);
        let name = Bytes(l.size).to_string();
        event(&mut out, &mut |o| {
            o.str("ph", "X").str("name", &name).str("cat", "alloc");
            o.u64("pid", 1).u64("tid", tid).micros("ts", l.start_ns);
            o.micros("dur", l.end_ns - l.start_ns);
            o.raw("args", |s| {
                let mut a = Object::new(s);
                a.u64("offset", l.offset)
                    .u64("size", l.size)
                    .opt_u64("requested", alloc.map(|r| r.requested))
                    .u64("stream", l.stream)
                    .opt_u64("freed_on_stream", free.map(|r| r.stream))
                    .opt_str("reuse", alloc.and_then(|r| r.reuse.map(reuse_name)))
                    .raw("location", |s| json::location(s, alloc.and_then(|r| r.location)))
                    .raw("free_location", |s| json::location(s, free.and_then(|r| r.location)))
                    .bool("allocated_before_window", alloc.is_none())
                    .bool("live_at_end", free.is_none())
                    .finish();
            });
        });
    }
    out.push_str("\n]}\n");
    out
}

struct Lanes {
    /// `(stream, lane)` of each track; the track's tid is its index + 1.
    tracks: Vec<(u64, usize)>,
    /// tid of each lifetime.
    tid_of: Vec<u64>,
}

/// First-fit interval partitioning per stream: a lifetime goes to the lowest track of its
/// stream whose last slice ended at or before its start.
fn assign_lanes(lives: &[Lifetime]) -> Lanes {
    let mut per_stream: HashMap<u64, Vec<(u64, u64)>> = HashMap::new(); // (end, tid)
    let mut tracks = Vec::new();
    let mut tid_of = Vec::with_capacity(lives.len());
    for l in lives {
        let lanes = per_stream.entry(l.stream).or_default();
        let tid = match lanes.iter_mut().find(|(end, _)| *end <= l.start_ns) {
            Some(lane) => {
                lane.0 = l.end_ns;
                lane.1
            }
            None => {
                tracks.push((l.stream, lanes.len()));
                let tid = tracks.len() as u64;
                lanes.push((l.end_ns, tid));
                tid
            }
        };
        tid_of.push(tid);
    }
    Lanes { tracks, tid_of }
}

/// The allocations and frees as a trace CSV in the format of the allocation traces that
/// `soma-replay` reads (see `data/traces/README.md`):
///
/// ```text
/// op,id,bytes,stream
/// a,<id>,<bytes>,<stream>
/// f,<id>,0,<stream>
/// ```
///
/// Ids count up from 0 in allocation order and are never reused; `bytes` is the size that
/// was asked for (the rounded size if a record carries none); `stream` is the backend id of
/// the stream the allocation was made or freed on. Frees of allocations made before the
/// first record held are left out (the format needs the allocation first); allocations
/// live at the end have no `f` line.
pub fn trace_csv(records: &[Record]) -> String {
    let mut out = String::from("op,id,bytes,stream\n");
    let mut open: HashMap<u64, u64> = HashMap::new();
    let mut next = 0u64;
    for r in records {
        match r.kind {
            RecordKind::Alloc => {
                let bytes = if r.requested > 0 { r.requested } else { r.size };
                open.insert(r.offset, next);
                let _ = writeln!(out, "a,{next},{bytes},{}", r.stream);
                next += 1;
            }
            RecordKind::Free => {
                if let Some(id) = open.remove(&r.offset) {
                    let _ = writeln!(out, "f,{id},0,{}", r.stream);
                }
            }
            _ => {}
        }
    }
    out
}
