//! [`SimDevice`]: device memory bookkeeping (address space, physical allocations, mappings,
//! `malloc`) over the raw memory of [`crate::memory`].

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use soma_core::hal::{
    AccessMode, CaptureMode, DeviceHal, DeviceInfo, DevicePtr, DriverError, DriverResult, EventHal,
    MemInfo, MemRef, PhysicalHandle, PoolAnnotation, ShareableHandle, StreamHal,
};

use crate::capture::Captures;
use crate::event::SimEvent;
use crate::faults::{FaultKind, Faults};
use crate::memory::{AcquireError, DeviceMemory, End, HostSpan, Owner, Range};
use crate::model_delay;
use crate::peer::{Check, Peers};
use crate::sanitizer::{Sanitizer, SanitizerMode, SanitizerReport};
use crate::stream::{SimStream, StreamShared};
use crate::LatencyModel;
use physical::Phys;

mod physical;

/// Driver calls counted by [`SimStats::calls`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallCounts {
    /// [`DeviceHal::reserve`] calls.
    pub reserve: u64,
    /// [`DeviceHal::release`] calls.
    pub release: u64,
    /// [`DeviceHal::alloc_physical`] calls.
    pub alloc_physical: u64,
    /// [`DeviceHal::free_physical`] calls.
    pub free_physical: u64,
    /// [`DeviceHal::map`] calls.
    pub map: u64,
    /// [`DeviceHal::unmap`] calls.
    pub unmap: u64,
    /// [`DeviceHal::malloc`] calls.
    pub malloc: u64,
    /// [`DeviceHal::free`] calls.
    pub free: u64,
    /// [`DeviceHal::copy_sync`] and [`DeviceHal::memset_sync`] calls.
    pub sync_copy: u64,
    /// [`DeviceHal::synchronize`] calls.
    pub synchronize: u64,
    /// [`DeviceHal::malloc_host`] calls.
    pub malloc_host: u64,
    /// [`DeviceHal::free_host`] calls.
    pub free_host: u64,
}

/// A snapshot of a device's counters ([`SimDevice::stats`]).
///
/// Call counts include calls that failed (by injection or bad arguments).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimStats {
    /// Bytes held by physical allocations ([`DeviceHal::alloc_physical`]).
    pub physical_bytes: u64,
    /// Bytes of physical allocations currently mapped (imported ones included).
    pub mapped_bytes: u64,
    /// Bytes of physical memory imported from other processes
    /// ([`DeviceHal::import_physical`]) and not freed yet: another process's memory, not
    /// counted against this device's capacity.
    pub imported_bytes: u64,
    /// Bytes held by [`DeviceHal::malloc`] (granule-rounded).
    pub malloc_bytes: u64,
    /// Bytes of page-locked host memory held by [`DeviceHal::malloc_host`] (page-rounded).
    pub host_bytes: u64,
    /// Streams of the device not yet dropped.
    pub live_streams: usize,
    /// Driver calls by kind.
    pub calls: CallCounts,
}

#[derive(Default)]
struct Calls {
    reserve: AtomicU64,
    release: AtomicU64,
    alloc_physical: AtomicU64,
    free_physical: AtomicU64,
    map: AtomicU64,
    unmap: AtomicU64,
    malloc: AtomicU64,
    free: AtomicU64,
    sync_copy: AtomicU64,
    synchronize: AtomicU64,
    malloc_host: AtomicU64,
    free_host: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ResKind {
    /// Made by `reserve`.
    User,
    /// Backing a `malloc`.
    Malloc,
}

#[derive(Default)]
struct State {
    /// Free address space: start → length, address ordered, coalesced.
    holes: BTreeMap<u64, u64>,
    /// Reservations: start → (length, kind).
    reservations: BTreeMap<u64, (u64, ResKind)>,
    /// User mappings: start → (length, handle).
    mappings: BTreeMap<u64, (u64, u64)>,
    physical: HashMap<u64, Phys>,
    next_handle: u64,
    /// Bytes of physical memory imported from other processes (not this device's).
    imported_bytes: u64,
    /// `malloc` allocations: start → length.
    mallocs: HashMap<u64, u64>,
    physical_bytes: u64,
    mapped_bytes: u64,
    malloc_bytes: u64,
    /// `malloc_host` allocations: address → page-rounded length.
    host_allocs: HashMap<u64, u64>,
    host_bytes: u64,
}

impl State {
    /// Address-ordered first fit.
    fn take_va(&mut self, size: u64) -> Option<u64> {
        let (&start, &len) = self.holes.iter().find(|(_, &len)| len >= size)?;
        self.holes.remove(&start);
        if len > size {
            self.holes.insert(start + size, len - size);
        }
        Some(start)
    }

