//! Stream shards ([`MemPoolBuilder::stream_shards`](super::MemPoolBuilder::stream_shards)):
//! one engine and lock per group of streams, so that streams allocating on different
//! threads do not serialise on one lock. Frees lock the block's shard (a sharded pool has no
//! free ring: a ring is drained only when its shard is locked, so a free parked there would
//! still count as used while other shards allocate).
//!
//! A sharded pool is a set of [`PoolCore`]s, each over its own reserved address range of
//! the pool's full `max_size` (address space is cheap; physical memory is what is limited).
//! Stream slot `s` allocates in shard `s % n`; a block is freed into the shard it came
//! from. Cross-stream reuse crosses shards: before any shard maps fresh memory, every
//! shard's cached memory is offered to the request under the same reuse rules (so a block
//! freed on one stream is found by another stream after an event wait, wherever it lives),
//! and a shard that runs out of memory first releases the other shards' idle segments and
//! retries. The pool's physical limit and its `used` / `reserved` counters and high-water
//! marks are kept here, in atomics shared by the shards, so that they stay exact for the
//! pool as a whole.

use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::allocate::{Granted, Request};
use super::core::{CoreSpec, PoolCore};
use super::order::Order;
use super::policy::OomAction;
use super::stats::PoolStats;
use crate::error::{OutOfMemory, Result};
use crate::stream::Stream;

/// The most shards a pool may have
/// ([`MemPoolBuilder::stream_shards`](super::MemPoolBuilder::stream_shards)).
pub const MAX_STREAM_SHARDS: usize = 64;

/// The pool-wide accounting shared by the shards of a sharded pool.
#[derive(Debug)]
pub(crate) struct Budget {
    /// The pool's `max_size`: what all shards together may map.
    max: u64,
    reserved: AtomicU64,
    reserved_high: AtomicU64,
    used: AtomicU64,
    used_high: AtomicU64,
    live: AtomicU64,
    live_high: AtomicU64,
}

impl Budget {
    pub(crate) fn new(max: u64) -> Budget {
        Budget {
            max,
            reserved: AtomicU64::new(0),
            reserved_high: AtomicU64::new(0),
            used: AtomicU64::new(0),
            used_high: AtomicU64::new(0),
            live: AtomicU64::new(0),
            live_high: AtomicU64::new(0),
        }
    }

    /// Claims `size` bytes of the pool's physical limit for a map; `false` (nothing claimed)
    /// when the shards together would exceed it.
    pub(crate) fn try_map(&self, size: u64) -> bool {
        let claimed = self.reserved.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
            r.checked_add(size).filter(|&n| n <= self.max)
        });
        match claimed {
            Ok(before) => {
                self.reserved_high.fetch_max(before + size, Ordering::AcqRel);
                true
            }
            Err(_) => false,
        }
    }

    /// Gives back what [`Budget::try_map`] claimed (a failed map, or an unmap).
    pub(crate) fn unmapped(&self, size: u64) {
        self.reserved.fetch_sub(size, Ordering::AcqRel);
    }

    /// Applies one shard's change of used bytes and live blocks (one critical section's
    /// worth: frees and allocations under one lock net out, as they did in the shard).
    #[inline]
    pub(crate) fn add_used(&self, used: i64, live: i64) {
        // One read-modify-write per counter; the high-water marks only when passed (a read
        // first: in steady state the pool is below its high).
        if used != 0 {
            let now = apply(&self.used, used);
            if used > 0 && now > self.used_high.load(Ordering::Acquire) {
                self.used_high.fetch_max(now, Ordering::AcqRel);
            }
        }
        if live != 0 {
            let now = apply(&self.live, live);
            if live > 0 && now > self.live_high.load(Ordering::Acquire) {
                self.live_high.fetch_max(now, Ordering::AcqRel);
            }
        }
    }

    /// The whole pool's counters now.
    pub(crate) fn counters(&self) -> BudgetCounters {
        BudgetCounters {
            used: self.used.load(Ordering::Acquire),
            used_high: self.used_high.load(Ordering::Acquire),
            reserved: self.reserved.load(Ordering::Acquire),
            reserved_high: self.reserved_high.load(Ordering::Acquire),
            live: self.live.load(Ordering::Acquire),
            live_high: self.live_high.load(Ordering::Acquire),
        }
    }

    pub(crate) fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }

    /// Restarts the `used` high-water mark (and the live-block one) from the current values.
    pub(crate) fn reset_used_high(&self) {
        self.used_high.store(self.used.load(Ordering::Acquire), Ordering::Release);
        self.live_high.store(self.live.load(Ordering::Acquire), Ordering::Release);
    }

    /// Restarts the `reserved` high-water mark from the current value.
    pub(crate) fn reset_reserved_high(&self) {
        self.reserved_high.store(self.reserved.load(Ordering::Acquire), Ordering::Release);
    }
}

