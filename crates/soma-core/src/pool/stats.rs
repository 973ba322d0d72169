//! Pool statistics: a plain `Copy` snapshot.

use std::fmt;
use std::ops::AddAssign;

use crate::engine::{EngineStats, ReuseKind};
use crate::error::Bytes;

/// Reuses of cached blocks, by the rule that allowed them.
///
/// With the `serde` feature it serializes as an object keyed by the field names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ReuseCounts {
    /// Rule 1: freed on the same stream.
    pub same_stream: u64,
    /// Rule 2: ordered after the free through events.
    pub event_dependency: u64,
    /// Rule 3: the free had completed.
    pub opportunistic: u64,
    /// Rule 4: the pool inserted a dependency.
    pub internal_dependency: u64,
    /// The host had observed the free's completion (a synchronize).
    pub host_synchronized: u64,
}

impl ReuseCounts {
    /// Sum over all rules.
    pub fn total(&self) -> u64 {
        self.same_stream
            + self.event_dependency
            + self.opportunistic
            + self.internal_dependency
            + self.host_synchronized
    }
}

/// Adds the reuses of another pool (or of another shard of the same pool), rule by rule.
impl AddAssign for ReuseCounts {
    fn add_assign(&mut self, other: ReuseCounts) {
        let ReuseCounts {
            same_stream,
            event_dependency,
            opportunistic,
            internal_dependency,
            host_synchronized,
        } = other;
        self.same_stream += same_stream;
        self.event_dependency += event_dependency;
        self.opportunistic += opportunistic;
        self.internal_dependency += internal_dependency;
        self.host_synchronized += host_synchronized;
    }
}

/// Counters of a pool: current, high-water and cumulative.
///
/// With the `serde` feature it serializes as an object keyed by the field names, in their
/// order here, every value an unsigned integer (`reuses` a nested [`ReuseCounts`] object).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes in live allocations (rounded sizes).
    pub used: u64,
    /// High-water mark of `used` (resettable).
    pub used_high: u64,
    /// Physical bytes held (used + cached).
    pub reserved: u64,
    /// High-water mark of `reserved` (resettable).
    pub reserved_high: u64,
    /// The pool's maximum size.
    pub max_size: u64,
    /// Live allocations.
    pub live_allocations: u64,
    /// High-water mark of live allocations.
    pub live_allocations_high: u64,
    /// Allocations served since creation.
    pub allocations: u64,
    /// Frees since creation.
    pub frees: u64,
    /// Allocations served from never-used memory.
    pub fresh_allocations: u64,
    /// Reuses of cached blocks by rule.
    pub reuses: ReuseCounts,
    /// Driver map calls (physical allocation + map).
    pub map_calls: u64,
    /// Driver unmap calls (unmap + physical free).
    pub unmap_calls: u64,
    /// Mapped runs currently held.
    pub mapped_segments: u64,
    /// Bytes mapped since creation.
    pub bytes_mapped_total: u64,
    /// Bytes unmapped since creation.
    pub bytes_unmapped_total: u64,
    /// Times recycling on growth paused because it had become chronic (see the semantics'
    /// "Recycling pauses when it is chronic").
    pub recycling_pauses: u64,
    /// Free bytes cached on a stream whose free the host has not observed (not yet reusable
    /// by every stream): a synchronisation, a successful query or a dropped stream makes
    /// the frees it covers leave this count, and so does the pool settling a free that the
    /// device completed (docs/semantics.md, *Settling on completion*).
    pub pending_bytes: u64,
    /// All free mapped bytes.
    pub free_bytes: u64,
    /// Largest free block.
    pub largest_free_block: u64,
    /// Allocations that failed with out of memory (each counted once, after its retry).
    pub ooms: u64,
    /// Times the pool waited for pending frees and retried an allocation.
    pub oom_retries: u64,
    /// Bytes kept for captured graphs (part of `reserved`): the graph memory of every graph
    /// and graph pool that allocated here, which only their captures reuse and neither
    /// release nor trimming gives back while they live (per graph:
    /// [`MemPool::graph_memory`](crate::MemPool::graph_memory)).
    pub graph_reserved: u64,
}

impl PoolStats {
    pub(crate) fn from_engine(e: &EngineStats, oom_retries: u64, ooms: u64, max_size: u64) -> Self {
        let r = |k: ReuseKind| e.reuses[k as usize];
        PoolStats {
            used: e.used,
            used_high: e.used_high,
            reserved: e.reserved,
            reserved_high: e.reserved_high,
            max_size,
            live_allocations: e.live_blocks,
            live_allocations_high: e.live_blocks_high,
            allocations: e.allocs,
            frees: e.frees,
            fresh_allocations: e.fresh_allocs,
            reuses: ReuseCounts {
                same_stream: r(ReuseKind::SameStream),
                event_dependency: r(ReuseKind::EventDependency),
                opportunistic: r(ReuseKind::Opportunistic),
                internal_dependency: r(ReuseKind::InternalDependency),
                host_synchronized: r(ReuseKind::HostSynchronized),
            },
            map_calls: e.map_calls,
            unmap_calls: e.unmap_calls,
            mapped_segments: e.mapped_segments,
            bytes_mapped_total: e.bytes_mapped_total,
            bytes_unmapped_total: e.bytes_unmapped_total,
            recycling_pauses: e.recycling_pauses,
            pending_bytes: e.pending_bytes,
            free_bytes: e.free_bytes,
            largest_free_block: e.largest_free_block,
            ooms,
            oom_retries,
            graph_reserved: 0,
        }
    }

