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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::{CoreSpec, MemPoolBuilder, PoolCore};

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

/// What a sharded pool has beyond its first shard (the pool's own core): the pool-wide
/// budget, the other shards — created on first use, each with its own address range; `None`
/// when that range could not be reserved (its streams then use shard 0) — and what it takes
/// to create them.
pub(crate) struct Shards {
    pub(crate) budget: Arc<Budget>,
    pub(crate) more: Box<[OnceLock<Option<Arc<PoolCore>>>]>,
    pub(crate) builder: MemPoolBuilder,
    pub(crate) spec: CoreSpec,
}

impl Shards {
    pub(crate) fn new(
        budget: Arc<Budget>,
        n: usize,
        builder: MemPoolBuilder,
        spec: CoreSpec,
    ) -> Shards {
        Shards { budget, more: (1..n).map(|_| OnceLock::new()).collect(), builder, spec }
    }

    /// The number of shards, the first included.
    pub(crate) fn count(&self) -> usize {
        self.more.len() + 1
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
