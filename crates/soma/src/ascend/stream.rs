//! [`AscendStream`]: an `aclrtStream` with soma's task positions, implementing [`StreamHal`].
//!
//! # Positions
//!
//! CANN has no per-task completion counter, so the stream numbers its own tasks: every
//! successful enqueue (copy, memset, host function, event record, event wait) takes the next
//! position under a small per-stream mutex, so positions follow the driver's enqueue order.
//! Completion is learnt without adding tasks:
//!
//! * [`StreamHal::synchronize`] and a [`StreamHal::query`] that answers "complete" set
//!   `completed` to the `enqueued` read *before* the driver call;
//! * an event observed complete ([`EventHal::query`] / [`EventHal::synchronize`]) advances its
//!   recording stream to the record's position;
//! * a host function advances its stream to its own position when it returns;
//! * device synchronization advances every stream of the device;
//! * soma-core passes on what its vector clocks learnt ([`StreamHal::note_completed`]): an
//!   event of another stream that waited on this one, directly or through a chain;
//! * a stream that completed a wait on an event has had the event's record complete: every
//!   advance of a stream's `completed` is passed on along its waits (`waits.rs`), so a
//!   stream learnt complete (a query, a synchronize) proves the records it waited for.
//!
//! `completed()` therefore lags the device (never leads it): the pool engine sees frees as
//! completed later than they are, which costs reuse opportunities, never safety. Before it
//! releases memory (`trim_to`, the release threshold) the pool polls the streams that freed
//! into it ([`StreamHal::poll_completed`]: one `aclrtStreamQuery`), so that memory the device
//! is done with goes back. No host function is enqueued per task to track completion (host
//! functions cost a runtime thread round trip on Ascend).

use std::any::Any;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ascend_sys::{aclrtStream, aclrtStreamStatus};
use soma_core::hal::{
    CaptureErrorKind, CaptureInfo, CaptureMode, DevicePtr, DriverError, DriverResult, EventHal,
    GraphHal, HostFn, KernelLaunch, MemRef, ReplayableHostFn, StreamHal,
};

use super::capture::{self, StreamCapture};
use super::conv::{dev_ptr, map_call_err, map_create_err, to_usize};
use super::device::{copy_args, lock, DeviceInner};
use super::event::AscendEvent;
use super::raw;
use super::waits::Waits;

/// A runtime handle, shareable between threads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Handle(pub(crate) *mut c_void);

// SAFETY: CANN stream / event / pool handles are opaque identifiers the runtime accepts from
// any thread (with the owning device current, which every caller ensures via `enter`).
unsafe impl Send for Handle {}
// SAFETY: as above; the handle is never dereferenced by Rust code.
unsafe impl Sync for Handle {}

/// Where an enqueued task went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Enqueued at this position.
    Position(u64),
    /// Captured into the capture with this id: no position.
    Captured(u64),
}

/// State shared by a stream, its host functions, the events recorded on it and the device's
/// in-flight table.
pub(crate) struct StreamShared {
    pub(crate) dev: Arc<DeviceInner>,
    pub(crate) raw: Handle,
    id: u64,
    /// Held while enqueuing (so positions follow the driver's order), while using the handle
    /// from a non-owner (so it is not destroyed under the call) and while the stream enters or
    /// leaves a capture.
    pub(crate) enqueue: Mutex<()>,
    destroyed: AtomicBool,
    enqueued: AtomicU64,
    completed: AtomicU64,
    /// Event waits, for what their completion proves about the recording streams.
    waits: Waits,
    sticky: Mutex<Option<DriverError>>,
    /// The capture the stream records into, if any.
    pub(crate) capture: StreamCapture,
}

impl StreamShared {
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn enqueued(&self) -> u64 {
        self.enqueued.load(Ordering::Acquire)
    }

    pub(crate) fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    /// Raises `completed` to `position` (at most what was enqueued); returns the new value.
    pub(crate) fn advance_completed(&self, position: u64) -> u64 {
        let target = position.min(self.enqueued());
        self.completed.fetch_max(target, Ordering::AcqRel).max(target)
    }

    /// The waits on events whose completion this stream has not passed on yet.
    pub(crate) fn waits(&self) -> &Waits {
        &self.waits
    }

