//! Peer access between the devices of one runtime library (`aclrtDeviceCanAccessPeer`,
//! `aclrtDeviceEnablePeerAccess`, `aclrtDeviceDisablePeerAccess`).
//!
//! CANN enables access from the *current* device to a peer: the backend makes the device
//! current first, as for every call. It also keeps, per device, the peers it enabled access
//! to: device ranges of their memory are then valid in this device's enqueues (see the
//! `ranges` module), and a second enable or a disable of what is not enabled is refused
//! before the runtime is asked.

use std::sync::{Arc, Weak};

use soma_core::hal::{DeviceHal, DriverError, DriverResult};

use super::conv::map_call_err;
use super::device::{lock, AscendDevice};
use super::raw;

impl AscendDevice {
    /// `peer` as a device of the same runtime library; `None` for another backend or library.
    fn same_runtime<'a>(&self, peer: &'a dyn DeviceHal) -> Option<&'a AscendDevice> {
        peer.as_any()
            .downcast_ref::<AscendDevice>()
            .filter(|p| Arc::ptr_eq(&p.inner.acl, &self.inner.acl))
    }

    /// `peer` as another device of this runtime library.
    fn other_device<'a>(&self, peer: &'a dyn DeviceHal) -> DriverResult<&'a AscendDevice> {
        let me = self.inner.id;
        let Some(p) = self.same_runtime(peer) else {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {me}: the peer is not a device of the same runtime library"
            )));
        };
        if p.inner.id == me {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {me} to itself: a device always uses its own memory"
            )));
        }
        Ok(p)
    }

    /// [`DeviceHal::can_access_peer`] (`aclrtDeviceCanAccessPeer`); `false` for a device of
    /// another backend or library.
    pub(crate) fn peer_can_access(&self, peer: &dyn DeviceHal) -> DriverResult<bool> {
        if self.same_runtime(peer).is_none() {
            return Ok(false);
        }
        let p = self.other_device(peer)?;
        raw::device::can_access_peer(&self.inner.acl, self.inner.id, p.inner.id)
            .map_err(map_call_err)
    }

    /// [`DeviceHal::enable_peer_access`] (`aclrtDeviceEnablePeerAccess` with this device
    /// current).
    pub(crate) fn peer_enable(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        let p = self.other_device(peer)?;
        let d = &self.inner;
        if self.peer_enabled(peer) {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {} to device {} is already enabled",
                d.id, p.inner.id
            )));
        }
        d.check_err()?;
        d.enter()?;
        raw::device::enable_peer_access(&d.acl, p.inner.id).map_err(map_call_err)?;
        let mut peers = lock(&d.peers);
        peers.retain(|w| w.strong_count() > 0);
        peers.push(Arc::downgrade(&p.inner));
        Ok(())
    }

    /// [`DeviceHal::disable_peer_access`] (`aclrtDeviceDisablePeerAccess` with this device
    /// current).
    pub(crate) fn peer_disable(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        let p = self.other_device(peer)?;
        let d = &self.inner;
        if !self.peer_enabled(peer) {
            return Err(DriverError::InvalidValue(format!(
                "peer access from device {} to device {} is not enabled",
                d.id, p.inner.id
            )));
        }
        d.check_err()?;
        d.enter()?;
        raw::device::disable_peer_access(&d.acl, p.inner.id).map_err(map_call_err)?;
        lock(&d.peers).retain(|w| w.upgrade().is_some_and(|q| q.id != p.inner.id));
        Ok(())
    }

    /// [`DeviceHal::peer_access_enabled`]: whether this device enabled access to `peer`.
    pub(crate) fn peer_enabled(&self, peer: &dyn DeviceHal) -> bool {
        let Some(p) = self.same_runtime(peer) else { return false };
        lock(&self.inner.peers).iter().filter_map(Weak::upgrade).any(|q| q.id == p.inner.id)
    }
}
