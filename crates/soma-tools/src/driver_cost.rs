//! Driver calls by kind and what they would cost on an Ascend device.
//!
//! Every allocator under test reports the driver calls it made ([`DriverCalls`], through
//! [`crate::baselines::Allocator::driver_calls`]); [`DriverCostModel`] turns them into the
//! time the driver would take. On the software NPU those calls are nearly free (a `mmap`, a
//! `mprotect`), so host time alone hides what growth and recycling cost a real user; the
//! figures add the *modelled* driver time to the measured host time.
//!
//! # The Ascend-like preset and where its numbers come from
//!
//! [`DriverCostModel::ascend_like`] takes its numbers from the software NPU's own
//! `LatencyModel::ascend_like()` (`soma::sim::LatencyModel`), so that a figure modelled here
//! and a run of the software NPU with its latency model agree:
//!
//! | call (CANN) | cost | source |
//! |---|---:|---|
//! | `aclrtMalloc` ([`malloc`](DriverCostModel::malloc)) | 1 ms | published measurements put `aclrtMalloc` at 0.5–2 ms; `LatencyModel::ascend_like().driver_alloc` |
//! | `aclrtMallocPhysical` ([`alloc_physical`](DriverCostModel::alloc_physical)) | 1 ms | the same driver allocation of physical memory; `LatencyModel::ascend_like()` charges `driver_alloc` for it too |
//! | `aclrtMapMem` ([`map`](DriverCostModel::map)) | 100 µs | `LatencyModel::ascend_like().map`: tens to a hundred µs per mapping change; torch_npu's allocator documents mapping changes as synchronous with the device and expensive (`NPUCachingAllocator.cpp`, note on expandable segments) |
//! | `aclrtUnmapMem` ([`unmap`](DriverCostModel::unmap)) | 100 µs | `LatencyModel::ascend_like().map`, charged per map *and* unmap |
//! | `aclrtFree`, `aclrtFreePhysical`, `aclrtReserveMemAddress`, `aclrtReleaseMemAddress` | 100 µs each | no published figure; each is a driver round trip that changes the device's address space, charged as a mapping change (the software NPU's model does not delay these calls at all) |
//!
//! The model charges each call alone: no batching, no overlap with device work. It is a
//! yardstick for comparing allocators, not a prediction of one program's run time.

use std::ops::{Add, Sub};
use std::time::Duration;

use soma::sim::{CallCounts, LatencyModel};

/// Driver calls by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    /// Address-range reservations (`aclrtReserveMemAddress`).
    pub reserve: u64,
    /// Address-range releases (`aclrtReleaseMemAddress`).
    pub release: u64,
    /// Physical allocations (`aclrtMallocPhysical`).
    pub alloc_physical: u64,
    /// Physical frees (`aclrtFreePhysical`).
    pub free_physical: u64,
    /// Mappings of physical memory into a reserved range (`aclrtMapMem`).
    pub map: u64,
    /// Unmappings (`aclrtUnmapMem`).
    pub unmap: u64,
    /// Plain device allocations (`aclrtMalloc`).
    pub malloc: u64,
    /// Plain device frees (`aclrtFree`).
    pub free: u64,
}

impl DriverCalls {
    /// `n` growths of a pool that maps on demand: each one physical allocation and one map.
    pub fn growths(n: u64) -> DriverCalls {
        DriverCalls { alloc_physical: n, map: n, ..DriverCalls::default() }
    }

    /// The calls of a pool that made `maps` maps and `unmaps` unmaps of whole segments, each
    /// map with its physical allocation and each unmap with its physical free (how soma's
    /// pool backs its segments).
    pub fn segments(maps: u64, unmaps: u64) -> DriverCalls {
        DriverCalls {
            alloc_physical: maps,
            map: maps,
            unmap: unmaps,
            free_physical: unmaps,
            ..DriverCalls::default()
        }
    }

    /// The memory-management calls among the software NPU's counters.
    pub fn of_sim(c: &CallCounts) -> DriverCalls {
        DriverCalls {
            reserve: c.reserve,
            release: c.release,
            alloc_physical: c.alloc_physical,
            free_physical: c.free_physical,
            map: c.map,
            unmap: c.unmap,
            malloc: c.malloc,
            free: c.free,
        }
    }

    /// Every call, whatever its kind.
    pub fn total(&self) -> u64 {
        self.kinds().iter().map(|&(_, n)| n).sum()
    }