    /// The sticky error (a host function panicked), if any.
    pub(crate) fn sticky(&self) -> DriverResult<()> {
        match &*lock(&self.sticky) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The sticky error if the task that set it came before `position`: what a record at
    /// `position` reports, as a record on a failed stream does on the software NPU.
    pub(crate) fn failed_before(&self, position: u64) -> DriverResult<()> {
        match &*lock(&self.sticky) {
            Some(e @ DriverError::TaskFailed { task, .. }) if *task < position => Err(e.clone()),
            _ => Ok(()),
        }
    }

    fn set_sticky(&self, e: DriverError) {
        lock(&self.sticky).get_or_insert(e);
    }

    /// Enqueues one task: `f(handle, slot)` makes the driver call; on success the task takes
    /// the position `slot` names. On a capturing stream the runtime captures the task: `slot`
    /// is [`Slot::Captured`] and no position is taken.
    pub(crate) fn enqueue(
        &self,
        f: impl FnOnce(aclrtStream, Slot) -> DriverResult<()>,
    ) -> DriverResult<Slot> {
        self.enqueue_task(false, f)
    }

    /// [`enqueue`](Self::enqueue) for an event wait, which may make the stream join a
    /// capture (then it is captured too).
    pub(crate) fn enqueue_wait(
        &self,
        f: impl FnOnce(aclrtStream, Slot) -> DriverResult<()>,
    ) -> DriverResult<Slot> {
        self.enqueue_task(true, f)
    }

    fn enqueue_task(
        &self,
        may_join: bool,
        f: impl FnOnce(aclrtStream, Slot) -> DriverResult<()>,
    ) -> DriverResult<Slot> {
        self.dev.check_err()?;
        self.dev.enter()?;
        let _g = lock(&self.enqueue);
        if let Some(id) = self.capture.id() {
            f(self.raw.0, Slot::Captured(id))?;
            self.dev.captures.note_task(id);
            return Ok(Slot::Captured(id));
        }
        let position = self.enqueued.load(Ordering::Relaxed) + 1;
        f(self.raw.0, Slot::Position(position))?;
        if may_join && self.dev.captures.active() {
            if let Some(id) = capture::joined(self)? {
                return Ok(Slot::Captured(id));
            }
        }
        self.enqueued.store(position, Ordering::Release);
        Ok(Slot::Position(position))
    }

    /// Waits for everything enqueued so far (`aclrtSynchronizeStream`); done before the stream
    /// begins or joins a capture.
    pub(crate) fn drain(&self) -> DriverResult<()> {
        self.dev.check_err()?;
        self.dev.enter()?;
        let n = self.enqueued();
        // SAFETY: the handle is live while `self` is (the stream's owner holds it).
        unsafe { raw::stream::synchronize(&self.dev.acl, self.raw.0) }.map_err(map_call_err)?;
        self.mark_completed(n);
        Ok(())
    }

    /// Queries the driver once (`aclrtStreamQuery`) and advances `completed` if the stream is
    /// idle. Errors are ignored: this only sharpens a conservative estimate.
    pub(crate) fn refresh(&self) {
        let _ = self.query_driver();
    }

    fn query_driver(&self) -> DriverResult<bool> {
        self.dev.enter()?;
        let _g = lock(&self.enqueue);
        if self.destroyed.load(Ordering::Acquire) {
            return Ok(true);
        }
        let n = self.enqueued();
        // SAFETY: the handle is live (not destroyed: checked under the lock that destruction
        // takes) and belongs to the current device.
        let st = unsafe { raw::stream::query(&self.dev.acl, self.raw.0) }.map_err(map_call_err)?;
        if st == aclrtStreamStatus::ACL_STREAM_STATUS_COMPLETE {
            self.mark_completed(n);
            Ok(true)
        } else if st == aclrtStreamStatus::ACL_STREAM_STATUS_NOT_READY {
            Ok(false)
        } else {
            Err(DriverError::Native {
                code: st.0 as i32,
                message: format!("aclrtStreamQuery returned unknown status {}", st.0),
            })
        }
    }
}

/// What a host function task owns until it runs.
struct HostFnTask {
    f: HostFn,
    stream: Arc<StreamShared>,
    position: u64,
}

/// The `aclrtHostFunc` of every host function: takes back the boxed [`HostFnTask`], runs the
/// closure with panics caught (a panic becomes the stream's sticky
/// [`DriverError::TaskFailed`]), then advances the stream's `completed` to the task.
///
/// The box is reclaimed exactly once: here when the launch succeeded (CANN calls a host function
/// once), by the launcher when it failed (then CANN never calls it).
pub(crate) extern "C" fn host_fn_trampoline(args: *mut c_void) {
    if args.is_null() {
        return;
    }
    // SAFETY: `args` is the `Box::into_raw` of a `HostFnTask` given to exactly one successful
    // `aclrtLaunchHostFunc`; the runtime calls the function once, so ownership returns here
    // once.
    let task = unsafe { Box::from_raw(args.cast::<HostFnTask>()) };
    let HostFnTask { f, stream, position } = *task;
    if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_owned());
        // Dropping the payload runs foreign code; keep a panic there from unwinding into C.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
        stream.set_sticky(DriverError::TaskFailed {
            stream: stream.id(),
            task: position,
            name: "host_fn".to_owned(),
            message: format!("panicked: {message}"),
        });
    }
    stream.mark_completed(position);
}

