//! The devices of one NPU as each sees the others: which device owns an address, and which
//! device may use which other's memory (peer access, per ordered pair).
//!
//! Each device's memory is its own `mmap` arena, so an address belongs to at most one device.
//! A task (or a synchronous copy) of device B names ranges; each lies in B's arena or in a
//! peer's. At the enqueue a peer range needs access enabled from B to its owner; a task that
//! was enqueued with access runs even if access is disabled meanwhile (its ranges are still
//! registered in flight with their owner, which keeps them mapped while it runs). The ranges
//! of a task are registered in the in-flight table of the device that owns each: conflicts and
//! unmaps are checked where the memory is.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use smallvec::SmallVec;
use soma_core::hal::{DeviceHal, DriverError, DriverResult};

use crate::device::{DeviceCore, SimDevice};
use crate::memory::{AcquireError, DeviceMemory, Owner, Range, SpanningAccess};

/// The devices of one NPU and the peer access matrix.
pub(crate) struct Peers {
    /// The devices by ordinal (weak: a device lives as long as its handles and streams).
    devices: OnceLock<Box<[Weak<DeviceCore>]>>,
    /// Bit `a` of `access[b]`: streams of device `b` may use device `a`'s memory.
    access: Box<[AtomicU32]>,
}

impl Peers {
    /// The table of an NPU of `count` devices (at most 32 fit the matrix; the builder allows
    /// [`MAX_DEVICES`](crate::MAX_DEVICES)).
    pub(crate) fn new(count: u32) -> Arc<Peers> {
        debug_assert!(count <= 32);
        Arc::new(Peers {
            devices: OnceLock::new(),
            access: (0..count).map(|_| AtomicU32::new(0)).collect(),
        })
    }

    /// Records the devices once they exist.
    pub(crate) fn set_devices(&self, devices: Vec<Weak<DeviceCore>>) {
        // Set once, by the builder, right after the devices are made.
        let _ = self.devices.set(devices.into_boxed_slice());
    }

    /// Whether streams of device `from` may use device `to`'s memory.
    pub(crate) fn enabled(&self, from: u32, to: u32) -> bool {
        self.access.get(from as usize).is_some_and(|a| a.load(Ordering::Acquire) & (1 << to) != 0)
    }

    /// The live device whose arena holds `[addr, addr + len)`, other than `except`.
    fn owner(&self, addr: u64, len: u64, except: u32) -> Option<Arc<DeviceCore>> {
        self.devices.get()?.iter().enumerate().find_map(|(i, d)| {
            if i as u32 == except {
                return None;
            }
            d.upgrade().filter(|core| core.memory.contains(addr, len))
        })
    }

    /// The peer pair of `device` and `peer`: their ordinals, once checked to be distinct
    /// devices of this NPU.
    fn pair(&self, device: &SimDevice, peer: &dyn DeviceHal) -> DriverResult<(u32, u32)> {
        let from = device.core.info.ordinal;
        let Some(other) = peer.as_any().downcast_ref::<SimDevice>() else {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {from}: the peer is not a software NPU device"
            )));
        };
        let to = other.core.info.ordinal;
        if !Arc::ptr_eq(&other.core.peers, &device.core.peers) {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {from}: device {to} belongs to another Npu"
            )));
        }
        if from == to {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {from} to itself: a device always uses its own memory"
            )));
        }
        Ok((from, to))
    }
}

impl SimDevice {
    /// [`DeviceHal::can_access_peer`]: every two devices of an NPU are linked (one server).
    pub(crate) fn peer_can_access(&self, peer: &dyn DeviceHal) -> DriverResult<bool> {
        let peers = &self.core.peers;
        match peers.pair(self, peer) {
            Ok(_) => Ok(true),
            Err(e) if is_same_device(self, peer) => Err(e),
            Err(_) => Ok(false),
        }
    }

    /// [`DeviceHal::enable_peer_access`].
    pub(crate) fn peer_enable(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        let peers = &self.core.peers;
        let (from, to) = peers.pair(self, peer)?;
        let before = peers.access[from as usize].fetch_or(1 << to, Ordering::AcqRel);
        if before & (1 << to) != 0 {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {from} to device {to} is already enabled"
            )));
        }
        Ok(())
    }

    /// [`DeviceHal::disable_peer_access`].
    pub(crate) fn peer_disable(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        let peers = &self.core.peers;
        let (from, to) = peers.pair(self, peer)?;
        let before = peers.access[from as usize].fetch_and(!(1 << to), Ordering::AcqRel);
        if before & (1 << to) == 0 {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {from} to device {to} is not enabled"
            )));
        }
        Ok(())
    }

    /// [`DeviceHal::peer_access_enabled`].
    pub(crate) fn peer_enabled(&self, peer: &dyn DeviceHal) -> bool {
        let peers = &self.core.peers;
        peers.pair(self, peer).is_ok_and(|(from, to)| peers.enabled(from, to))
    }
}