    /// `(name, count)` of every kind, in a fixed order (the names of the JSON object).
    pub fn kinds(&self) -> [(&'static str, u64); 8] {
        [
            ("reserve", self.reserve),
            ("release", self.release),
            ("alloc_physical", self.alloc_physical),
            ("free_physical", self.free_physical),
            ("map", self.map),
            ("unmap", self.unmap),
            ("malloc", self.malloc),
            ("free", self.free),
        ]
    }

    /// A JSON object of the counts: `{"reserve":0,…,"free":0}`.
    pub fn to_json(&self) -> String {
        let fields: Vec<String> =
            self.kinds().iter().map(|(k, n)| format!("\"{k}\":{n}")).collect();
        format!("{{{}}}", fields.join(","))
    }

    fn zip(self, o: DriverCalls, f: impl Fn(u64, u64) -> u64) -> DriverCalls {
        DriverCalls {
            reserve: f(self.reserve, o.reserve),
            release: f(self.release, o.release),
            alloc_physical: f(self.alloc_physical, o.alloc_physical),
            free_physical: f(self.free_physical, o.free_physical),
            map: f(self.map, o.map),
            unmap: f(self.unmap, o.unmap),
            malloc: f(self.malloc, o.malloc),
            free: f(self.free, o.free),
        }
    }
}

impl Add for DriverCalls {
    type Output = DriverCalls;
    fn add(self, o: DriverCalls) -> DriverCalls {
        self.zip(o, |a, b| a + b)
    }
}

/// The calls made between two snapshots of the same counters (`later - earlier`).
impl Sub for DriverCalls {
    type Output = DriverCalls;
    fn sub(self, o: DriverCalls) -> DriverCalls {
        self.zip(o, |a, b| a - b)
    }
}

/// Modelled time of each kind of driver call (see the [module docs](self) for the preset's
/// sources).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverCostModel {
    /// Per `aclrtReserveMemAddress`.
    pub reserve: Duration,
    /// Per `aclrtReleaseMemAddress`.
    pub release: Duration,
    /// Per `aclrtMallocPhysical`.
    pub alloc_physical: Duration,
    /// Per `aclrtFreePhysical`.
    pub free_physical: Duration,
    /// Per `aclrtMapMem`.
    pub map: Duration,
    /// Per `aclrtUnmapMem`.
    pub unmap: Duration,
    /// Per `aclrtMalloc`.
    pub malloc: Duration,
    /// Per `aclrtFree`.
    pub free: Duration,
}

impl DriverCostModel {
    /// The Ascend-like preset: the software NPU's `LatencyModel::ascend_like()` for the calls
    /// it models (allocations 1 ms, map and unmap 100 µs), a mapping change's 100 µs for the
    /// others.
    pub fn ascend_like() -> DriverCostModel {
        let sim = LatencyModel::ascend_like();
        DriverCostModel {
            reserve: sim.map,
            release: sim.map,
            alloc_physical: sim.driver_alloc,
            free_physical: sim.map,
            map: sim.map,
            unmap: sim.map,
            malloc: sim.driver_alloc,
            free: sim.map,
        }
    }

    /// The modelled time of `calls`.
    pub fn time(&self, calls: &DriverCalls) -> Duration {
        let per = |n: u64, d: Duration| d * u32::try_from(n).unwrap_or(u32::MAX);
        per(calls.reserve, self.reserve)
            + per(calls.release, self.release)
            + per(calls.alloc_physical, self.alloc_physical)
            + per(calls.free_physical, self.free_physical)
            + per(calls.map, self.map)
            + per(calls.unmap, self.unmap)
            + per(calls.malloc, self.malloc)
            + per(calls.free, self.free)
    }

    /// The modelled time of `calls` spread over `ops` ops, in ns per op (0 for no ops).
    pub fn ns_per_op(&self, calls: &DriverCalls, ops: u64) -> f64 {
        if ops == 0 {
            return 0.0;
        }
        self.time(calls).as_nanos() as f64 / ops as f64
    }

    /// A JSON object of the per-call costs in ns, keyed as [`DriverCalls::to_json`].
    pub fn to_json(&self) -> String {
        let costs = [
            ("reserve", self.reserve),
            ("release", self.release),
            ("alloc_physical", self.alloc_physical),
            ("free_physical", self.free_physical),
            ("map", self.map),
            ("unmap", self.unmap),
            ("malloc", self.malloc),
            ("free", self.free),
        ];
        let fields: Vec<String> =
            costs.iter().map(|(k, d)| format!("\"{k}\":{}", d.as_nanos())).collect();
        format!("{{{}}}", fields.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ascend_like_follows_the_software_npu_and_charges_every_kind() {
        let m = DriverCostModel::ascend_like();
        let sim = LatencyModel::ascend_like();
        assert_eq!((m.malloc, m.alloc_physical), (sim.driver_alloc, sim.driver_alloc));
        assert_eq!((m.map, m.unmap), (sim.map, sim.map));
        assert_eq!(m.malloc, Duration::from_millis(1));
        let one_of_each = DriverCalls {
            reserve: 1,
            release: 1,
            alloc_physical: 1,
            free_physical: 1,
            map: 1,
            unmap: 1,
            malloc: 1,
            free: 1,
        };
        // Two allocations at 1 ms, six other calls at 100 µs.
        assert_eq!(m.time(&one_of_each), Duration::from_micros(2600));
        // Three growths (1 ms + 100 µs each), one unmap with its physical free (200 µs).
        assert_eq!(m.ns_per_op(&DriverCalls::segments(3, 1), 8), 3_500_000.0 / 8.0);
        assert_eq!(m.ns_per_op(&one_of_each, 0), 0.0);
        assert!(m.to_json().contains("\"malloc\":1000000"));
    }

    #[test]
    fn calls_add_subtract_and_serialize() {
        let a = DriverCalls::segments(5, 2);
        let b = DriverCalls { malloc: 3, free: 1, ..DriverCalls::growths(1) };
        let sum = a + b;
        assert_eq!((sum.map, sum.alloc_physical, sum.malloc, sum.unmap), (6, 6, 3, 2));
        assert_eq!(sum - b, a);
        assert_eq!(sum.total(), 5 + 5 + 2 + 2 + 1 + 1 + 3 + 1);
        assert_eq!(
            b.to_json(),
            "{\"reserve\":0,\"release\":0,\"alloc_physical\":1,\"free_physical\":0,\
             \"map\":1,\"unmap\":0,\"malloc\":3,\"free\":1}"
        );
        let mut sim = CallCounts::default();
        sim.map = 4;
        sim.malloc = 2;
        sim.synchronize = 9;
        let d = DriverCalls::of_sim(&sim);
        assert_eq!((d.map, d.malloc, d.total()), (4, 2, 6));
    }
}
