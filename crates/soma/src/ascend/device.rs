//! [`AscendDevice`]: the [`DeviceHal`] of one NPU over the CANN runtime.

use std::any::Any;
use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use ascend_sys::{
    aclrtMemAllocationType, aclrtMemAttr, aclrtMemGranularityOptions, aclrtMemHandleType,
    aclrtMemLocation, aclrtMemLocationType, aclrtMemMallocPolicy, aclrtMemPoolProps,
    aclrtMemcpyKind, aclrtPhysicalMemProp, Acl,
};
use soma_core::hal::{
    CaptureMode, DeviceHal, DeviceInfo, DevicePtr, DriverError, DriverResult, EventHal, MemInfo,
    MemRef, PhysicalHandle, ShareableHandle, StreamHal,
};

use super::capture::Captures;
use super::conv::{dev_ptr, is_unsupported, map_alloc_err, map_call_err, to_dev_ptr, to_usize};
use super::event::AscendEvent;
use super::ranges::{InFlight, MemState};
use super::raw::{self, ACL_ERROR_REPEAT_INITIALIZE};
use super::stream::{AscendStream, StreamShared};

/// Granularity assumed when the runtime cannot be asked (no VMM): 2 MiB, Ascend's granule.
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;

/// Locks a std mutex, ignoring poisoning: every critical section here leaves the state
/// consistent before anything that can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes sure `aclInit` has run in this process for `acl`: calls it once per [`Acl`] instance
/// and tolerates `ACL_ERROR_REPEAT_INITIALIZE` (another component initialised the process).
fn ensure_init(acl: &Arc<Acl>) -> DriverResult<()> {
    static DONE: Mutex<Vec<Weak<Acl>>> = Mutex::new(Vec::new());
    let mut done = lock(&DONE);
    done.retain(|w| w.strong_count() > 0);
    // A Weak in the list keeps its allocation, so an address in it is never reused.
    if done.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(acl))) {
        return Ok(());
    }
    match raw::init::init(acl) {
        Ok(()) => {}
        Err(e) if e.code() == Some(ACL_ERROR_REPEAT_INITIALIZE) => {}
        Err(e) => return Err(map_call_err(e)),
    }
    done.push(Arc::downgrade(acl));
    Ok(())
}

/// The number of NPUs the runtime sees (`aclrtGetDeviceCount`), after `aclInit`.
///
/// # Errors
/// `aclInit` or `aclrtGetDeviceCount` failed (mapped as in [`super`]'s docs).
pub fn device_count(acl: &Arc<Acl>) -> DriverResult<u32> {
    ensure_init(acl)?;
    raw::device::count(acl).map_err(map_call_err)
}

/// Opens every NPU the runtime sees, in ordinal order.
///
/// # Errors
/// As [`device_count`] and [`AscendDevice::open`].
pub fn devices(acl: Arc<Acl>) -> DriverResult<Vec<AscendDevice>> {
    let n = device_count(&acl)?;
    (0..n).map(|i| AscendDevice::open(acl.clone(), i)).collect()
}

static NEXT_DEVICE_KEY: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// Key of the device this thread last made current with `aclrtSetDevice` through soma
    /// (0: none).
    static CURRENT_DEVICE: Cell<u64> = const { Cell::new(0) };
}

/// Forgets which device soma last made current on the calling thread, so that the next soma
/// call on this thread calls `aclrtSetDevice` again.
///
/// Call it after code outside soma changed the thread's current device or context
/// (`aclrtSetDevice`, `aclrtSetCurrentContext`) on a thread that soma also uses.
pub fn forget_current_device() {
    CURRENT_DEVICE.with(|c| c.set(0));
}