    fn give_va(&mut self, mut start: u64, mut len: u64) {
        if let Some((&ps, &pl)) = self.holes.range(..start).next_back() {
            if ps + pl == start {
                self.holes.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.holes.get(&(start + len)) {
            self.holes.remove(&(start + len));
            len += nl;
        }
        self.holes.insert(start, len);
    }

    fn used(&self) -> u64 {
        self.physical_bytes + self.malloc_bytes
    }
}

/// The shared core of a device: what streams keep alive.
pub(crate) struct DeviceCore {
    pub(crate) info: DeviceInfo,
    pub(crate) memory: DeviceMemory,
    state: Mutex<State>,
    pub(crate) faults: Faults,
    latency: Mutex<LatencyModel>,
    calls: Calls,
    streams: Mutex<Vec<Weak<StreamShared>>>,
    pub(crate) live_streams: AtomicUsize,
    /// The stream-order sanitizer, when on: the NPU's, shared by all its devices.
    pub(crate) sanitizer: Option<Arc<Sanitizer>>,
    sanitizer_mode: SanitizerMode,
    /// The graph captures begun on the device's streams and not ended.
    pub(crate) captures: Captures,
    /// The NPU's devices and who may access whose memory.
    pub(crate) peers: Arc<Peers>,
}

/// What the devices of one NPU share.
pub(crate) struct Shared {
    /// The stream-order sanitizer, when on.
    pub(crate) sanitizer: Option<Arc<Sanitizer>>,
    pub(crate) sanitizer_mode: SanitizerMode,
    /// The device table and the peer access matrix.
    pub(crate) peers: Arc<Peers>,
}

impl DeviceCore {
    pub(crate) fn latency(&self) -> LatencyModel {
        *self.latency.lock()
    }
}

/// One software NPU device. Implements [`DeviceHal`].
///
/// Get one from [`Npu::device`](crate::Npu::device). Device addresses are real host
/// addresses inside one `mmap`ed region per device; mapped memory is real memory (resident
/// once touched). Each physical allocation is a memory file of its own (`memfd`), mapped with
/// `MAP_SHARED` where it is mapped: `unmap` keeps its bytes in the file and the next `map`
/// shows them again, at any address; `free_physical` closes it, and `free` gives `malloc`'s
/// memory back to the OS.
///
/// Physical memory can be shared with another process ([`DeviceHal::export_physical`],
/// [`DeviceHal::import_physical`]): the importer maps the same file, so both processes see
/// the same bytes. Streams, events, the in-flight table and the sanitizer stay per process.
/// Shared memory (from its export or import on) is never under a Rust reference: kernels get
/// private copies of their buffers there, written back when they end, and copies and memsets
/// use atomic loads and stores, so a race with another process gives torn bytes, not
/// undefined behaviour. Exporting waits for the accesses in flight to the allocation to end.
///
/// # Semantics worth knowing
///
/// * A physical allocation keeps its contents across [`unmap`](DeviceHal::unmap) until
///   [`free_physical`](DeviceHal::free_physical), as on a device (CANN and CUDA alike); memory
///   never mapped reads as zero. Each holds one file descriptor until it is freed (the soft
///   limit on open files is raised to the hard one when it runs out).
/// * A handle can be mapped at one place at a time; a mapping covers the whole handle.
/// * Device ranges touched by tasks and synchronous copies must lie inside mapped memory (they
///   may span adjacent mappings); otherwise [`DriverError::InvalidAddress`].
/// * [`unmap`](DeviceHal::unmap) and [`free`](DeviceHal::free) of a range that a task in
///   flight (executing right now) accesses fail with [`DriverError::InvalidValue`] and change
///   nothing. They do not synchronize: a task still *queued* on a stream that touches memory
///   unmapped meanwhile fails when it runs ([`DriverError::TaskFailed`] with an
///   invalid-address message) — ordering frees after last use is the caller's job.
/// * `malloc` has its own fault rule ([`FaultKind::Malloc`]); its internal reservation,
///   allocation and mapping neither consult nor count as `alloc_physical` / `map` calls.
/// * A synchronous copy that conflicts with a task in flight (one of them writes overlapping
///   bytes) fails with [`DriverError::InvalidValue`] naming the data race.
pub struct SimDevice {
    pub(crate) core: Arc<DeviceCore>,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevice").field("info", &self.core.info).finish_non_exhaustive()
    }
}

impl SimDevice {
    pub(crate) fn new(
        info: DeviceInfo,
        address_space: u64,
        latency: LatencyModel,
        shared: Shared,
    ) -> DriverResult<Self> {
        let memory = DeviceMemory::new(address_space, info.granularity)?;
        let mut state = State { next_handle: 1, ..State::default() };
        state.holes.insert(memory.start(), memory.len());
        Ok(Self {
            core: Arc::new(DeviceCore {
                info,
                memory,
                state: Mutex::new(state),
                faults: Faults::default(),
                latency: Mutex::new(latency),
                calls: Calls::default(),
                streams: Mutex::new(Vec::new()),
                live_streams: AtomicUsize::new(0),
                sanitizer: shared.sanitizer,
                sanitizer_mode: shared.sanitizer_mode,
                captures: Captures::default(),
                peers: shared.peers,
            }),
        })
    }

