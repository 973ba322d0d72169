//! The driver HAL: what a stream-ordered pool needs from a device.
//!
//! Backends (`soma-sim`, the `ascend` backend of `soma`) implement these object-safe traits
//! ([`DeviceHal`], [`StreamHal`], [`EventHal`], and [`GraphHal`] for graph capture); the pool
//! engine and the typed handles of this crate are written against them and never name a
//! backend.
//!
//! # Who validates what
//!
//! * The **backend** validates every device address it is given: a range that is not inside
//!   memory it currently has mapped (or allocated with [`DeviceHal::malloc`]) is an
//!   [`DriverError::InvalidAddress`], never a crash. That is what makes the device-only
//!   operations safe functions.
//! * The **caller** (the typed layer) guarantees what the backend cannot check: that host
//!   pointers given to the `unsafe` copy functions stay valid until the task completes.
//!
//! # Stream positions
//!
//! Every stream numbers the tasks enqueued on it `1, 2, 3, …` in enqueue order.
//! [`StreamHal::enqueued`] is the number of tasks enqueued so far and
//! [`StreamHal::completed`] the number that have finished (executed, or skipped after an
//! error). Both are monotonic, and `completed() <= enqueued()`. "Has the stream executed
//! everything enqueued before position `p`" is `completed() >= p`: one atomic load.
//!
//! # Failed calls
//!
//! A call that returns an error has changed nothing: no task was enqueued, no memory was
//! allocated, mapped or accounted. (One exception, graph capture's forbidden calls, which
//! invalidate the capture: see [`capture`].)
//!
//! # Several devices
//!
//! A device's streams use its own memory. Once peer access is enabled from device B to
//! device A ([`DeviceHal::enable_peer_access`], per ordered pair), kernels, copies and
//! memsets on B's streams may also name A's memory: the backend validates each range against
//! the device that owns it, and a range of a device without access is an
//! [`DriverError::InvalidAddress`] naming it. A stream may wait on an event recorded on
//! another device's stream of the same backend (the order holds across devices).
//!
//! # Graph capture
//!
//! A stream can record its tasks into a graph instead of running them
//! ([`StreamHal::begin_capture`] … [`StreamHal::end_capture`]) and a [`GraphHal`] runs them
//! again at every launch. Captured tasks take no stream position; a launch is one task. The
//! rules are in the [`capture`] module.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;

mod annotation;
pub mod capture;
mod kernel;

pub use annotation::PoolAnnotation;

pub use capture::{
    CaptureErrorKind, CaptureInfo, CaptureMode, CaptureStatus, GraphHal, ReplayableHostFn,
    ReplayableKernel, ReplayableKernelBody,
};
pub use kernel::{
    AccessMode, BufferAccess, HostFn, KernelBody, KernelBuffers, KernelError, KernelLaunch, MemRef,
};

/// An address in a device's address space.
///
/// Opaque to safe code: it can be compared, offset and printed, never dereferenced on the
/// host. Address 0 is never a valid device address.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(u64);

impl DevicePtr {
    /// Wraps a raw device address; `None` for the null address.
    pub const fn new(addr: u64) -> Option<Self> {
        if addr == 0 {
            None
        } else {
            Some(Self(addr))
        }
    }

    /// The raw address (for FFI and diagnostics).
    pub const fn addr(self) -> u64 {
        self.0
    }

    /// `self + bytes`, or `None` on overflow.
    pub const fn checked_add(self, bytes: u64) -> Option<Self> {
        match self.0.checked_add(bytes) {
            Some(a) => Some(Self(a)),
            None => None,
        }
    }

    /// Bytes from `base` to `self`, or `None` if `self < base`.
    pub const fn offset_from(self, base: DevicePtr) -> Option<u64> {
        self.0.checked_sub(base.0)
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A physical memory allocation of a device (`aclrtDrvMemHandle`), not yet or no longer
/// mapped. Its size is a multiple of the device's granularity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PhysicalHandle(pub u64);

/// A physical allocation exported for other processes (`aclrtMemExportToShareableHandle`'s
/// `shareableHandle`): a number that names the allocation to every process of the machine,
/// to be passed to them by any means (a pipe, a socket, a command line).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShareableHandle(pub u64);

/// Static facts about a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal (`aclrtSetDevice` id).
    pub ordinal: u32,
    /// Total device memory in bytes.
    pub total_memory: u64,
    /// Physical allocation granularity in bytes (a power of two; 2 MiB on Ascend).
    pub granularity: u64,
    /// Product model name, e.g. `"Atlas A2"`.
    pub product: String,
    /// Whether the device supports CANN's own stream-ordered pool API (`aclrtMemPool*`).
    pub supports_native_pool: bool,
    /// Whether the virtual memory management calls (reserve / map) are available; when not,
    /// pools fall back to [`DeviceHal::malloc`] segments.
    pub supports_vmm: bool,
}

/// Free and total device memory, as `aclrtGetMemInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes not held by any physical allocation or `malloc`.
    pub free: u64,
    /// Device capacity in bytes.
    pub total: u64,
}

