//! Physical memory of a [`SimDevice`]: allocations, their mappings, and their exports to and
//! imports from other processes.

use std::sync::Arc;

use soma_core::hal::{DevicePtr, DriverError, DriverResult, PhysicalHandle, ShareableHandle};

use super::{bad_addr, bump, DeviceCore, ResKind, SimDevice};
use crate::faults::FaultKind;
use crate::memory::SharedPages;
use crate::{ipc, model_delay};

/// Physical memory: its own memory file, which holds the bytes until the handle is freed,
/// whether mapped or not (as on a device: unmapping keeps the contents).
pub(super) struct Phys {
    pages: Arc<SharedPages>,
    mapped_at: Option<u64>,
    share: Share,
}

/// Whether a physical allocation crosses processes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Share {
    /// Allocated here, not exported.
    Local,
    /// Allocated here and exported under this handle.
    Exported(ShareableHandle),
    /// Imported from another process under this handle (counts as imported, not allocated).
    Imported(ShareableHandle),
}

fn unknown(handle: PhysicalHandle) -> DriverError {
    DriverError::InvalidHandle(format!("physical handle {}", handle.0))
}

impl SimDevice {
    /// The size of physical memory `handle` (allocated here or imported), if it is live.
    pub fn physical_size(&self, handle: PhysicalHandle) -> Option<u64> {
        self.core.state.lock().physical.get(&handle.0).map(|p| p.pages.len())
    }

    pub(super) fn physical_alloc(&self, size: u64) -> DriverResult<PhysicalHandle> {
        self.check_vmm()?;
        bump(&self.core.calls.alloc_physical);
        model_delay(self.core.latency().driver_alloc);
        // Every call counts towards a fault rule, as in `stats().calls` (and as `map` does):
        // the rule comes before the argument checks.
        if self.core.faults.hit(FaultKind::AllocPhysical) {
            return Err(DriverError::Injected(format!("alloc_physical({size})")));
        }
        self.check_granular(size)?;
        let mut st = self.core.state.lock();
        if st.used().checked_add(size).is_none_or(|u| u > self.core.info.total_memory) {
            return Err(self.oom(&st, size));
        }
        let pages = Arc::new(SharedPages::create(size)?);
        let h = st.next_handle;
        st.next_handle += 1;
        st.physical.insert(h, Phys { pages, mapped_at: None, share: Share::Local });
        st.physical_bytes += size;
        Ok(PhysicalHandle(h))
    }

    pub(super) fn physical_free(&self, handle: PhysicalHandle) -> DriverResult<()> {
        self.check_vmm()?;
        bump(&self.core.calls.free_physical);
        let mut st = self.core.state.lock();
        let p = st.physical.get(&handle.0).ok_or_else(|| unknown(handle))?;
        if p.mapped_at.is_some() {
            return Err(DriverError::InvalidValue(format!(
                "physical handle {} is still mapped",
                handle.0
            )));
        }
        let (size, share) = (p.pages.len(), p.share);
        match share {
            Share::Imported(_) => st.imported_bytes -= size,
            Share::Local | Share::Exported(_) => st.physical_bytes -= size,
        }
        st.physical.remove(&handle.0);
        drop(st);
        forget_share(share);
        Ok(())
    }

    pub(super) fn physical_map(&self, va: DevicePtr, handle: PhysicalHandle) -> DriverResult<()> {
        self.check_vmm()?;
        bump(&self.core.calls.map);
        model_delay(self.core.latency().map);
        if self.core.faults.hit(FaultKind::Map) {
            return Err(DriverError::Injected(format!("map({va}, {})", handle.0)));
        }
        let a = va.addr();
        let mut st = self.core.state.lock();
        let p = st.physical.get(&handle.0).ok_or_else(|| unknown(handle))?;
        if p.mapped_at.is_some() {
            return Err(DriverError::InvalidValue(format!(
                "physical handle {} is already mapped",
                handle.0
            )));
        }
        let pages = Arc::clone(&p.pages);
        let cross_process = p.share != Share::Local;
        let size = pages.len();
        if a % self.core.info.granularity != 0 {
            return Err(bad_addr(a, size, "not aligned to the granularity"));
        }
        let end = a.checked_add(size).ok_or_else(|| bad_addr(a, size, "overflow"))?;
        match st.reservations.range(..=a).next_back() {
            Some((&rs, &(rl, ResKind::User))) if end <= rs + rl => {}
            _ => return Err(bad_addr(a, size, "not inside a reservation")),
        }
        if st.mappings.range(..end).next_back().is_some_and(|(&ms, &(ml, _))| ms + ml > a) {
            return Err(bad_addr(a, size, "overlaps an existing mapping"));
        }
        self.core.memory.map_shared(a, size, &pages, cross_process)?;
        if let Some(p) = st.physical.get_mut(&handle.0) {
            p.mapped_at = Some(a);
        }
        st.mappings.insert(a, (size, handle.0));
        st.mapped_bytes += size;
        Ok(())
    }