    /// The stream-order sanitizer's mode on this device.
    pub fn sanitizer_mode(&self) -> SanitizerMode {
        self.core.sanitizer_mode
    }

    /// Every report of the stream-order sanitizer so far (empty when it is off). The
    /// sanitizer is the NPU's, shared by its devices (a task of one device may use a peer's
    /// memory): every device answers with the reports of all of them.
    pub fn sanitizer_reports(&self) -> Vec<SanitizerReport> {
        self.core.sanitizer.as_ref().map_or_else(Vec::new, |s| s.reports())
    }

    /// How many allocation generations the sanitizer tracks: `(live, freed)` (diagnostics;
    /// freed generations are pruned once no task can be attributed to them any more).
    pub fn sanitizer_generations(&self) -> (usize, usize) {
        self.core.sanitizer.as_ref().map_or((0, 0), |s| s.generations())
    }

    /// How many streams the sanitizer keeps state for (diagnostics): the device's streams,
    /// dropped streams it has not forgotten yet, and the streams its vector clocks and
    /// recorded uses name. A dropped stream is forgotten once its last task has run, in
    /// batches, so the count stays bounded however many streams are created and dropped.
    pub fn sanitizer_tracked_streams(&self) -> usize {
        self.core.sanitizer.as_ref().map_or(0, |s| s.tracked_streams())
    }

    /// Returns the sanitizer's reports so far and forgets them.
    pub fn take_sanitizer_reports(&self) -> Vec<SanitizerReport> {
        self.core.sanitizer.as_ref().map_or_else(Vec::new, |s| s.take_reports())
    }

    /// How many graph captures begun on the device's streams have not ended.
    pub fn active_captures(&self) -> usize {
        self.core.captures.count()
    }

    /// Checks an unsafe call — what `what` names: a synchronous copy or memset, or an
    /// asynchronous copy of pageable host memory — against the capture modes of the calling
    /// thread and of the device's active captures (see
    /// [`CaptureMode`](soma_core::hal::CaptureMode)). The device's own synchronous copies and
    /// memsets check themselves; the C API checks its pageable copies with this.
    ///
    /// # Errors
    /// [`DriverError::Capture`] when the call is forbidden; the captures that forbid it are
    /// invalidated.
    pub fn check_unsafe_call(&self, what: &str) -> DriverResult<()> {
        self.core.captures.check_unsafe_call(what)
    }

    /// The fault injection controls of this device.
    pub fn faults(&self) -> &Faults {
        &self.core.faults
    }

    /// The latency model in effect.
    pub fn latency(&self) -> LatencyModel {
        self.core.latency()
    }

    /// Replaces the latency model (takes effect for calls and tasks that start afterwards).
    pub fn set_latency(&self, model: LatencyModel) {
        *self.core.latency.lock() = model;
    }

    /// A snapshot of the device's counters.
    pub fn stats(&self) -> SimStats {
        let st = self.core.state.lock();
        let c = &self.core.calls;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SimStats {
            physical_bytes: st.physical_bytes,
            mapped_bytes: st.mapped_bytes,
            imported_bytes: st.imported_bytes,
            malloc_bytes: st.malloc_bytes,
            host_bytes: st.host_bytes,
            live_streams: self.core.live_streams.load(Ordering::Relaxed),
            calls: CallCounts {
                reserve: l(&c.reserve),
                release: l(&c.release),
                alloc_physical: l(&c.alloc_physical),
                free_physical: l(&c.free_physical),
                map: l(&c.map),
                unmap: l(&c.unmap),
                malloc: l(&c.malloc),
                free: l(&c.free),
                sync_copy: l(&c.sync_copy),
                synchronize: l(&c.synchronize),
                malloc_host: l(&c.malloc_host),
                free_host: l(&c.free_host),
            },
        }
    }

