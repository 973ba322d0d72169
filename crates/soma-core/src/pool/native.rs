//! A pool delegated to the device's own stream-ordered pool (CANN's `aclrtMemPool*`, see
//! [`MemPoolBuilder::native`](super::MemPoolBuilder::native)) behind the same typed API:
//! every operation asks the driver's pool, which keeps its own books.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::allocate::Granted;
use super::attr::{
    Attribute as _, ReleaseThreshold, ReservedMemCurrent, ReservedMemHigh,
    ReuseAllowInternalDependencies, ReuseAllowOpportunistic, ReuseFollowEventDependencies,
    UsedMemCurrent, UsedMemHigh,
};
use super::core::CoreSpec;
use super::free::wait_for_uses;
use super::handle::{Origin, StreamUse};
use super::oom::retry_after_oom;
use super::policy::{
    OomAction, OomHook, ReusePolicy, Settings, FOLLOW_EVENT_DEPENDENCIES, INTERNAL_DEPENDENCIES,
    OPPORTUNISTIC,
};
use super::stats::PoolStats;
use crate::device::Device;
use crate::error::{Error, OutOfMemory, Result};
use crate::hal::{DeviceHal, DevicePtr, DriverError, NativePoolHal};
use crate::observe::Snapshot;
use crate::stream::Stream;

/// A pool served by the driver's own pool.
pub(crate) struct NativePool {
    pool: Box<dyn NativePoolHal>,
    hal: Arc<dyn DeviceHal>,
    pub(super) max_size: u64,
    pub(super) alignment: u64,
    pub(super) id: u64,
    /// The reuse switches as last set (the driver's pool has them too) and the threshold.
    pub(super) settings: Arc<Settings>,
    on_oom: Option<OomHook>,
    created: Instant,
    /// An error from a `Drop` that could not be reported; returned by the next fallible call.
    sticky: Mutex<Option<Error>>,
}

impl NativePool {
    /// Creates the driver's pool with the settings of `spec`.
    pub(super) fn create(device: &Device, spec: &CoreSpec) -> Result<NativePool> {
        let pool = device.hal().create_native_pool(spec.max_size)?;
        let reuse = spec.settings.reuse_policy();
        pool.set_attr(ReuseFollowEventDependencies::ID, reuse.follow_event_dependencies.into())?;
        pool.set_attr(ReuseAllowOpportunistic::ID, reuse.opportunistic.into())?;
        pool.set_attr(ReuseAllowInternalDependencies::ID, reuse.internal_dependencies.into())?;
        pool.set_attr(ReleaseThreshold::ID, spec.settings.release_threshold())?;
        Ok(NativePool {
            pool,
            hal: Arc::clone(device.hal()),
            max_size: spec.max_size,
            alignment: spec.alignment,
            id: spec.id,
            settings: Arc::clone(&spec.settings),
            on_oom: spec.on_oom.clone(),
            created: spec.created,
            sticky: Mutex::new(None),
        })
    }

    /// Allocates `bytes` for `stream`; out of memory calls the hooks, which may ask for one
    /// more attempt.
    pub(super) fn allocate(
        &self,
        bytes: u64,
        stream: &Stream<'_>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
    ) -> Result<Granted> {
        match self.try_allocate(bytes, stream) {
            Err(Error::OutOfMemory(oom)) => {
                retry_after_oom(self.on_oom.as_ref(), on_oom, oom, || {
                    self.try_allocate(bytes, stream)
                })
            }
            other => other,
        }
    }