/// State shared by a device and its streams, events and pools.
///
/// Lock order (never taken in the other direction): event `last` → memory (`mem`) → stream
/// `enqueue` → `in_flight`; `deferred` and `streams` are leaves.
pub(crate) struct DeviceInner {
    pub(crate) acl: Arc<Acl>,
    pub(crate) id: i32,
    key: u64,
    pub(crate) info: DeviceInfo,
    phys_prop: aclrtPhysicalMemProp,
    pub(crate) mem: Mutex<MemState>,
    pub(crate) in_flight: Mutex<(Vec<InFlight>, usize)>,
    streams: Mutex<Vec<Weak<StreamShared>>>,
    deferred: Mutex<Option<DriverError>>,
    next_stream_id: AtomicU64,
    /// The graph captures active on the device's streams.
    pub(crate) captures: Captures,
    /// The devices this one has enabled peer access to (`aclrtDeviceEnablePeerAccess`): their
    /// memory is valid in this device's enqueues.
    pub(crate) peers: Mutex<Vec<Weak<DeviceInner>>>,
}

impl DeviceInner {
    /// Makes this device current on the calling thread (`aclrtSetDevice`), unless soma already
    /// did so last on this thread. One thread-local load when it is already current.
    pub(crate) fn enter(&self) -> DriverResult<()> {
        if CURRENT_DEVICE.with(Cell::get) == self.key {
            return Ok(());
        }
        raw::device::set(&self.acl, self.id).map_err(map_call_err)?;
        CURRENT_DEVICE.with(|c| c.set(self.key));
        Ok(())
    }

    /// A key unique to this device state in the process (the order in which the memory locks
    /// of several devices are taken).
    pub(crate) fn key(&self) -> u64 {
        self.key
    }

    /// The devices this one has peer access to, while they exist.
    pub(crate) fn peers_with_access(&self) -> Vec<Arc<DeviceInner>> {
        let peers = lock(&self.peers);
        if peers.is_empty() {
            return Vec::new();
        }
        peers.iter().filter_map(Weak::upgrade).collect()
    }

    /// Stores an error that `Drop` could not return; the next fallible device call returns it.
    pub(crate) fn record_err(&self, e: DriverError) {
        lock(&self.deferred).get_or_insert(e);
    }

    /// Returns (and clears) an error recorded by a `Drop`.
    pub(crate) fn check_err(&self) -> DriverResult<()> {
        match lock(&self.deferred).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(crate) fn register_stream(&self, s: &Arc<StreamShared>) {
        let mut v = lock(&self.streams);
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(s));
    }

    /// The device's streams that are alive.
    pub(crate) fn live_streams(&self) -> Vec<Arc<StreamShared>> {
        lock(&self.streams).iter().filter_map(Weak::upgrade).collect()
    }

    pub(crate) fn next_stream_id(&self) -> u64 {
        self.next_stream_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Free device memory in bytes, 0 if the runtime cannot say (for OOM reports).
    pub(crate) fn free_bytes(&self) -> u64 {
        raw::device::mem_info(&self.acl, aclrtMemAttr::ACL_HBM_MEM).map_or(0, |(f, _)| f as u64)
    }

    fn require_vmm(&self) -> DriverResult<()> {
        if self.info.supports_vmm {
            Ok(())
        } else {
            Err(DriverError::Unsupported(format!(
                "device {} has no virtual memory management (aclrtReserveMemAddress / \
                 aclrtMapMem)",
                self.id
            )))
        }
    }

    fn check_granules(&self, size: u64) -> DriverResult<()> {
        if size == 0 || size % self.info.granularity != 0 {
            return Err(DriverError::InvalidValue(format!(
                "size {size} is not a non-zero multiple of the granularity {}",
                self.info.granularity
            )));
        }
        Ok(())
    }
}

pub(crate) fn bad_addr(addr: u64, len: u64, reason: &str) -> DriverError {
    DriverError::InvalidAddress { addr, len, reason: reason.to_owned() }
}

/// The properties of the physical memory soma allocates on device `id`: pinned HBM (huge pages
/// first) at the device, no export handle.
pub(crate) fn physical_prop(id: u32) -> aclrtPhysicalMemProp {
    aclrtPhysicalMemProp {
        handleType: aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE,
        allocationType: aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED,
        memAttr: aclrtMemAttr::ACL_HBM_MEM_HUGE,
        location: aclrtMemLocation {
            id,
            type_: aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE,
        },
        reserve: 0,
    }
}

/// The properties of a CANN pool of `max_size` bytes on device `id`.
pub(crate) fn pool_props(id: u32, max_size: usize) -> aclrtMemPoolProps {
    aclrtMemPoolProps {
        allocType: aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED,
        handleType: aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE,
        location: aclrtMemLocation {
            id,
            type_: aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE,
        },
        maxSize: max_size,
        reserved: [0; 32],
    }
}

/// The symbols the VMM path needs.
const VMM_SYMBOLS: [&str; 7] = [
    "aclrtReserveMemAddress",
    "aclrtReleaseMemAddress",
    "aclrtMallocPhysical",
    "aclrtFreePhysical",
    "aclrtMapMem",
    "aclrtUnmapMem",
    "aclrtMemGetAllocationGranularity",
];

/// One NPU, driven through the CANN runtime: implements [`DeviceHal`].
///
/// Cheap to clone (an `Arc`); streams, events and pools created from it keep the device state
/// alive. Every call first makes the device current on the calling thread
/// (`aclrtSetDevice`, cached per thread; see the [module docs](super)).
#[derive(Clone)]
pub struct AscendDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for AscendDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AscendDevice").field("info", &self.inner.info).finish_non_exhaustive()
    }
}

