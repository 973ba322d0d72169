//! The end of an engine-backed pool, without waiting for any stream: what no work can touch
//! any more is unmapped at once, and the address range given back; what frees still in
//! flight on their streams (or raw blocks any stream may still use) keep is handed to the
//! device as a [`DeferredRelease`], released once that work has completed (see
//! `deferred.rs`).

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::api::{Backend, MemPool};
use super::core::PoolCore;
use super::deferred::DeferredRelease;
use super::graph_region::is_stream_slot;
use super::order::Order;
use crate::engine::{
    Backing, BackingError, BlockId, BlockState, Engine, FreeTag, StreamOrder as _, StreamSlot,
};
use crate::hal::{DevicePtr, DriverError};

impl Drop for MemPool<'_> {
    /// Drops the pool without blocking: memory that work enqueued before the drop may still
    /// use (frees in flight on their streams, raw blocks never freed) is released by the
    /// device once that work has completed — at a later synchronisation, stream drop, pool
    /// creation or drop, or when the device is dropped — and everything else at once. A
    /// stream held by a blocking host function does not hold the drop up.
    fn drop(&mut self) {
        // A native pool is destroyed when dropped (the backend keeps its errors).
        let Backend::Engine(cores) = self.backend() else { return };
        for core in cores.iter().skip(1) {
            core.shut_down();
        }
        cores.first().shut_down();
        // Memory of pools dropped earlier whose work has completed since.
        self.device().shared.deferred.release_complete(&self.device().shared);
    }
}

/// A backing that unmaps nothing: it lists the mappings the engine gives up, for the device
/// to release later.
struct Handover {
    base: DevicePtr,
    /// Mappings are real (not the accounting of one preallocated segment).
    mapped: bool,
    mappings: Vec<DevicePtr>,
}

impl Backing for Handover {
    type Error = DriverError;

    fn map(&mut self, _: u64, _: u64) -> Result<u64, BackingError<DriverError>> {
        // A teardown never maps.
        Err(BackingError::OutOfMemory)
    }

    fn unmap(&mut self, offset: u64, _: u64, _: u64) -> Result<(), DriverError> {
        if self.mapped {
            // The engine hands out offsets inside the reserved range, which does not wrap.
            self.mappings.push(self.base.checked_add(offset).unwrap_or(self.base));
        }
        Ok(())
    }
}

impl PoolCore {
    /// The end of a pool (or of one of its shards): no allocation is alive (they borrow the
    /// pool), but frees may still be in flight on their streams. Releases what is complete,
    /// and hands the rest to the device with the work it waits for.
    pub(super) fn shut_down(&self) {
        // Listener calls from now on find nothing to do.
        self.torn_down.store(true, Ordering::Release);
        let (waits, raw) = {
            let mut inner = self.lock();
            if let Some(p) = &self.passthrough {
                // Deferred frees go to the engine with their tags: stream order then makes
                // them pending frees like any other.
                for (block, tag) in p.take_all() {
                    let _ = inner.engine.free(block, tag);
                }
            }
            if let Some(ipc) = &self.ipc {
                // Frees that waited for importers: the pool ends, importers keep the memory
                // they mapped.
                for (block, tag) in ipc.take_deferred() {
                    let _ = inner.engine.free(block, tag);
                }
            }
            // Graph memory goes with the pool: a graph launched after the pool's drop uses
            // freed memory (as with raw blocks), and a launch in flight may still use it.
            let graph_memory = self.release_all_graph_memory(&mut inner);
            let raw: Vec<BlockId> = inner.raw_blocks.drain().collect();
            for &block in &raw {
                // Raw blocks never given to `free_raw` go with the pool (`alloc_raw`'s
                // contract); what any stream enqueued so far may use them (see below), so
                // their tag is never consulted.
                let _ = inner.engine.free(block, FreeTag { stream: 0, pos: 0 });
            }
            (tagged_frees(&inner.engine), !raw.is_empty() || graph_memory)
        };
        let waits = if raw { self.every_live_stream() } else { waits };
        let waits: SmallVec<[(StreamSlot, u64); 4]> =
            waits.into_iter().filter(|&(slot, pos)| !self.is_complete_now(slot, pos)).collect();
        let mut inner = self.lock();
        let hal = self.hal();
        if waits.is_empty() {
            // Nothing to report to from a destructor; the device's counters show any leak.
            let (engine, mut backing) = inner.parts(self);
            let _ = engine.teardown(&mut backing);
            drop(inner);
            let _ = if self.preallocated { hal.free(self.base) } else { hal.release(self.base) };
            return;
        }
        if !raw {
            // What no work can touch any more goes now.
            let order = Order::completion(&self.device);
            let (engine, mut backing) = inner.parts(self);
            let _ = engine.release(0, &order, &mut backing);
        }
        let mut handover =
            Handover { base: self.base, mapped: !self.preallocated, mappings: Vec::new() };
        let _ = inner.engine.teardown(&mut handover);
        drop(inner);
        self.device.deferred.push(DeferredRelease {
            waits,
            mappings: handover.mappings,
            base: self.base,
            preallocated: self.preallocated,
        });
    }

    /// The end of every live stream's queue now: raw blocks and graph memory may be used by
    /// any of them.
    fn every_live_stream(&self) -> SmallVec<[(StreamSlot, u64); 4]> {
        let slots = 0..self.device.slots.count() as StreamSlot;
        slots.filter_map(|s| self.device.live_stream(s).map(|l| (s, l.enqueued()))).collect()
    }

    /// Whether the work of `slot` up to `pos` has completed (a backend that caches completion
    /// is asked first, without blocking).
    fn is_complete_now(&self, slot: StreamSlot, pos: u64) -> bool {
        let order = Order::completion(&self.device);
        let tag = FreeTag { stream: slot, pos };
        order.is_complete(tag)
            || self.device.live_stream(slot).is_some_and(|live| {
                live.hal.poll_completed();
                order.is_complete(tag)
            })
    }
}

/// Per stream slot, the latest position of `engine`'s free blocks still tagged with it
/// (graph slots, released before, name no stream).
fn tagged_frees(engine: &Engine) -> SmallVec<[(StreamSlot, u64); 4]> {
    let mut v: SmallVec<[(StreamSlot, u64); 4]> = SmallVec::new();
    for b in engine.blocks() {
        if let BlockState::Free(Some(tag)) = b.state {
            if !is_stream_slot(tag.stream) {
                continue;
            }
            match v.iter_mut().find(|(s, _)| *s == tag.stream) {
                Some(e) => e.1 = e.1.max(tag.pos),
                None => v.push((tag.stream, tag.pos)),
            }
        }
    }
    v
}
