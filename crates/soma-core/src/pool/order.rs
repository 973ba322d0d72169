//! What the engine learns of stream order: when a free may be reused by a stream, when it
//! has completed. And settling: merging the frees the host has observed with their free
//! neighbours, when the device reports a dropped stream or a synchronisation.

use super::core::{Locked, PoolCore};
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

    /// The order of a release, a settling or a teardown: completion alone, no requester.
    pub(super) fn completion(device: &'a DeviceShared) -> Order<'a> {
        Order { device, requester: None, reuse: 0 }
    }
}

impl StreamOrder for Order<'_> {
    fn eligibility(&self, s: StreamSlot) -> Eligibility {
        let host_observed = self.device.slots.host_observed(s);
        let event = match self.requester {
            Some(t) if self.reuse & FOLLOW_EVENT_DEPENDENCIES != 0 => t.clock().get(s),
            _ => 0,
        };
        let completed =
            if self.reuse & OPPORTUNISTIC != 0 { self.device.slots.completed_bound(s) } else { 0 };
        Eligibility { host_observed, event, completed }
    }

    fn internal_dependencies(&self) -> bool {
        self.requester.is_some() && self.reuse & INTERNAL_DEPENDENCIES != 0
    }

    fn is_complete(&self, tag: FreeTag) -> bool {
        self.device.slots.is_complete(tag.stream, tag.pos)
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
        (Some(s), None) => device.slots.live_count() <= 1 && device.slots.is_live(s),
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
        // A slot no stream holds: every stream's frees count.
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
}