/// The raw `aclrtStream` of a soma [`Stream`](soma_core::Stream) of the ascend backend, for
/// operators soma does not launch (aclnn, ATB, custom kernels): `use
/// soma::ascend::AscendStreamExt as _; let raw = stream.as_raw()?;`.
///
/// Work enqueued on the raw handle is ordered like soma's own work on the stream; handing
/// the handle out makes every later free on the stream wait for it (see
/// [`Stream::expect_foreign_work`](soma_core::Stream::expect_foreign_work)). A buffer used by
/// such work on a stream other than its own needs
/// [`record_use`](soma_core::BufferOwner::record_use) before the work is enqueued.
pub trait AscendStreamExt {
    /// The stream's `aclrtStream`.
    ///
    /// # Errors
    /// [`DriverError::InvalidHandle`] for a stream of another backend.
    fn as_raw(&self) -> DriverResult<aclrtStream>;
}

impl AscendStreamExt for soma_core::Stream<'_> {
    fn as_raw(&self) -> DriverResult<aclrtStream> {
        let stream = self.hal().as_any().downcast_ref::<AscendStream>().ok_or_else(|| {
            DriverError::InvalidHandle(format!("stream {} is not an ascend stream", self.id()))
        })?;
        self.expect_foreign_work();
        Ok(stream.shared.raw.0)
    }
}

/// Launches host function `f` as task `position` of `s` (enqueue lock held).
fn launch_host_task(
    s: &Arc<StreamShared>,
    raw_stream: aclrtStream,
    f: HostFn,
    position: u64,
) -> DriverResult<()> {
    let task = Box::into_raw(Box::new(HostFnTask { f, stream: Arc::clone(s), position }));
    // SAFETY: the stream is live; the trampoline is sound to call once with `task` (a leaked
    // `HostFnTask` box it takes back).
    let r = unsafe {
        raw::stream::launch_host_func(
            &s.dev.acl,
            raw_stream,
            Some(host_fn_trampoline),
            task.cast::<c_void>(),
        )
    };
    if let Err(e) = r {
        // SAFETY: the launch failed, so the runtime never calls the trampoline: this is the
        // only owner of the box.
        drop(unsafe { Box::from_raw(task) });
        return Err(map_call_err(e));
    }
    Ok(())
}

/// A stream of an [`AscendDevice`](super::AscendDevice): implements [`StreamHal`].
///
/// Dropping it synchronizes it (`aclrtSynchronizeStream`), then destroys it
/// (`aclrtDestroyStream`); errors there are kept by the device and returned by its next
/// fallible call.
pub struct AscendStream {
    pub(crate) shared: Arc<StreamShared>,
}

impl std::fmt::Debug for AscendStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AscendStream")
            .field("id", &self.shared.id)
            .field("device", &self.shared.dev.id)
            .field("enqueued", &self.shared.enqueued())
            .field("completed", &self.shared.completed())
            .finish()
    }
}

