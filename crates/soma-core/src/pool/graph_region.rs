//! Graph-private memory in a core: the regions of the captures (and graph pools) that
//! allocated here, their graph slots, captured allocations and frees, graph outputs freed
//! outside their graph, and the release of a region once its graphs are gone.
//!
//! A task captured into a graph runs at every launch of the graph, on whatever stream it is
//! launched, so the memory of an allocation made while capturing must stay the graph's for
//! as long as the graph can be launched, and be safe to use at every launch without the
//! allocator running. A region holds such memory:
//!
//! * **Graph slots.** The engine sees a region's frees as frees of *graph slots*: stream slots
//!   from [`MAX_STREAMS`] up, which name no stream, one per (region, capturing stream),
//!   handed out densely from a free list and recycled when the region goes. The engine keeps
//!   them private ([`Engine::set_private_slots`]): their free blocks serve their own slot
//!   only, under any rule, and merge only among themselves. None of them is complete while
//!   the region lives, so recycling, releases and `trim_to` never unmap them.
//! * **Captured allocations** are served at capture time from the capturing stream's graph
//!   slot (the same-stream rule: its frees inside the capture are earlier in that stream's
//!   captured order, so at every launch), from memory nobody can be using any more (never
//!   used, settled, freed on a stream whose free the host observed or the device completed),
//!   or by growth, which maps now. Never under the event rule (a launch on another stream is
//!   not ordered by the capturing stream's clock) nor with an inserted dependency (it would
//!   be captured). Launches therefore make no allocator call and no driver call.
//! * **Captured frees** return the block to the freeing stream's graph slot, tagged with that
//!   slot's own position counter. Only a block of the same region may be freed while
//!   capturing.
//! * **Outputs** (captured allocations freed outside the capture) stay allocated in the
//!   engine, parked with their free's tag, until the region goes: every launch writes them.
//! * **Release.** When the region's token goes (see `graph_pool.rs`; a graph's drop first
//!   waits for its launches), its parked blocks are freed with their tags, its graph slots'
//!   free blocks settle as host-observed frees (merging back with the pool's memory) and the
//!   slots are recycled.

use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;

use super::allocate::{Granted, Request};
use super::core::{HistoryEntry, PoolCore, PoolInner};
use super::free::wait_for_uses;
use super::graph_pool::{CaptureMemory, GraphMemoryOwner, GraphMemoryStats};
use super::handle::StreamUse;
use super::order::{Order, ReleaseOrder};
use crate::device::MAX_STREAMS;
use crate::engine::{BlockId, BlockState, Engine, FreeTag, StreamSlot};
use crate::error::{Error, Result};
use crate::hal::{CaptureErrorKind, CaptureStatus, DriverError, PoolAnnotation};
use crate::observe::RecordKind;
use crate::stream::Stream;

/// The first graph slot: the stream slots of a device end below it.
pub(super) const FIRST_GRAPH_SLOT: StreamSlot = MAX_STREAMS as StreamSlot;

/// Settling passes at a region's release before its slots are empty: a pass may merge a
/// settled block into one of the slots' blocks it has not reached yet.
const RELEASE_PASSES: usize = 8;

/// Whether `slot` names a stream of the device (not a graph slot).
#[inline]
pub(super) fn is_stream_slot(slot: StreamSlot) -> bool {
    slot < FIRST_GRAPH_SLOT
}

/// A graph slot in use: its region, the capturing stream whose frees it holds, and the
/// position of its next free.
struct GraphSlot {
    region: u64,
    stream: StreamSlot,
    next_pos: u64,
}

/// The graph memory of one token in one core.
pub(super) struct Region {
    key: u64,
    owner: GraphMemoryOwner,
    /// Bytes of its live captured blocks (those in `GraphRegions::blocks`).
    live_bytes: u64,
    /// Its blocks freed outside a capture: allocated in the engine until the release, then
    /// freed with the tag of their free (with their sizes).
    parked: Vec<(BlockId, FreeTag, u64)>,
    /// Its graph slots.
    slots: SmallVec<[StreamSlot; 2]>,
}

/// The graph memory of a core (under the core's lock).
#[derive(Default)]
pub(super) struct GraphRegions {
    regions: Vec<Region>,
    /// Graph slots by `slot - FIRST_GRAPH_SLOT`; `None`: free.
    slots: Vec<Option<GraphSlot>>,
    /// The live captured blocks of the live regions, with their region's key.
    blocks: HashMap<BlockId, u64>,
}

