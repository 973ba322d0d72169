//! `serde` for the history's records and the snapshot (feature `serde`), and the JSON exports
//! written from it by `serde_json`, byte for byte as the hand-written writer's.

use std::io;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Record, Snapshot, SnapshotSegment};
use crate::engine::StreamSlot;

/// [`Record::location`] as `{"file","line","column"}` or `null`. A `Location` cannot be built
/// outside the compiler, so reading one back gives `None`.
pub(super) mod location {
    use std::panic::Location;

    use serde::de::IgnoredAny;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize)]
    struct SourceLocation<'a> {
        file: &'a str,
        line: u32,
        column: u32,
    }

    pub(crate) fn serialize<S: Serializer>(
        location: &Option<&'static Location<'static>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        location
            .map(|l| SourceLocation { file: l.file(), line: l.line(), column: l.column() })
            .serialize(serializer)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<&'static Location<'static>>, D::Error> {
        IgnoredAny::deserialize(deserializer)?;
        Ok(None)
    }
}

/// The `totals` object of a snapshot. The counts follow from the segments: written, not read.
#[derive(Serialize, Deserialize)]
struct Totals {
    used: u64,
    reserved: u64,
    cached: u64,
    free: u64,
    largest_free_block: u64,
    #[serde(skip_deserializing)]
    segments: u64,
    #[serde(skip_deserializing)]
    blocks: u64,
    #[serde(skip_deserializing)]
    live_blocks: u64,
}

/// One entry of a snapshot's `cached_by_stream`.
#[derive(Serialize)]
struct CachedOnStream {
    stream: Option<u64>,
    slot: StreamSlot,
    bytes: u64,
}

/// A snapshot in the shape of [`Snapshot::to_json`], as written.
#[derive(Serialize)]
struct SnapshotOut<'a> {
    t_ns: u64,
    max_size: u64,
    alignment: u64,
    totals: Totals,
    cached_by_stream: Vec<CachedOnStream>,
    segments: &'a [SnapshotSegment],
}

/// What reading a snapshot back needs of that shape.
#[derive(Deserialize)]
struct SnapshotIn {
    t_ns: u64,
    max_size: u64,
    alignment: u64,
    totals: Totals,
    segments: Vec<SnapshotSegment>,
}

impl Serialize for Snapshot {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        SnapshotOut {
            t_ns: self.t_ns,
            max_size: self.max_size,
            alignment: self.alignment,
            totals: Totals {
                used: self.used,
                reserved: self.reserved,
                cached: self.cached,
                free: self.free,
                largest_free_block: self.largest_free_block,
                segments: self.segments.len() as u64,
                blocks: self.blocks().count() as u64,
                live_blocks: self.live_blocks() as u64,
            },
            cached_by_stream: self
                .cached_by_stream()
                .into_iter()
                .map(|(stream, slot, bytes)| CachedOnStream { stream, slot, bytes })
                .collect(),
            segments: &self.segments,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Snapshot {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let SnapshotIn { t_ns, max_size, alignment, totals, segments } =
            SnapshotIn::deserialize(deserializer)?;
        Ok(Snapshot {
            t_ns,
            max_size,
            alignment,
            used: totals.used,
            reserved: totals.reserved,
            cached: totals.cached,
            free: totals.free,
            largest_free_block: totals.largest_free_block,
            segments,
        })
    }
}

/// `serde_json`'s compact output, escaping U+2028 and U+2029 as well, as the hand-written
/// writer does (so that the output is the same with and without the feature, and stays a
/// valid JavaScript string literal).
struct ExportFormatter;

impl serde_json::ser::Formatter for ExportFormatter {
    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        let mut start = 0;
        for (at, separator) in fragment.match_indices(['\u{2028}', '\u{2029}']) {
            writer.write_all(&fragment.as_bytes()[start..at])?;
            writer.write_all(if separator == "\u{2028}" { b"\\u2028" } else { b"\\u2029" })?;
            start = at + separator.len();
        }
        writer.write_all(&fragment.as_bytes()[start..])
    }
}

/// Appends `value` as JSON to `out`.
fn write(out: &mut Vec<u8>, value: &impl Serialize) {
    let mut serializer = serde_json::Serializer::with_formatter(out, ExportFormatter);
    value
        .serialize(&mut serializer)
        .expect("records and snapshots have string keys only, and writing to memory cannot fail");
}

fn into_string(json: Vec<u8>) -> String {
    String::from_utf8(json).expect("serde_json writes UTF-8")
}

/// [`json_lines`](super::json_lines) with `serde_json`.
pub(super) fn json_lines(records: &[Record]) -> String {
    let mut out = Vec::with_capacity(records.len() * 160);
    for record in records {
        write(&mut out, record);
        out.push(b'\n');
    }
    into_string(out)
}

/// [`Snapshot::to_json`] with `serde_json`.
pub(super) fn to_json(snapshot: &Snapshot) -> String {
    let mut out = Vec::with_capacity(256 + snapshot.blocks().count() * 64);
    write(&mut out, snapshot);
    into_string(out)
}

#[cfg(test)]
mod tests;
