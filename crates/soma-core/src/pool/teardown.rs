//! The end of an engine-backed pool: frees still in flight on their streams are waited for,
//! then everything is unmapped and the address range given back.

use std::sync::atomic::Ordering;

use super::api::{Backend, MemPool};
use super::core::PoolCore;
use super::order::Order;
use crate::engine::{BlockId, BlockState, FreeTag, StreamOrder as _, StreamSlot};

impl Drop for MemPool<'_> {
    fn drop(&mut self) {
        // A native pool is destroyed when dropped (the backend keeps its errors).
        let Backend::Engine(cores) = self.backend() else { return };
        for core in cores.iter().skip(1) {
            core.shut_down();
        }
        cores.first().shut_down();
    }
}

impl PoolCore {
    /// The end of a pool (or of one of its shards): no allocation is alive (they borrow the
    /// pool), but frees may still be in flight on their streams — waits for those, then
    /// unmaps everything and gives the address range back.
    fn shut_down(&self) {
        if let Some(p) = &self.passthrough {
            // Deferred frees: let their host functions run, then hand them to the engine.
            if p.outstanding() {
                let _ = self.hal().synchronize();
            }
            self.drain_passthrough(&mut self.lock());
        }
        self.wait_for_pending_frees();
        self.torn_down.store(true, Ordering::Release);
        let mut inner = self.lock();
        if !inner.raw_blocks.is_empty() {
            // Raw blocks never given to `free_raw` go with the pool (`alloc_raw`'s contract),
            // once the device's work is done: any stream may still use them.
            drop(inner);
            let _ = self.hal().synchronize();
            inner = self.lock();
            let raw: Vec<BlockId> = inner.raw_blocks.drain().collect();
            for block in raw {
                // Complete (the device synchronised): any tag will do.
                let _ = inner.engine.free(block, FreeTag { stream: 0, pos: 0 });
            }
        }
        // Nothing to report to from a destructor; the device's counters show any leak.
        let (engine, mut backing) = inner.parts(self);
        let _ = engine.teardown(&mut backing);
        drop(inner);
        let hal = self.hal();
        let _ = if self.preallocated { hal.free(self.base) } else { hal.release(self.base) };
    }

    /// Synchronises every live stream that holds a free of this core not yet complete.
    fn wait_for_pending_frees(&self) {
        let pending: Vec<(StreamSlot, u64)> = {
            let inner = self.lock();
            let mut v: Vec<(StreamSlot, u64)> = Vec::new();
            for b in inner.engine.blocks() {
                if let BlockState::Free(Some(tag)) = b.state {
                    match v.iter_mut().find(|(s, _)| *s == tag.stream) {
                        Some(e) => e.1 = e.1.max(tag.pos),
                        None => v.push((tag.stream, tag.pos)),
                    }
                }
            }
            v
        };
        let order = Order::completion(&self.device);
        for (slot, pos) in pending {
            if !order.is_complete(FreeTag { stream: slot, pos }) {
                if let Some(live) = self.device.live_stream(slot) {
                    let _ = live.hal.synchronize();
                }
            }
        }
    }
}