impl GraphRegions {
    fn region(&mut self, key: u64) -> Option<&mut Region> {
        self.regions.iter_mut().find(|r| r.key == key)
    }

    /// The graph slot of region `key` (created with `owner` if needed) for the captured work
    /// of the stream in slot `stream`: the lowest free one when it has none yet.
    fn slot_for(&mut self, key: u64, owner: GraphMemoryOwner, stream: StreamSlot) -> StreamSlot {
        let found = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.region == key && s.stream == stream));
        if let Some(i) = found {
            return FIRST_GRAPH_SLOT + i as StreamSlot;
        }
        let i = self.slots.iter().position(Option::is_none).unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        self.slots[i] = Some(GraphSlot { region: key, stream, next_pos: 0 });
        let slot = FIRST_GRAPH_SLOT + i as StreamSlot;
        match self.region(key) {
            Some(r) => r.slots.push(slot),
            None => self.regions.push(Region {
                key,
                owner,
                live_bytes: 0,
                parked: Vec::new(),
                slots: SmallVec::from_elem(slot, 1),
            }),
        }
        slot
    }

    /// The tag of the next free on graph slot `slot`.
    fn next_tag(&mut self, slot: StreamSlot) -> FreeTag {
        let s = self.slots[(slot - FIRST_GRAPH_SLOT) as usize].as_mut().expect("a slot in use");
        s.next_pos += 1;
        FreeTag { stream: slot, pos: s.next_pos }
    }

    /// The region of live block `block`, if a live region holds it.
    pub(super) fn region_of(&self, block: BlockId) -> Option<u64> {
        self.blocks.get(&block).copied()
    }

    /// Block `block` of `size` bytes was allocated in region `key`.
    fn note_alloc(&mut self, key: u64, block: BlockId, size: u64) {
        if let Some(r) = self.region(key) {
            r.live_bytes += size;
            self.blocks.insert(block, key);
        }
    }

    /// Takes live block `block` of `size` bytes out of its region; its key.
    fn note_free(&mut self, block: BlockId, size: u64) -> Option<u64> {
        let key = self.blocks.remove(&block)?;
        if let Some(r) = self.region(key) {
            r.live_bytes -= size;
        }
        Some(key)
    }

    /// Takes region `key` out, with its live blocks (they become ordinary blocks); the
    /// region and how many live blocks it had.
    fn take(&mut self, key: u64) -> Option<(Region, u64)> {
        let i = self.regions.iter().position(|r| r.key == key)?;
        let region = self.regions.swap_remove(i);
        let before = self.blocks.len();
        self.blocks.retain(|_, k| *k != key);
        Some((region, (before - self.blocks.len()) as u64))
    }

    /// The keys of every region.
    fn keys(&self) -> Vec<u64> {
        self.regions.iter().map(|r| r.key).collect()
    }

    /// Frees graph slot `slot` for another region.
    fn recycle(&mut self, slot: StreamSlot) {
        self.slots[(slot - FIRST_GRAPH_SLOT) as usize] = None;
    }

    /// What each region holds (its free memory counted in `engine`).
    pub(super) fn stats<'a>(
        &'a self,
        engine: &'a Engine,
    ) -> impl Iterator<Item = GraphMemoryStats> + 'a {
        self.regions.iter().map(|r| {
            let parked: u64 = r.parked.iter().map(|p| p.2).sum();
            let cached: u64 = r.slots.iter().map(|&s| engine.cached_bytes(s)).sum();
            let used = r.live_bytes + parked;
            GraphMemoryStats { owner: r.owner, used, reserved: used + cached }
        })
    }
}

/// The graph memory of the capture `stream` records into; `Ok(None)` when it is not
/// capturing. `what` (a pool allocation or free) is refused in an invalidated capture, and
/// in one begun on the backend's stream directly (the pool could not tell when its graph
/// goes).
pub(super) fn capture_memory(
    stream: &Stream<'_>,
    what: &'static str,
) -> Result<Option<Arc<CaptureMemory>>> {
    if stream.capture_id().is_none() {
        return Ok(None);
    }
    let info = stream.capture_info()?;
    let Some(capture) = info.capture else { return Ok(None) };
    if info.status == CaptureStatus::Invalidated {
        return Err(capture_error(
            CaptureErrorKind::Invalidated,
            format!("{what} on stream {}: capture {capture} was invalidated", stream.id()),
        ));
    }
    match stream.device().shared.captures.get(capture) {
        Some(memory) => Ok(Some(memory)),
        None => Err(capture_error(
            CaptureErrorKind::NotCapturable,
            format!(
                "{what} on stream {}, which is capturing (capture {capture}) but did not begin \
                 it through Stream::begin_capture: the pool cannot keep graph memory for it",
                stream.id()
            ),
        )),
    }
}