/// Errors a backend reports. Backends map their native codes onto these with small named
/// functions; the native code is kept where there is one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// Not enough device memory for a physical allocation or `malloc`.
    #[error("device out of memory: requested {requested} bytes, {free} bytes free")]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the device had free.
        free: u64,
    },
    /// An address or range outside the memory the device has mapped or allocated.
    #[error("invalid device address {addr:#x} (+{len} bytes): {reason}")]
    InvalidAddress {
        /// First byte.
        addr: u64,
        /// Length of the access.
        len: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// An argument the backend rejects (size, alignment, flags…).
    #[error("invalid value: {0}")]
    InvalidValue(String),
    /// A stream, event or handle that does not exist (any more).
    #[error("invalid handle: {0}")]
    InvalidHandle(String),
    /// The backend or the device model does not support the operation.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A task failed on a stream; the stream stays failed and skips later tasks.
    #[error("task {task} ({name}) failed on stream {stream}: {message}")]
    TaskFailed {
        /// Backend id of the stream.
        stream: u64,
        /// Position of the failed task on its stream.
        task: u64,
        /// Task kind or kernel name.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// A failure injected by the software NPU's fault injection.
    #[error("injected fault: {0}")]
    Injected(String),
    /// A graph capture rule was broken (see the [`capture`] module).
    #[error("graph capture: {message}")]
    Capture {
        /// Which rule.
        kind: CaptureErrorKind,
        /// What happened, naming the stream, event or capture.
        message: String,
    },
    /// A native error code the mapping functions do not cover.
    #[error("driver error {code}: {message}")]
    Native {
        /// The backend's own code (e.g. an `aclError`).
        code: i32,
        /// Its message.
        message: String,
    },
}

/// Result of HAL calls.
pub type DriverResult<T> = Result<T, DriverError>;

/// A device: memory, streams and events.
///
/// Implementations are shared between threads (`Send + Sync`); every method may be called
/// from any thread.
pub trait DeviceHal: Send + Sync + 'static {
    /// Static facts about the device.
    fn info(&self) -> &DeviceInfo;

    /// Free and total memory (`aclrtGetMemInfo`).
    fn mem_info(&self) -> DriverResult<MemInfo>;

    /// Reserves `size` bytes of virtual address space (a multiple of the granularity),
    /// inaccessible until mapped (`aclrtReserveMemAddress`).
    fn reserve(&self, size: u64) -> DriverResult<DevicePtr>;

    /// Releases a reservation made by [`reserve`](Self::reserve) (`aclrtReleaseMemAddress`).
    /// Fails if any part of it is still mapped.
    fn release(&self, base: DevicePtr) -> DriverResult<()>;

    /// Allocates physical memory (`aclrtMallocPhysical`); `size` is a multiple of the
    /// granularity. Fails with [`DriverError::OutOfMemory`] beyond the device's capacity.
    fn alloc_physical(&self, size: u64) -> DriverResult<PhysicalHandle>;

    /// Frees physical memory that is not mapped (`aclrtFreePhysical`).
    fn free_physical(&self, handle: PhysicalHandle) -> DriverResult<()>;

    /// Maps the whole of `handle` at `va`, which lies inside a reservation and is not mapped
    /// (`aclrtMapMem`). The memory becomes accessible to tasks.
    fn map(&self, va: DevicePtr, handle: PhysicalHandle) -> DriverResult<()>;

    /// Unmaps the mapping that starts at `va` (`aclrtUnmapMem`) and returns the handle that was
    /// mapped there; the physical memory keeps its contents until it is freed. Fails, leaving
    /// the mapping in place, if a task in flight uses the range.
    fn unmap(&self, va: DevicePtr) -> DriverResult<PhysicalHandle>;

    /// Exports physical memory `handle` of this process so that other processes can import it
    /// (`aclrtMemExportToShareableHandle`). With `check_pids` (CANN's default flag) only the
    /// processes named with [`allow_shareable_pids`](Self::allow_shareable_pids) may import
    /// it; without, any process may. One shareable handle per handle: exporting a handle
    /// twice, or an imported one, is an error. Freeing the handle withdraws the export:
    /// later imports fail, earlier ones keep the memory until they are freed.
    ///
    /// # Errors
    /// [`DriverError::InvalidHandle`] for a handle that is not this device's;
    /// [`DriverError::InvalidValue`] for a handle already exported or imported;
    /// [`DriverError::Unsupported`] when the backend has no IPC (the default).
    fn export_physical(
        &self,
        handle: PhysicalHandle,
        check_pids: bool,
    ) -> DriverResult<ShareableHandle> {
        let _ = (handle, check_pids);
        Err(DriverError::Unsupported(
            "this backend cannot share memory with other processes".into(),
        ))
    }

    /// Adds processes to the whitelist of a handle this process exported
    /// (`aclrtMemSetPidToShareableHandle`); process ids are what
    /// [`process_id`](Self::process_id) answers in the importing process.
    ///
    /// # Errors
    /// [`DriverError::InvalidHandle`] for a shareable handle this process did not export (or
    /// whose memory was freed); [`DriverError::InvalidValue`] for an empty list;
    /// [`DriverError::Unsupported`] when the backend has no IPC (the default).
    fn allow_shareable_pids(&self, shareable: ShareableHandle, pids: &[i32]) -> DriverResult<()> {
        let _ = (shareable, pids);
        Err(DriverError::Unsupported(
            "this backend cannot share memory with other processes".into(),
        ))
    }

    /// Imports memory another process exported (`aclrtMemImportFromShareableHandle`) as a
    /// physical handle of this device, to be mapped and freed as any other. Import and export
    /// only work across processes, and a process holds at most one handle per shareable
    /// handle at a time. `size` is the exported allocation's size as the exporter tells it (a
    /// backend that can check it does); 0 asks the backend to find it out, which not every
    /// backend can (the software NPU can, CANN's runtime cannot).
    ///
    /// The memory is shared with the exporting process (and any other importer), which
    /// accesses it without this process knowing. Ordering the accesses of one process to the
    /// shared bytes with the writes of another is the programs' job, as on a device, where
    /// nothing orders work across processes either; an unordered race leaves the bytes
    /// unspecified (torn), never undefined behaviour. A backend keeps that promise: the
    /// software NPU never lets a Rust reference cover bytes another process may write.
    ///
    /// # Errors
    /// [`DriverError::InvalidHandle`] for a handle no live process exports (never exported,
    /// freed, or its process exited); [`DriverError::InvalidValue`] for this process's own
    /// export, a process not on the whitelist, a handle this process already imported, a
    /// size other than the exported one, or one that is not a multiple of this device's
    /// granularity;
    /// [`DriverError::Unsupported`] when the backend has no IPC (the default).
    fn import_physical(
        &self,
        shareable: ShareableHandle,
        size: u64,
    ) -> DriverResult<PhysicalHandle> {
        let _ = (shareable, size);
        Err(DriverError::Unsupported(
            "this backend cannot share memory with other processes".into(),
        ))
    }

    /// The id of this process for whitelists ([`allow_shareable_pids`](Self::allow_shareable_pids);
    /// `aclrtDeviceGetBareTgid`, which answers the host's id inside a container). The default
    /// is the id the OS gives the process.
    ///
    /// # Errors
    /// Backend failures.
    fn process_id(&self) -> DriverResult<i32> {
        i32::try_from(std::process::id())
            .map_err(|_| DriverError::InvalidValue("process id out of range".into()))
    }

    /// Allocates `size` bytes of device memory outside any pool (`aclrtMalloc`).
    fn malloc(&self, size: u64) -> DriverResult<DevicePtr>;

    /// Frees memory from [`malloc`](Self::malloc) (`aclrtFree`). Work still in flight on the
    /// range makes this an error, not a crash.
    fn free(&self, ptr: DevicePtr) -> DriverResult<()>;

    /// Allocates `size` bytes of page-locked host memory (`aclrtMallocHost`): host memory
    /// the device copies to and from directly, without staging. Aligned to at least a host
    /// page; its contents are undefined.
    ///
    /// # Errors
    /// [`DriverError::Unsupported`] for backends without page-locked memory (the default),
    /// [`DriverError::InvalidValue`] for size 0, out of host memory.
    fn malloc_host(&self, size: u64) -> DriverResult<NonNull<u8>> {
        let _ = size;
        Err(DriverError::Unsupported("this backend has no page-locked host memory".into()))
    }

    /// Frees memory from [`malloc_host`](Self::malloc_host) (`aclrtFreeHost`).
    ///
    /// # Safety
    /// `ptr` was returned by `malloc_host` of this device and is not freed yet; nothing
    /// accesses its memory during or after the call (no host reference, no task in flight).
    ///
    /// # Errors
    /// A pointer the backend did not hand out (it is then left alone).
    unsafe fn free_host(&self, ptr: NonNull<u8>) -> DriverResult<()> {
        let _ = ptr;
        Err(DriverError::Unsupported("this backend has no page-locked host memory".into()))
    }

    /// Creates a stream.
    fn create_stream(&self) -> DriverResult<Box<dyn StreamHal>>;

    /// Creates an event.
    fn create_event(&self) -> DriverResult<Box<dyn EventHal>>;

    /// Blocks until every stream of the device has completed everything enqueued so far
    /// (`aclrtSynchronizeDevice`); reports the first stream error found.
    fn synchronize(&self) -> DriverResult<()>;

    /// Synchronous copy of `len` bytes (`aclrtMemcpy`). Device ends are validated.
    ///
    /// # Safety
    /// Host ends must be valid for `len` bytes (reads for `src`, writes for `dst`) for the
    /// duration of the call.
    unsafe fn copy_sync(&self, dst: MemRef, src: MemRef, len: u64) -> DriverResult<()>;

    /// Synchronous memset of device memory (`aclrtMemset`).
    fn memset_sync(&self, dst: DevicePtr, value: u8, len: u64) -> DriverResult<()>;

    /// Creates a pool of the device's own stream-ordered allocator (CANN's `aclrtMemPool*`)
    /// of `max_size` bytes (0 = device memory), for `MemPool::builder().native()`.
    ///
    /// # Errors
    /// [`DriverError::Unsupported`] when the backend or the product has none (the default).
    fn create_native_pool(&self, _max_size: u64) -> DriverResult<Box<dyn NativePoolHal>> {
        Err(DriverError::Unsupported(
            "this backend has no native stream-ordered pool (CANN's aclrtMemPool* API)".into(),
        ))
    }

    /// Whether work on this device's streams could use `peer`'s memory once peer access is
    /// enabled (`aclrtDeviceCanAccessPeer`): both devices belong to this backend, are
    /// distinct, and are linked. `false` by default.
    ///
    /// # Errors
    /// Backend failures.
    fn can_access_peer(&self, peer: &dyn DeviceHal) -> DriverResult<bool> {
        let _ = peer;
        Ok(false)
    }

    /// Lets kernels and copies on this device's streams use `peer`'s memory
    /// (`aclrtDeviceEnablePeerAccess` with this device current). Access is per ordered pair:
    /// enabling it from `self` to `peer` gives `peer` no access to `self`'s memory.
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for the device itself, a device that cannot be reached,
    /// or access already enabled; [`DriverError::Unsupported`] when the backend has no peer
    /// access (the default). A refused call changes nothing.
    fn enable_peer_access(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        let _ = peer;
        Err(DriverError::Unsupported("this backend has no peer access between devices".into()))
    }

    /// Withdraws the access [`enable_peer_access`](Self::enable_peer_access) gave
    /// (`aclrtDeviceDisablePeerAccess`). Work already enqueued keeps running; new work on this
    /// device's streams may no longer use `peer`'s memory.
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] when access is not enabled;
    /// [`DriverError::Unsupported`] when the backend has no peer access (the default).
    fn disable_peer_access(&self, peer: &dyn DeviceHal) -> DriverResult<()> {
        let _ = peer;
        Err(DriverError::Unsupported("this backend has no peer access between devices".into()))
    }

    /// Whether peer access from this device to `peer` is enabled (`false` by default).
    fn peer_access_enabled(&self, peer: &dyn DeviceHal) -> bool {
        let _ = peer;
        false
    }

    /// Whether the device wants [`PoolAnnotation`]s (a sanitizer is on). Pools ask once, at
    /// creation, so that the hot path pays nothing otherwise.
    fn wants_annotations(&self) -> bool {
        false
    }

    /// Receives a pool annotation (only called when [`wants_annotations`](Self::wants_annotations)).
    fn annotate(&self, _annotation: PoolAnnotation) {}

    /// Sets the calling thread's capture mode to `mode` and returns the mode it had
    /// (`aclmdlRICaptureThreadExchangeMode`; every thread starts in [`CaptureMode::Global`]).
    /// The mode is the thread's, for every device of the backend.
    ///
    /// # Errors
    /// [`DriverError::Unsupported`] when the backend has no graph capture (the default).
    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode> {
        let _ = mode;
        Err(DriverError::Unsupported("this backend has no graph capture".into()))
    }

    /// The object as [`Any`], for backends that need to recognise their own types.
    fn as_any(&self) -> &dyn Any;
}

