//! Graph capture on the ascend backend: which streams capture (the runtime decides; the
//! backend mirrors it so that captured tasks take no position), the replayable host
//! functions a capture keeps, and [`AscendGraph`], an `aclmdlRI`.
//!
//! # Capture state
//!
//! A stream enters a capture at `aclmdlRICaptureBegin`, or when a wait makes it join one: a
//! wait enqueued while a capture is active on the device asks the runtime
//! (`aclmdlRICaptureGetInfo`) whether the stream is capturing now. It leaves when the
//! capture's origin ends it. Every transition happens under the stream's enqueue lock, so a
//! task is either captured (no position) or enqueued (the next position). The capture id is
//! the model handle's address, as `aclmdlRICaptureGetInfo` reports it.
//!
//! A stream is drained (`aclrtSynchronizeStream`) before it begins or joins a capture: its
//! queue then holds no work of its own while it captures, so that a synchronisation the
//! runtime refuses during the capture has nothing left to wait for (the HAL's contract).

use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ascend_sys::{aclmdlRICaptureMode, aclmdlRICaptureStatus};
use soma_core::hal::{
    CaptureErrorKind, CaptureInfo, CaptureMode, CaptureStatus, DriverError, DriverResult, GraphHal,
    ReplayableHostFn, StreamHal,
};

use super::conv::map_call_err;
use super::device::{lock, DeviceInner};
use super::raw;
use super::stream::{AscendStream, Handle, Slot, StreamShared};

fn error(kind: CaptureErrorKind, message: String) -> DriverError {
    DriverError::Capture { kind, message }
}

/// A stream's capture state; changed only under its enqueue lock.
#[derive(Default)]
pub(crate) struct StreamCapture {
    /// The capture's id, 0 when none.
    id: AtomicU64,
    /// Entries and exits so far: odd while capturing.
    epoch: AtomicU64,
}

