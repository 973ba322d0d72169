//! Device ranges: the bookkeeping of the memory soma handed to or got from the runtime, the
//! validation of the device ends of every enqueue against it (the HAL contract), and the
//! ranges in flight that unmaps and frees must wait for.
//!
//! With peer access enabled from this device to others ([`DeviceHal::enable_peer_access`]),
//! a range may lie in a peer's memory: it is validated against the peer's bookkeeping, under
//! the peer's memory lock (locks of several devices are taken in the order of their keys),
//! and the task's use is noted in the peer's in-flight list, which its unmaps and frees check.
//!
//! [`DeviceHal::enable_peer_access`]: soma_core::hal::DeviceHal::enable_peer_access

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, MutexGuard, Weak};

use soma_core::hal::{DevicePtr, DriverError, DriverResult, MemRef};

use super::device::{bad_addr, lock, DeviceInner};
use super::stream::StreamShared;

/// Bookkeeping of the device memory soma handed to or got from the runtime: it lets the
/// backend validate device ranges (the HAL contract) and return the handle `unmap` needs.
#[derive(Debug, Default)]
pub(crate) struct MemState {
    /// Reservations: start → length.
    pub(crate) reservations: BTreeMap<u64, u64>,
    /// Physical allocations: handle → (size, mapped at).
    pub(crate) physical: HashMap<u64, (u64, Option<u64>)>,
    /// Mappings: start → (length, handle).
    pub(crate) mappings: BTreeMap<u64, (u64, u64)>,
    /// `aclrtMalloc` allocations: start → length.
    pub(crate) mallocs: BTreeMap<u64, u64>,
    /// Native pool allocations: start → (length, pool key).
    pub(crate) pool_allocs: BTreeMap<u64, (u64, u64)>,
    /// `aclrtMallocHost` allocations: start → length.
    pub(crate) host_allocs: BTreeMap<u64, u64>,
}

impl MemState {
    /// End of the region of `map` containing `addr`, if any.
    fn end_in<V>(map: &BTreeMap<u64, V>, addr: u64, len_of: impl Fn(&V) -> u64) -> Option<u64> {
        map.range(..=addr)
            .next_back()
            .map(|(&s, v)| s.saturating_add(len_of(v)))
            .filter(|&end| end > addr)
    }

    /// Whether `addr..addr+len` is covered by mapped, malloc'd or pool memory (possibly several
    /// adjacent regions, e.g. consecutive granules of one reservation).
    pub(crate) fn covers(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else { return false };
        let mut cur = addr;
        while cur < end {
            let next = [
                Self::end_in(&self.mappings, cur, |v| v.0),
                Self::end_in(&self.mallocs, cur, |v| *v),
                Self::end_in(&self.pool_allocs, cur, |v| v.0),
            ]
            .into_iter()
            .flatten()
            .max();
            match next {
                Some(n) => cur = n,
                None => return false,
            }
        }
        true
    }

    pub(crate) fn pool_insert(&mut self, addr: u64, len: u64, pool: u64) {
        self.pool_allocs.insert(addr, (len, pool));
    }

    pub(crate) fn pool_owns(&self, addr: u64, pool: u64) -> bool {
        self.pool_allocs.get(&addr).is_some_and(|&(_, p)| p == pool)
    }

    pub(crate) fn pool_remove(&mut self, addr: u64) {
        self.pool_allocs.remove(&addr);
    }

    pub(crate) fn pool_count(&self, pool: u64) -> usize {
        self.pool_allocs.values().filter(|&&(_, p)| p == pool).count()
    }

    #[cfg(test)]
    pub(crate) fn test_map(&mut self, addr: u64, len: u64) {
        self.mappings.insert(addr, (len, 0));
    }

    #[cfg(test)]
    pub(crate) fn test_malloc(&mut self, addr: u64, len: u64) {
        self.mallocs.insert(addr, len);
    }

    pub(crate) fn overlaps_mapping(&self, start: u64, end: u64) -> bool {
        self.mappings.range(..end).next_back().is_some_and(|(&s, &(l, _))| s + l > start)
    }
}

/// One device range used by an enqueued task (copy or memset), until its stream completes it.
pub(crate) struct InFlight {
    stream: Weak<StreamShared>,
    position: u64,
    start: u64,
    end: u64,
}

impl DeviceInner {
    /// [`DriverError::InvalidAddress`] unless `ptr..ptr+len` is device memory soma knows.
    pub(crate) fn check_range(&self, ptr: DevicePtr, len: u64) -> DriverResult<()> {
        if lock(&self.mem).covers(ptr.addr(), len) {
            Ok(())
        } else {
            Err(bad_addr(ptr.addr(), len, "not inside mapped or allocated device memory"))
        }
    }

    /// Validates the device end of a copy.
    pub(crate) fn check_ref(&self, r: MemRef, len: u64) -> DriverResult<()> {
        match r {
            MemRef::Device(p) => self.check_range(p, len),
            MemRef::Host(_) => Ok(()),
        }
    }