    /// Creates a stream with its concrete type (what [`DeviceHal::create_stream`] boxes).
    ///
    /// # Errors
    /// The OS refused to start the worker thread.
    pub fn create_sim_stream(&self) -> DriverResult<SimStream> {
        let s = SimStream::new(Arc::clone(&self.core))?;
        let mut streams = self.core.streams.lock();
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(s.shared()));
        Ok(s)
    }

    fn granule_round(&self, size: u64) -> DriverResult<u64> {
        let g = self.core.info.granularity;
        if size == 0 {
            return Err(DriverError::InvalidValue("size 0".into()));
        }
        size.checked_next_multiple_of(g)
            .ok_or_else(|| DriverError::InvalidValue(format!("size {size} overflows")))
    }

    /// Virtual memory management calls on a device model without it.
    fn check_vmm(&self) -> DriverResult<()> {
        if self.core.info.supports_vmm {
            Ok(())
        } else {
            Err(DriverError::Unsupported(
                "this device has no virtual memory management (reserve / physical allocation / map)"
                    .into(),
            ))
        }
    }

    fn check_granular(&self, size: u64) -> DriverResult<()> {
        let g = self.core.info.granularity;
        if size == 0 || size % g != 0 {
            return Err(DriverError::InvalidValue(format!(
                "size {size} is not a non-zero multiple of the granularity {g}"
            )));
        }
        Ok(())
    }

    fn oom(&self, st: &State, requested: u64) -> DriverError {
        DriverError::OutOfMemory {
            requested,
            free: self.core.info.total_memory.saturating_sub(st.used()),
        }
    }
}

fn bad_addr(addr: u64, len: u64, reason: &str) -> DriverError {
    DriverError::InvalidAddress { addr, len, reason: reason.into() }
}

impl DeviceHal for SimDevice {
    fn info(&self) -> &DeviceInfo {
        &self.core.info
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        let st = self.core.state.lock();
        let total = self.core.info.total_memory;
        Ok(MemInfo { free: total.saturating_sub(st.used()), total })
    }

    fn reserve(&self, size: u64) -> DriverResult<DevicePtr> {
        self.check_vmm()?;
        bump(&self.core.calls.reserve);
        self.check_granular(size)?;
        let mut st = self.core.state.lock();
        let start = st.take_va(size).ok_or_else(|| {
            DriverError::InvalidValue(format!("no {size} bytes of device address space left"))
        })?;
        st.reservations.insert(start, (size, ResKind::User));
        drop(st);
        if let Some(san) = &self.core.sanitizer {
            // Address space reused: what the sanitizer knew about it is stale.
            san.on_release(start, start + size);
        }
        DevicePtr::new(start).ok_or_else(|| DriverError::InvalidValue("null address".into()))
    }

    fn release(&self, base: DevicePtr) -> DriverResult<()> {
        self.check_vmm()?;
        bump(&self.core.calls.release);
        let a = base.addr();
        let mut st = self.core.state.lock();
        let Some(&(len, kind)) = st.reservations.get(&a) else {
            return Err(bad_addr(a, 0, "not the base of a reservation"));
        };
        if kind != ResKind::User {
            return Err(bad_addr(a, len, "memory from malloc; use free"));
        }
        if st.mappings.range(a..a + len).next().is_some() {
            return Err(DriverError::InvalidValue(format!(
                "reservation {base} still has mappings; unmap them first"
            )));
        }
        st.reservations.remove(&a);
        st.give_va(a, len);
        drop(st);
        if let Some(san) = &self.core.sanitizer {
            san.on_release(a, a + len);
        }
        Ok(())
    }

    fn alloc_physical(&self, size: u64) -> DriverResult<PhysicalHandle> {
        self.physical_alloc(size)
    }

    fn free_physical(&self, handle: PhysicalHandle) -> DriverResult<()> {
        self.physical_free(handle)
    }

    fn map(&self, va: DevicePtr, handle: PhysicalHandle) -> DriverResult<()> {
        self.physical_map(va, handle)
    }