fn apply(counter: &AtomicU64, delta: i64) -> u64 {
    if delta >= 0 {
        counter.fetch_add(delta as u64, Ordering::AcqRel) + delta as u64
    } else {
        let d = delta.unsigned_abs();
        counter.fetch_sub(d, Ordering::AcqRel) - d
    }
}

/// The pool-wide counters of a sharded pool ([`Budget::counters`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BudgetCounters {
    pub(crate) used: u64,
    pub(crate) used_high: u64,
    pub(crate) reserved: u64,
    pub(crate) reserved_high: u64,
    pub(crate) live: u64,
    pub(crate) live_high: u64,
}

/// A sharded pool: its first core (shard 0), the pool-wide budget, the other shards —
/// created on first use, each with its own address range; `None` when that range could not
/// be reserved (its streams then use shard 0) — and what it takes to create them.
pub(super) struct Shards {
    core: Arc<PoolCore>,
    budget: Arc<Budget>,
    more: Box<[OnceLock<Option<Arc<PoolCore>>>]>,
    spec: CoreSpec,
}

impl Shards {
    /// `n` shards, of which `core` is the first (created over `budget`); the others are
    /// created from `spec` when a stream first allocates in them.
    pub(super) fn new(
        core: Arc<PoolCore>,
        budget: Arc<Budget>,
        n: usize,
        spec: CoreSpec,
    ) -> Shards {
        Shards { core, budget, more: (1..n).map(|_| OnceLock::new()).collect(), spec }
    }

    /// The number of shards, the first included.
    fn count(&self) -> usize {
        self.more.len() + 1
    }

    /// Shard `shard` (shard 0 for an index that names no created shard).
    #[inline]
    pub(super) fn core_at(&self, shard: u8) -> &PoolCore {
        let more = usize::from(shard).checked_sub(1).and_then(|i| self.more.get(i));
        more.and_then(|c| c.get()).and_then(Option::as_deref).unwrap_or(&self.core)
    }

    /// The shard `stream` allocates in: its slot modulo the shard count, created (its range
    /// reserved) on first use; shard 0 when that fails.
    pub(super) fn home(&self, stream: &Stream<'_>) -> &PoolCore {
        let i = stream.slot() as usize % self.count();
        let Some(cell) = i.checked_sub(1).and_then(|j| self.more.get(j)) else {
            return &self.core;
        };
        let created = cell.get_or_init(|| {
            PoolCore::create(&self.core.device, &self.spec, i as u8, Some(&self.budget)).ok()
        });
        created.as_deref().unwrap_or(&self.core)
    }

    /// Allocates `bytes` for `stream` in its shard, the other shards being its peers: their
    /// cached memory is offered first, their idle memory released when the shard runs out.
    /// (A sharded pool has no free ring: every allocation takes this path.)
    #[inline(never)]
    pub(super) fn allocate(
        &self,
        bytes: u64,
        align: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
    ) -> Result<Granted> {
        let home = self.home(stream);
        // Inline for every possible shard count: no heap allocation per allocation.
        let peers: smallvec::SmallVec<[&PoolCore; MAX_STREAM_SHARDS]> =
            self.cores().iter().filter(|c| !std::ptr::eq(*c, home)).collect();
        home.allocate(&Request { bytes, align, stream, location, peers: &peers }, on_oom)
    }

    /// The shards created so far.
    pub(super) fn cores(&self) -> Cores<'_> {
        Cores { first: &self.core, shards: Some(self) }
    }
}

/// The engine cores of a pool, borrowed: the pool's one core, or its shards.
#[derive(Clone, Copy)]
pub(super) struct Cores<'a> {
    first: &'a PoolCore,
    shards: Option<&'a Shards>,
}

impl<'a> Cores<'a> {
    /// The one core of a pool that is not sharded.
    pub(super) fn single(core: &'a PoolCore) -> Cores<'a> {
        Cores { first: core, shards: None }
    }

    /// Shard 0: the whole pool unless it is sharded.
    pub(super) fn first(self) -> &'a PoolCore {
        self.first
    }