    /// Runs `f` (an enqueue) with the device ends of `refs` validated and the memory locks
    /// held, so that no unmap or free of those ranges can slip between the check and the
    /// enqueue. A range may lie in this device's memory or in that of a peer it has access to;
    /// `f` gets the owner of each end, to note its use there.
    pub(crate) fn with_valid<R>(
        self: &Arc<Self>,
        refs: &[(MemRef, u64)],
        f: impl FnOnce(&Owners) -> DriverResult<R>,
    ) -> DriverResult<R> {
        let peers = self.peers_with_access();
        if peers.is_empty() {
            let mem = lock(&self.mem);
            let mut owners = Vec::with_capacity(refs.len());
            for &(r, len) in refs {
                owners.push(match r {
                    MemRef::Device(p) if !mem.covers(p.addr(), len) => {
                        return Err(bad_addr(p.addr(), len, NOT_DEVICE_MEMORY))
                    }
                    MemRef::Device(_) => Some(Arc::clone(self)),
                    MemRef::Host(_) => None,
                });
            }
            let out = f(&Owners(owners));
            drop(mem);
            return out;
        }
        // This device first: its own memory is where a range is looked for first.
        let devices: Vec<Arc<DeviceInner>> =
            std::iter::once(Arc::clone(self)).chain(peers).collect();
        let mut order: Vec<usize> = (0..devices.len()).collect();
        order.sort_by_key(|&i| devices[i].key());
        let mut guards: Vec<Option<MutexGuard<'_, MemState>>> =
            devices.iter().map(|_| None).collect();
        for i in order {
            guards[i] = Some(lock(&devices[i].mem));
        }
        let mut owners = Vec::with_capacity(refs.len());
        for &(r, len) in refs {
            let MemRef::Device(p) = r else {
                owners.push(None);
                continue;
            };
            let at =
                guards.iter().position(|g| g.as_ref().is_some_and(|g| g.covers(p.addr(), len)));
            match at {
                Some(i) => owners.push(Some(Arc::clone(&devices[i]))),
                None => return Err(bad_addr(p.addr(), len, NOT_DEVICE_MEMORY)),
            }
        }
        let out = f(&Owners(owners));
        drop(guards);
        out
    }

    /// Notes that the task at `position` of `stream` uses `ptr..ptr+len` (device memory).
    pub(crate) fn note_use(&self, stream: &Arc<StreamShared>, position: u64, r: MemRef, len: u64) {
        let MemRef::Device(p) = r else { return };
        let mut guard = lock(&self.in_flight);
        let (list, cap) = &mut *guard;
        if list.len() >= *cap {
            list.retain(|f| f.stream.upgrade().is_some_and(|s| s.completed() < f.position));
            *cap = (list.len() * 2).max(64);
        }
        list.push(InFlight {
            stream: Arc::downgrade(stream),
            position,
            start: p.addr(),
            end: p.addr().saturating_add(len),
        });
    }

    /// [`DriverError::InvalidValue`] if a task in flight uses any byte of `start..end`. Streams
    /// whose cached completion is behind are queried (`aclrtStreamQuery`) once, outside the
    /// in-flight lock (lock order: memory → stream → in-flight).
    pub(crate) fn check_idle(&self, start: u64, end: u64) -> DriverResult<()> {
        let overlaps = |f: &InFlight| f.start < end && start < f.end;
        let behind: Vec<Arc<StreamShared>> = {
            let mut guard = lock(&self.in_flight);
            let (list, _) = &mut *guard;
            list.retain(|f| f.stream.upgrade().is_some_and(|s| s.completed() < f.position));
            let mut v: Vec<Arc<StreamShared>> = Vec::new();
            for f in list.iter().filter(|f| overlaps(f)) {
                if let Some(s) = f.stream.upgrade() {
                    if !v.iter().any(|x| Arc::ptr_eq(x, &s)) {
                        v.push(s);
                    }
                }
            }
            v
        };
        if behind.is_empty() {
            return Ok(());
        }
        for s in &behind {
            s.refresh();
        }
        let mut guard = lock(&self.in_flight);
        let (list, _) = &mut *guard;
        list.retain(|f| f.stream.upgrade().is_some_and(|s| s.completed() < f.position));
        match list.iter().find(|f| overlaps(f)) {
            None => Ok(()),
            Some(f) => Err(DriverError::InvalidValue(format!(
                "device range {start:#x}..{end:#x} is used by task {} of stream {}, which has \
                 not completed",
                f.position,
                f.stream.upgrade().map_or(0, |s| s.id()),
            ))),
        }
    }
}

/// Why a device end is refused.
const NOT_DEVICE_MEMORY: &str =
    "not inside mapped or allocated device memory of this device or of a peer it has access to";

/// The device that owns each end of an enqueue (`None` for a host end), found by
/// [`DeviceInner::with_valid`].
pub(crate) struct Owners(Vec<Option<Arc<DeviceInner>>>);

impl Owners {
    /// Notes, on the device that owns end `i`, that the task at `position` of `stream` uses
    /// it.
    pub(crate) fn note_use(
        &self,
        i: usize,
        stream: &Arc<StreamShared>,
        position: u64,
        r: MemRef,
        len: u64,
    ) {
        if let Some(Some(owner)) = self.0.get(i) {
            owner.note_use(stream, position, r, len);
        }
    }
}