    pub(super) fn physical_unmap(&self, va: DevicePtr) -> DriverResult<PhysicalHandle> {
        self.check_vmm()?;
        bump(&self.core.calls.unmap);
        model_delay(self.core.latency().map);
        let a = va.addr();
        let mut st = self.core.state.lock();
        let Some(&(size, h)) = st.mappings.get(&a) else {
            return Err(bad_addr(a, 0, "not the start of a mapping"));
        };
        self.core.memory.unmap_shared(a, size)?;
        st.mappings.remove(&a);
        if let Some(p) = st.physical.get_mut(&h) {
            p.mapped_at = None;
        }
        st.mapped_bytes -= size;
        Ok(PhysicalHandle(h))
    }

    pub(super) fn physical_export(
        &self,
        handle: PhysicalHandle,
        check_pids: bool,
    ) -> DriverResult<ShareableHandle> {
        self.check_vmm()?;
        let mut st = self.core.state.lock();
        let p = st.physical.get_mut(&handle.0).ok_or_else(|| unknown(handle))?;
        match p.share {
            Share::Local => {}
            Share::Exported(s) => {
                return Err(DriverError::InvalidValue(format!(
                    "physical handle {} is already exported as shareable handle {:#x} (one \
                     shareable handle per handle)",
                    handle.0, s.0
                )))
            }
            Share::Imported(s) => {
                return Err(DriverError::InvalidValue(format!(
                    "physical handle {} was imported (shareable handle {:#x}): only the \
                     process that allocated memory exports it",
                    handle.0, s.0
                )))
            }
        }
        // Before the memory file leaves the process: from now on another process may write
        // the bytes at any time.
        if let Some(a) = p.mapped_at {
            self.core.memory.share(a, p.pages.len())?;
        }
        let shareable = ipc::export(Arc::clone(&p.pages), check_pids)?;
        p.share = Share::Exported(shareable);
        Ok(shareable)
    }

    pub(super) fn physical_import(
        &self,
        shareable: ShareableHandle,
        size: u64,
    ) -> DriverResult<PhysicalHandle> {
        self.check_vmm()?;
        ipc::claim_import(shareable)?;
        let fetched = ipc::fetch(shareable);
        let pages = match fetched.and_then(|p| self.check_imported(&p, size).map(|()| p)) {
            Ok(pages) => pages,
            Err(e) => {
                ipc::release_import(shareable);
                return Err(e);
            }
        };
        let mut st = self.core.state.lock();
        let h = st.next_handle;
        st.next_handle += 1;
        st.imported_bytes += pages.len();
        let phys =
            Phys { pages: Arc::new(pages), mapped_at: None, share: Share::Imported(shareable) };
        st.physical.insert(h, phys);
        Ok(PhysicalHandle(h))
    }

    /// Imported memory must be of the size the caller expects (0: any) and mappable here: a
    /// whole number of granules.
    fn check_imported(&self, pages: &SharedPages, size: u64) -> DriverResult<()> {
        if size != 0 && size != pages.len() {
            return Err(DriverError::InvalidValue(format!(
                "the exported memory holds {} bytes, not {size}",
                pages.len()
            )));
        }
        let g = self.core.info.granularity;
        if pages.len() == 0 || pages.len() % g != 0 {
            return Err(DriverError::InvalidValue(format!(
                "imported memory of {} bytes is not a whole number of this device's {g}-byte \
                 granules",
                pages.len()
            )));
        }
        Ok(())
    }
}

/// Withdraws the export of freed memory, or gives back the import claim of a freed import.
fn forget_share(share: Share) {
    match share {
        Share::Local => {}
        Share::Exported(s) => ipc::withdraw(s),
        Share::Imported(s) => ipc::release_import(s),
    }
}

impl Drop for DeviceCore {
    fn drop(&mut self) {
        // The device's exports end with it; its imports are no longer held.
        for p in self.state.get_mut().physical.values() {
            forget_share(p.share);
        }
    }
}