fn is_same_device(device: &SimDevice, peer: &dyn DeviceHal) -> bool {
    peer.as_any().downcast_ref::<SimDevice>().is_some_and(|p| Arc::ptr_eq(&p.core, &device.core))
}

/// Whether access is checked when ranges are placed: at the enqueue (and for synchronous
/// calls), not when an enqueued task runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Peer ranges need access enabled now.
    Access,
    /// The task was accepted with access: only find the owners.
    Owners,
}

/// Where a request's ranges lie: the device's own memory (`0`) or a peer's (`k`, the peer
/// `peers[k - 1]`).
pub(crate) struct Placement {
    peers: SmallVec<[Arc<DeviceCore>; 1]>,
    of: SmallVec<[usize; 4]>,
}

impl DeviceCore {
    /// Places `ranges`: `None` when all lie in this device's arena (or in no device's, which
    /// the mapped check then reports), else which memory holds each.
    ///
    /// # Errors
    /// With [`Check::Access`], [`DriverError::InvalidAddress`] for a range of a device this one
    /// has no peer access to.
    pub(crate) fn place(&self, ranges: &[Range], check: Check) -> DriverResult<Option<Placement>> {
        let local = |r: &Range| r.len == 0 || self.memory.contains(r.addr, r.len);
        if ranges.iter().all(local) {
            return Ok(None);
        }
        let me = self.info.ordinal;
        let mut placement = Placement { peers: SmallVec::new(), of: SmallVec::new() };
        for r in ranges {
            let owner = if local(r) { None } else { self.peers.owner(r.addr, r.len, me) };
            let Some(owner) = owner else {
                placement.of.push(0);
                continue;
            };
            let them = owner.info.ordinal;
            if check == Check::Access && !self.peers.enabled(me, them) {
                return Err(DriverError::InvalidAddress {
                    addr: r.addr,
                    len: r.len,
                    reason: format!(
                        "memory of device {them}: peer access from device {me} is not enabled"
                    ),
                });
            }
            let at = match placement.peers.iter().position(|p| Arc::ptr_eq(p, &owner)) {
                Some(i) => i,
                None => {
                    placement.peers.push(owner);
                    placement.peers.len() - 1
                }
            };
            placement.of.push(at + 1);
        }
        Ok(Some(placement))
    }

    /// Checks that every range is mapped in the memory that holds it; peer ranges need
    /// access (see [`place`](Self::place)).
    pub(crate) fn check_mapped_anywhere(&self, ranges: &[Range]) -> DriverResult<()> {
        match self.place(ranges, Check::Access)? {
            None => self.memory.check_mapped(ranges),
            Some(p) => {
                let memories = p.memories(&self.memory);
                for (m, memory) in memories.iter().enumerate() {
                    let mine: SmallVec<[Range; 4]> = ranges
                        .iter()
                        .zip(&p.of)
                        .filter(|(_, &of)| of == m)
                        .map(|(r, _)| *r)
                        .collect();
                    memory.check_mapped(&mine)?;
                }
                Ok(())
            }
        }
    }
}

impl DeviceCore {
    /// Registers `ranges` in flight in the memories `placement` found for them (all in this
    /// device's memory without one).
    pub(crate) fn acquire_placed<'m>(
        &'m self,
        placement: Option<&'m Placement>,
        owner: Owner,
        ranges: &[Range],
        exclusive_writes: bool,
    ) -> Result<SpanningAccess<'m>, AcquireError> {
        match placement {
            None => SpanningAccess::acquire(&[&self.memory], &[], owner, ranges, exclusive_writes),
            Some(p) => SpanningAccess::acquire(
                &p.memories(&self.memory),
                p.of(),
                owner,
                ranges,
                exclusive_writes,
            ),
        }
    }
}

impl Placement {
    /// The memories by index: this device's, then each peer's.
    pub(crate) fn memories<'a>(&'a self, own: &'a DeviceMemory) -> SmallVec<[&'a DeviceMemory; 2]> {
        std::iter::once(own).chain(self.peers.iter().map(|p| &p.memory)).collect()
    }

    /// Which memory holds each range.
    pub(crate) fn of(&self) -> &[usize] {
        &self.of
    }

    /// Whether ranges `a` and `b` lie on different devices.
    pub(crate) fn across(&self, a: usize, b: usize) -> bool {
        self.of.get(a) != self.of.get(b)
    }
}
