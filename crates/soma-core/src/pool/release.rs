//! Giving memory back to the device: the release threshold after a synchronisation,
//! `trim_to`, and a pass-through pool's deferred frees.

use smallvec::SmallVec;

use super::core::{HistoryEntry, PoolCore, PoolInner};
use super::graph_region::is_stream_slot;
use super::order::Order;
use super::passthrough::Passthrough;
use super::shards::Cores;
use crate::device::LiveStream;
use crate::engine::StreamSlot;
use crate::error::{Error, Result};
use crate::observe::RecordKind;

impl PoolCore {
    /// After a host synchronisation: settles the frees it made host-observed (they merge
    /// with free neighbours of any stream, see [`crate::engine::Engine::settle`]), then
    /// releases free memory down to the threshold.
    pub(super) fn apply_release_threshold(&self) {
        let threshold = self.settings.release_threshold();
        let reserved =
            self.budget.as_ref().map_or_else(|| self.lock().engine.reserved(), |b| b.reserved());
        if reserved > threshold {
            // Only when something may be released: the poll is a driver call per stream.
            self.poll_freeing_streams();
        }
        let Some(mut inner) = self.lock_settled() else { return };
        // A shard releases what the pool as a whole holds above the threshold (the device
        // calls every shard in turn).
        let pool_reserved = self.budget.as_ref().map_or(inner.engine.reserved(), |b| b.reserved());
        if pool_reserved <= threshold {
            return;
        }
        let keep = self.keep_for(inner.engine.reserved(), threshold);
        let order = Order::completion(&self.device);
        let (engine, mut backing) = inner.parts(self);
        match engine.release(keep, &order, &mut backing) {
            Ok(released) => {
                crate::observe::trace_trim("threshold", released, inner.engine.reserved());
                inner.record(
                    self,
                    HistoryEntry { size: released, ..HistoryEntry::of(RecordKind::Trim) },
                );
            }
            // Not an error of any call: memory the backend would not release yet (a use
            // the pool was not told of still running) stays cached, accounted exactly, and
            // a later synchronisation or `trim_to` tries again. Sticky errors are for frees.
            Err(e) => crate::observe::trace_release_failed("threshold", &e),
        }
    }

    /// Releases free memory of this core so that the pool holds at least `bytes` (see
    /// [`crate::MemPool::trim_to`]); returns the bytes released.
    fn trim_to(&self, bytes: u64) -> Result<u64> {
        self.poll_freeing_streams();
        let mut inner = self.lock();
        self.drain_passthrough(&mut inner);
        // At least `bytes` stay (CUDA's and CANN's `minBytesToKeep`): the engine keeps its
        // target rounded down to a granule, so round it up here. `max_size` is a multiple of
        // the granularity, so the rounded target stays within it.
        let at_least = bytes.next_multiple_of(inner.engine.config().granularity);
        let keep = self.keep_for(inner.engine.reserved(), at_least);
        let order = Order::completion(&self.device);
        let (engine, mut backing) = inner.parts(self);
        let released = engine.release(keep, &order, &mut backing).map_err(Error::Driver)?;
        inner.record(self, HistoryEntry { size: released, ..HistoryEntry::of(RecordKind::Trim) });
        crate::observe::trace_trim("trim_to", released, inner.engine.reserved());
        Ok(released)
    }

    /// Asks the backend to bring the completion of the live streams that freed here up to
    /// date ([`poll_completed`](crate::hal::StreamHal::poll_completed)) before memory is
    /// released: a backend that caches completion would otherwise keep memory whose frees the
    /// device has finished.
    fn poll_freeing_streams(&self) {
        for (_, live) in self.freeing_live_streams() {
            live.hal.poll_completed();
        }
    }

    /// The live streams that freed into this core (read under the lock, returned without it).
    pub(super) fn freeing_live_streams(&self) -> SmallVec<[(StreamSlot, LiveStream); 8]> {
        let slots: SmallVec<[StreamSlot; 8]> =
            self.lock().engine.freeing_streams().filter(|&s| is_stream_slot(s)).collect();
        slots.into_iter().filter_map(|s| self.device.live_stream(s).map(|live| (s, live))).collect()
    }

    /// What this core keeps (the `keep` of [`crate::engine::Engine::release`]) so that the
    /// pool holds `target` bytes: `target` itself when the pool is one core; a shard keeps
    /// its `reserved` minus the pool's excess over `target`.
    fn keep_for(&self, reserved: u64, target: u64) -> u64 {
        match &self.budget {
            Some(b) => reserved.saturating_sub(b.reserved().saturating_sub(target)),
            None => target,
        }
    }

    /// Pass-through mode: hands the frees that completed to the engine and releases every
    /// fully free granule.
    #[inline]
    pub(super) fn drain_passthrough(&self, inner: &mut PoolInner) {
        if let Some(p) = &self.passthrough {
            self.drain_passthrough_slow(inner, p);
        }
    }

    #[cold]
    #[inline(never)]
    fn drain_passthrough_slow(&self, inner: &mut PoolInner, p: &Passthrough) {
        let done = p.take_done();
        if done.is_empty() {
            return;
        }
        for (block, tag) in done {
            let _ = inner.engine.free(block, tag);
        }
        let order = Order::completion(&self.device);
        let (engine, mut backing) = inner.parts(self);
        if let Err(e) = engine.release(0, &order, &mut backing) {
            // As at the threshold: the memory stays mapped until the next drain releases it.
            crate::observe::trace_release_failed("pass-through", &e);
        }
    }
}

impl Cores<'_> {
    /// Releases free memory down to `max(bytes, used)`: a sharded pool trims its shards in
    /// turn until the pool as a whole is at `bytes`. Returns the bytes released.
    pub(super) fn trim_to(self, bytes: u64) -> Result<u64> {
        let mut total = 0;
        for core in self.iter() {
            total += core.trim_to(bytes)?;
        }
        Ok(total)
    }
}