impl AscendStream {
    /// `aclrtCreateStream`; the device is current.
    pub(crate) fn new(dev: &Arc<DeviceInner>) -> DriverResult<Self> {
        let raw = raw::stream::create(&dev.acl).map_err(|e| map_create_err(e, "stream"))?;
        let shared = Arc::new(StreamShared {
            dev: dev.clone(),
            raw: Handle(raw),
            id: dev.next_stream_id(),
            enqueue: Mutex::new(()),
            destroyed: AtomicBool::new(false),
            enqueued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            waits: Waits::default(),
            sticky: Mutex::new(None),
            capture: StreamCapture::default(),
        });
        dev.register_stream(&shared);
        Ok(Self { shared })
    }

    /// The runtime handle (for calls this crate does not wrap). It stays valid while `self`
    /// lives; tasks enqueued through it directly are not counted in the positions.
    pub fn as_raw(&self) -> aclrtStream {
        self.shared.raw.0
    }

    /// Whether `self` belongs to the device state `dev`.
    pub(crate) fn same_device(&self, dev: &Arc<DeviceInner>) -> bool {
        Arc::ptr_eq(&self.shared.dev, dev)
    }

    /// An event of this device, to record.
    fn event<'a>(&self, event: &'a dyn EventHal) -> DriverResult<&'a AscendEvent> {
        let e = Self::ascend_event(event)?;
        if !e.same_device(&self.shared.dev) {
            return Err(DriverError::InvalidHandle("the event belongs to another device".into()));
        }
        Ok(e)
    }

    /// An event of any device of this runtime, to wait on (the order holds across devices).
    fn event_to_wait<'a>(&self, event: &'a dyn EventHal) -> DriverResult<&'a AscendEvent> {
        let e = Self::ascend_event(event)?;
        if !e.same_runtime(&self.shared.dev) {
            return Err(DriverError::InvalidHandle(
                "the event belongs to another runtime library".into(),
            ));
        }
        Ok(e)
    }

    fn ascend_event(event: &dyn EventHal) -> DriverResult<&AscendEvent> {
        event.as_any().downcast_ref::<AscendEvent>().ok_or_else(|| {
            DriverError::InvalidHandle("the event is not an event of the ascend backend".into())
        })
    }

    fn copy(&self, dst: MemRef, src: MemRef, len: u64) -> DriverResult<()> {
        let s = &self.shared;
        s.dev.with_valid(&[(dst, len), (src, len)], |owners| {
            if len == 0 {
                return Ok(());
            }
            let n = to_usize(len)?;
            let (dp, sp, kind) = copy_args(dst, src);
            let position = s.enqueue(|raw, _| {
                // SAFETY: device ends are validated and stay mapped while the memory lock is
                // held (unmap/free also check in-flight use); host ends stay valid until the
                // task completes, or the graph is destroyed when it is captured (the caller's
                // contract, see `copy_async`); the stream is live.
                unsafe { raw::mem::memcpy_async(&s.dev.acl, dp, sp, n, kind, raw) }
                    .map_err(map_call_err)
            })?;
            // A captured copy uses the memory at the graph's launches, not now.
            if let Slot::Position(position) = position {
                owners.note_use(0, s, position, dst, len);
                owners.note_use(1, s, position, src, len);
            }
            Ok(())
        })
    }
}

impl Drop for AscendStream {
    fn drop(&mut self) {
        let s = &self.shared;
        let acl = &s.dev.acl;
        let result = s.dev.enter().and_then(|()| {
            let n = s.enqueued();
            // SAFETY: the handle is live until the destroy below.
            unsafe { raw::stream::synchronize(acl, s.raw.0) }.map_err(map_call_err)?;
            s.mark_completed(n);
            let _g = lock(&s.enqueue);
            s.destroyed.store(true, Ordering::Release);
            // SAFETY: the handle is live, drained, and not used afterwards: `destroyed` is set
            // under the lock every other user of the handle takes.
            unsafe { raw::stream::destroy(acl, s.raw.0) }.map_err(map_call_err)
        });
        if let Err(e) = result {
            s.dev.record_err(e);
        }
    }
}

impl StreamHal for AscendStream {
    fn id(&self) -> u64 {
        self.shared.id
    }

    fn enqueued(&self) -> u64 {
        self.shared.enqueued()
    }

    fn completed(&self) -> u64 {
        self.shared.completed()
    }

