//! What the engine learns of stream order: when a free may be reused by a stream, when it
//! has completed. And settling: merging the frees the host has observed with their free
//! neighbours, when the device reports a dropped stream or a synchronisation.
//!
//! Graph slots (see `graph_region.rs`) name no stream: their frees are eligible for no other
//! slot and never complete, except while their region is released ([`ReleaseOrder`]).

use super::core::{Locked, PoolCore};
use super::graph_region::is_stream_slot;
use super::policy::{FOLLOW_EVENT_DEPENDENCIES, INTERNAL_DEPENDENCIES, OPPORTUNISTIC};
use crate::device::{DeviceShared, StreamEventListener};
use crate::engine::{Eligibility, Engine, FreeTag, StreamOrder, StreamSlot};
use crate::stream::Stream;
use std::sync::atomic::Ordering;

/// The stream-order knowledge the engine consults for one request (or release).
pub(super) struct Order<'a> {
    device: &'a DeviceShared,
    requester: Option<&'a Stream<'a>>,
    reuse: u32,
}

impl<'a> Order<'a> {
    /// The order a request of `stream` sees in `core`, under the pool's reuse rules now.
    #[inline]
    pub(super) fn for_request(core: &'a PoolCore, stream: &'a Stream<'a>) -> Order<'a> {
        Order { device: &core.device, requester: Some(stream), reuse: core.settings.reuse_bits() }
    }

    /// The order a request of capturing stream `stream` sees in `core`: what no future
    /// launch of the graph can race with — host-observed frees, and completed ones when the
    /// pool's opportunistic rule is on; never the event rule (a launch is not ordered by the
    /// capturing stream's clock) nor an inserted dependency (it would be captured).
    pub(super) fn for_capture(core: &'a PoolCore, stream: &'a Stream<'a>) -> Order<'a> {
        let reuse = core.settings.reuse_bits() & OPPORTUNISTIC;
        Order { device: &core.device, requester: Some(stream), reuse }
    }

    /// The order of a release, a settling or a teardown: completion alone, no requester.
    pub(super) fn completion(device: &'a DeviceShared) -> Order<'a> {
        Order { device, requester: None, reuse: 0 }
    }
}

impl StreamOrder for Order<'_> {
    fn eligibility(&self, s: StreamSlot) -> Eligibility {
        let event = match self.requester {
            Some(t) if self.reuse & FOLLOW_EVENT_DEPENDENCIES != 0 && is_stream_slot(s) => {
                t.clock().get(s)
            }
            _ => 0,
        };
        Eligibility { event, ..self.completion(s) }
    }

    fn internal_dependencies(&self) -> bool {
        self.requester.is_some() && self.reuse & INTERNAL_DEPENDENCIES != 0
    }

    fn is_complete(&self, tag: FreeTag) -> bool {
        is_stream_slot(tag.stream) && self.device.slots.is_complete(tag.stream, tag.pos)
    }

    fn completion(&self, s: StreamSlot) -> Eligibility {
        if !is_stream_slot(s) {
            return Eligibility::default();
        }
        let host_observed = self.device.slots.host_observed(s);
        let completed =
            if self.reuse & OPPORTUNISTIC != 0 { self.device.slots.completed_bound(s) } else { 0 };
        Eligibility { host_observed, event: 0, completed }
    }
}

/// The order of a region's release: the completion order, under which the frees of the
/// region's graph slots are host-observed and complete (its graphs are gone, and their
/// launches complete), so that settling merges them back with the pool's memory.
pub(super) struct ReleaseOrder<'a> {
    completion: Order<'a>,
    slots: &'a [StreamSlot],
}

impl<'a> ReleaseOrder<'a> {
    pub(super) fn new(device: &'a DeviceShared, slots: &'a [StreamSlot]) -> ReleaseOrder<'a> {
        ReleaseOrder { completion: Order::completion(device), slots }
    }
}

impl StreamOrder for ReleaseOrder<'_> {
    fn eligibility(&self, s: StreamSlot) -> Eligibility {
        if self.slots.contains(&s) {
            return Eligibility { host_observed: u64::MAX, ..Eligibility::default() };
        }
        self.completion.eligibility(s)
    }

    fn internal_dependencies(&self) -> bool {
        false
    }

    fn is_complete(&self, tag: FreeTag) -> bool {
        self.slots.contains(&tag.stream) || self.completion.is_complete(tag)
    }
}

/// Settles `engine`'s host-observed frees ([`Engine::settle`]), unless nothing was freed or
/// the only stream that ever freed there is alive and alone on the device: its frees merge
/// among themselves already, and settling would cost a pass over them at every
/// synchronisation. (A dropped stream's frees settle: the next stream may come after it.)
pub(super) fn settle(device: &DeviceShared, engine: &mut Engine) {
    let mut freeing = engine.freeing_streams();
    let nothing_to_merge = match (freeing.next(), freeing.next()) {
        (None, _) => true,
        (Some(s), None) => {
            is_stream_slot(s) && device.slots.live_count() <= 1 && device.slots.is_live(s)
        }
        (Some(_), Some(_)) => false,
    };
    drop(freeing);
    if !nothing_to_merge {
        engine.settle(&Order::completion(device));
    }
}

impl PoolCore {
    /// The free bytes of `engine` cached on a stream whose free the host has not observed:
    /// what is not yet reusable by every stream. Settling untags observed frees, but it is
    /// skipped for a stream alone on the device and does not follow observations that are
    /// not synchronisations (a successful query): the count follows the observations
    /// themselves, whatever was settled.
    pub(super) fn unobserved_bytes(&self, engine: &Engine) -> u64 {
        // A slot no stream holds: every stream's frees count (graph memory, on private slots,
        // is not pending on a stream: it is counted apart).
        let frees = engine.pending_frees(StreamSlot::MAX, &Order::completion(&self.device));
        frees.iter().map(|p| p.bytes).sum()
    }

    /// The pool locked with every host-observed free settled (the deferred frees of a
    /// pass-through pool handed over first); `None` for a pool torn down.
    pub(super) fn lock_settled(&self) -> Option<Locked<'_>> {
        if self.torn_down.load(Ordering::Acquire) {
            return None;
        }
        let mut inner = self.lock();
        self.drain_passthrough(&mut inner);
        settle(&self.device, &mut inner.engine);
        Some(inner)
    }
}

impl StreamEventListener for PoolCore {
    /// Settles the dropped stream's frees, host-observed now.
    fn stream_dropped(&self) {
        self.lock_settled();
    }

    /// Settles what the synchronisation made host-observed, then releases free memory down
    /// to the release threshold.
    fn host_synchronized(&self) {
        self.apply_release_threshold();
    }

    /// Releases the region kept for the token, if this core has one.
    fn graph_memory_released(&self, key: u64) {
        self.release_graph_memory(key);
    }
}