    /// One attempt. Errors as the engine's: a size above the pool's max size is
    /// [`Error::InvalidSize`], a full pool [`Error::OutOfMemory`] with the numbers the
    /// driver's pool gives.
    #[inline(never)]
    fn try_allocate(&self, bytes: u64, stream: &Stream<'_>) -> Result<Granted> {
        self.take_sticky()?;
        let size = crate::engine::checked_align_up(bytes, self.alignment)
            .filter(|&s| s <= self.max_size)
            .ok_or_else(|| {
                Error::InvalidSize(format!(
                    "size {bytes} (rounded to a multiple of {}) exceeds the pool's max size {}",
                    self.alignment, self.max_size
                ))
            })?;
        match self.pool.malloc_async(bytes, &**stream.hal()) {
            Ok(ptr) => Ok(Granted { block: None, ptr, size, origin: Origin::new(0, None) }),
            Err(e @ DriverError::OutOfMemory { .. }) => {
                Err(Error::OutOfMemory(Box::new(self.oom_report(bytes, size, stream, e))))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The report of a pool that is full: its own counters, the device's memory.
    #[cold]
    fn oom_report(
        &self,
        bytes: u64,
        rounded: u64,
        stream: &Stream<'_>,
        cause: DriverError,
    ) -> OutOfMemory {
        let attr = |id| self.pool.get_attr(id).unwrap_or(0);
        let (device_free, device_total) = self.hal.mem_info().map_or((0, 0), |m| (m.free, m.total));
        OutOfMemory {
            requested: bytes,
            rounded,
            stream: stream.id(),
            used: attr(UsedMemCurrent::ID),
            reserved: attr(ReservedMemCurrent::ID),
            max: self.max_size,
            largest_free_block: 0,
            pending_bytes: 0,
            pending: Vec::new(),
            reuse: self.settings.reuse_policy(),
            device_free,
            device_total,
            retried: false,
            cause: Some(format!("the driver's pool answered: {cause}")),
        }
    }

    /// Frees `ptr` onto `stream`, after making `stream` wait for the other streams in `uses`.
    pub(super) fn free(
        &self,
        ptr: DevicePtr,
        stream: &Stream<'_>,
        uses: &[StreamUse],
    ) -> Result<()> {
        wait_for_uses(stream, uses)?;
        Ok(self.pool.free_async(ptr, &**stream.hal())?)
    }

    /// The driver's trim; returns the bytes it released.
    pub(super) fn trim_to(&self, bytes: u64) -> Result<u64> {
        let before = self.pool.get_attr(ReservedMemCurrent::ID)?;
        self.pool.trim_to(bytes)?;
        let after = self.pool.get_attr(ReservedMemCurrent::ID)?;
        Ok(before.saturating_sub(after))
    }

    /// The counters the driver's pool has (the others stay 0).
    pub(super) fn stats(&self) -> PoolStats {
        let get = |id| self.pool.get_attr(id).unwrap_or(0);
        PoolStats {
            used: get(UsedMemCurrent::ID),
            used_high: get(UsedMemHigh::ID),
            reserved: get(ReservedMemCurrent::ID),
            reserved_high: get(ReservedMemHigh::ID),
            max_size: self.max_size,
            ..PoolStats::default()
        }
    }

    /// Reads attribute `id` from the driver's pool.
    pub(super) fn attr(&self, id: u32) -> Result<u64> {
        Ok(self.pool.get_attr(id)?)
    }

    /// Sets attribute `id` in the driver's pool.
    pub(super) fn set_attr(&self, id: u32, value: u64) -> Result<()> {
        Ok(self.pool.set_attr(id, value)?)
    }

    /// Sets a reuse switch: the driver's pool, then the stored one.
    pub(super) fn set_reuse_switch(&self, id: u32, bit: u32, on: bool) -> Result<()> {
        self.pool.set_attr(id, on.into())?;
        self.settings.set_reuse_flag(bit, on);
        Ok(())
    }

    /// Sets the switches one by one, as the attributes do, so that the stored policy agrees
    /// with the driver's pool even when a later switch fails; a failure is reported at the
    /// pool's next fallible call.
    pub(super) fn set_reuse_policy(&self, policy: ReusePolicy) {
        let switches = [
            (
                ReuseFollowEventDependencies::ID,
                FOLLOW_EVENT_DEPENDENCIES,
                policy.follow_event_dependencies,
            ),
            (ReuseAllowOpportunistic::ID, OPPORTUNISTIC, policy.opportunistic),
            (
                ReuseAllowInternalDependencies::ID,
                INTERNAL_DEPENDENCIES,
                policy.internal_dependencies,
            ),
        ];
        let set =
            switches.into_iter().try_for_each(|(id, bit, on)| self.set_reuse_switch(id, bit, on));
        if let Err(e) = set {
            self.set_sticky(e);
        }
    }

    /// Sets the release threshold (at most the max size): stored, then the driver's pool.
    pub(super) fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.settings.set_release_threshold(bytes, self.max_size)?;
        self.set_attr(ReleaseThreshold::ID, bytes)
    }

    /// Restarts both high-water marks.
    pub(super) fn reset_highs(&self) -> Result<()> {
        self.set_attr(UsedMemHigh::ID, 0)?;
        self.set_attr(ReservedMemHigh::ID, 0)
    }

    /// An empty snapshot: the driver does not expose its blocks.
    pub(super) fn snapshot(&self) -> Snapshot {
        let t_ns = self.created.elapsed().as_nanos() as u64;
        Snapshot::from_blocks(t_ns, self.max_size, self.alignment, std::iter::empty(), |_| {
            (None, 0)
        })
    }

    /// Stores `error` for the next fallible call (the first one stays).
    pub(super) fn set_sticky(&self, error: Error) {
        self.sticky.lock().get_or_insert(error);
    }

    /// The stored error, taken.
    pub(super) fn take_sticky(&self) -> Result<()> {
        match self.sticky.lock().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
