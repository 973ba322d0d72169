//! The engine's backing over the device: maps and unmaps physical memory in a core's address
//! range, and turns the driver's failures into the engine's and the engine's back into the
//! pool's errors.

use super::core::{HistoryEntry, PoolCore};
use crate::engine::{Backing, BackingError};
use crate::error::Error;
use crate::hal::{DriverError, PhysicalHandle};
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

    fn record(&mut self, kind: RecordKind, offset: u64, size: u64) {
        if let Some(history) = self.history.as_deref_mut() {
            let t_ns = self.core.created.elapsed().as_nanos() as u64;
            let entry = HistoryEntry { offset, size, ..HistoryEntry::of(kind) };
            history.push(entry.stamped(t_ns, self.used, self.reserved));
        }
    }
}

impl Backing for HalBacking<'_> {
    fn map(&mut self, offset: u64, size: u64) -> std::result::Result<u64, BackingError> {
        let va = self
            .core
            .base
            .checked_add(offset)
            .ok_or_else(|| BackingError::Failed("offset overflow".into()))?;
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
        self.reserved += size;
        self.record(RecordKind::Map, offset, size);
        crate::observe::trace_map(offset, size, self.reserved);
        Ok(handle.0)
    }

    fn unmap(
        &mut self,
        offset: u64,
        size: u64,
        token: u64,
    ) -> std::result::Result<(), BackingError> {
        let va = self
            .core
            .base
            .checked_add(offset)
            .ok_or_else(|| BackingError::Failed("offset overflow".into()))?;
        if self.core.preallocated {
            self.reserved = self.reserved.saturating_sub(size);
            self.record(RecordKind::Unmap, offset, size);
            return Ok(());
        }
        let hal = self.core.hal();
        let handle = hal.unmap(va).map_err(map_backing_error)?;
        debug_assert_eq!(handle, PhysicalHandle(token));
        hal.free_physical(handle).map_err(map_backing_error)?;
        if let Some(b) = self.core.budget.as_deref() {
            // Accounted as the engine accounts it: released once the free succeeded.
            b.unmapped(size);
        }
        self.reserved = self.reserved.saturating_sub(size);
        self.record(RecordKind::Unmap, offset, size);
        Ok(())
    }
}

/// Maps driver errors of the physical side: `OutOfMemory` stays OOM (the engine may recycle
/// and retry); everything else is a failure carried as text.
fn map_backing_error(e: DriverError) -> BackingError {
    match e {
        DriverError::OutOfMemory { .. } => BackingError::OutOfMemory,
        other => BackingError::Failed(other.to_string()),
    }
}

/// The pool's error for a map or unmap that failed inside the engine: `what` failed, and
/// `detail` is the engine's report (the backing hands driver failures to it as text).
pub(super) fn backing_failure(what: &str, detail: String) -> Error {
    Error::Driver(DriverError::Native { code: -1, message: format!("{what}: {detail}") })
}
