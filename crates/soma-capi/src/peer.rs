//! Peer access between devices: `aclrtDeviceCanAccessPeer`, `aclrtDeviceEnablePeerAccess`,
//! `aclrtDeviceDisablePeerAccess`.
//!
//! Access is per ordered pair, enabled from the calling thread's current device (device 0
//! when none was set) to a peer: afterwards the current device's streams may copy to and from
//! the peer's memory (`aclrtMemcpyAsync` between devices) and wait on the peer's events, and
//! `aclrtMemcpy` between the two devices runs with the current device. Every two devices of
//! the software NPU are linked.

use ascend_sys::{aclError, AclError};

use crate::error::{guard, AclErr};
use crate::runtime::{out_ptr, rt, write_out, DevEntry, Runtime};

/// The entries of `deviceId` and `peerDeviceId`: both valid, and distinct (CANN answers
/// `ACL_ERROR_INVALID_PARAM` for a device and itself).
fn pair(
    rt: &'static Runtime,
    device: i32,
    peer: i32,
) -> Result<(&'static DevEntry, &'static DevEntry), AclErr> {
    let (a, b) = (rt.device(device.into())?, rt.device(peer.into())?);
    if a.index == b.index {
        return Err(AclErr::param(format!(
            "deviceId and peerDeviceId are both {device}: peer access is between two devices"
        )));
    }
    Ok((a, b))
}

/// Whether `deviceId` can access `peerDeviceId`'s memory once access is enabled: 1 (every two
/// devices of the software NPU are linked) or 0.
///
/// # Safety
/// `canAccessPeer` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtDeviceCanAccessPeer(
    canAccessPeer: *mut i32,
    deviceId: i32,
    peerDeviceId: i32,
) -> aclError {
    guard("aclrtDeviceCanAccessPeer", || {
        let out = out_ptr(canAccessPeer, "canAccessPeer")?;
        let (dev, peer) = pair(rt()?, deviceId, peerDeviceId)?;
        let can = dev.device.can_access_peer(&peer.device)?;
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, i32::from(can)) };
        Ok(())
    })
}

/// Enables access from the current device to `peerDeviceId`'s memory. `flags` is reserved:
/// anything but 0 is `ACL_ERROR_FEATURE_UNSUPPORTED`, as on CANN; access already enabled is
/// `ACL_ERROR_INVALID_PARAM`.
#[no_mangle]
pub extern "C" fn aclrtDeviceEnablePeerAccess(peerDeviceId: i32, flags: u32) -> aclError {
    guard("aclrtDeviceEnablePeerAccess", || {
        if flags != 0 {
            return Err(AclErr::new(
                AclError::ERROR_FEATURE_UNSUPPORTED,
                format!("flags must be 0 (reserved), not {flags}"),
            ));
        }
        let rt = rt()?;
        let (dev, peer) = pair(rt, rt.current().index as i32, peerDeviceId)?;
        Ok(dev.device.enable_peer_access(&peer.device)?)
    })
}

/// Disables the access `aclrtDeviceEnablePeerAccess` enabled from the current device to
/// `peerDeviceId`; access not enabled is `ACL_ERROR_INVALID_PARAM`. Work already enqueued
/// runs.
#[no_mangle]
pub extern "C" fn aclrtDeviceDisablePeerAccess(peerDeviceId: i32) -> aclError {
    guard("aclrtDeviceDisablePeerAccess", || {
        let rt = rt()?;
        let (dev, peer) = pair(rt, rt.current().index as i32, peerDeviceId)?;
        Ok(dev.device.disable_peer_access(&peer.device)?)
    })
}