    /// The cores created so far, shard 0 first.
    pub(super) fn iter(self) -> impl Iterator<Item = &'a PoolCore> {
        let more = self.shards.into_iter().flat_map(|s| s.more.iter());
        std::iter::once(self.first).chain(more.filter_map(|c| c.get().and_then(Option::as_deref)))
    }

    /// Shard `shard` (shard 0 for an index that names no created shard).
    pub(super) fn core_at(self, shard: u8) -> &'a PoolCore {
        self.shards.map_or(self.first, |s| s.core_at(shard))
    }

    /// The pool-wide counters of a sharded pool (`None`: one core, its engine keeps them).
    pub(super) fn budget(self) -> Option<&'a Budget> {
        self.shards.map(|s| &*s.budget)
    }

    /// The pool's counters: its one engine's, or the shards' added up with the pool-wide
    /// sizes and high-water marks (which are the pool's own, not a sum).
    pub(super) fn stats(self) -> PoolStats {
        let mut sum = PoolStats::default();
        for core in self.iter() {
            let inner = core.lock();
            let mut engine = inner.engine.stats();
            if engine.pending_bytes > 0 {
                engine.pending_bytes = core.unobserved_bytes(&inner.engine);
            }
            let mut stats = PoolStats::from_engine(&engine, inner.oom_retries, inner.ooms, 0);
            stats.graph_reserved = inner.graph.stats(&inner.engine).map(|g| g.reserved).sum();
            sum += stats;
        }
        sum.max_size = self.first.max_size;
        if let Some(budget) = self.budget() {
            let c = budget.counters();
            sum.used = c.used;
            sum.used_high = c.used_high;
            sum.reserved = c.reserved;
            sum.reserved_high = c.reserved_high;
            sum.live_allocations = c.live;
            sum.live_allocations_high = c.live_high;
        }
        sum
    }
}

impl PoolCore {
    /// A sharded pool, before this shard (the requesting stream's) maps: cached memory of any
    /// shard, this one first — first under the rules that need no new dependency, then (when
    /// internal dependencies are allowed) with rule 4 — so that the pool reuses before it
    /// grows, as one engine does. `None` when no shard has a fitting block; bad requests are
    /// left to the engine's full path to report.
    pub(super) fn reuse_in_shards(
        &self,
        req: &Request<'_>,
        order: &Order<'_>,
    ) -> Result<Option<Granted>> {
        use crate::engine::StreamOrder as _;
        for with_dependency in [false, true] {
            if with_dependency && !order.internal_dependencies() {
                break;
            }
            for &core in std::iter::once(&self).chain(req.peers) {
                let got = {
                    let mut inner = core.lock();
                    if std::ptr::eq(core, self) {
                        if let Some(e) = self.take_sticky(&mut inner) {
                            return Err(e);
                        }
                    }
                    inner.engine.alloc_cached(
                        req.bytes,
                        core.alignment.max(req.align),
                        req.stream.slot(),
                        order,
                        with_dependency,
                    )
                };
                match got {
                    Ok(Some(a)) => {
                        let a = core.finish_allocate(req, a)?;
                        return Ok(Some(core.granted(&a)));
                    }
                    Ok(None) => {}
                    Err(_) => return Ok(None),
                }
            }
        }
        Ok(None)
    }

    /// Releases the idle memory of the other shards (`peers`): fully free segments whose
    /// frees have completed, as `trim_to(0)` does. Returns the bytes released.
    pub(super) fn release_peers(&self, peers: &[&PoolCore]) -> u64 {
        let order = Order::completion(&self.device);
        let mut released = 0;
        for &core in peers {
            let mut inner = core.lock();
            let (engine, mut backing) = inner.parts(core);
            match engine.release(0, &order, &mut backing) {
                Ok(n) => released += n,
                // Not an error of the request: what could not go stays cached, and the
                // request goes on with what did.
                Err(e) => crate::observe::trace_release_failed("other shards", &e),
            }
        }
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_refuses_a_map_beyond_the_limit_and_keeps_the_high_water_marks() {
        let b = Budget::new(10);
        assert!(b.try_map(6));
        assert!(!b.try_map(5), "6 + 5 > 10");
        assert_eq!(b.reserved(), 6, "a refused map claims nothing");
        assert!(b.try_map(4));
        b.unmapped(7);
        let c = b.counters();
        assert_eq!((c.reserved, c.reserved_high), (3, 10));
        b.add_used(5, 2);
        b.add_used(-3, -1);
        b.add_used(1, 1);
        let c = b.counters();
        assert_eq!((c.used, c.used_high, c.live, c.live_high), (3, 5, 2, 2));
        b.reset_used_high();
        b.reset_reserved_high();
        let c = b.counters();
        assert_eq!((c.used_high, c.reserved_high, c.live_high), (3, 3, 2));
    }
}