/// A pool of the device's own stream-ordered allocator (CANN's `aclrtMemPool*`).
///
/// Attribute ids and value meanings are the C API's (`docs/how-it-works.md`, *Attributes*); boolean
/// switches are passed as 0 / 1.
pub trait NativePoolHal: Send + Sync + 'static {
    /// The pool's size in bytes (rounded by the driver).
    fn max_size(&self) -> u64;
    /// `aclrtMemPoolMallocAsync`: `size` bytes usable by work enqueued on `stream` afterwards.
    fn malloc_async(&self, size: u64, stream: &dyn StreamHal) -> DriverResult<DevicePtr>;
    /// `aclrtMemPoolFreeAsync`: returns `ptr` to the pool in `stream`'s order.
    fn free_async(&self, ptr: DevicePtr, stream: &dyn StreamHal) -> DriverResult<()>;
    /// `aclrtMemPoolSetAttr`.
    fn set_attr(&self, id: u32, value: u64) -> DriverResult<()>;
    /// `aclrtMemPoolGetAttr`.
    fn get_attr(&self, id: u32) -> DriverResult<u64>;
    /// `aclrtMemPoolTrimTo`.
    fn trim_to(&self, bytes: u64) -> DriverResult<()>;
}

/// A stream: tasks execute strictly in enqueue order.
///
/// Dropping the stream waits for everything enqueued on it to execute (or be skipped after an
/// error) and ends its worker; nothing is left running.
pub trait StreamHal: Send + Sync + 'static {
    /// A backend-unique id of this stream (for reports).
    fn id(&self) -> u64;

    /// Number of tasks enqueued so far (the position of the last one).
    fn enqueued(&self) -> u64;

    /// Number of tasks finished (executed or skipped); `completed() >= p` means every task at
    /// position `<= p` is done.
    fn completed(&self) -> u64;

    /// Blocks until every task enqueued before the call is done. Reports the stream's sticky
    /// error, if any, but only after the queue up to that point has drained: when it returns,
    /// no task enqueued before the call is running or will run.
    fn synchronize(&self) -> DriverResult<()>;

    /// Whether everything enqueued so far is done (never blocks); reports the sticky error.
    fn query(&self) -> DriverResult<bool>;

    /// The host learnt, without asking this stream (through events waited on by other
    /// streams, a chain of them), that every task at a position `<= position` is done. A
    /// backend that caches completion may advance its cache; the default ignores it.
    fn note_completed(&self, position: u64) {
        let _ = position;
    }

    /// Work this stream's positions do not count may have been enqueued on the backend's
    /// raw handle (an operator library launching on it directly). A backend that numbers its
    /// own tasks takes the next position for it now, without a driver call, so that a later
    /// free is tagged after that work and counts as complete only once something covering it
    /// (a synchronize, a later record or host function) has completed. Backends whose
    /// positions count every task of the stream (the software NPU's) need nothing: the
    /// default ignores it.
    fn note_foreign_work(&self) {}

    /// Brings [`completed`](Self::completed) up to date with the device where the backend
    /// caches it (one non-blocking driver query; no host observation is implied). The pool
    /// calls it before releasing memory (`trim_to`, the release threshold), so that frees the
    /// device has finished count as complete. The default does nothing.
    fn poll_completed(&self) {}

    /// Enqueues a host function.
    fn host_fn(&self, f: HostFn) -> DriverResult<()>;

    /// Enqueues a kernel.
    fn launch(&self, kernel: KernelLaunch) -> DriverResult<()>;

    /// Enqueues a device-to-device copy. Either end may be memory of a peer device this
    /// stream's device has access to (see the module docs, *Several devices*).
    fn copy_d2d(&self, dst: DevicePtr, src: DevicePtr, len: u64) -> DriverResult<()>;

    /// Enqueues a copy whose ends may be host memory (`aclrtMemcpyAsync`).
    ///
    /// # Safety
    /// Host ends must stay valid (readable for `src`, writable and not otherwise accessed for
    /// `dst`) until the task completes, i.e. until `completed()` reaches its position. On a
    /// capturing stream the copy is recorded and runs at every launch of the graph: host ends
    /// must then stay valid, and not otherwise accessed while a launch runs, until the graph
    /// is dropped.
    unsafe fn copy_async(&self, dst: MemRef, src: MemRef, len: u64) -> DriverResult<()>;

    /// Enqueues a memset of device memory.
    fn memset(&self, dst: DevicePtr, value: u8, len: u64) -> DriverResult<()>;

    /// Enqueues a record of `event`; returns the position of the record task. Re-recording
    /// replaces the event's previous record. On a capturing stream the record is captured:
    /// it takes no position (the stream's [`enqueued`](Self::enqueued) count is returned)
    /// and the event's latest record becomes the captured one.
    fn record(&self, event: &dyn EventHal) -> DriverResult<u64>;

    /// Makes later tasks of this stream wait until `event`'s latest record (at the time of
    /// this call) has completed. Waiting on a never-recorded event is a no-op. On a capturing
    /// stream the wait is captured; a stream that waits on a captured record joins its
    /// capture ([`capture`]).
    fn wait(&self, event: &dyn EventHal) -> DriverResult<()>;

    /// Enqueues a host function that may run many times: on a capturing stream it is
    /// captured and runs at every launch of the graph. The default runs it once through
    /// [`host_fn`](Self::host_fn).
    fn host_fn_replayable(&self, f: ReplayableHostFn) -> DriverResult<()> {
        self.host_fn(Box::new(move || f()))
    }

    /// Enqueues a kernel whose body may run many times: on a capturing stream it is captured
    /// and runs at every launch of the graph. The default launches it once through
    /// [`launch`](Self::launch).
    fn launch_replayable(&self, kernel: ReplayableKernel) -> DriverResult<()> {
        self.launch(kernel.once())
    }

    /// Starts capturing this stream's tasks into a new graph (`aclmdlRICaptureBegin`).
    ///
    /// # Errors
    /// [`CaptureErrorKind::StreamCaptured`] when the stream is already capturing;
    /// [`DriverError::Unsupported`] when the backend has no graph capture (the default).
    fn begin_capture(&self, mode: CaptureMode) -> DriverResult<()> {
        let _ = mode;
        Err(DriverError::Unsupported("this backend has no graph capture".into()))
    }

    /// Ends the capture begun on this stream and returns its graph (`aclmdlRICaptureEnd`);
    /// every stream of the capture leaves it, whether the call succeeds or not (unless the
    /// stream or thread is the wrong one).
    ///
    /// # Errors
    /// [`CaptureErrorKind::NotCapturing`], [`CaptureErrorKind::Unmatched`],
    /// [`CaptureErrorKind::Unjoined`], [`CaptureErrorKind::Invalidated`];
    /// [`DriverError::Unsupported`] when the backend has no graph capture (the default).
    fn end_capture(&self) -> DriverResult<Box<dyn GraphHal>> {
        Err(DriverError::Unsupported("this backend has no graph capture".into()))
    }

    /// The stream's capture state (`aclmdlRICaptureGetInfo`); never capturing by default.
    ///
    /// # Errors
    /// Backend failures (a backend may ask the driver).
    fn capture_info(&self) -> DriverResult<CaptureInfo> {
        Ok(CaptureInfo::NONE)
    }

    /// How many times the stream entered or left a capture: odd while it is capturing. Read
    /// before and after a call, it tells whether the call may have been captured (an odd
    /// value, or two different values): what the typed layer checks before it learns
    /// ordering from a record or a wait. One atomic load; `0` by default.
    fn capture_epoch(&self) -> u64 {
        0
    }

    /// The object as [`Any`].
    fn as_any(&self) -> &dyn Any;
}

/// An event: a marker recorded on a stream.
pub trait EventHal: Send + Sync + 'static {
    /// Whether the latest record has completed (true if never recorded); a record that
    /// completed with its stream's failure reports that error, as `synchronize` does.
    fn query(&self) -> DriverResult<bool>;

    /// Blocks until the latest record has completed.
    fn synchronize(&self) -> DriverResult<()>;

    /// Milliseconds between the completion of `self`'s record and `end`'s record.
    ///
    /// # Errors
    /// Either event not recorded or not complete.
    fn elapsed_ms(&self, end: &dyn EventHal) -> DriverResult<f32>;

    /// The object as [`Any`].
    fn as_any(&self) -> &dyn Any;
}