/// A capture error of kind `kind`.
pub(super) fn capture_error(kind: CaptureErrorKind, message: String) -> Error {
    Error::Driver(DriverError::Capture { kind, message })
}

impl PoolCore {
    /// A request of a stream capturing into `memory`: served now from the region of the
    /// capture (or of its graph pool) in this core, under the rules of the module docs. Out
    /// of memory is reported at once: the pool's wait for pending frees would synchronise
    /// streams the capture may not.
    pub(super) fn allocate_captured(
        &self,
        req: &Request<'_>,
        memory: &CaptureMemory,
    ) -> Result<Granted> {
        let stream = req.stream;
        let (key, owner) = memory.region_for(self.id);
        let order = Order::for_capture(self, stream);
        let result = {
            let mut inner = self.lock();
            self.drain_passthrough(&mut inner);
            if let Some(e) = self.take_sticky(&mut inner) {
                return Err(e);
            }
            let slot = inner.graph.slot_for(key, owner, stream.slot());
            let result = self.alloc_locked(&mut inner, req, slot, &order);
            if let Ok(a) = &result {
                inner.graph.note_alloc(key, a.block, a.size);
                self.graph_blocks.fetch_add(1, Ordering::Relaxed);
            }
            result
        };
        let a = result.map_err(|e| self.failed(req, e, false, &[]))?;
        debug_assert!(a.dependency.is_none(), "captured requests take no dependency");
        if self.annotate {
            self.hal().annotate(PoolAnnotation::GraphAlloc {
                pool: self.id,
                region: key,
                ptr: self.ptr_at(a.offset),
                size: req.bytes,
                stream: stream.id(),
                position: stream.hal().enqueued(),
            });
        }
        if self.history_on {
            let entry = HistoryEntry {
                stream: stream.id(),
                offset: a.offset,
                size: a.size,
                requested: req.bytes,
                reuse: a.reuse,
                location: req.location,
                ..HistoryEntry::of(RecordKind::Alloc)
            };
            self.lock().record(self, entry);
        }
        Ok(self.granted(&a))
    }

    /// A free of `block` on a stream that captured, or to which a graph's block may have been
    /// handed off: a captured free (the block must be of the capture's region), an output's
    /// free outside its graph (parked until the region goes). `Ok(false)`: an ordinary free,
    /// for the caller to make.
    #[cold]
    #[inline(never)]
    pub(super) fn free_graph_aware(
        &self,
        block: BlockId,
        stream: &Stream<'_>,
        uses: &[StreamUse],
        location: Option<&'static Location<'static>>,
    ) -> Result<bool> {
        let memory = capture_memory(stream, "a pool free")?;
        if memory.is_none() && self.graph_blocks.load(Ordering::Relaxed) == 0 {
            return Ok(false);
        }
        let region = self.lock().graph.region_of(block);
        match (memory, region) {
            (None, None) => Ok(false),
            (None, Some(key)) => {
                wait_for_uses(stream, uses)?;
                self.free_output(block, key, stream, location)?;
                Ok(true)
            }
            (Some(memory), Some(key)) if memory.region_for(self.id).0 == key => {
                wait_for_uses(stream, uses)?;
                self.free_captured(block, key, stream, location)?;
                Ok(true)
            }
            (Some(_), _) => Err(capture_error(
                CaptureErrorKind::NotCapturable,
                format!(
                    "a pool free on stream {}, which is capturing, of a block not allocated in \
                     the capture's graph memory: its memory would go back to the pool while the \
                     graph, launched later, still uses it (free it outside the capture)",
                    stream.id()
                ),
            )),
        }
    }

    /// A free inside a capture of live block `block` of region `key`: it goes to the freeing
    /// stream's graph slot.
    fn free_captured(
        &self,
        block: BlockId,
        key: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
    ) -> Result<()> {
        let mut inner = self.lock();
        let (offset, size) = live_block(&inner.engine, block)?;
        let owner = inner.graph.region(key).map(|r| r.owner).ok_or_else(|| {
            Error::InvalidArgument(format!("block {block:?}: its graph memory is gone"))
        })?;
        let slot = inner.graph.slot_for(key, owner, stream.slot());
        let tag = inner.graph.next_tag(slot);
        inner.engine.free_private(block, tag).map_err(|e| {
            Error::InvalidArgument(format!("free of block {block:?} failed: {e:?}"))
        })?;
        inner.graph.note_free(block, size);
        self.graph_blocks.fetch_sub(1, Ordering::Relaxed);
        self.note_graph_free(&mut inner, key, (offset, size), stream, location);
        Ok(())
    }

