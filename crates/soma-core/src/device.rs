//! The typed device handle and the device-wide happens-before state.

pub mod slots;

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::engine::StreamSlot;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::hal::{DeviceHal, DeviceInfo, MemInfo, StreamHal};
use crate::pool::deferred::DeferredReleases;
use crate::pool::ActiveCaptures;
use crate::stream::Stream;
use slots::{Progress, Slots};

/// Most streams alive at once on one device (CANN's own limit is of the same order).
pub const MAX_STREAMS: usize = 1024;

/// A device: the entry point for streams, events and pools.
///
/// Cheap to clone (a reference-counted handle); every clone is the same device, with one
/// happens-before state shared by all its streams and pools.
#[derive(Clone)]
pub struct Device {
    pub(crate) shared: Arc<DeviceShared>,
    /// Present in every handle but the device's own default pool's: when the last handle
    /// that has it goes, the default pool goes too (the pool holds a handle without it, so
    /// the device and its default pool do not keep each other alive).
    _owner: Option<Arc<DeviceOwner>>,
}

/// Drops the device's default pool when the last owning [`Device`] handle goes.
struct DeviceOwner(Weak<DeviceShared>);

impl Drop for DeviceOwner {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            let pool = shared.default_pool.lock().pool.take();
            drop(pool);
        }
    }
}

/// A live stream as the device sees it: its backend and its slot's base.
pub(crate) type LiveStream = slots::LiveStream<Arc<dyn StreamHal>>;

impl Progress for Arc<dyn StreamHal> {
    #[inline]
    fn completed(&self) -> u64 {
        StreamHal::completed(&**self)
    }

    fn note_completed(&self, position: u64) {
        StreamHal::note_completed(&**self, position);
    }
}

impl LiveStream {
    /// The global position of the end of the stream's queue.
    pub(crate) fn enqueued(&self) -> u64 {
        self.base + self.hal.enqueued()
    }
}

/// What the device tells the pools built on it. A pool registers itself with
/// [`DeviceShared::register_listener`]; the device keeps a weak reference and knows nothing
/// else of it. Both calls come without any lock of the device held.
pub(crate) trait StreamEventListener: Send + Sync {
    /// A stream of the device was dropped: it drained, so its frees are host-observed, and
    /// no synchronisation may follow to act on them.
    fn stream_dropped(&self);

    /// The host synchronised with a stream, an event or the whole device: frees it covered
    /// are host-observed now.
    fn host_synchronized(&self);

    /// The last holder of the graph memory token `key` went (a graph, a graph pool, or a
    /// capture that ended without a graph): the memory kept for it may go back to the pools.
    fn graph_memory_released(&self, key: u64);
}

pub(crate) struct DeviceShared {
    pub(crate) hal: Arc<dyn DeviceHal>,
    pub(crate) slots: Slots<Arc<dyn StreamHal>>,
    listeners: Mutex<Vec<Weak<dyn StreamEventListener>>>,
    /// The device's default pool, made on first use (see `Device::default_pool`).
    pub(crate) default_pool: Mutex<crate::pool::DefaultPool>,
    /// Memory of dropped pools that work may still use, released once it has completed.
    pub(crate) deferred: DeferredReleases,
    /// The captures begun through the typed API and not ended, with their graph memory.
    pub(crate) captures: ActiveCaptures,
}

impl Drop for DeviceShared {
    /// Every stream of the device has drained (each held the device): what dropped pools
    /// left goes back now.
    fn drop(&mut self) {
        self.deferred.release_all(&*self.hal);
    }
}

impl DeviceShared {
    /// Records that the host observed completion of slot's work below global `bound`.
    pub(crate) fn observe(&self, slot: StreamSlot, bound: u64) {
        self.slots.observe(slot, bound);
    }

    pub(crate) fn live_stream(&self, slot: StreamSlot) -> Option<LiveStream> {
        self.slots.live(slot)
    }

