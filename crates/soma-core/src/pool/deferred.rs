//! Memory of a dropped pool that work on its streams may still use. Dropping a pool never
//! waits for a stream (one held by a blocking host function would hang the drop): what is
//! complete is released at once, the rest — the mappings whose frees are still in flight,
//! and the pool's address reservation — is handed to the device, which releases it at a
//! later device call on a host thread, once the work it waits for has completed: a
//! synchronisation, a stream's drop, a pool's creation or drop, a pool's out-of-memory
//! retry, and at the latest when the device itself is dropped (its streams have drained by
//! then). Nothing is unmapped while work may still use it, and no driver call is made from a
//! stream's callback (CANN forbids releasing resources there).

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::device::DeviceShared;
use crate::engine::StreamSlot;
use crate::hal::{DeviceHal, DevicePtr};

/// What one dropped pool (or shard) left to release.
pub(crate) struct DeferredRelease {
    /// `(slot, global position)`: work up to each must be complete before anything goes.
    pub(crate) waits: SmallVec<[(StreamSlot, u64); 4]>,
    /// Mappings still held, each unmapped and its physical memory freed.
    pub(crate) mappings: Vec<DevicePtr>,
    /// The address reservation, or the one `malloc` segment of a device without VMM.
    pub(crate) base: DevicePtr,
    /// `base` is a `malloc` segment (freed), not a reservation (released).
    pub(crate) preallocated: bool,
}

impl DeferredRelease {
    /// Whether the work every wait names has completed (a backend that caches completion is
    /// asked first, without blocking).
    fn complete(&self, device: &DeviceShared) -> bool {
        self.waits.iter().all(|&(slot, pos)| {
            device.slots.is_complete(slot, pos)
                || device.live_stream(slot).is_some_and(|live| {
                    live.hal.poll_completed();
                    device.slots.is_complete(slot, pos)
                })
        })
    }

    /// Unmaps and frees what is left, then gives the base back. `None` when done; the rest
    /// when the backend refused an unmap and `retry` (it is kept for a later call).
    fn release(mut self, hal: &dyn DeviceHal, retry: bool) -> Option<DeferredRelease> {
        while let Some(&va) = self.mappings.last() {
            match hal.unmap(va) {
                Ok(handle) => {
                    // Nothing to report to: the device's counters show a leak.
                    let _ = hal.free_physical(handle);
                }
                Err(_) if retry => return Some(self),
                Err(_) => {}
            }
            self.mappings.pop();
        }
        let _ = if self.preallocated { hal.free(self.base) } else { hal.release(self.base) };
        None
    }
}

/// The device's list of [`DeferredRelease`]s.
#[derive(Default)]
pub(crate) struct DeferredReleases {
    list: Mutex<Vec<DeferredRelease>>,
    /// Whether the list may hold anything: the device's calls look here first, without the
    /// lock.
    any: AtomicBool,
}

impl DeferredReleases {
    /// Hands `release` to the device.
    pub(crate) fn push(&self, release: DeferredRelease) {
        self.list.lock().push(release);
        self.any.store(true, Ordering::Release);
    }

    /// Releases every entry whose work has completed (the driver calls made without the
    /// list's lock held).
    #[inline]
    pub(crate) fn release_complete(&self, device: &DeviceShared) {
        if self.any.load(Ordering::Acquire) {
            self.release_complete_slow(device);
        }
    }

    #[cold]
    #[inline(never)]
    fn release_complete_slow(&self, device: &DeviceShared) {
        let pending = {
            let mut list = self.list.lock();
            // Under the lock: a push after this sets it again.
            self.any.store(false, Ordering::Release);
            std::mem::take(&mut *list)
        };
        let mut kept = Vec::new();
        for release in pending {
            if !release.complete(device) {
                kept.push(release);
            } else if let Some(rest) = release.release(&*device.hal, true) {
                kept.push(rest);
            }
        }
        if !kept.is_empty() {
            self.push_all(kept);
        }
    }

    fn push_all(&self, releases: Vec<DeferredRelease>) {
        self.list.lock().extend(releases);
        self.any.store(true, Ordering::Release);
    }

    /// Releases everything: the device is going away, so every stream of it has drained.
    pub(crate) fn release_all(&self, hal: &dyn DeviceHal) {
        for release in std::mem::take(&mut *self.list.lock()) {
            let _ = release.release(hal, false);
        }
    }
}
