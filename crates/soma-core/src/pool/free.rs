//! Frees: a typed allocation's through the free ring when the core has one (no lock), every
//! other one under the lock. Either way the freeing stream is first made to wait for the
//! block's uses on other streams, so that stream order alone covers every use.

use std::panic::Location;

use super::core::{HistoryEntry, PoolCore};
use super::free_ring::RingedFree;
use super::handle::{PeerUse, StreamUse};
use crate::engine::{BlockId, BlockState, FreeError, FreeTag};
use crate::error::{Error, Result};
use crate::hal::{DevicePtr, PoolAnnotation};
use crate::observe::RecordKind;
use crate::stream::Stream;

/// A typed allocation (`PoolAlloc`) going back to its pool.
pub(crate) struct TypedFree<'a> {
    /// The engine's block; `None` for a native pool, which frees by pointer.
    pub(crate) block: Option<BlockId>,
    pub(crate) ptr: DevicePtr,
    /// Bytes as requested (the block is this rounded to the pool's alignment).
    pub(crate) bytes: u64,
    /// The shard that holds the block.
    pub(crate) shard: u8,
    pub(crate) stream: &'a Stream<'a>,
    /// Other streams that used the block.
    pub(crate) uses: &'a [StreamUse],
    /// The caller's source location, for the history.
    pub(crate) location: Option<&'static Location<'static>>,
}

impl PoolCore {
    /// Frees a typed allocation: through the free ring when the core has one (no lock), else
    /// as [`PoolCore::free_block`].
    #[inline]
    pub(super) fn free_typed(&self, f: &TypedFree<'_>) -> Result<()> {
        // One load tells whether the stream needs anything but the fast path: a stream that
        // captured (or took over a graph's block) may be freeing graph memory.
        let flags = f.stream.flags();
        if flags & crate::stream::GRAPH_PATH != 0
            && self.free_flagged(f.block, f.stream, f.uses, f.location)?
        {
            return Ok(());
        }
        let (Some(ring), Some(block)) = (&self.free_ring, f.block) else {
            return self.free_unringed(f.block, f.ptr, f.stream, f.uses, f.location);
        };
        // `bytes` was rounded when the block was allocated, so this never falls back.
        let Some(size) = self.block_size(f.bytes) else {
            return self.free_unringed(f.block, f.ptr, f.stream, f.uses, f.location);
        };
        wait_for_uses(f.stream, f.uses)?;
        let ringed = RingedFree {
            block,
            offset: f.ptr.offset_from(self.base).unwrap_or(0),
            size,
            tag: FreeTag { stream: f.stream.slot(), pos: f.stream.positions_with(flags).1 },
        };
        if ring.push(ringed).is_err() {
            // Full: drain it (the lock does) and free directly.
            let mut inner = self.lock();
            inner.engine.free(block, ringed.tag).map_err(|e| free_failed(block, &e))?;
        }
        Ok(())
    }

    /// [`PoolCore::free_typed`] on a stream with [`GRAPH_PATH`](crate::stream::GRAPH_PATH)
    /// flags: `Ok(true)` when the free concerned graph memory and was made (see
    /// `graph_region.rs`), `Ok(false)` for an ordinary free. (The free's fields one by one,
    /// as for `free_unringed`.)
    #[cold]
    #[inline(never)]
    fn free_flagged(
        &self,
        block: Option<BlockId>,
        stream: &Stream<'_>,
        uses: &[StreamUse],
        location: Option<&'static Location<'static>>,
    ) -> Result<bool> {
        match block {
            Some(block) => self.free_graph_aware(block, stream, uses, location),
            None => Ok(false),
        }
    }

    /// [`PoolCore::free_typed`] without the ring. (The free's fields one by one: a reference
    /// to it would make the hot path build it in memory.)
    fn free_unringed(
        &self,
        block: Option<BlockId>,
        ptr: DevicePtr,
        stream: &Stream<'_>,
        uses: &[StreamUse],
        location: Option<&'static Location<'static>>,
    ) -> Result<()> {
        let Some(block) = block else {
            return Err(Error::InvalidArgument(format!("{ptr} has no block in this pool")));
        };
        self.free_block(block, stream, uses, location)
    }