impl AscendDevice {
    /// Opens NPU `ordinal`: `aclInit` (once per process), `aclrtSetDevice`, and the probes that
    /// fill [`DeviceInfo`]: total memory (`aclrtGetMemInfo(ACL_HBM_MEM)`), granularity and VMM
    /// support (`aclrtMemGetAllocationGranularity`; unsupported or missing VMM symbols →
    /// `supports_vmm = false` and a 2 MiB granularity), native pool support (a probe
    /// `aclrtMemPoolCreate` of one granule, destroyed at once; `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`
    /// or a missing symbol → `false`). The product name is `"ascend"`: the subset has no query
    /// for the SoC name.
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for an ordinal beyond the device count; a mapped driver
    /// error for any failing call other than the "unsupported" answers of the probes.
    pub fn open(acl: Arc<Acl>, ordinal: u32) -> DriverResult<Self> {
        let count = device_count(&acl)?;
        if ordinal >= count {
            return Err(DriverError::InvalidValue(format!(
                "device ordinal {ordinal} out of range: the runtime sees {count} device(s)"
            )));
        }
        let id = i32::try_from(ordinal)
            .map_err(|_| DriverError::InvalidValue(format!("device ordinal {ordinal}")))?;
        let key = NEXT_DEVICE_KEY.fetch_add(1, Ordering::Relaxed);
        raw::device::set(&acl, id).map_err(map_call_err)?;
        CURRENT_DEVICE.with(|c| c.set(key));

        let (_, total) =
            raw::device::mem_info(&acl, aclrtMemAttr::ACL_HBM_MEM).map_err(map_call_err)?;
        let phys_prop = physical_prop(ordinal);
        let vmm_symbols = VMM_SYMBOLS.iter().all(|s| acl.has(s));
        let (granularity, supports_vmm) = if vmm_symbols {
            match raw::vmm::granularity(
                &acl,
                &phys_prop,
                aclrtMemGranularityOptions::ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
            ) {
                Ok(g) if g.is_power_of_two() => (g as u64, true),
                Ok(g) => {
                    return Err(DriverError::Native {
                        code: 0,
                        message: format!(
                            "aclrtMemGetAllocationGranularity returned {g}, not a power of two"
                        ),
                    })
                }
                Err(e) if is_unsupported(&e) => (DEFAULT_GRANULARITY, false),
                Err(e) => return Err(map_call_err(e)),
            }
        } else {
            (DEFAULT_GRANULARITY, false)
        };

        let supports_native_pool = probe_native_pool(&acl, ordinal, granularity)?;

        let info = DeviceInfo {
            ordinal,
            total_memory: total as u64,
            granularity,
            product: "ascend".to_owned(),
            supports_native_pool,
            supports_vmm,
        };
        Ok(Self {
            inner: Arc::new(DeviceInner {
                acl,
                id,
                key,
                info,
                phys_prop,
                mem: Mutex::new(MemState::default()),
                in_flight: Mutex::new((Vec::new(), 64)),
                streams: Mutex::new(Vec::new()),
                deferred: Mutex::new(None),
                next_stream_id: AtomicU64::new(1),
                captures: Captures::default(),
                peers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The library this device is driven through.
    pub fn acl(&self) -> &Arc<Acl> {
        &self.inner.acl
    }

    /// The device ordinal (`aclrtSetDevice` id).
    pub fn ordinal(&self) -> u32 {
        self.inner.info.ordinal
    }

    /// Creates a stream, typed (the [`DeviceHal`] method returns it boxed).
    ///
    /// # Errors
    /// `aclrtSetDevice` or `aclrtCreateStream` failed.
    pub fn create_ascend_stream(&self) -> DriverResult<AscendStream> {
        self.inner.check_err()?;
        self.inner.enter()?;
        AscendStream::new(&self.inner)
    }

    /// Creates an event, typed.
    ///
    /// # Errors
    /// `aclrtSetDevice` or `aclrtCreateEvent` failed.
    pub fn create_ascend_event(&self) -> DriverResult<AscendEvent> {
        self.inner.check_err()?;
        self.inner.enter()?;
        AscendEvent::new(&self.inner)
    }
}

/// `true` if a pool of one granule can be created (then destroyed), `false` if the runtime
/// answers "not supported" or lacks the pool functions.
fn probe_native_pool(acl: &Acl, ordinal: u32, granularity: u64) -> DriverResult<bool> {
    if !["aclrtMemPoolCreate", "aclrtMemPoolDestroy"].iter().all(|s| acl.has(s)) {
        return Ok(false);
    }
    let props = pool_props(ordinal, to_usize(granularity)?);
    match raw::pool::create(acl, &props) {
        Ok(pool) => {
            // SAFETY: `pool` was just created by `acl` and has no allocations.
            unsafe { raw::pool::destroy(acl, pool) }.map_err(map_call_err)?;
            Ok(true)
        }
        Err(e) if is_unsupported(&e) => Ok(false),
        Err(e) => Err(map_call_err(e)),
    }
}

impl DeviceHal for AscendDevice {
    fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        let (free, total) =
            raw::device::mem_info(&d.acl, aclrtMemAttr::ACL_HBM_MEM).map_err(map_call_err)?;
        Ok(MemInfo { free: free as u64, total: total as u64 })
    }

    fn reserve(&self, size: u64) -> DriverResult<DevicePtr> {
        let d = &self.inner;
        d.check_err()?;
        d.require_vmm()?;
        d.check_granules(size)?;
        d.enter()?;
        let va = raw::vmm::reserve(&d.acl, to_usize(size)?).map_err(map_call_err)?;
        let Some(p) = to_dev_ptr(va) else {
            return Err(DriverError::Native {
                code: 0,
                message: "aclrtReserveMemAddress returned success and a null address".into(),
            });
        };
        lock(&d.mem).reservations.insert(p.addr(), size);
        Ok(p)
    }

    fn release(&self, base: DevicePtr) -> DriverResult<()> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        let mut mem = lock(&d.mem);
        let Some(&len) = mem.reservations.get(&base.addr()) else {
            return Err(bad_addr(base.addr(), 0, "not the start of a reservation"));
        };
        if mem.overlaps_mapping(base.addr(), base.addr() + len) {
            return Err(bad_addr(base.addr(), len, "the reservation still has mappings"));
        }
        // SAFETY: `base` starts a reservation made through `acl` with nothing mapped in it
        // (checked above under the lock that every map/unmap takes).
        unsafe { raw::vmm::release(&d.acl, dev_ptr(base)) }.map_err(map_call_err)?;
        mem.reservations.remove(&base.addr());
        Ok(())
    }

    fn alloc_physical(&self, size: u64) -> DriverResult<PhysicalHandle> {
        let d = &self.inner;
        d.check_err()?;
        d.require_vmm()?;
        d.check_granules(size)?;
        d.enter()?;
        let h = raw::vmm::malloc_physical(&d.acl, to_usize(size)?, &d.phys_prop)
            .map_err(|e| map_alloc_err(e, size, || d.free_bytes()))?;
        let handle = h as usize as u64;
        lock(&d.mem).physical.insert(handle, (size, None));
        Ok(PhysicalHandle(handle))
    }

    fn free_physical(&self, handle: PhysicalHandle) -> DriverResult<()> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        let mut mem = lock(&d.mem);
        match mem.physical.get(&handle.0) {
            None => {
                return Err(DriverError::InvalidHandle(format!("physical handle {:#x}", handle.0)))
            }
            Some((_, Some(at))) => {
                return Err(DriverError::InvalidValue(format!(
                    "physical handle {:#x} is still mapped at {at:#x}",
                    handle.0
                )))
            }
            Some((_, None)) => {}
        }
        // SAFETY: a live, unmapped physical allocation of `acl` (checked above, under the lock).
        unsafe { raw::vmm::free_physical(&d.acl, handle.0 as usize as *mut c_void) }
            .map_err(map_call_err)?;
        mem.physical.remove(&handle.0);
        Ok(())
    }

    fn map(&self, va: DevicePtr, handle: PhysicalHandle) -> DriverResult<()> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        let mut mem = lock(&d.mem);
        let size = match mem.physical.get(&handle.0) {
            None => {
                return Err(DriverError::InvalidHandle(format!("physical handle {:#x}", handle.0)))
            }
            Some((_, Some(at))) => {
                return Err(DriverError::InvalidValue(format!(
                    "physical handle {:#x} is already mapped at {at:#x}",
                    handle.0
                )))
            }
            Some((size, None)) => *size,
        };
        let a = va.addr();
        if a % d.info.granularity != 0 {
            return Err(bad_addr(a, size, "not aligned to the granularity"));
        }
        let end = a.checked_add(size).ok_or_else(|| bad_addr(a, size, "range overflows"))?;
        match mem.reservations.range(..=a).next_back() {
            Some((&s, &l)) if end <= s + l => {}
            _ => return Err(bad_addr(a, size, "not inside a reservation")),
        }
        if mem.overlaps_mapping(a, end) {
            return Err(bad_addr(a, size, "overlaps an existing mapping"));
        }
        // SAFETY: the range lies in a reservation of `acl` and is unmapped; the handle is a live,
        // unmapped physical allocation of exactly `size` bytes (all checked under the lock).
        unsafe {
            raw::vmm::map(&d.acl, dev_ptr(va), to_usize(size)?, handle.0 as usize as *mut c_void)
        }
        .map_err(map_call_err)?;
        mem.mappings.insert(a, (size, handle.0));
        if let Some(p) = mem.physical.get_mut(&handle.0) {
            p.1 = Some(a);
        }
        Ok(())
    }

    fn unmap(&self, va: DevicePtr) -> DriverResult<PhysicalHandle> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        let mut mem = lock(&d.mem);
        let a = va.addr();
        let Some(&(size, h)) = mem.mappings.get(&a) else {
            return Err(bad_addr(a, 0, "not the start of a mapping"));
        };
        d.check_idle(a, a + size)?;
        // SAFETY: `va` starts a mapping made through `acl` that no task in flight uses.
        unsafe { raw::vmm::unmap(&d.acl, dev_ptr(va)) }.map_err(map_call_err)?;
        mem.mappings.remove(&a);
        if let Some(p) = mem.physical.get_mut(&h) {
            p.1 = None;
        }
        Ok(PhysicalHandle(h))
    }