impl StreamCapture {
    /// The capture the stream records into, if any.
    pub(crate) fn id(&self) -> Option<u64> {
        match self.id.load(Ordering::Acquire) {
            0 => None,
            id => Some(id),
        }
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn enter(&self, id: u64) {
        self.id.store(id, Ordering::Release);
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    fn leave(&self) {
        if self.id.swap(0, Ordering::AcqRel) != 0 {
            self.epoch.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// A host function captured into a model: the runtime calls it at every execution with the
/// address of this (shared, so the address is stable) until the model is destroyed.
pub(crate) struct ReplayHostFn {
    f: ReplayableHostFn,
    dev: Weak<DeviceInner>,
    stream: u64,
}

/// The `aclrtHostFunc` of captured host functions: runs the closure with panics caught (a
/// panic becomes the device's deferred error; no stream position belongs to it).
extern "C" fn replay_host_fn_trampoline(args: *mut c_void) {
    if args.is_null() {
        return;
    }
    // SAFETY: `args` is the address of a `ReplayHostFn` kept by its capture and then by its
    // graph, which destroys the model (after its executions) before releasing it.
    let task = unsafe { &*args.cast::<ReplayHostFn>() };
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (task.f)())) {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_owned());
        // Dropping the payload runs foreign code; keep a panic there from unwinding into C.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
        if let Some(dev) = task.dev.upgrade() {
            dev.record_err(DriverError::TaskFailed {
                stream: task.stream,
                task: 0,
                name: "host_fn (graph launch)".to_owned(),
                message: format!("panicked: {message}"),
            });
        }
    }
}

/// What the backend keeps for a capture until it ends.
#[derive(Default)]
struct Book {
    tasks: usize,
    host_fns: Vec<Arc<ReplayHostFn>>,
}

/// The captures active on a device.
#[derive(Default)]
pub(crate) struct Captures {
    books: Mutex<HashMap<u64, Book>>,
    active: AtomicUsize,
}

impl Captures {
    /// Whether a capture is active on the device (one atomic load).
    pub(crate) fn active(&self) -> bool {
        self.active.load(Ordering::Acquire) > 0
    }

    fn begin(&self, id: u64) {
        let mut b = lock(&self.books);
        b.entry(id).or_default();
        self.active.store(b.len(), Ordering::Release);
    }

    /// Counts a task captured into capture `id`.
    pub(crate) fn note_task(&self, id: u64) {
        if let Some(book) = lock(&self.books).get_mut(&id) {
            book.tasks += 1;
        }
    }

    fn end(&self, id: u64) -> Book {
        let mut b = lock(&self.books);
        let book = b.remove(&id).unwrap_or_default();
        self.active.store(b.len(), Ordering::Release);
        book
    }
}

/// The capture `aclmdlRICaptureGetInfo` reports for `s`: status and id.
fn driver_info(s: &StreamShared) -> DriverResult<(CaptureStatus, u64)> {
    // SAFETY: the stream is live while `s` is, and its device current (callers `enter`).
    let (status, model) =
        unsafe { raw::mdl::capture_get_info(&s.dev.acl, s.raw.0) }.map_err(map_call_err)?;
    let status = match status {
        aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active,
        aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED => {
            CaptureStatus::Invalidated
        }
        _ => CaptureStatus::None,
    };
    Ok((status, model as u64))
}

/// After a wait on `s` (enqueue lock held) while a capture is active on the device: the
/// capture the wait made `s` join, if any; `s` is now in it and the wait counted there.
pub(crate) fn joined(s: &StreamShared) -> DriverResult<Option<u64>> {
    let (status, id) = driver_info(s)?;
    if status == CaptureStatus::None || id == 0 {
        return Ok(None);
    }
    s.capture.enter(id);
    s.dev.captures.note_task(id);
    Ok(Some(id))
}

/// Before a device synchronisation: when a capture is active, the runtime refuses it,
/// possibly without waiting, so the streams that are not capturing are drained first
/// (capturing ones hold no work of their own) and the refusal still comes after the drain.
pub(crate) fn drain_outside_captures<'a>(
    dev: &DeviceInner,
    streams: impl Iterator<Item = &'a Arc<StreamShared>>,
) {
    if !dev.captures.active() {
        return;
    }
    for s in streams.filter(|s| s.capture.id().is_none()) {
        // A failure here is the synchronisation's to report.
        let _ = s.drain();
    }
}

/// `aclmdlRICaptureThreadExchangeMode`: the calling thread's new mode; the old one.
pub(crate) fn exchange_mode(dev: &DeviceInner, mode: CaptureMode) -> DriverResult<CaptureMode> {
    dev.check_err()?;
    let old =
        raw::mdl::exchange_mode(&dev.acl, aclmdlRICaptureMode(mode.raw())).map_err(map_call_err)?;
    CaptureMode::from_raw(old.0).ok_or_else(|| DriverError::Native {
        code: 0,
        message: format!("aclmdlRICaptureThreadExchangeMode returned unknown mode {}", old.0),
    })
}

/// `aclmdlRICaptureBegin` on `s`, drained first.
pub(crate) fn begin(s: &StreamShared, mode: CaptureMode) -> DriverResult<()> {
    s.drain()?;
    let _g = lock(&s.enqueue);
    if let Some(id) = s.capture.id() {
        return Err(error(
            CaptureErrorKind::StreamCaptured,
            format!("stream {} is capturing already (capture {id:#x})", s.id()),
        ));
    }
    let acl = &s.dev.acl;
    // SAFETY: the stream is live and its device current (`drain` entered it).
    unsafe { raw::mdl::capture_begin(acl, s.raw.0, aclmdlRICaptureMode(mode.raw())) }
        .map_err(map_call_err)?;
    let (_, id) = driver_info(s)?;
    if id == 0 {
        return Err(DriverError::Native {
            code: 0,
            message: "aclmdlRICaptureGetInfo gave no model for a capture just begun".into(),
        });
    }
    s.dev.captures.begin(id);
    s.capture.enter(id);
    Ok(())
}

/// `aclmdlRICaptureEnd` on `s`; every stream of the capture leaves it when it ended.
pub(crate) fn end(s: &StreamShared) -> DriverResult<AscendGraph> {
    s.dev.check_err()?;
    s.dev.enter()?;
    let guard = lock(&s.enqueue);
    let Some(id) = s.capture.id() else {
        return Err(error(
            CaptureErrorKind::NotCapturing,
            format!("stream {} is not capturing", s.id()),
        ));
    };
    // SAFETY: the stream is live and its device current.
    let result = unsafe { raw::mdl::capture_end(&s.dev.acl, s.raw.0) }.map_err(map_call_err);
    if let Err(e) = &result {
        if driver_info(s)?.0 != CaptureStatus::None {
            // Not ended (the wrong stream or thread): the capture goes on.
            return Err(e.clone());
        }
    }
    s.capture.leave();
    drop(guard);
    for other in s.dev.live_streams() {
        if other.capture.id() == Some(id) {
            let _g = lock(&other.enqueue);
            if other.capture.id() == Some(id) {
                other.capture.leave();
            }
        }
    }
    let book = s.dev.captures.end(id);
    let model = result?;
    Ok(AscendGraph {
        dev: Arc::clone(&s.dev),
        model: Handle(model),
        id,
        tasks: book.tasks,
        launches: Mutex::new(Vec::new()),
        host_fns: book.host_fns,
    })
}

/// The capture state of `s` (a driver query while it captures).
pub(crate) fn info(s: &StreamShared) -> DriverResult<CaptureInfo> {
    let Some(id) = s.capture.id() else { return Ok(CaptureInfo::NONE) };
    s.dev.enter()?;
    Ok(match driver_info(s)?.0 {
        CaptureStatus::None => CaptureInfo::NONE,
        status => CaptureInfo { status, capture: Some(id) },
    })
}

/// Launches `f` on the capturing stream `s` (enqueue lock held, capture `id`) so that the
/// runtime calls it at every execution of the model.
pub(crate) fn launch_replayable_host_fn(
    s: &StreamShared,
    raw_stream: ascend_sys::aclrtStream,
    id: u64,
    f: ReplayableHostFn,
) -> DriverResult<()> {
    let task = Arc::new(ReplayHostFn { f, dev: Arc::downgrade(&s.dev), stream: s.id() });
    let args = Arc::as_ptr(&task).cast_mut().cast::<c_void>();
    // SAFETY: the stream is live; the trampoline only reads `args`, which the capture's book
    // (then the graph) keeps alive until the model is destroyed.
    unsafe {
        raw::stream::launch_host_func(&s.dev.acl, raw_stream, Some(replay_host_fn_trampoline), args)
    }
    .map_err(map_call_err)?;
    match lock(&s.dev.captures.books).get_mut(&id) {
        Some(book) => book.host_fns.push(task),
        // The runtime holds the address now: it must stay valid, even without a book.
        None => std::mem::forget(task),
    }
    Ok(())
}

/// A model runtime instance captured on an [`AscendDevice`](super::AscendDevice): implements
/// [`GraphHal`].
///
/// Each launch is `aclmdlRIExecuteAsync` followed by a record of an event of the graph for
/// that stream (one position: both are one task for soma). Dropping the graph synchronises
/// those events, destroys the model (`aclmdlRIDestroy`) and only then frees the captured host
/// functions; errors there are kept by the device and returned by its next fallible call.
pub struct AscendGraph {
    dev: Arc<DeviceInner>,
    model: Handle,
    id: u64,
    tasks: usize,
    /// Per launch stream, the event recorded after its latest launch.
    launches: Mutex<Vec<(Weak<StreamShared>, Handle)>>,
    host_fns: Vec<Arc<ReplayHostFn>>,
}

impl std::fmt::Debug for AscendGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AscendGraph").field("id", &self.id).field("tasks", &self.tasks).finish()
    }
}