    /// Registers `listener` for the device's stream events, for as long as it lives.
    pub(crate) fn register_listener(&self, listener: Weak<dyn StreamEventListener>) {
        let mut listeners = self.listeners.lock();
        listeners.retain(|l| l.strong_count() > 0);
        listeners.push(listener);
    }

    /// The listeners that are still alive (taken out of the lock before they are called).
    fn live_listeners(&self) -> Vec<Arc<dyn StreamEventListener>> {
        self.listeners.lock().iter().filter_map(Weak::upgrade).collect()
    }

    /// Tells every pool that a stream was dropped, so that they settle its frees; releases
    /// what dropped pools left that no work uses any more.
    pub(crate) fn settle_pools(&self) {
        for listener in self.live_listeners() {
            listener.stream_dropped();
        }
        self.deferred.release_complete(self);
    }

    /// Tells every pool that the host synchronised, so that they apply their release
    /// threshold; releases what dropped pools left that no work uses any more.
    pub(crate) fn after_host_sync(&self) {
        for listener in self.live_listeners() {
            listener.host_synchronized();
        }
        self.deferred.release_complete(self);
    }

    /// Tells every pool that the graph memory token `key` is gone, so that they release what
    /// they kept for it.
    pub(crate) fn graph_memory_released(&self, key: u64) {
        for listener in self.live_listeners() {
            listener.graph_memory_released(key);
        }
    }

    /// [`Error::TooManyStreams`] when every stream slot is taken (checked before the backend
    /// creates a stream, whose own limit would report something less clear).
    pub(crate) fn check_stream_room(&self) -> Result<()> {
        if self.slots.has_room() {
            Ok(())
        } else {
            Err(Error::TooManyStreams { max: MAX_STREAMS })
        }
    }

    pub(crate) fn attach_stream(&self, hal: Arc<dyn StreamHal>) -> Result<(StreamSlot, u64)> {
        self.slots.attach(hal).ok_or(Error::TooManyStreams { max: MAX_STREAMS })
    }

    /// Called when a stream has drained: everything it enqueued is complete.
    pub(crate) fn detach_stream(&self, slot: StreamSlot, final_global: u64) {
        self.slots.detach(slot, final_global);
    }
}

impl Device {
    /// Wraps a backend device. Backends call this once per device and hand out clones.
    pub fn new(hal: Arc<dyn DeviceHal>) -> Device {
        let shared = Arc::new(DeviceShared {
            hal,
            slots: Slots::new(MAX_STREAMS),
            listeners: Mutex::new(Vec::new()),
            default_pool: Mutex::new(crate::pool::DefaultPool::default()),
            deferred: DeferredReleases::default(),
            captures: ActiveCaptures::default(),
        });
        let owner = Some(Arc::new(DeviceOwner(Arc::downgrade(&shared))));
        Device { shared, _owner: owner }
    }