    fn malloc(&self, size: u64) -> DriverResult<DevicePtr> {
        let d = &self.inner;
        d.check_err()?;
        if size == 0 {
            return Err(DriverError::InvalidValue("malloc of 0 bytes".into()));
        }
        d.enter()?;
        let p = raw::mem::malloc(
            &d.acl,
            to_usize(size)?,
            aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST,
        )
        .map_err(|e| map_alloc_err(e, size, || d.free_bytes()))?;
        let Some(ptr) = to_dev_ptr(p) else {
            return Err(DriverError::Native {
                code: 0,
                message: "aclrtMalloc returned success and a null pointer".into(),
            });
        };
        lock(&d.mem).mallocs.insert(ptr.addr(), size);
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr) -> DriverResult<()> {
        let d = &self.inner;
        d.check_err()?;
        d.enter()?;
        let mut mem = lock(&d.mem);
        let Some(&len) = mem.mallocs.get(&ptr.addr()) else {
            return Err(bad_addr(
                ptr.addr(),
                0,
                "not a pointer returned by malloc (or already freed)",
            ));
        };
        d.check_idle(ptr.addr(), ptr.addr() + len)?;
        // SAFETY: `ptr` came from `aclrtMalloc` of `acl`, is not freed and no task uses it.
        unsafe { raw::mem::free(&d.acl, dev_ptr(ptr)) }.map_err(map_call_err)?;
        mem.mallocs.remove(&ptr.addr());
        Ok(())
    }