    /// Frees `block` onto `stream` under the lock, after making `stream` wait for the other
    /// streams in `other_uses`; annotates the free for the sanitizer, defers it in a
    /// pass-through pool, records it in the history.
    pub(super) fn free_block(
        &self,
        block: BlockId,
        stream: &Stream<'_>,
        other_uses: &[StreamUse],
        location: Option<&'static Location<'static>>,
    ) -> Result<()> {
        wait_for_uses(stream, other_uses)?;
        // One read of the position serves the tag and the sanitizer's annotation: another
        // thread enqueueing on the stream in between must not move one without the other.
        let (local, global) = stream.positions();
        let tag = FreeTag { stream: stream.slot(), pos: global };
        let mut inner = self.lock();
        let info = if self.history_on || self.annotate { inner.engine.block(block) } else { None };
        if self.annotate {
            if let Some(info) = info.filter(|i| i.state == BlockState::Live) {
                self.hal().annotate(PoolAnnotation::Free {
                    pool: self.id,
                    ptr: self.ptr_at(info.offset),
                    stream: stream.id(),
                    position: local,
                });
            }
        }
        match &self.passthrough {
            Some(p) if info.is_none_or(|i| i.state == BlockState::Live) => {
                p.defer(block, tag, &**stream.hal()).map_err(|()| {
                    Error::InvalidArgument(format!("free of block {block:?}: double free"))
                })?;
            }
            // Held by another process: freed when the last importer releases it.
            _ if self.held_by_importers(&inner.engine, block, tag) => {}
            _ => inner.engine.free(block, tag).map_err(|e| free_failed(block, &e))?,
        }
        if let Some(info) = info.filter(|_| inner.history.is_some()) {
            let entry = HistoryEntry {
                stream: stream.id(),
                offset: info.offset,
                size: info.size,
                location,
                ..HistoryEntry::of(RecordKind::Free)
            };
            inner.record(self, entry);
        }
        Ok(())
    }
}

/// Makes `stream` wait on an event recorded on each other stream in `uses` (now), so that
/// `stream`'s later work is ordered after every recorded use.
#[inline]
pub(super) fn wait_for_uses(stream: &Stream<'_>, uses: &[StreamUse]) -> Result<()> {
    if uses.is_empty() {
        return Ok(());
    }
    wait_for_each_use(stream, uses)
}

/// [`wait_for_uses`] for a block used on other streams.
#[inline(never)]
fn wait_for_each_use(stream: &Stream<'_>, uses: &[StreamUse]) -> Result<()> {
    let device = &stream.device().shared;
    for used in uses {
        let (user, at) = match used {
            StreamUse::Local(user, at) => (*user, *at),
            StreamUse::Peer(peer) => {
                wait_for_peer_use(stream, peer)?;
                continue;
            }
        };
        if user == stream.slot() {
            continue;
        }
        // A stream that held the slot before the live one was dropped, which drained it:
        // nothing to wait for (and the live stream never touched this block).
        if let Some(live) = device.live_stream(user).filter(|l| l.base <= at) {
            // A record on a capturing stream would be captured, and the wait on it would make
            // the freeing stream join that capture — unless the free is captured into the same
            // capture (a use by another stream of the capture, ordered within the graph).
            let capture = stream.capture_id();
            if capture.is_none() || crate::graph::capture_of(&*live.hal) != capture {
                crate::graph::refuse_capturing(&*live.hal, "ordering a pool free after a use")?;
            }
            let event = device.hal.create_event()?;
            let pos = live.hal.record(&*event)?;
            let epoch = stream.capture_epoch();
            stream.wait_raw(&*event)?;
            // A wait captured (a free inside a capture) orders the launches, not the
            // stream's own work.
            if stream.outside_capture_since(epoch) {
                stream.clock().raise(user, live.base + pos);
            }
        }
    }
    Ok(())
}

/// Makes `stream` wait for everything enqueued so far on a peer device's stream that used
/// the block (an event of that device, recorded on it). The freeing stream's clock learns
/// nothing: its entries name slots of its own device.
fn wait_for_peer_use(stream: &Stream<'_>, peer: &PeerUse) -> Result<()> {
    // A stream that was dropped has drained: nothing to wait for.
    let Some(user) = peer.stream.upgrade() else { return Ok(()) };
    crate::graph::refuse_capturing(&*user, "ordering a pool free after a peer device's use")?;
    let event = peer.device.hal().create_event()?;
    user.record(&*event)?;
    stream.wait_raw(&*event)
}

/// The error of an engine free that failed (an unknown or already free block).
fn free_failed(block: BlockId, e: &FreeError) -> Error {
    Error::InvalidArgument(format!("free of block {block:?} failed: {e:?} (double free?)"))
}