    /// A handle to the same device that does not keep its default pool alive: what the
    /// default pool itself holds.
    pub(crate) fn without_owner(&self) -> Device {
        Device { shared: Arc::clone(&self.shared), _owner: None }
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

    /// This process's id, as the exporting process of a shared pool names it in
    /// [`MemPool::allow_process`](crate::MemPool::allow_process) (`aclrtDeviceGetBareTgid`).
    ///
    /// # Errors
    /// Backend failures.
    pub fn process_id(&self) -> Result<i32> {
        Ok(self.shared.hal.process_id()?)
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
        let snapshot: Vec<(StreamSlot, u64)> = (0..self.shared.slots.count() as StreamSlot)
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

    /// Whether this device's streams could use `peer`'s memory once access is enabled
    /// (`aclrtDeviceCanAccessPeer`): `false` for a device of another backend or NPU.
    ///
    /// # Errors
    /// [`Error::PeerAccess`] for the device itself; backend failures.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        self.refuse_itself(peer, "can_access_peer")?;
        Ok(self.hal().can_access_peer(&**peer.hal())?)
    }

    /// Lets kernels, copies and memsets enqueued on this device's streams use `peer`'s memory
    /// (`aclrtDeviceEnablePeerAccess` from this device): a pool's allocations on `peer` become
    /// usable here, their frees ordered after those uses (see
    /// [`BufferOwner::record_use`](crate::BufferOwner::record_use)), and streams of the two
    /// devices may wait on each other's events. Access is per ordered pair: `peer` gains no
    /// access to this device's memory.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().devices(2).build()?;
    /// # let (d0, d1) = (soma_core::Device::new(npu.device(0)?), soma_core::Device::new(npu.device(1)?));
    /// use soma_core::MemPool;
    /// let (s0, s1) = (d0.create_stream()?, d1.create_stream()?);
    /// let (p0, p1) = (MemPool::builder().build(&d0)?, MemPool::builder().build(&d1)?);
    /// let weights = p0.upload(&[1.0f32, 2.0], &s0)?;
    /// let mut local = p1.alloc_zeros::<f32>(2, &s1)?;
    /// assert!(s1.copy(&mut local, &weights).is_err()); // no access yet
    /// d1.enable_peer_access(&d0)?;
    /// s1.copy(&mut local, &weights)?;                  // device 1 reads device 0's memory
    /// assert_eq!(s1.download(&local)?, vec![1.0, 2.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::PeerAccess`] for the device itself, a device it cannot access
    /// ([`can_access_peer`](Self::can_access_peer)), or access already enabled; backend
    /// failures. A refused call changes nothing.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        self.refuse_itself(peer, "enable_peer_access")?;
        if self.has_peer_access(peer) {
            return Err(Error::PeerAccess(format!(
                "access from device {} to device {} is already enabled",
                self.info().ordinal,
                peer.info().ordinal
            )));
        }
        if !self.can_access_peer(peer)? {
            return Err(Error::PeerAccess(format!(
                "device {} cannot access device {} (another backend or NPU, or no link)",
                self.info().ordinal,
                peer.info().ordinal
            )));
        }
        Ok(self.hal().enable_peer_access(&**peer.hal())?)
    }

    /// Withdraws the access [`enable_peer_access`](Self::enable_peer_access) gave
    /// (`aclrtDeviceDisablePeerAccess`). Work already enqueued runs; new work on this
    /// device's streams may no longer use `peer`'s memory. Frees of `peer`'s allocations stay
    /// ordered after their uses here.
    ///
    /// # Errors
    /// [`Error::PeerAccess`] for the device itself or access not enabled; backend failures.
    pub fn disable_peer_access(&self, peer: &Device) -> Result<()> {
        self.refuse_itself(peer, "disable_peer_access")?;
        if !self.has_peer_access(peer) {
            return Err(Error::PeerAccess(format!(
                "access from device {} to device {} is not enabled",
                self.info().ordinal,
                peer.info().ordinal
            )));
        }
        Ok(self.hal().disable_peer_access(&**peer.hal())?)
    }

    /// Whether work on this device's streams may use `peer`'s memory: the same device, or
    /// peer access enabled from this device to `peer`.
    pub fn has_peer_access(&self, peer: &Device) -> bool {
        self.same_as(peer) || self.hal().peer_access_enabled(&**peer.hal())
    }

    /// Whether the streams of `self` and `other` may order each other with events: the same
    /// device, or peer access enabled between them in either direction.
    pub(crate) fn linked_to(&self, other: &Device) -> bool {
        self.has_peer_access(other) || other.has_peer_access(self)
    }

    fn refuse_itself(&self, peer: &Device, what: &str) -> Result<()> {
        if self.same_as(peer) {
            return Err(Error::PeerAccess(format!(
                "{what}: device {} and itself (a device always uses its own memory)",
                self.info().ordinal
            )));
        }
        Ok(())
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