    /// A free outside any capture of live block `block` of region `key` (a graph's output):
    /// parked in the region until it goes, or freed at once if it went meanwhile.
    fn free_output(
        &self,
        block: BlockId,
        key: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
    ) -> Result<()> {
        let tag = FreeTag { stream: stream.slot(), pos: stream.position() };
        let mut inner = self.lock();
        let (offset, size) = live_block(&inner.engine, block)?;
        if inner.graph.note_free(block, size).is_none() {
            // The region went since the caller looked: an ordinary block now.
            drop(inner);
            return self.free_block(block, stream, &[], location);
        }
        if let Some(r) = inner.graph.region(key) {
            r.parked.push((block, tag, size));
        }
        self.graph_blocks.fetch_sub(1, Ordering::Relaxed);
        self.note_graph_free(&mut inner, key, (offset, size), stream, location);
        Ok(())
    }

    /// The annotation and the history record of block `(offset, size)` returned to region
    /// `key`.
    fn note_graph_free(
        &self,
        inner: &mut PoolInner,
        key: u64,
        (offset, size): (u64, u64),
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
    ) {
        if self.annotate {
            self.hal().annotate(PoolAnnotation::GraphFree {
                pool: self.id,
                region: key,
                ptr: self.ptr_at(offset),
            });
        }
        if inner.history.is_some() {
            let entry = HistoryEntry {
                stream: stream.id(),
                offset,
                size,
                location,
                ..HistoryEntry::of(RecordKind::Free)
            };
            inner.record(self, entry);
        }
    }

    /// Whether live block `block` belongs to a live graph region (it must not move).
    pub(super) fn is_graph_block(&self, block: BlockId) -> bool {
        self.graph_blocks.load(Ordering::Relaxed) > 0
            && self.lock().graph.region_of(block).is_some()
    }

    /// The last holder of token `key` went: releases its region here, if any.
    pub(super) fn release_graph_memory(&self, key: u64) {
        if self.torn_down.load(Ordering::Acquire) {
            return;
        }
        let mut inner = self.lock();
        if let Some((region, live)) = inner.graph.take(key) {
            self.release_region(&mut inner, region, live);
        }
    }

    /// Releases every region (the pool is going away); whether there was one.
    pub(super) fn release_all_graph_memory(&self, inner: &mut PoolInner) -> bool {
        let keys = inner.graph.keys();
        for &key in &keys {
            if let Some((region, live)) = inner.graph.take(key) {
                self.release_region(inner, region, live);
            }
        }
        !keys.is_empty()
    }

    /// Gives region `region` (taken out, with `live` live blocks) back to the pool: its
    /// parked blocks are freed with their tags, its free blocks settle and merge with the
    /// pool's memory, its graph slots are recycled.
    fn release_region(&self, inner: &mut PoolInner, region: Region, live: u64) {
        if self.annotate {
            self.hal().annotate(PoolAnnotation::GraphRelease { pool: self.id, region: region.key });
        }
        self.graph_blocks.fetch_sub(live, Ordering::Relaxed);
        for &(block, tag, _) in &region.parked {
            // Live since it was parked: the free cannot fail.
            let _ = inner.engine.free(block, tag);
        }
        let order = ReleaseOrder::new(&self.device, &region.slots);
        let empty = |e: &Engine| region.slots.iter().all(|&s| e.cached_bytes(s) == 0);
        for _ in 0..RELEASE_PASSES {
            if empty(&inner.engine) {
                break;
            }
            inner.engine.settle(&order);
        }
        for &slot in &region.slots {
            // A slot that still held a block would make it look like the next region's.
            if inner.engine.cached_bytes(slot) == 0 {
                inner.graph.recycle(slot);
            }
        }
    }
}

/// The offset and size of live block `block`.
fn live_block(engine: &Engine, block: BlockId) -> Result<(u64, u64)> {
    match engine.block(block) {
        Some(b) if b.state == BlockState::Live => Ok((b.offset, b.size)),
        _ => {
            Err(Error::InvalidArgument(format!("free of block {block:?}: not live (double free?)")))
        }
    }
}