    fn unmap(&self, va: DevicePtr) -> DriverResult<PhysicalHandle> {
        self.physical_unmap(va)
    }

    fn export_physical(
        &self,
        handle: PhysicalHandle,
        check_pids: bool,
    ) -> DriverResult<ShareableHandle> {
        self.physical_export(handle, check_pids)
    }

    fn allow_shareable_pids(&self, shareable: ShareableHandle, pids: &[i32]) -> DriverResult<()> {
        crate::ipc::allow(shareable, pids)
    }

    fn import_physical(
        &self,
        shareable: ShareableHandle,
        size: u64,
    ) -> DriverResult<PhysicalHandle> {
        self.physical_import(shareable, size)
    }

    fn malloc(&self, size: u64) -> DriverResult<DevicePtr> {
        bump(&self.core.calls.malloc);
        model_delay(self.core.latency().driver_alloc);
        if self.core.faults.hit(FaultKind::Malloc) {
            return Err(DriverError::Injected(format!("malloc({size})")));
        }
        let len = self.granule_round(size)?;
        let mut st = self.core.state.lock();
        if st.used().checked_add(len).is_none_or(|u| u > self.core.info.total_memory) {
            return Err(self.oom(&st, len));
        }
        let start = st.take_va(len).ok_or_else(|| {
            DriverError::InvalidValue(format!("no {len} bytes of device address space left"))
        })?;
        let mapped = DevicePtr::new(start)
            .ok_or_else(|| DriverError::InvalidValue("null address".into()))
            .and_then(|p| self.core.memory.map(start, len).map(|()| p));
        match mapped {
            Ok(p) => {
                st.reservations.insert(start, (len, ResKind::Malloc));
                st.mallocs.insert(start, len);
                st.malloc_bytes += len;
                drop(st);
                if let Some(san) = &self.core.sanitizer {
                    san.on_malloc(start, size, len);
                }
                Ok(p)
            }
            Err(e) => {
                st.give_va(start, len);
                Err(e)
            }
        }
    }

    fn free(&self, ptr: DevicePtr) -> DriverResult<()> {
        bump(&self.core.calls.free);
        let a = ptr.addr();
        let mut st = self.core.state.lock();
        let Some(&len) = st.mallocs.get(&a) else {
            return Err(bad_addr(a, 0, "not a pointer returned by malloc (or already freed)"));
        };
        self.core.memory.unmap(a, len)?;
        st.mallocs.remove(&a);
        st.reservations.remove(&a);
        st.give_va(a, len);
        st.malloc_bytes -= len;
        drop(st);
        if let Some(san) = &self.core.sanitizer {
            san.on_driver_free(a);
        }
        Ok(())
    }

    fn malloc_host(&self, size: u64) -> DriverResult<NonNull<u8>> {
        bump(&self.core.calls.malloc_host);
        if size == 0 {
            return Err(DriverError::InvalidValue("malloc_host of 0 bytes".into()));
        }
        let page = crate::memory::page_size();
        let len = size
            .checked_next_multiple_of(page)
            .ok_or_else(|| DriverError::InvalidValue(format!("malloc_host of {size} bytes")))?;
        let ptr = crate::memory::alloc_host(len)?;
        let mut st = self.core.state.lock();
        st.host_allocs.insert(ptr.as_ptr() as u64, len);
        st.host_bytes += len;
        Ok(ptr)
    }

    unsafe fn free_host(&self, ptr: NonNull<u8>) -> DriverResult<()> {
        bump(&self.core.calls.free_host);
        let mut st = self.core.state.lock();
        let addr = ptr.as_ptr() as u64;
        let Some(len) = st.host_allocs.remove(&addr) else {
            return Err(DriverError::InvalidValue(format!(
                "{addr:#x} is not page-locked memory of this device (or was freed already)"
            )));
        };
        st.host_bytes -= len;
        drop(st);
        // SAFETY: the table held exactly this allocation (now removed, so it is freed once);
        // the caller guarantees nothing refers to it any more.
        unsafe { crate::memory::free_host(ptr, len) };
        Ok(())
    }

    fn create_stream(&self) -> DriverResult<Box<dyn StreamHal>> {
        Ok(Box::new(self.create_sim_stream()?))
    }

    fn create_event(&self) -> DriverResult<Box<dyn EventHal>> {
        Ok(Box::new(SimEvent::new()))
    }

