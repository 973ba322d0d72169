//! The typed device handle and the device-wide happens-before state.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::engine::StreamSlot;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::hal::{DeviceHal, DeviceInfo, MemInfo, StreamHal};
use crate::pool::PoolCore;
use crate::stream::Stream;

/// Most streams alive at once on one device (CANN's own limit is of the same order).
pub const MAX_STREAMS: usize = 1024;

/// A device: the entry point for streams, events and pools.
///
/// Cheap to clone (a reference-counted handle); every clone is the same device, with one
/// happens-before state shared by all its streams and pools.
#[derive(Clone)]
pub struct Device {
    pub(crate) shared: Arc<DeviceShared>,
}

/// What a stream slot knows about its current (or last) stream.
pub(crate) struct SlotState {
    /// Frees on this slot with a global position below this bound were observed complete by
    /// the host (stream / event / device synchronize, or the stream was dropped).
    pub(crate) observed: AtomicU64,
    /// The live stream in this slot, if any.
    pub(crate) live: Mutex<Option<LiveStream>>,
}

/// A live stream as the device sees it.
#[derive(Clone)]
pub(crate) struct LiveStream {
    pub(crate) hal: Arc<dyn StreamHal>,
    /// Global position of the slot = `base + hal position`; monotonic across incarnations.
    pub(crate) base: u64,
}

impl LiveStream {
    pub(crate) fn enqueued(&self) -> u64 {
        self.base + self.hal.enqueued()
    }

    pub(crate) fn completed(&self) -> u64 {
        self.base + self.hal.completed()
    }
}

struct SlotAllocator {
    free: Vec<StreamSlot>,
    next_unused: StreamSlot,
    /// Base for the next incarnation of each slot that has been used.
    next_base: Vec<u64>,
}

pub(crate) struct DeviceShared {
    pub(crate) hal: Arc<dyn DeviceHal>,
    pub(crate) slots: Box<[SlotState]>,
    allocator: Mutex<SlotAllocator>,
    pools: Mutex<Vec<Weak<PoolCore>>>,
}

impl DeviceShared {
    pub(crate) fn slot(&self, slot: StreamSlot) -> &SlotState {
        &self.slots[slot as usize]
    }

    /// Records that the host observed completion of slot's work below global `bound`.
    pub(crate) fn observe(&self, slot: StreamSlot, bound: u64) {
        let before = self.slot(slot).observed.fetch_max(bound, Ordering::AcqRel);
        if bound > before {
            // Tell the backend too: one that caches completion (the ascend backend checks
            // unmaps against it) would otherwise ask the driver, which knows only "not idle".
            if let Some(live) = self.live_stream(slot) {
                if let Some(done) = bound.checked_sub(1).and_then(|d| d.checked_sub(live.base)) {
                    live.hal.note_completed(done);
                }
            }
        }
    }

    /// How many streams of the device are alive.
    pub(crate) fn live_streams(&self) -> usize {
        let alloc = self.allocator.lock();
        alloc.next_unused as usize - alloc.free.len()
    }

    /// Whether a stream occupies `slot`.
    pub(crate) fn is_live(&self, slot: StreamSlot) -> bool {
        self.slot(slot).live.lock().is_some()
    }

    pub(crate) fn live_stream(&self, slot: StreamSlot) -> Option<LiveStream> {
        self.slot(slot).live.lock().clone()
    }

    pub(crate) fn register_pool(&self, pool: &Arc<PoolCore>) {
        let mut pools = self.pools.lock();
        pools.retain(|p| p.strong_count() > 0);
        pools.push(Arc::downgrade(pool));
    }

    /// The pools (shards) of the device that are still alive.
    fn live_pools(&self) -> Vec<Arc<PoolCore>> {
        self.pools.lock().iter().filter_map(Weak::upgrade).collect()
    }

    /// Settles every live pool's host-observed frees (called when a stream was dropped: its
    /// frees are host-observed, and no synchronisation may follow to settle them).
    pub(crate) fn settle_pools(&self) {
        for pool in self.live_pools() {
            pool.settle_observed(self);
        }
    }