impl AscendGraph {
    /// The runtime's model handle, valid while `self` lives.
    pub fn as_raw(&self) -> ascend_sys::aclmdlRI {
        self.model.0
    }

    /// The event recorded after launches on `s` (created at the first one).
    fn event_for(
        &self,
        launches: &mut Vec<(Weak<StreamShared>, Handle)>,
        s: &Arc<StreamShared>,
    ) -> DriverResult<Handle> {
        if let Some((_, e)) = launches.iter().find(|(w, _)| w.as_ptr() == Arc::as_ptr(s)) {
            return Ok(*e);
        }
        self.dev.enter()?;
        let e = Handle(raw::event::create(&self.dev.acl).map_err(map_call_err)?);
        launches.push((Arc::downgrade(s), e));
        Ok(e)
    }
}

impl GraphHal for AscendGraph {
    fn id(&self) -> u64 {
        self.id
    }

    fn task_count(&self) -> usize {
        self.tasks
    }

    fn launch(&self, stream: &dyn StreamHal) -> DriverResult<u64> {
        let s = stream.as_any().downcast_ref::<AscendStream>().ok_or_else(|| {
            DriverError::InvalidHandle("the stream is not a stream of the ascend backend".into())
        })?;
        if !s.same_device(&self.dev) {
            return Err(DriverError::InvalidHandle(format!(
                "graph {:#x} belongs to another device than stream {}",
                self.id,
                s.id()
            )));
        }
        let shared = &s.shared;
        let not_capturable = || {
            error(
                CaptureErrorKind::NotCapturable,
                format!(
                    "launching graph {:#x} on stream {}, which is capturing, cannot be captured",
                    self.id,
                    shared.id()
                ),
            )
        };
        if shared.capture.id().is_some() {
            return Err(not_capturable());
        }
        let mut launches = lock(&self.launches);
        let event = self.event_for(&mut launches, shared)?;
        let acl = &self.dev.acl;
        let slot = shared.enqueue(|raw_stream, slot| {
            if let Slot::Captured(_) = slot {
                return Err(not_capturable());
            }
            // SAFETY: the model and the stream are live and of this device (current).
            unsafe { raw::mdl::execute_async(acl, self.model.0, raw_stream) }
                .map_err(map_call_err)?;
            // SAFETY: the event and the stream are live and of this device.
            unsafe { raw::event::record(acl, event.0, raw_stream) }.map_err(map_call_err)
        })?;
        match slot {
            Slot::Position(position) => Ok(position),
            Slot::Captured(_) => Err(not_capturable()),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for AscendGraph {
    fn drop(&mut self) {
        let acl = &self.dev.acl;
        let launches = std::mem::take(self.launches.get_mut().unwrap_or_else(|e| e.into_inner()));
        let result = self.dev.enter().and_then(|()| {
            for (_, event) in &launches {
                // SAFETY: the event is live (created by this graph) and recorded.
                unsafe { raw::event::synchronize(acl, event.0) }.map_err(map_call_err)?;
                // SAFETY: live, its record completed, not used afterwards.
                unsafe { raw::event::destroy(acl, event.0) }.map_err(map_call_err)?;
            }
            // SAFETY: the model is live and its launches have completed.
            unsafe { raw::mdl::destroy(acl, self.model.0) }.map_err(map_call_err)
        });
        match result {
            // The captured host functions go only now, after the model.
            Ok(()) => self.host_fns.clear(),
            Err(e) => {
                self.dev.record_err(e);
                // The model may still call them: they stay.
                std::mem::forget(std::mem::take(&mut self.host_fns));
            }
        }
    }
}