    fn synchronize(&self) -> DriverResult<()> {
        bump(&self.core.calls.synchronize);
        let streams: Vec<Arc<StreamShared>> = {
            let mut v = self.core.streams.lock();
            // A dropped stream drained when it was dropped and is no longer the device's,
            // even while an event recorded on it keeps its state (and its error) alive.
            v.retain(|w| w.upgrade().is_some_and(|s| !s.dropped.load(Ordering::Acquire)));
            v.iter().filter_map(Weak::upgrade).collect()
        };
        let mut first = None;
        for s in streams {
            if let Err(e) = s.synchronize() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    unsafe fn copy_sync(&self, dst: MemRef, src: MemRef, len: u64) -> DriverResult<()> {
        bump(&self.core.calls.sync_copy);
        self.core.captures.check_unsafe_call("a synchronous copy")?;
        let n = usize::try_from(len).map_err(|_| DriverError::InvalidValue("length".into()))?;
        let end = |m: MemRef, mode| match m {
            MemRef::Device(p) => (End::Device(p.addr()), Some(Range { addr: p.addr(), len, mode })),
            // SAFETY: the caller of `copy_sync` guarantees host ends are valid for `len`
            // bytes for the duration of the call, which outlives the span.
            MemRef::Host(h) => (End::Host(unsafe { HostSpan::new(h, n) }), None),
        };
        let (d, dr) = end(dst, AccessMode::Write);
        let (s, sr) = end(src, AccessMode::Read);
        let ranges: Vec<Range> = dr.into_iter().chain(sr).collect();
        if let Some(san) = &self.core.sanitizer {
            san.check_host("copy_sync", &ranges).map_err(DriverError::InvalidValue)?;
        }
        self.core.check_mapped_anywhere(&ranges)?;
        let placement = self.core.place(&ranges, Check::Access)?;
        let lat = self.core.latency();
        let across = ranges.len() == 2 && placement.as_ref().is_some_and(|p| p.across(0, 1));
        model_delay(if across { lat.peer_copy_time(len) } else { lat.copy_time(len) });
        let owner = Owner::Host("copy_sync");
        let mut acc = self
            .core
            .acquire_placed(placement.as_ref(), owner, &ranges, false)
            .map_err(host_err)?;
        acc.copy(&d, &s, len)
    }

    fn memset_sync(&self, dst: DevicePtr, value: u8, len: u64) -> DriverResult<()> {
        bump(&self.core.calls.sync_copy);
        self.core.captures.check_unsafe_call("a synchronous memset")?;
        let r = Range { addr: dst.addr(), len, mode: AccessMode::Write };
        if let Some(san) = &self.core.sanitizer {
            san.check_host("memset_sync", &[r]).map_err(DriverError::InvalidValue)?;
        }
        let placement = self.core.place(&[r], Check::Access)?;
        let owner = Owner::Host("memset_sync");
        let mut acc =
            self.core.acquire_placed(placement.as_ref(), owner, &[r], false).map_err(host_err)?;
        acc.fill(dst.addr(), value, len)
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

    fn wants_annotations(&self) -> bool {
        self.core.sanitizer.is_some()
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode> {
        Ok(crate::capture::exchange_thread_mode(mode))
    }

    fn annotate(&self, annotation: PoolAnnotation) {
        let Some(san) = &self.core.sanitizer else { return };
        let ptr = match annotation {
            PoolAnnotation::Alloc { ptr, .. }
            | PoolAnnotation::Free { ptr, .. }
            | PoolAnnotation::GraphAlloc { ptr, .. }
            | PoolAnnotation::GraphFree { ptr, .. } => ptr.addr(),
            PoolAnnotation::GraphRelease { .. } => 0,
        };
        let range = {
            let st = self.core.state.lock();
            st.reservations
                .range(..=ptr)
                .next_back()
                .filter(|(&start, &(len, kind))| kind == ResKind::User && ptr - start < len)
                .map(|(&start, &(len, _))| (start, start + len))
        };
        if let Some(action) = san.on_annotation(annotation, range, &self.core.memory) {
            action.apply();
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn host_err(e: AcquireError) -> DriverError {
    match e {
        AcquireError::Invalid(e) => e,
        AcquireError::Conflict(m) => DriverError::InvalidValue(m),
    }
}

impl DeviceCore {
    pub(crate) fn stream_dropped(&self) {
        self.live_streams.fetch_sub(1, Ordering::Relaxed);
    }
}