    /// Applies every live pool's release threshold (called after a host synchronisation).
    pub(crate) fn after_host_sync(&self) {
        for pool in self.live_pools() {
            pool.apply_release_threshold(self);
        }
    }

    /// [`Error::TooManyStreams`] when every stream slot is taken (checked before the backend
    /// creates a stream, whose own limit would report something less clear).
    pub(crate) fn check_stream_room(&self) -> Result<()> {
        let alloc = self.allocator.lock();
        if alloc.free.is_empty() && alloc.next_unused as usize >= MAX_STREAMS {
            return Err(Error::TooManyStreams { max: MAX_STREAMS });
        }
        Ok(())
    }

    pub(crate) fn attach_stream(&self, hal: Arc<dyn StreamHal>) -> Result<(StreamSlot, u64)> {
        let mut alloc = self.allocator.lock();
        let slot = match alloc.free.pop() {
            Some(s) => s,
            None if (alloc.next_unused as usize) < MAX_STREAMS => {
                alloc.next_unused += 1;
                alloc.next_base.push(0);
                alloc.next_unused - 1
            }
            None => return Err(Error::TooManyStreams { max: MAX_STREAMS }),
        };
        let base = alloc.next_base[slot as usize];
        *self.slot(slot).live.lock() = Some(LiveStream { hal, base });
        Ok((slot, base))
    }

    /// Called when a stream has drained: everything it enqueued is complete.
    pub(crate) fn detach_stream(&self, slot: StreamSlot, final_global: u64) {
        let mut alloc = self.allocator.lock();
        *self.slot(slot).live.lock() = None;
        self.observe(slot, final_global + 1);
        alloc.next_base[slot as usize] = final_global + 1;
        alloc.free.push(slot);
    }
}

impl Device {
    /// Wraps a backend device. Backends call this once per device and hand out clones.
    pub fn new(hal: Arc<dyn DeviceHal>) -> Device {
        let slots = (0..MAX_STREAMS)
            .map(|_| SlotState { observed: AtomicU64::new(0), live: Mutex::new(None) })
            .collect();
        Device {
            shared: Arc::new(DeviceShared {
                hal,
                slots,
                allocator: Mutex::new(SlotAllocator {
                    free: Vec::new(),
                    next_unused: 0,
                    next_base: Vec::new(),
                }),
                pools: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Static facts: ordinal, memory, granularity, product model.
    pub fn info(&self) -> &DeviceInfo {
        self.shared.hal.info()
    }

    /// Free and total device memory, as `aclrtGetMemInfo` reports them.
    ///
    /// # Errors
    /// Backend failures.
    pub fn mem_info(&self) -> Result<MemInfo> {
        Ok(self.shared.hal.mem_info()?)
    }

    /// The backend device, for what the typed API does not cover.
    pub fn hal(&self) -> &Arc<dyn DeviceHal> {
        &self.shared.hal
    }

    /// Creates a stream.
    ///
    /// # Errors
    /// Backend failures, or [`Error::TooManyStreams`].
    pub fn create_stream(&self) -> Result<Stream<'_>> {
        Stream::new(self)
    }

    /// Creates an event that is not recorded yet (see [`Stream::record`]).
    ///
    /// # Errors
    /// Backend failures.
    pub fn create_event(&self) -> Result<Event<'_>> {
        Event::new(self)
    }

    /// Blocks until every stream of the device has completed everything enqueued so far,
    /// then applies the release threshold of every pool of the device.
    ///
    /// # Errors
    /// The first stream error the backend reports.
    pub fn synchronize(&self) -> Result<()> {
        let snapshot: Vec<(StreamSlot, u64)> = (0..self.shared.slots.len() as StreamSlot)
            .filter_map(|s| self.shared.live_stream(s).map(|l| (s, l.enqueued())))
            .collect();
        let result = self.shared.hal.synchronize();
        // Even on error the queues have drained up to the call (HAL contract).
        for (slot, enqueued) in snapshot {
            self.shared.observe(slot, enqueued + 1);
        }
        self.shared.after_host_sync();
        Ok(result?)
    }

    pub(crate) fn same_as(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let info = self.info();
        f.debug_struct("Device")
            .field("ordinal", &info.ordinal)
            .field("product", &info.product)
            .finish()
    }
}