    fn note_foreign_work(&self) {
        // A position without a driver task: only an observation that covers the foreign work
        // (a synchronize, a query, a later record or host function completing) reaches it.
        let _g = lock(&self.shared.enqueue);
        self.shared.enqueued.fetch_add(1, Ordering::AcqRel);
    }

    fn synchronize(&self) -> DriverResult<()> {
        let s = &self.shared;
        s.dev.enter()?;
        let n = s.enqueued();
        // SAFETY: the handle is live while `self` is.
        unsafe { raw::stream::synchronize(&s.dev.acl, s.raw.0) }.map_err(map_call_err)?;
        s.mark_completed(n);
        // A deferred error is reported only now: callers count on a synchronize having
        // drained the queue even when it fails (the HAL's contract).
        s.dev.check_err()?;
        s.sticky()
    }

    fn query(&self) -> DriverResult<bool> {
        let s = &self.shared;
        s.dev.check_err()?;
        let idle = s.query_driver()?;
        s.sticky()?;
        Ok(idle)
    }

    fn note_completed(&self, position: u64) {
        self.shared.mark_completed(position);
    }

    fn poll_completed(&self) {
        self.shared.refresh();
    }

    fn host_fn(&self, f: HostFn) -> DriverResult<()> {
        let s = &self.shared;
        s.enqueue(|raw, slot| match slot {
            Slot::Position(position) => launch_host_task(s, raw, f, position),
            Slot::Captured(_) => Err(DriverError::Capture {
                kind: CaptureErrorKind::NotCapturable,
                message: format!(
                    "a host function on stream {}, which is capturing, cannot be captured: its \
                     body runs once (FnOnce); use the replayable form",
                    s.id()
                ),
            }),
        })
        .map(drop)
    }

    fn launch(&self, kernel: KernelLaunch) -> DriverResult<()> {
        drop(kernel);
        Err(DriverError::Unsupported(
            "kernels written as Rust closures run only on the software NPU".into(),
        ))
    }

    fn copy_d2d(&self, dst: DevicePtr, src: DevicePtr, len: u64) -> DriverResult<()> {
        self.copy(MemRef::Device(dst), MemRef::Device(src), len)
    }

    unsafe fn copy_async(&self, dst: MemRef, src: MemRef, len: u64) -> DriverResult<()> {
        self.copy(dst, src, len)
    }

    fn memset(&self, dst: DevicePtr, value: u8, len: u64) -> DriverResult<()> {
        let s = &self.shared;
        let r = MemRef::Device(dst);
        s.dev.with_valid(&[(r, len)], |owners| {
            if len == 0 {
                return Ok(());
            }
            let n = to_usize(len)?;
            let position = s.enqueue(|raw, _| {
                // SAFETY: the range is validated device memory that stays mapped while the
                // memory lock is held; the stream is live.
                unsafe {
                    raw::mem::memset_async(&s.dev.acl, dev_ptr(dst), i32::from(value), n, raw)
                }
                .map_err(map_call_err)
            })?;
            if let Slot::Position(position) = position {
                owners.note_use(0, s, position, r, len);
            }
            Ok(())
        })
    }

    fn record(&self, event: &dyn EventHal) -> DriverResult<u64> {
        let e = self.event(event)?;
        e.record_on(&self.shared)
    }

    fn wait(&self, event: &dyn EventHal) -> DriverResult<()> {
        let e = self.event_to_wait(event)?;
        e.wait_on(&self.shared)
    }

    fn host_fn_replayable(&self, f: ReplayableHostFn) -> DriverResult<()> {
        let s = &self.shared;
        s.enqueue(|raw, slot| match slot {
            Slot::Position(position) => launch_host_task(s, raw, Box::new(move || f()), position),
            Slot::Captured(id) => capture::launch_replayable_host_fn(s, raw, id, f),
        })
        .map(drop)
    }

    fn begin_capture(&self, mode: CaptureMode) -> DriverResult<()> {
        capture::begin(&self.shared, mode)
    }

    fn end_capture(&self) -> DriverResult<Box<dyn GraphHal>> {
        Ok(Box::new(capture::end(&self.shared)?))
    }

    fn capture_info(&self) -> DriverResult<CaptureInfo> {
        capture::info(&self.shared)
    }

    fn capture_epoch(&self) -> u64 {
        self.shared.capture.epoch()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