    fn malloc_host(&self, size: u64) -> DriverResult<NonNull<u8>> {
        let d = &self.inner;
        d.check_err()?;
        if size == 0 {
            return Err(DriverError::InvalidValue("malloc_host of 0 bytes".into()));
        }
        d.enter()?;
        let p = raw::mem::malloc_host(&d.acl, to_usize(size)?)
            .map_err(|e| map_alloc_err(e, size, || 0))?;
        let Some(ptr) = NonNull::new(p.cast::<u8>()) else {
            return Err(DriverError::Native {
                code: 0,
                message: "aclrtMallocHost returned success and a null pointer".into(),
            });
        };
        lock(&d.mem).host_allocs.insert(p as u64, size);
        Ok(ptr)
    }

    unsafe fn free_host(&self, ptr: NonNull<u8>) -> DriverResult<()> {
        let d = &self.inner;
        d.enter()?;
        let mut mem = lock(&d.mem);
        let addr = ptr.as_ptr() as u64;
        if !mem.host_allocs.contains_key(&addr) {
            return Err(DriverError::InvalidValue(format!(
                "{addr:#x} is not page-locked memory of this device (or was freed already)"
            )));
        }
        // SAFETY: from `aclrtMallocHost` of `acl` (in the table), not freed yet; the caller
        // guarantees nothing uses it.
        unsafe { raw::mem::free_host(&d.acl, ptr.as_ptr().cast()) }.map_err(map_call_err)?;
        mem.host_allocs.remove(&addr);
        Ok(())
    }