    /// Peak reserved / peak used (1.0 = no memory lost to fragmentation or caching); 1.0 for
    /// a pool that never allocated.
    pub fn fragmentation(&self) -> f64 {
        if self.used_high == 0 {
            1.0
        } else {
            self.reserved_high as f64 / self.used_high as f64
        }
    }
}

/// Adds the counters of another pool (or of another shard of the same pool): current values,
/// cumulative counts, high-water marks and max sizes add up (summed marks bound the
/// combined one from above); the largest free block is the larger of the two.
impl AddAssign for PoolStats {
    fn add_assign(&mut self, other: PoolStats) {
        let PoolStats {
            used,
            used_high,
            reserved,
            reserved_high,
            max_size,
            live_allocations,
            live_allocations_high,
            allocations,
            frees,
            fresh_allocations,
            reuses,
            map_calls,
            unmap_calls,
            mapped_segments,
            bytes_mapped_total,
            bytes_unmapped_total,
            recycling_pauses,
            pending_bytes,
            free_bytes,
            largest_free_block,
            ooms,
            oom_retries,
            graph_reserved,
        } = other;
        self.used += used;
        self.used_high += used_high;
        self.reserved += reserved;
        self.reserved_high += reserved_high;
        self.max_size += max_size;
        self.live_allocations += live_allocations;
        self.live_allocations_high += live_allocations_high;
        self.allocations += allocations;
        self.frees += frees;
        self.fresh_allocations += fresh_allocations;
        self.reuses += reuses;
        self.map_calls += map_calls;
        self.unmap_calls += unmap_calls;
        self.mapped_segments += mapped_segments;
        self.bytes_mapped_total += bytes_mapped_total;
        self.bytes_unmapped_total += bytes_unmapped_total;
        self.recycling_pauses += recycling_pauses;
        self.pending_bytes += pending_bytes;
        self.free_bytes += free_bytes;
        self.largest_free_block = self.largest_free_block.max(largest_free_block);
        self.ooms += ooms;
        self.oom_retries += oom_retries;
        self.graph_reserved += graph_reserved;
    }
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<22} {:>12} {:>12}", "", "current", "high")?;
        writeln!(
            f,
            "{:<22} {:>12} {:>12}",
            "used",
            Bytes(self.used).to_string(),
            Bytes(self.used_high).to_string()
        )?;
        writeln!(
            f,
            "{:<22} {:>12} {:>12}",
            "reserved",
            Bytes(self.reserved).to_string(),
            Bytes(self.reserved_high).to_string()
        )?;
        writeln!(
            f,
            "{:<22} {:>12} {:>12}",
            "live allocations", self.live_allocations, self.live_allocations_high
        )?;
        writeln!(f, "{:<22} {:>12}", "allocations", self.allocations)?;
        writeln!(f, "{:<22} {:>12}", "frees", self.frees)?;
        writeln!(
            f,
            "{:<22} {:>12} (same stream {}, event {}, opportunistic {}, internal {}, host sync {})",
            "reuses",
            self.reuses.total(),
            self.reuses.same_stream,
            self.reuses.event_dependency,
            self.reuses.opportunistic,
            self.reuses.internal_dependency,
            self.reuses.host_synchronized
        )?;
        writeln!(
            f,
            "{:<22} {:>12} / {} (recycling paused {}x)",
            "driver map / unmap", self.map_calls, self.unmap_calls, self.recycling_pauses
        )?;
        writeln!(f, "{:<22} {:>12}", "pending frees", Bytes(self.pending_bytes).to_string())?;
        writeln!(f, "{:<22} {:>12}", "graph memory", Bytes(self.graph_reserved).to_string())?;
        writeln!(
            f,
            "{:<22} {:>12}",
            "largest free block",
            Bytes(self.largest_free_block).to_string()
        )?;
        writeln!(f, "{:<22} {:>12} (retries {})", "out of memory", self.ooms, self.oom_retries)?;
        write!(f, "{:<22} {:>12.3}", "fragmentation", self.fragmentation())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_stats_sums_the_counters_and_keeps_the_largest_free_block() {
        let part = |n: u64| PoolStats {
            used: n,
            used_high: 2 * n,
            max_size: 100,
            allocations: 3 * n,
            reuses: ReuseCounts { event_dependency: n, ..ReuseCounts::default() },
            largest_free_block: 10 * n,
            ooms: n,
            oom_retries: 1,
            ..PoolStats::default()
        };
        let mut sum = part(1);
        sum += part(4);
        assert_eq!((sum.used, sum.used_high, sum.max_size, sum.allocations), (5, 10, 200, 15));
        assert_eq!((sum.reuses.event_dependency, sum.reuses.total()), (5, 5));
        assert_eq!((sum.largest_free_block, sum.ooms, sum.oom_retries), (40, 5, 2));
    }
}
