//! A request the engine could not serve at once: out of memory in a sharded pool releases the
//! other shards' idle memory, out of memory with frees pending on other streams waits for
//! them, and what still fails is reported with the pool's numbers — after the out-of-memory
//! hooks, which may ask for one more attempt.

use smallvec::SmallVec;

use super::allocate::{Granted, Request};
use super::backing::AllocError;
use super::core::{HistoryEntry, PoolCore};
use super::order::{settle, Order};
use super::policy::{OomAction, OomHook};
use crate::engine::{Allocation, PendingFrees};
use crate::error::{Error, OutOfMemory, Result};
use crate::observe::{PendingFree, RecordKind};

/// How a request that failed its first attempt ends.
pub(super) enum Outcome {
    /// This core served it after all; the allocation still needs its finishing steps.
    Served(Allocation),
    /// Another shard served it, finishing steps done.
    ServedElsewhere(Granted),
    /// It failed.
    Failed(Error),
}

/// Out of memory after the pool's own wait and retry: both the per-call hook and the pool's
/// hook may free memory, so either may ask for one more attempt, `retry`. (Out of line, for
/// the engine's cores and the native pool alike: the hot path calls its first attempt
/// directly.)
#[cold]
#[inline(never)]
pub(super) fn retry_after_oom(
    pool_hook: Option<&OomHook>,
    on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
    oom: Box<OutOfMemory>,
    retry: impl FnOnce() -> Result<Granted>,
) -> Result<Granted> {
    // Both hooks are called, always: either may free memory.
    let local = on_oom(&oom);
    let global = pool_hook.map_or(OomAction::Fail, |hook| hook(&oom));
    if local == OomAction::Retry || global == OomAction::Retry {
        return retry();
    }
    Err(Error::OutOfMemory(oom))
}

impl PoolCore {
    /// The rest of a failed first attempt of a request (cold): out of memory in a sharded
    /// pool first releases the other shards' idle memory and retries; out of memory with frees
    /// pending on other streams waits for them and retries once; otherwise the error is
    /// reported and recorded.
    #[cold]
    #[inline(never)]
    pub(super) fn alloc_failed(
        &self,
        req: &Request<'_>,
        order: &Order<'_>,
        first: AllocError,
    ) -> Outcome {
        let first = match first {
            AllocError::OutOfMemory(_)
                if !req.peers.is_empty() && self.release_peers(req.peers) > 0 =>
            {
                match self.alloc_here(req, order) {
                    Ok(a) => return Outcome::Served(a),
                    Err(e) => e,
                }
            }
            other => other,
        };
        // What was pending on other streams before the wait, for the report.
        let mut first_pending = SmallVec::new();
        let result = match first {
            AllocError::OutOfMemory(mut info) => {
                for &peer in req.peers {
                    let more = peer.lock().engine.pending_frees(req.stream.slot(), order);
                    info.pending.extend(more);
                }
                // With nothing pending but enough free bytes in the pool, the frees are
                // eligible but may be cut into per-stream blocks that only settling merges (a
                // reuse switch on must not fail what the same program with it off serves):
                // what the device has completed of the streams that freed here becomes
                // host-observed without waiting — no stream is synchronised, so neither the
                // requesting stream nor one that took a dropped stream's slot can block this.
                let settle_completed = info.pending.is_empty()
                    && info.reserved.saturating_sub(info.used) >= info.rounded;
                if info.pending.is_empty() && !settle_completed {
                    Err((AllocError::OutOfMemory(info), false))
                } else {
                    first_pending.clone_from(&info.pending);
                    match self.wait_and_retry(req, order, &info.pending, settle_completed) {
                        Ok(outcome) => return outcome,
                        Err(e) => Err((e, true)),
                    }
                }
            }
            other => Err((other, false)),
        };
        match result {
            Ok(a) => Outcome::Served(a),
            Err((e, retried)) => Outcome::Failed(self.failed(req, e, retried, &first_pending)),
        }
    }

