//! Physical memory shared between processes (`aclrtMemExportToShareableHandle`,
//! `aclrtMemSetPidToShareableHandle`, `aclrtMemImportFromShareableHandle`,
//! `aclrtDeviceGetBareTgid`).
//!
//! An imported handle is tracked as a physical allocation of this device of the size the
//! exporter told (CANN's import does not say it), so that maps are checked as usual.

use std::ffi::c_void;

use soma_core::hal::{DriverError, DriverResult, PhysicalHandle, ShareableHandle};

use super::conv::{map_call_err, to_usize};
use super::device::{lock, AscendDevice};
use super::raw;

impl AscendDevice {
    /// [`DeviceHal::export_physical`](soma_core::hal::DeviceHal::export_physical).
    pub(crate) fn ipc_export(
        &self,
        handle: PhysicalHandle,
        check_pids: bool,
    ) -> DriverResult<ShareableHandle> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        if !lock(&d.mem).physical.contains_key(&handle.0) {
            return Err(DriverError::InvalidHandle(format!("physical handle {:#x}", handle.0)));
        }
        let flags = u64::from(!check_pids);
        // SAFETY: a live physical allocation of `acl` (checked above).
        let shareable =
            unsafe { raw::ipc::export(&d.acl, handle.0 as usize as *mut c_void, flags) }
                .map_err(map_call_err)?;
        Ok(ShareableHandle(shareable))
    }

    /// [`DeviceHal::allow_shareable_pids`](soma_core::hal::DeviceHal::allow_shareable_pids).
    pub(crate) fn ipc_allow(&self, shareable: ShareableHandle, pids: &[i32]) -> DriverResult<()> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        raw::ipc::set_pids(&d.acl, shareable.0, pids).map_err(map_call_err)
    }

    /// [`DeviceHal::import_physical`](soma_core::hal::DeviceHal::import_physical).
    pub(crate) fn ipc_import(
        &self,
        shareable: ShareableHandle,
        size: u64,
    ) -> DriverResult<PhysicalHandle> {
        let d = &self.inner;
        d.check_err()?;
        if size == 0 || size % d.info.granularity != 0 {
            return Err(DriverError::InvalidValue(format!(
                "imported memory of {size} bytes: the runtime does not tell the size of imported \
                 memory, give the exported allocation's (a multiple of the granularity {})",
                d.info.granularity
            )));
        }
        to_usize(size)?;
        d.enter()?;
        let h = raw::ipc::import(&d.acl, shareable.0, d.id).map_err(map_call_err)?;
        let handle = h as usize as u64;
        lock(&d.mem).physical.insert(handle, (size, None));
        Ok(PhysicalHandle(handle))
    }

    /// [`DeviceHal::process_id`](soma_core::hal::DeviceHal::process_id).
    pub(crate) fn ipc_process_id(&self) -> DriverResult<i32> {
        raw::ipc::bare_tgid(&self.inner.acl).map_err(map_call_err)
    }
}
