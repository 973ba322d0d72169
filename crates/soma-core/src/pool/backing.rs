//! The engine's backing over the device: maps and unmaps physical memory in a core's address
//! range, and hands the driver's failures to the engine as they are.

use super::core::{HistoryEntry, PoolCore};
use crate::engine::{Backing, BackingError};
use crate::hal::{DevicePtr, DriverError, PhysicalHandle};
use crate::observe::{History, RecordKind};

/// Maps the engine's offsets onto the device: one physical allocation per mapped run.
///
/// Built on every allocation, so it holds the core rather than copies of the core's fields
/// (its device, range base and budget are read only when the engine maps or unmaps).
pub(super) struct HalBacking<'a> {
    core: &'a PoolCore,
    history: Option<&'a mut History>,
    /// The engine's used and reserved bytes, for the history records of this call's maps.
    used: u64,
    reserved: u64,
}

impl<'a> HalBacking<'a> {
    #[inline]
    pub(super) fn new(
        core: &'a PoolCore,
        history: Option<&'a mut History>,
        used: u64,
        reserved: u64,
    ) -> Self {
        HalBacking { core, history, used, reserved }
    }

    /// The device address of `offset` in the core's range (`size` bytes from there, for the
    /// error).
    fn address_of(&self, offset: u64, size: u64) -> Result<DevicePtr, DriverError> {
        self.core.base.checked_add(offset).ok_or_else(|| DriverError::InvalidAddress {
            addr: self.core.base.addr(),
            len: offset.saturating_add(size),
            reason: format!("offset {offset} overflows the address space"),
        })
    }

    fn record(&mut self, kind: RecordKind, offset: u64, size: u64) {
        if let Some(history) = self.history.as_deref_mut() {
            let t_ns = self.core.created.elapsed().as_nanos() as u64;
            let entry = HistoryEntry { offset, size, ..HistoryEntry::of(kind) };
            history.push(entry.stamped(t_ns, self.used, self.reserved));
        }
    }
}

impl Backing for HalBacking<'_> {
    type Error = DriverError;

    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError<DriverError>> {
        let va = self.address_of(offset, size).map_err(BackingError::Driver)?;
        if self.core.preallocated {
            self.reserved += size;
            self.record(RecordKind::Map, offset, size);
            return Ok(0);
        }
        if self.core.budget.as_deref().is_some_and(|b| !b.try_map(size)) {
            // The other shards hold the rest of the pool's limit.
            return Err(BackingError::OutOfMemory);
        }
        let hal = self.core.hal();
        let mapped = hal.alloc_physical(size).and_then(|handle| match hal.map(va, handle) {
            Ok(()) => Ok(handle),
            Err(e) => {
                // The physical allocation is ours alone; give it back before reporting.
                let _ = hal.free_physical(handle);
                Err(e)
            }
        });
        let handle = match mapped {
            Ok(handle) => handle,
            Err(e) => {
                if let Some(b) = self.core.budget.as_deref() {
                    b.unmapped(size);
                }
                return Err(map_backing_error(e));
            }
        };
        if let Some(ipc) = &self.core.ipc {
            ipc.mapped(offset, size, handle.0);
        }
        self.reserved += size;
        self.record(RecordKind::Map, offset, size);
        crate::observe::trace_map(offset, size, self.reserved);
        Ok(handle.0)
    }

    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), DriverError> {
        let va = self.address_of(offset, size)?;
        if self.core.preallocated {
            self.reserved = self.reserved.saturating_sub(size);
            self.record(RecordKind::Unmap, offset, size);
            return Ok(());
        }
        let hal = self.core.hal();
        let handle = hal.unmap(va)?;
        debug_assert_eq!(handle, PhysicalHandle(token));
        if let Some(ipc) = &self.core.ipc {
            ipc.unmapped(offset);
        }
        hal.free_physical(handle)?;
        if let Some(b) = self.core.budget.as_deref() {
            // Accounted as the engine accounts it: released once the free succeeded.
            b.unmapped(size);
        }
        self.reserved = self.reserved.saturating_sub(size);
        self.record(RecordKind::Unmap, offset, size);
        Ok(())
    }
}

/// An engine allocation's error: its backing failures are the driver's own errors.
pub(super) type AllocError = crate::engine::AllocError<DriverError>;

/// Maps a driver error of a map: `OutOfMemory` stays OOM (the engine may recycle and
/// retry); everything else is the driver's error as it is.
fn map_backing_error(e: DriverError) -> BackingError<DriverError> {
    match e {
        DriverError::OutOfMemory { .. } => BackingError::OutOfMemory,
        other => BackingError::Driver(other),
    }
}
