//! A replica of CANN SOMA's allocator: 2 MiB rounding, best fit by size then address.

use std::collections::{BTreeMap, BTreeSet};

use super::growth::GrowthMapping;
use super::Allocator;
use crate::driver_cost::DriverCalls;
use crate::{round_up, GRANULE};

/// CANN SOMA's algorithm: sizes rounded up to 2 MiB, best fit (smallest size, then lowest
/// address) over a `BTreeSet<(size, address)>` of free segments, merge with free neighbours
/// (found through a `BTreeMap<address, size>`) on free. How CANN SOMA maps its memory is
/// not documented: the replica is charged as a pool that maps its high-water growth (one
/// physical allocation and one map per growth).
#[derive(Debug)]
pub struct SomaReplica {
    by_size: BTreeSet<(u64, u64)>,
    by_addr: BTreeMap<u64, u64>,
    growth: GrowthMapping,
}

impl SomaReplica {
    /// A replica managing `range` bytes.
    pub fn new(range: u64) -> SomaReplica {
        let range = range / GRANULE * GRANULE;
        SomaReplica {
            by_size: BTreeSet::from([(range, 0)]),
            by_addr: BTreeMap::from([(0, range)]),
            growth: GrowthMapping::default(),
        }
    }
}

impl Allocator for SomaReplica {
    type Handle = (u64, u64);
    fn name(&self) -> &'static str {
        "soma-replica"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<(u64, u64)> {
        let size = round_up(bytes, GRANULE);
        let &(seg, addr) = self.by_size.range((size, 0)..).next()?;
        self.by_size.remove(&(seg, addr));
        self.by_addr.remove(&addr);
        if seg > size {
            self.by_size.insert((seg - size, addr + size));
            self.by_addr.insert(addr + size, seg - size);
        }
        self.growth.note_end(addr + size);
        Some((addr, size))
    }
    #[inline]
    fn free(&mut self, (mut addr, mut size): (u64, u64)) {
        if let Some((&pa, &ps)) = self.by_addr.range(..addr).next_back() {
            if pa + ps == addr {
                self.by_addr.remove(&pa);
                self.by_size.remove(&(ps, pa));
                addr = pa;
                size += ps;
            }
        }
        if let Some(ns) = self.by_addr.remove(&(addr + size)) {
            self.by_size.remove(&(ns, addr + size));
            size += ns;
        }
        self.by_addr.insert(addr, size);
        self.by_size.insert((size, addr));
    }
    fn reserved_high(&self) -> u64 {
        self.growth.mapped()
    }
    fn driver_calls(&self) -> DriverCalls {
        self.growth.calls()
    }
}
