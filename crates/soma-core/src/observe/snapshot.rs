//! [`Snapshot`]: the pool's segments and blocks at one moment.

use std::fmt;

use crate::engine::{BlockInfo, BlockState, StreamSlot};
use crate::error::Bytes;

/// What a block of a [`Snapshot`] holds.
///
/// With the `serde` feature it serializes as an object tagged by `state` (`live`, `cached`,
/// `free`), with a cached block's fields after the tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(tag = "state", rename_all = "snake_case")
)]
pub enum BlockStatus {
    /// Handed out to an allocation.
    Live,
    /// Freed onto a stream and cached there: reusable at once by that stream, by others
    /// under the pool's reuse rules.
    Cached {
        /// Backend id of the stream it was freed on; `None` when that stream has been
        /// dropped (it drained, so the block is reusable by every stream).
        stream: Option<u64>,
        /// The device's slot of that stream (slots are recycled after a stream is dropped).
        slot: StreamSlot,
        /// The stream's position at the free.
        pos: u64,
        /// Whether the host has observed the free's completion (a synchronize): the block is
        /// then reusable by every stream.
        host_observed: bool,
    },
    /// Mapped and never used, or returned to every stream: reusable by any stream.
    Free,
}

impl BlockStatus {
    /// `live`, `cached` or `free`.
    pub const fn as_str(&self) -> &'static str {
        match self {
            BlockStatus::Live => "live",
            BlockStatus::Cached { .. } => "cached",
            BlockStatus::Free => "free",
        }
    }
}

/// One block of a [`Snapshot`].
///
/// With the `serde` feature it serializes as `{"offset","size","state",…}`: the status's
/// fields follow the size, as in [`Snapshot::to_json`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SnapshotBlock {
    /// Offset in the pool's range.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// What it holds.
    #[cfg_attr(feature = "serde", serde(flatten))]
    pub status: BlockStatus,
}

/// A run of mapped memory of a [`Snapshot`]: maximal contiguous mapped addresses (one or
/// more driver mappings that happen to be adjacent) and the blocks that tile it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SnapshotSegment {
    /// Offset in the pool's range.
    pub offset: u64,
    /// Size in bytes (a multiple of the granularity).
    pub size: u64,
    /// Its blocks in address order; their sizes sum to `size`.
    pub blocks: Vec<SnapshotBlock>,
}

/// The pool's memory at one moment: mapped segments and their blocks with their state, and
/// totals; from [`MemPool::snapshot`](crate::MemPool::snapshot). Unmapped address space is
/// not listed.
///
/// [`to_json`](Self::to_json) gives it as JSON; `Display` gives a short summary. With the
/// `serde` feature it implements `Serialize` and `Deserialize` in the shape of that JSON.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// Nanoseconds since the pool was created.
    pub t_ns: u64,
    /// The pool's maximum size (its address range).
    pub max_size: u64,
    /// Block alignment.
    pub alignment: u64,
    /// Bytes in live blocks.
    pub used: u64,
    /// Bytes mapped (the sum of the segments' sizes).
    pub reserved: u64,
    /// Bytes in cached blocks (freed onto a stream).
    pub cached: u64,
    /// Bytes in free blocks reusable by any stream (never used).
    pub free: u64,
    /// Largest cached or free block.
    pub largest_free_block: u64,
    /// Mapped runs in address order.
    pub segments: Vec<SnapshotSegment>,
}

impl Snapshot {
    /// Builds a snapshot from blocks in address order; `stream_of` maps a slot to its live
    /// stream's backend id and host-observed bound.
    pub(crate) fn from_blocks(
        t_ns: u64,
        max_size: u64,
        alignment: u64,
        blocks: impl Iterator<Item = BlockInfo>,
        mut stream_of: impl FnMut(StreamSlot) -> (Option<u64>, u64),
    ) -> Snapshot {
        let mut s = Snapshot {
            t_ns,
            max_size,
            alignment,
            used: 0,
            reserved: 0,
            cached: 0,
            free: 0,
            largest_free_block: 0,
            segments: Vec::new(),
        };
        let mut current: Option<SnapshotSegment> = None;
        for b in blocks {
            let status = match b.state {
                BlockState::Unmapped => {
                    s.segments.extend(current.take());
                    continue;
                }
                BlockState::Live => {
                    s.used += b.size;
                    BlockStatus::Live
                }
                BlockState::Free(None) => {
                    s.free += b.size;
                    s.largest_free_block = s.largest_free_block.max(b.size);
                    BlockStatus::Free
                }
                BlockState::Free(Some(tag)) => {
                    s.cached += b.size;
                    s.largest_free_block = s.largest_free_block.max(b.size);
                    let (stream, observed) = stream_of(tag.stream);
                    BlockStatus::Cached {
                        stream,
                        slot: tag.stream,
                        pos: tag.pos,
                        host_observed: tag.pos < observed,
                    }
                }
            };
            s.reserved += b.size;
            let seg = current.get_or_insert_with(|| SnapshotSegment {
                offset: b.offset,
                size: 0,
                blocks: Vec::new(),
            });
            seg.size += b.size;
            seg.blocks.push(SnapshotBlock { offset: b.offset, size: b.size, status });
        }
        s.segments.extend(current);
        s
    }