    fn create_stream(&self) -> DriverResult<Box<dyn StreamHal>> {
        Ok(Box::new(self.create_ascend_stream()?))
    }

    fn create_event(&self) -> DriverResult<Box<dyn EventHal>> {
        Ok(Box::new(self.create_ascend_event()?))
    }

    fn synchronize(&self) -> DriverResult<()> {
        let d = &self.inner;
        d.enter()?;
        let streams: Vec<(Arc<StreamShared>, u64)> = {
            let mut v = lock(&d.streams);
            v.retain(|w| w.strong_count() > 0);
            v.iter()
                .filter_map(Weak::upgrade)
                .map(|s| {
                    let n = s.enqueued();
                    (s, n)
                })
                .collect()
        };
        super::capture::drain_outside_captures(d, streams.iter().map(|(s, _)| s));
        raw::device::synchronize(&d.acl).map_err(map_call_err)?;
        // A deferred error is reported only after the drain, which callers count on even
        // when the call fails (the HAL's contract).
        let mut first = d.check_err().err();
        for (s, n) in streams {
            s.mark_completed(n);
            if let Err(e) = s.sticky() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    unsafe fn copy_sync(&self, dst: MemRef, src: MemRef, len: u64) -> DriverResult<()> {
        let d = &self.inner;
        d.check_err()?;
        if len == 0 {
            d.check_ref(dst, len)?;
            return d.check_ref(src, len);
        }
        d.enter()?;
        let (dp, sp, kind) = copy_args(dst, src);
        // The memory lock is held for the whole copy: a free or unmap of either range on
        // another thread waits for it instead of pulling the memory from under it.
        d.with_valid(&[(dst, len), (src, len)], |_| {
            // SAFETY: device ends were validated against soma's bookkeeping, and stay mapped
            // (the lock `with_valid` holds); host ends are valid for `len` bytes for the
            // duration of the call (our caller's contract).
            unsafe { raw::mem::memcpy(&d.acl, dp, sp, to_usize(len)?, kind) }.map_err(map_call_err)
        })
    }

    fn memset_sync(&self, dst: DevicePtr, value: u8, len: u64) -> DriverResult<()> {
        let d = &self.inner;
        d.check_err()?;
        if len == 0 {
            return d.check_range(dst, len);
        }
        d.enter()?;
        // As in `copy_sync`: the memory lock is held for the whole memset.
        d.with_valid(&[(MemRef::Device(dst), len)], |_| {
            // SAFETY: the range is device memory soma mapped or allocated (checked under the
            // lock `with_valid` holds, which keeps it so).
            unsafe { raw::mem::memset(&d.acl, dev_ptr(dst), i32::from(value), to_usize(len)?) }
                .map_err(map_call_err)
        })
    }

    fn export_physical(
        &self,
        handle: PhysicalHandle,
        check_pids: bool,
    ) -> DriverResult<ShareableHandle> {
        self.ipc_export(handle, check_pids)
    }

    fn allow_shareable_pids(&self, shareable: ShareableHandle, pids: &[i32]) -> DriverResult<()> {
        self.ipc_allow(shareable, pids)
    }

    fn import_physical(
        &self,
        shareable: ShareableHandle,
        size: u64,
    ) -> DriverResult<PhysicalHandle> {
        self.ipc_import(shareable, size)
    }

    fn process_id(&self) -> DriverResult<i32> {
        self.ipc_process_id()
    }

    fn can_access_peer(&self, peer: &dyn DeviceHal) -> DriverResult<bool> {
        self.peer_can_access(peer)
    }

    fn enable_peer_access(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        self.peer_enable(peer)
    }

    fn disable_peer_access(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        self.peer_disable(peer)
    }

    fn peer_access_enabled(&self, peer: &dyn DeviceHal) -> bool {
        self.peer_enabled(peer)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode> {
        super::capture::exchange_mode(&self.inner, mode)
    }

    fn create_native_pool(
        &self,
        max_size: u64,
    ) -> DriverResult<Box<dyn soma_core::hal::NativePoolHal>> {
        Ok(Box::new(super::native_pool::NativePool::create(self, max_size)?))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `(dst, src, kind)` of a copy between two [`MemRef`]s.
pub(crate) fn copy_args(dst: MemRef, src: MemRef) -> (*mut c_void, *const c_void, aclrtMemcpyKind) {
    let (dp, d_dev) = match dst {
        MemRef::Device(p) => (dev_ptr(p), true),
        MemRef::Host(h) => (h.cast::<c_void>(), false),
    };
    let (sp, s_dev) = match src {
        MemRef::Device(p) => (dev_ptr(p).cast_const(), true),
        MemRef::Host(h) => (h.cast_const().cast::<c_void>(), false),
    };
    let kind = match (s_dev, d_dev) {
        (false, false) => aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_HOST,
        (false, true) => aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
        (true, false) => aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
        (true, true) => aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE,
    };
    (dp, sp, kind)
}
