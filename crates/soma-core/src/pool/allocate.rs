//! Allocation in one core: the request, the engine's answer under the lock, and what a
//! served request still needs (an inserted dependency, the sanitizer's annotation, the
//! history record).

use std::panic::Location;

use super::backing::AllocError;
use super::core::{HistoryEntry, PoolCore, PoolInner};
use super::free::wait_for_uses;
use super::handle::{Origin, StreamUse};
use super::oom::{retry_after_oom, Outcome};
use super::order::Order;
use super::policy::OomAction;
use crate::engine::{Allocation, BlockId, FreeTag, StreamOrder, StreamSlot};
use crate::error::{Error, OutOfMemory, Result};
use crate::hal::{DevicePtr, PoolAnnotation};
use crate::observe::RecordKind;
use crate::stream::Stream;

/// A block handed out by a pool: from the engine (`block`) or from the device's native
/// pool (`block == None`, freed by pointer).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Granted {
    pub(crate) block: Option<BlockId>,
    pub(crate) ptr: DevicePtr,
    pub(crate) size: u64,
    /// The shard whose engine holds `block` (0 unless the pool is sharded) and the rule
    /// that served it.
    pub(crate) origin: Origin,
}

/// One allocation request as it goes through a core.
pub(super) struct Request<'r> {
    /// Bytes asked for (the block is rounded to `align`).
    pub(super) bytes: u64,
    /// The block's alignment: the pool's, or more for `alloc_aligned_async` (0 means the
    /// pool's).
    pub(super) align: u64,
    pub(super) stream: &'r Stream<'r>,
    /// The caller's source location, for the history.
    pub(super) location: Option<&'static Location<'static>>,
    /// The other shards of a sharded pool (empty otherwise): their cached memory is tried
    /// before this shard grows, and their idle memory released when it runs out.
    pub(super) peers: &'r [&'r PoolCore],
}

impl PoolCore {
    /// The lock-free allocation path: the free ring's only free, if it was made on `stream`
    /// with the size a request of `bytes` gets — what the engine's search would hand out (the
    /// latest exact fit freed on the requesting stream), without taking the lock. With more
    /// frees waiting, the engine decides (after the lock's drain), so that placement — and
    /// fragmentation — stay the engine's.
    #[inline]
    pub(super) fn reuse_ringed(&self, bytes: u64, stream: &Stream<'_>) -> Option<Granted> {
        let ring = self.free_ring.as_ref()?;
        if self.sticky_pending() {
            return None;
        }
        let size = self.block_size(bytes)?;
        let slot = stream.slot();
        let f = ring.pop_only_if(|f| f.tag.stream == slot && f.size == size)?;
        Some(Granted {
            block: Some(f.block),
            ptr: self.ptr_at(f.offset),
            size,
            origin: self.ringed_origin,
        })
    }

    /// Allocates `req.bytes` for `req.stream` (rounded to the pool's alignment), waiting for
    /// other streams' pending frees and retrying once before reporting out of memory; the
    /// out-of-memory hooks may then ask for one more attempt.
    #[inline(always)]
    pub(super) fn allocate(
        &self,
        req: &Request<'_>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
    ) -> Result<Granted> {
        match self.try_allocate(req) {
            Err(Error::OutOfMemory(oom)) => {
                retry_after_oom(self.on_oom.as_ref(), on_oom, oom, || self.try_allocate(req))
            }
            other => other,
        }
    }

    #[inline(always)]
    fn try_allocate(&self, req: &Request<'_>) -> Result<Granted> {
        let order = Order::for_request(self, req.stream);
        if !req.peers.is_empty() {
            if let Some(g) = self.reuse_in_shards(req, &order)? {
                return Ok(g);
            }
        }
        let first = {
            let mut inner = self.lock();
            self.drain_passthrough(&mut inner);
            if let Some(e) = self.take_sticky(&mut inner) {
                return Err(e);
            }
            self.alloc_locked(&mut inner, req, req.stream.slot(), &order)
        };
        let allocation = match first {
            // The common case reads the engine's answer where it landed: no moves of it.
            Ok(a) if a.dependency.is_none() && !self.annotate && !self.history_on => {
                return Ok(self.granted(&a));
            }
            Ok(a) => a,
            Err(e) => match self.alloc_failed(req, &order, e) {
                Outcome::Served(a) => a,
                Outcome::ServedElsewhere(granted) => return Ok(granted),
                Outcome::Failed(error) => return Err(error),
            },
        };
        let a = self.finish_allocate(req, allocation)?;
        Ok(self.granted(&a))
    }