    /// All blocks in address order.
    pub fn blocks(&self) -> impl Iterator<Item = &SnapshotBlock> + '_ {
        self.segments.iter().flat_map(|s| &s.blocks)
    }

    /// Live blocks.
    pub fn live_blocks(&self) -> usize {
        self.blocks().filter(|b| b.status == BlockStatus::Live).count()
    }

    /// Cached bytes per stream, as `(stream id or None if dropped, slot, bytes)`, by slot.
    pub fn cached_by_stream(&self) -> Vec<(Option<u64>, StreamSlot, u64)> {
        let mut v: Vec<(Option<u64>, StreamSlot, u64)> = Vec::new();
        for b in self.blocks() {
            if let BlockStatus::Cached { stream, slot, .. } = b.status {
                match v.iter_mut().find(|e| e.1 == slot) {
                    Some(e) => e.2 += b.size,
                    None => v.push((stream, slot, b.size)),
                }
            }
        }
        v.sort_by_key(|e| e.1);
        v
    }

    /// The snapshot as one JSON object:
    ///
    /// ```text
    /// {"t_ns":…,"max_size":…,"alignment":…,
    ///  "totals":{"used":…,"reserved":…,"cached":…,"free":…,"largest_free_block":…,
    ///            "segments":…,"blocks":…,"live_blocks":…},
    ///  "cached_by_stream":[{"stream":id|null,"slot":…,"bytes":…}…],
    ///  "segments":[{"offset":…,"size":…,"blocks":[
    ///     {"offset":…,"size":…,"state":"live"|"cached"|"free",
    ///      // cached only:
    ///      "stream":id|null,"slot":…,"pos":…,"host_observed":bool}…]}…]}
    /// ```
    ///
    /// Every number is an unsigned integer (bytes, or nanoseconds for `t_ns`).
    ///
    /// With the `serde` feature this is `serde_json`'s output for the snapshot, whose
    /// `Serialize` writes this object (and whose `Deserialize` reads it back; the totals'
    /// counts and `cached_by_stream` follow from the segments and are not read).
    pub fn to_json(&self) -> String {
        #[cfg(feature = "serde")]
        {
            super::serialize::to_json(self)
        }
        #[cfg(not(feature = "serde"))]
        {
            self.to_json_by_hand()
        }
    }

    /// [`to_json`](Self::to_json) without `serde`; with it, the reference its output is
    /// tested against.
    #[cfg(any(test, not(feature = "serde")))]
    pub(crate) fn to_json_by_hand(&self) -> String {
        use super::json::Object;

        let mut out = String::with_capacity(256 + self.blocks().count() * 64);
        let blocks = self.blocks().count() as u64;
        let mut o = Object::new(&mut out);
        o.u64("t_ns", self.t_ns).u64("max_size", self.max_size).u64("alignment", self.alignment);
        o.raw("totals", |s| {
            Object::new(s)
                .u64("used", self.used)
                .u64("reserved", self.reserved)
                .u64("cached", self.cached)
                .u64("free", self.free)
                .u64("largest_free_block", self.largest_free_block)
                .u64("segments", self.segments.len() as u64)
                .u64("blocks", blocks)
                .u64("live_blocks", self.live_blocks() as u64)
                .finish()
        });
        o.raw("cached_by_stream", |s| {
            s.push('[');
            for (i, (stream, slot, bytes)) in self.cached_by_stream().into_iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                Object::new(s)
                    .opt_u64("stream", stream)
                    .u64("slot", u64::from(slot))
                    .u64("bytes", bytes)
                    .finish();
            }
            s.push(']');
        });
        o.raw("segments", |s| {
            s.push('[');
            for (i, seg) in self.segments.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                let mut so = Object::new(s);
                so.u64("offset", seg.offset).u64("size", seg.size);
                so.raw("blocks", |s| {
                    s.push('[');
                    for (j, b) in seg.blocks.iter().enumerate() {
                        if j > 0 {
                            s.push(',');
                        }
                        let mut bo = Object::new(s);
                        bo.u64("offset", b.offset)
                            .u64("size", b.size)
                            .str("state", b.status.as_str());
                        if let BlockStatus::Cached { stream, slot, pos, host_observed } = b.status {
                            bo.opt_u64("stream", stream)
                                .u64("slot", u64::from(slot))
                                .u64("pos", pos)
                                .bool("host_observed", host_observed);
                        }
                        bo.finish();
                    }
                    s.push(']');
                });
                so.finish();
            }
            s.push(']');
        });
        o.finish();
        out
    }
}

impl fmt::Display for Snapshot {
    /// A summary: totals, then one line per segment with its blocks by state.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "pool snapshot: used {}, reserved {} of {}, cached {}, free {}, largest free block {}",
            Bytes(self.used),
            Bytes(self.reserved),
            Bytes(self.max_size),
            Bytes(self.cached),
            Bytes(self.free),
            Bytes(self.largest_free_block)
        )?;
        for (stream, slot, bytes) in self.cached_by_stream() {
            match stream {
                Some(id) => writeln!(f, "  cached on stream {id}: {}", Bytes(bytes))?,
                None => writeln!(f, "  cached on dropped stream (slot {slot}): {}", Bytes(bytes))?,
            }
        }
        for seg in &self.segments {
            let (mut live, mut other) = (0, 0);
            for b in &seg.blocks {
                if b.status == BlockStatus::Live {
                    live += 1;
                } else {
                    other += 1;
                }
            }
            writeln!(
                f,
                "  segment {:#x} {:>10}: {live} live, {other} free or cached blocks",
                seg.offset,
                Bytes(seg.size).to_string()
            )?;
        }
        Ok(())
    }
}