    /// The pool's own retry: makes the frees pending on other streams host-observed (waiting
    /// for those streams, without the pool's lock) — or, with `settle_completed`, what the
    /// device has completed of the streams that freed here — settles them, and tries again:
    /// every shard's cached memory, then this shard with growth.
    #[allow(clippy::result_large_err, reason = "as Engine::alloc, whose error this is")]
    fn wait_and_retry(
        &self,
        req: &Request<'_>,
        order: &Order<'_>,
        pending: &[PendingFrees],
        settle_completed: bool,
    ) -> std::result::Result<Outcome, AllocError> {
        let device = &self.device;
        let cores = || std::iter::once(self).chain(req.peers.iter().copied());
        if settle_completed {
            for core in cores() {
                for (slot, live) in core.freeing_live_streams() {
                    live.hal.poll_completed();
                    device.observe(slot, live.completed() + 1);
                }
            }
        }
        // Wait for the streams holding pending frees, then retry once: their blocks become
        // host-observed and reusable here.
        for pending in pending {
            if let Some(live) = device.live_stream(pending.stream) {
                let enqueued = live.enqueued();
                let _ = live.hal.synchronize();
                device.observe(pending.stream, enqueued + 1);
            }
        }
        // Memory of dropped pools whose work the wait completed goes back to the device.
        device.deferred.release_complete(device);
        // Host-observed now, those frees settle: merged with their free neighbours of any
        // stream, they may serve a request none fits alone.
        for core in cores() {
            settle(device, &mut core.lock().engine);
        }
        self.lock().oom_retries += 1;
        if !req.peers.is_empty() {
            match self.reuse_in_shards(req, order) {
                Ok(Some(g)) => return Ok(Outcome::ServedElsewhere(g)),
                Ok(None) => {}
                Err(e) => return Ok(Outcome::Failed(e)),
            }
            self.release_peers(req.peers);
        }
        self.alloc_here(req, order).map(Outcome::Served)
    }

    /// The error of a request that failed for good, counted and recorded (and traced when
    /// out of memory).
    pub(super) fn failed(
        &self,
        req: &Request<'_>,
        e: AllocError,
        retried: bool,
        first_pending: &[PendingFrees],
    ) -> Error {
        let oom = matches!(e, AllocError::OutOfMemory(_));
        let error = self.alloc_error(req, e, retried, first_pending);
        let mut inner = self.lock();
        if oom {
            inner.ooms += 1;
        }
        let kind = if oom { RecordKind::Oom } else { RecordKind::AllocFailed };
        if oom {
            crate::observe::trace_oom(&error);
        }
        let entry = HistoryEntry {
            stream: req.stream.id(),
            requested: req.bytes,
            location: req.location,
            ..HistoryEntry::of(kind)
        };
        inner.record(self, entry);
        error
    }

    /// The error for a failed allocation; out of memory carries the pool's numbers, the
    /// frees that were pending on other streams (`first_pending`, before the pool's wait, or
    /// those of the final attempt) by stream id, and the reuse policy.
    fn alloc_error(
        &self,
        req: &Request<'_>,
        e: AllocError,
        retried: bool,
        first_pending: &[PendingFrees],
    ) -> Error {
        match e {
            AllocError::InvalidSize(msg) => Error::InvalidSize(msg),
            AllocError::InvalidAlignment(msg) => Error::InvalidArgument(msg),
            AllocError::Backing(e) => Error::Driver(e),
            AllocError::OutOfMemory(info) => {
                let mem = self.hal().mem_info().ok();
                let source =
                    if first_pending.is_empty() { &info.pending[..] } else { first_pending };
                let mut pending: Vec<PendingFree> = source
                    .iter()
                    .map(|p| PendingFree {
                        stream: self.device.live_stream(p.stream).map_or(0, |l| l.hal.id()),
                        bytes: p.bytes,
                    })
                    .collect();
                pending.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.stream.cmp(&b.stream)));
                Error::OutOfMemory(Box::new(OutOfMemory {
                    requested: req.bytes,
                    rounded: info.rounded,
                    stream: req.stream.id(),
                    // A sharded pool reports the pool's figures, not the shard's.
                    used: self.budget.as_ref().map_or(info.used, |b| b.counters().used),
                    reserved: self.budget.as_ref().map_or(info.reserved, |b| b.reserved()),
                    max: info.max,
                    largest_free_block: info.largest_free_block,
                    pending_bytes: pending.iter().map(|p| p.bytes).sum(),
                    pending,
                    reuse: self.settings.reuse_policy(),
                    device_free: mem.map_or(0, |m| m.free),
                    device_total: mem.map_or(0, |m| m.total),
                    retried,
                    cause: None,
                }))
            }
        }
    }
}