    /// One engine allocation in this core, growth included (the retries after the first).
    #[allow(clippy::result_large_err, reason = "as Engine::alloc, whose error this is")]
    pub(super) fn alloc_here(
        &self,
        req: &Request<'_>,
        order: &Order<'_>,
    ) -> std::result::Result<Allocation, AllocError> {
        self.alloc_locked(&mut self.lock(), req, req.stream.slot(), order)
    }

    /// One engine allocation for stream slot `slot` (the request's stream's, or its graph
    /// slot in a capture) under the lock `inner`. Out of line: inlined into the public entry
    /// points with the rest of the path it costs more than the call; the only call of
    /// [`Engine::alloc`](crate::engine::Engine::alloc), which inlines here.
    #[inline(never)]
    #[allow(clippy::result_large_err, reason = "as Engine::alloc, whose error this is")]
    pub(super) fn alloc_locked(
        &self,
        inner: &mut PoolInner,
        req: &Request<'_>,
        slot: StreamSlot,
        order: &dyn StreamOrder,
    ) -> std::result::Result<Allocation, AllocError> {
        let (engine, mut backing) = inner.parts(self);
        let align = self.alignment.max(req.align);
        engine.alloc(req.bytes, align, slot, order, &mut backing)
    }

    pub(super) fn granted(&self, a: &Allocation) -> Granted {
        Granted {
            block: Some(a.block),
            ptr: self.ptr_at(a.offset),
            size: a.size,
            origin: Origin::new(self.shard, a.reuse),
        }
    }

    /// The success path of [`PoolCore::try_allocate`]: the dependency an internal-dependency
    /// reuse needs, annotations and history.
    #[inline(always)]
    pub(super) fn finish_allocate(
        &self,
        req: &Request<'_>,
        allocation: Allocation,
    ) -> Result<Allocation> {
        if allocation.dependency.is_none() && !self.annotate && !self.history_on {
            return Ok(allocation);
        }
        self.finish_allocate_slow(req, allocation)
    }

    /// [`PoolCore::finish_allocate`] with a dependency to insert, an annotation or a history
    /// record to make.
    #[inline(never)]
    fn finish_allocate_slow(
        &self,
        req: &Request<'_>,
        allocation: Allocation,
    ) -> Result<Allocation> {
        let stream = req.stream;
        if let Some(tag) = allocation.dependency {
            if let Err(e) = insert_dependency(tag, stream) {
                // Give the block back where it came from: its original tag keeps it safe.
                let _ = self.lock().engine.free(allocation.block, tag);
                return Err(e);
            }
        }
        if self.annotate {
            self.hal().annotate(PoolAnnotation::Alloc {
                pool: self.id,
                ptr: self.ptr_at(allocation.offset),
                size: req.bytes,
                stream: stream.id(),
                position: stream.hal().enqueued(),
            });
        }
        if self.history_on {
            let mut inner = self.lock();
            let entry = HistoryEntry {
                stream: stream.id(),
                offset: allocation.offset,
                size: allocation.size,
                requested: req.bytes,
                reuse: allocation.reuse,
                location: req.location,
                ..HistoryEntry::of(RecordKind::Alloc)
            };
            inner.record(self, entry);
        }
        Ok(allocation)
    }
}

/// Rule 4: make `stream` wait on an event recorded on `tag.stream` after the free.
pub(super) fn insert_dependency(tag: FreeTag, stream: &Stream<'_>) -> Result<()> {
    // An event recorded on the freeing stream now (after the free), waited on by `stream`:
    // exactly what ordering after a recorded use does. A dropped stream has drained, so its
    // free is complete and nothing is inserted.
    wait_for_uses(stream, &[StreamUse::Local(tag.stream, tag.pos)])
}
