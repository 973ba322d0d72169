//! [`SimStream`]: a worker thread that executes tasks in enqueue order.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use soma_core::hal::{
    AccessMode, CaptureInfo, CaptureMode, DevicePtr, DriverError, DriverResult, EventHal, GraphHal,
    HostFn, KernelLaunch, MemRef, ReplayableHostFn, ReplayableKernel, StreamHal,
};

use crate::capture::{self, CapEnd, Op, StreamCapture};
use crate::device::DeviceCore;
use crate::event::{downcast_event, RecordState};
use crate::graph::{GraphBody, SimGraph};
use crate::memory::{check_no_self_overlap, End, HostSpan, Owner, Range, SpanningAccess};
use crate::model_delay;
use crate::peer::{Check, Placement};
use crate::sanitizer::{Sanitizer, Stamp};

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// The state of a stream shared by its handle, its worker and the events recorded on it.
pub(crate) struct StreamShared {
    id: u64,
    enqueued: AtomicU64,
    completed: AtomicU64,
    failed: AtomicBool,
    error: Mutex<Option<DriverError>>,
    done_lock: Mutex<()>,
    done_cv: Condvar,
    waiters: AtomicUsize,
    /// Set when the stream's handle is dropped (its queue drained): an event recorded on it
    /// may keep this state alive, but the device no longer has the stream.
    pub(crate) dropped: AtomicBool,
    /// The device's stream-order sanitizer, if on.
    pub(crate) san: Option<Arc<Sanitizer>>,
    /// The capture the stream records into, if any.
    pub(crate) capture: StreamCapture,
}

impl StreamShared {
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn completed_pos(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    /// Blocks (no spinning) until `completed >= pos`.
    pub(crate) fn wait_for(&self, pos: u64) {
        if self.completed.load(Ordering::SeqCst) >= pos {
            return;
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let mut g = self.done_lock.lock();
        while self.completed.load(Ordering::SeqCst) < pos {
            self.done_cv.wait(&mut g);
        }
        drop(g);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// Marks `pos` completed and wakes waiters.
    fn finish(&self, pos: u64) {
        self.completed.store(pos, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            drop(self.done_lock.lock());
            self.done_cv.notify_all();
        }
    }

    fn sticky(&self) -> Option<DriverError> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.error.lock().clone()
    }

    pub(crate) fn fail(&self, e: DriverError) {
        let mut g = self.error.lock();
        if g.is_none() {
            *g = Some(e);
        }
        self.failed.store(true, Ordering::Release);
    }

    /// Drains the queue, then reports the sticky error; on a capturing stream (whose queue
    /// holds only what was enqueued before the capture) the capture's error instead, and the
    /// capture is invalidated.
    pub(crate) fn synchronize(&self) -> DriverResult<()> {
        let target = self.enqueued.load(Ordering::SeqCst);
        self.wait_for(target);
        if let Some(san) = &self.san {
            // Everything enqueued before the call has run (or was skipped): the host has
            // observed it, so every task enqueued from now on is ordered after it.
            san.observe(self.id, target + 1);
        }
        if let Some(cap) = self.capture.current() {
            return Err(cap.stream_captured("synchronize", self.id));
        }
        self.sticky().map_or(Ok(()), Err)
    }
}

pub(crate) enum TaskKind {
    Host(HostFn),
    Kernel(KernelLaunch),
    Copy { dst: End, src: End, len: u64, name: &'static str },
    Memset { dst: u64, value: u8, len: u64 },
    Record(Arc<RecordState>),
    Wait(Arc<RecordState>),
    Graph(crate::graph::GraphLaunch),
}

impl TaskKind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            TaskKind::Host(_) => "host_fn",
            TaskKind::Kernel(k) => k.name,
            TaskKind::Copy { name, .. } => name,
            TaskKind::Memset { .. } => "memset",
            TaskKind::Record(_) => "event_record",
            TaskKind::Wait(_) => "event_wait",
            TaskKind::Graph(_) => "graph_launch",
        }
    }

    /// Completes the task's event records without running it (skipped, or failed by an
    /// injected fault), so that their waiters never hang.
    fn complete_records(&self, error: DriverError) {
        match self {
            TaskKind::Record(r) => r.complete(Some(error)),
            TaskKind::Graph(g) => g.complete_records(0, Some(error)),
            _ => {}
        }
    }
}

struct Task {
    pos: u64,
    kind: TaskKind,
    /// Sanitizer stamp (host order and stream clock at the enqueue), when it is on.
    stamp: Option<Stamp>,
}

impl TaskKind {
    /// Whether the task accesses device memory (what the sanitizer checks).
    fn accesses_device(&self) -> bool {
        match self {
            TaskKind::Kernel(k) => k.buffers.iter().any(|b| b.len > 0),
            TaskKind::Copy { dst, src, .. } => {
                matches!(dst, End::Device(_)) || matches!(src, End::Device(_))
            }
            TaskKind::Memset { .. } => true,
            TaskKind::Graph(g) => g.accesses_device(),
            _ => false,
        }
    }
}

/// A stream of the software NPU. Implements [`StreamHal`].
///
/// Tasks run strictly in enqueue order on the stream's own worker thread. Several host threads
/// may enqueue concurrently.
///
/// # Errors inside tasks
///
/// A task that fails (a kernel returns an error or panics, a copy touches unmapped memory, a
/// data race with another stream is detected, an injected fault) makes the stream *failed*:
/// it stores a sticky [`DriverError::TaskFailed`], and every later task is skipped (counted
/// completed without running; skipped host functions are dropped unrun, skipped event
/// records complete marked with the error). As on CANN, **the stream stays failed**:
/// every later [`synchronize`](StreamHal::synchronize) and [`query`](StreamHal::query) reports
/// the same error until [`clear_error`](Self::clear_error) is called.
///
/// # Event records
///
/// A record is a task like any other: it completes when the work enqueued before it has
/// run. On a stream with nothing in flight it is complete when [`record`](StreamHal::record)
/// returns — completed on the calling thread, as a device completes a record on an idle
/// stream at once — so that recording and waiting on idle streams costs no thread wake-up.
/// (With the stream-order sanitizer on, or a task fault armed, every record goes through the
/// queue.)
///
/// # Data races
///
/// Before a kernel, copy or memset runs, it registers its device ranges in the device-wide
/// in-flight table; if a task of another stream (or a synchronous copy) holds an overlapping
/// range and one of the two writes, the task fails with a "concurrent conflicting access
/// (data race)" error naming both streams and task positions, instead of running.
///
/// # Drop
///
/// Dropping the stream executes everything still queued and joins the worker thread.
pub struct SimStream {
    shared: Arc<StreamShared>,
    core: Arc<DeviceCore>,
    tx: Mutex<Option<Sender<Task>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStream")
            .field("id", &self.shared.id)
            .field("enqueued", &self.enqueued())
            .field("completed", &self.completed())
            .finish()
    }
}

fn device_range(p: DevicePtr, len: u64, mode: AccessMode) -> DriverResult<Range> {
    if p.addr().checked_add(len).is_none() {
        return Err(DriverError::InvalidAddress {
            addr: p.addr(),
            len,
            reason: "range overflows".into(),
        });
    }
    Ok(Range { addr: p.addr(), len, mode })
}

impl SimStream {
    pub(crate) fn new(core: Arc<DeviceCore>) -> DriverResult<Self> {
        let id = NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed);
        let san = core.sanitizer.clone();
        let shared = Arc::new(StreamShared {
            id,
            enqueued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            done_lock: Mutex::new(()),
            done_cv: Condvar::new(),
            waiters: AtomicUsize::new(0),
            dropped: AtomicBool::new(false),
            san,
            capture: StreamCapture::default(),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let (c, s) = (Arc::clone(&core), Arc::clone(&shared));
        let worker = std::thread::Builder::new()
            .name(format!("soma-sim-stream-{id}"))
            .spawn(move || worker_loop(&c, &s, &rx))
            .map_err(|e| DriverError::Native {
                code: -1,
                message: format!("cannot start stream worker: {e}"),
            })?;
        // Registered once the stream exists: a stream whose worker did not start is never
        // dropped, and would stay in the sanitizer's tables.
        if let Some(san) = &shared.san {
            san.register_stream(id, Arc::downgrade(&shared));
        }
        core.live_streams.fetch_add(1, Ordering::Relaxed);
        Ok(Self { shared, core, tx: Mutex::new(Some(tx)), worker: Mutex::new(Some(worker)) })
    }

    pub(crate) fn shared(&self) -> &Arc<StreamShared> {
        &self.shared
    }

    pub(crate) fn core(&self) -> &Arc<DeviceCore> {
        &self.core
    }

    /// Enqueues one launch of graph `body`, whose waits on records made outside its capture
    /// resolved to `waits` (per task of the body): the sanitizer orders the launch after them,
    /// and the launch records the graph's events at its position.
    pub(crate) fn enqueue_graph(
        &self,
        body: &Arc<GraphBody>,
        waits: Vec<Option<Arc<RecordState>>>,
    ) -> DriverResult<u64> {
        if let Some(san) = &self.shared.san {
            for clock in waits.iter().flatten().filter_map(|r| r.clock.as_ref()) {
                san.on_wait(self.shared.id, clock);
            }
        }
        let guard = self.tx.lock();
        let Some(tx) = guard.as_ref() else {
            return Err(self.destroyed());
        };
        let pos = self.shared.enqueued.load(Ordering::Relaxed) + 1;
        let stamp = self
            .shared
            .san
            .as_ref()
            .map(|san| san.on_enqueue(self.shared.id, body.accesses_device));
        let launch = crate::graph::new_launch(body, &self.shared, pos, stamp.as_ref(), waits);
        self.send(tx, Task { pos, kind: TaskKind::Graph(launch), stamp })
    }

    /// The sticky error, if the stream has failed.
    pub fn error(&self) -> Option<DriverError> {
        self.shared.sticky()
    }

    /// Clears the sticky error and returns it: tasks enqueued afterwards (and queued tasks not
    /// yet skipped) run again.
    pub fn clear_error(&self) -> Option<DriverError> {
        let mut g = self.shared.error.lock();
        self.shared.failed.store(false, Ordering::Release);
        g.take()
    }

    /// Enqueues the task `make(position)`; the position assignment and the channel send are
    /// atomic together, so positions follow channel order.
    fn enqueue(&self, make: impl FnOnce(u64) -> TaskKind) -> DriverResult<u64> {
        let guard = self.tx.lock();
        let Some(tx) = guard.as_ref() else {
            return Err(self.destroyed());
        };
        let pos = self.shared.enqueued.load(Ordering::Relaxed) + 1;
        let kind = make(pos);
        let stamp = self
            .shared
            .san
            .as_ref()
            .map(|san| san.on_enqueue(self.shared.id, kind.accesses_device()));
        self.send(tx, Task { pos, kind, stamp })
    }

    /// As [`enqueue`](Self::enqueue) for a task that does not access device memory; `make`
    /// also gets the sanitizer's stamp at the enqueue (records capture its clock).
    fn enqueue_stamped(
        &self,
        make: impl FnOnce(u64, Option<&Stamp>) -> TaskKind,
    ) -> DriverResult<u64> {
        let guard = self.tx.lock();
        let Some(tx) = guard.as_ref() else {
            return Err(self.destroyed());
        };
        let pos = self.shared.enqueued.load(Ordering::Relaxed) + 1;
        let stamp = self.shared.san.as_ref().map(|san| san.on_enqueue(self.shared.id, false));
        let kind = make(pos, stamp.as_ref());
        self.send(tx, Task { pos, kind, stamp })
    }

    /// Publishes the task's position and sends it (with the enqueue lock held).
    fn send(&self, tx: &Sender<Task>, task: Task) -> DriverResult<u64> {
        let pos = task.pos;
        // Publish the position before the send so that `completed <= enqueued` always holds.
        self.shared.enqueued.store(pos, Ordering::SeqCst);
        if tx.send(task).is_err() {
            // The worker is gone (cannot happen while we hold the sender): never leave a
            // position that would not complete.
            self.shared.finish(pos);
            return Err(DriverError::InvalidHandle(format!("stream {} has no worker", self.id())));
        }
        Ok(pos)
    }

    /// The error of an enqueue on a destroyed stream.
    fn destroyed(&self) -> DriverError {
        DriverError::InvalidHandle(format!("stream {} is destroyed", self.id()))
    }

    /// A record on a stream with nothing in flight (every enqueued task completed, the
    /// stream not failed): it completes at once, on the calling thread, as the worker would
    /// complete it first thing — without waking the worker. `None`: work is in flight, the
    /// record goes through the queue. Callers leave the sanitizer's stamps and armed task
    /// faults to the queue.
    fn record_idle(&self, ev: &crate::event::SimEvent) -> DriverResult<Option<u64>> {
        let guard = self.tx.lock();
        if guard.is_none() {
            return Err(self.destroyed());
        }
        // `enqueued` only moves under the enqueue lock, which this thread holds; `completed`
        // reaching it means the worker has finished every task and the channel is empty, and
        // only the worker's tasks can fail the stream.
        let enqueued = self.shared.enqueued.load(Ordering::Relaxed);
        if self.shared.completed.load(Ordering::SeqCst) != enqueued
            || self.shared.failed.load(Ordering::Acquire)
        {
            return Ok(None);
        }
        let pos = enqueued + 1;
        let r = Arc::new(RecordState::new(Arc::clone(&self.shared), pos, None));
        r.complete(None);
        ev.set_latest(r);
        self.shared.enqueued.store(pos, Ordering::SeqCst);
        self.shared.finish(pos);
        Ok(Some(pos))
    }

    /// Checks that every range is mapped device memory of this device, or of a peer it has
    /// access to.
    fn check_mapped(&self, ranges: &[Range]) -> DriverResult<()> {
        self.core.check_mapped_anywhere(ranges)
    }

    /// Checks a kernel's buffers: no overflow, no write overlapping another buffer, mapped.
    fn check_kernel(&self, buffers: &[soma_core::hal::BufferAccess]) -> DriverResult<()> {
        let ranges = buffers
            .iter()
            .map(|b| device_range(b.ptr, b.len, b.mode))
            .collect::<DriverResult<Vec<_>>>()?;
        check_no_self_overlap(&ranges)?;
        self.check_mapped(&ranges)
    }
}

/// The task name of a copy between `dst` and `src`.
fn copy_name(dst: MemRef, src: MemRef) -> &'static str {
    match (dst, src) {
        (MemRef::Device(_), MemRef::Host(_)) => "copy_h2d",
        (MemRef::Host(_), MemRef::Device(_)) => "copy_d2h",
        (MemRef::Device(_), MemRef::Device(_)) => "copy_d2d",
        (MemRef::Host(_), MemRef::Host(_)) => "copy_h2h",
    }
}

impl Drop for SimStream {
    fn drop(&mut self) {
        capture::stream_dropped(&self.shared, &self.core.captures);
        // Closing the channel lets the worker drain the queue and exit.
        drop(self.tx.lock().take());
        if let Some(w) = self.worker.lock().take() {
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
                // Drained: no task of the stream is left for its faults to hit.
                self.core.faults.forget_stream(self.shared.id);
            }
        }
        if let Some(san) = &self.shared.san {
            san.stream_dropped(self.shared.id, self.enqueued());
        }
        self.shared.dropped.store(true, Ordering::Release);
        self.core.stream_dropped();
    }
}

fn worker_loop(core: &DeviceCore, s: &StreamShared, rx: &Receiver<Task>) {
    for Task { pos, kind, stamp } in rx.iter() {
        let name = kind.name();
        let tracked = stamp.as_ref().filter(|st| st.tracked).map(|st| st.seq);
        let result = if let Some(err) = s.sticky() {
            // Skipped: host fns and kernels are dropped unrun; records complete with the error.
            kind.complete_records(err);
            drop(catch_unwind(AssertUnwindSafe(move || drop(kind))));
            Ok(())
        } else if core.faults.task_hit(s.id, pos) {
            let msg = "injected fault".to_string();
            kind.complete_records(task_failed(s, pos, name, &msg));
            drop(catch_unwind(AssertUnwindSafe(move || drop(kind))));
            Err(msg)
        } else {
            match catch_unwind(AssertUnwindSafe(|| {
                execute_task(core, s, pos, kind, stamp.as_ref(), true)
            })) {
                Ok(r) => r,
                Err(p) => Err(format!("panicked: {}", panic_message(p.as_ref()))),
            }
        };
        if let Err(message) = result {
            s.fail(task_failed(s, pos, name, &message));
        }
        match &s.san {
            Some(san) => {
                if let Some(seq) = tracked {
                    san.retire(s.id, seq);
                }
                if san.poisons() {
                    san.finish_with_poison(s.id, pos, &core.memory, || s.finish(pos));
                } else {
                    s.finish(pos);
                }
            }
            None => s.finish(pos),
        }
    }
}

pub(crate) fn task_failed(s: &StreamShared, pos: u64, name: &str, message: &str) -> DriverError {
    DriverError::TaskFailed { stream: s.id, task: pos, name: name.into(), message: message.into() }
}

pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

/// Runs the sanitizer's checks of a task's ranges, when it is on (`replay`: a task of a graph
/// launch).
fn sanitize(
    s: &StreamShared,
    pos: u64,
    stamp: Option<&Stamp>,
    (name, replay): (&'static str, bool),
    ranges: &[Range],
) -> Result<(), String> {
    match (&s.san, stamp) {
        (Some(san), Some(stamp)) => san.check_task(s.id, pos, stamp, (name, replay), ranges),
        _ => Ok(()),
    }
}

/// Registers a task's ranges in flight in the memories `placement` found for them.
fn acquire_placed<'m>(
    core: &'m DeviceCore,
    placement: Option<&'m Placement>,
    owner: Owner,
    ranges: &[Range],
    exclusive_writes: bool,
) -> Result<SpanningAccess<'m>, String> {
    core.acquire_placed(placement, owner, ranges, exclusive_writes).map_err(|e| e.message())
}

/// Runs task `pos` of `s`; `charge_launch`: whether it pays the latency model's launch cost
/// (a task of a graph launch does not: the launch paid it once).
pub(crate) fn execute_task(
    core: &DeviceCore,
    s: &StreamShared,
    pos: u64,
    kind: TaskKind,
    stamp: Option<&Stamp>,
    charge_launch: bool,
) -> Result<(), String> {
    let owner = Owner::Task { stream: s.id, task: pos };
    let lat = core.latency();
    let launch = if charge_launch { lat.launch } else { std::time::Duration::ZERO };
    // Only a graph launch's tasks run without their own launch cost.
    let replay = !charge_launch;
    match kind {
        TaskKind::Host(f) => {
            model_delay(launch);
            f();
            Ok(())
        }
        TaskKind::Kernel(k) => {
            model_delay(launch);
            let ranges: Vec<Range> = k
                .buffers
                .iter()
                .map(|b| Range { addr: b.ptr.addr(), len: b.len, mode: b.mode })
                .collect();
            sanitize(s, pos, stamp, (k.name, replay), &ranges)?;
            let placement = core.place(&ranges, Check::Owners).map_err(|e| e.to_string())?;
            let acc = acquire_placed(core, placement.as_ref(), owner, &ranges, true)?;
            let body = k.body;
            body(&acc).map_err(|e| e.0)
        }
        TaskKind::Copy { dst, src, len, name } => {
            model_delay(launch);
            let mut ranges: smallvec::SmallVec<[Range; 2]> = smallvec::SmallVec::new();
            if let End::Device(a) = dst {
                ranges.push(Range { addr: a, len, mode: AccessMode::Write });
            }
            if let End::Device(a) = src {
                ranges.push(Range { addr: a, len, mode: AccessMode::Read });
            }
            sanitize(s, pos, stamp, (name, replay), &ranges)?;
            let placement = core.place(&ranges, Check::Owners).map_err(|e| e.to_string())?;
            let mut acc = acquire_placed(core, placement.as_ref(), owner, &ranges, false)?;
            // Between two devices the copy crosses the link between them.
            let across = ranges.len() == 2 && placement.as_ref().is_some_and(|p| p.across(0, 1));
            model_delay(if across { lat.peer_copy_time(len) } else { lat.copy_time(len) });
            acc.copy(&dst, &src, len).map_err(|e| e.to_string())
        }
        TaskKind::Memset { dst, value, len } => {
            model_delay(launch);
            let r = Range { addr: dst, len, mode: AccessMode::Write };
            sanitize(s, pos, stamp, ("memset", replay), &[r])?;
            let placement = core.place(&[r], Check::Owners).map_err(|e| e.to_string())?;
            let mut acc = acquire_placed(core, placement.as_ref(), owner, &[r], false)?;
            acc.fill(dst, value, len).map_err(|e| e.to_string())
        }
        TaskKind::Record(r) => {
            r.complete(None);
            Ok(())
        }
        TaskKind::Wait(r) => {
            r.stream.wait_for(r.position);
            Ok(())
        }
        TaskKind::Graph(g) => crate::graph::run(core, s, pos, g, stamp),
    }
}

impl StreamHal for SimStream {
    fn id(&self) -> u64 {
        self.shared.id
    }

    fn enqueued(&self) -> u64 {
        self.shared.enqueued.load(Ordering::SeqCst)
    }

    fn completed(&self) -> u64 {
        self.shared.completed.load(Ordering::SeqCst)
    }

    fn synchronize(&self) -> DriverResult<()> {
        self.shared.synchronize()
    }

    fn query(&self) -> DriverResult<bool> {
        if let Some(cap) = self.shared.capture.current() {
            return Err(cap.stream_captured("query", self.shared.id));
        }
        if let Some(e) = self.shared.sticky() {
            return Err(e);
        }
        let enqueued = self.enqueued();
        let done = self.completed() >= enqueued;
        if let (true, Some(san)) = (done, &self.shared.san) {
            san.observe(self.shared.id, enqueued + 1);
        }
        Ok(done)
    }

    fn host_fn(&self, f: HostFn) -> DriverResult<()> {
        capture::refuse_once(&self.shared, "a host function")?;
        self.enqueue(|_| TaskKind::Host(f)).map(drop)
    }

    fn launch(&self, kernel: KernelLaunch) -> DriverResult<()> {
        self.check_kernel(&kernel.buffers)?;
        capture::refuse_once(&self.shared, &format!("kernel {}", kernel.name))?;
        self.enqueue(|_| TaskKind::Kernel(kernel)).map(drop)
    }

    fn host_fn_replayable(&self, f: ReplayableHostFn) -> DriverResult<()> {
        if let Some(r) = capture::push(&self.shared, || Op::Host(Arc::clone(&f))) {
            return r;
        }
        self.enqueue(|_| TaskKind::Host(Box::new(move || f()))).map(drop)
    }

    fn launch_replayable(&self, kernel: ReplayableKernel) -> DriverResult<()> {
        self.check_kernel(&kernel.buffers)?;
        if let Some(r) = capture::push(&self.shared, || Op::Kernel(kernel.clone())) {
            return r;
        }
        self.enqueue(|_| TaskKind::Kernel(kernel.once())).map(drop)
    }

    fn begin_capture(&self, mode: CaptureMode) -> DriverResult<()> {
        capture::begin(&self.shared, &self.core.captures, mode)
    }

    fn end_capture(&self) -> DriverResult<Box<dyn GraphHal>> {
        let ended = capture::end(&self.shared, &self.core.captures)?;
        Ok(Box::new(SimGraph::new(ended, Arc::clone(&self.core))))
    }

    fn capture_info(&self) -> DriverResult<CaptureInfo> {
        Ok(capture::info(&self.shared))
    }

    fn capture_epoch(&self) -> u64 {
        self.shared.capture.epoch()
    }

    fn copy_d2d(&self, dst: DevicePtr, src: DevicePtr, len: u64) -> DriverResult<()> {
        let d = device_range(dst, len, AccessMode::Write)?;
        let s = device_range(src, len, AccessMode::Read)?;
        self.check_mapped(&[d, s])?;
        let (dst_end, src_end) = (CapEnd::Device(dst.addr()), CapEnd::Device(src.addr()));
        let name = "copy_d2d";
        if let Some(r) =
            capture::push(&self.shared, || Op::Copy { dst: dst_end, src: src_end, len, name })
        {
            return r;
        }
        self.enqueue(|_| TaskKind::Copy {
            dst: End::Device(dst.addr()),
            src: End::Device(src.addr()),
            len,
            name: "copy_d2d",
        })
        .map(drop)
    }

    unsafe fn copy_async(&self, dst: MemRef, src: MemRef, len: u64) -> DriverResult<()> {
        let n = usize::try_from(len).map_err(|_| DriverError::InvalidValue("length".into()))?;
        let mut ranges: smallvec::SmallVec<[Range; 2]> = smallvec::SmallVec::new();
        if let MemRef::Device(p) = dst {
            ranges.push(device_range(p, len, AccessMode::Write)?);
        }
        if let MemRef::Device(p) = src {
            ranges.push(device_range(p, len, AccessMode::Read)?);
        }
        self.check_mapped(&ranges)?;
        let name = copy_name(dst, src);
        let cap_end = |m: MemRef| match m {
            MemRef::Device(p) => CapEnd::Device(p.addr()),
            MemRef::Host(h) => CapEnd::Host { ptr: h, len: n },
        };
        let (cap_dst, cap_src) = (cap_end(dst), cap_end(src));
        if let Some(r) =
            capture::push(&self.shared, || Op::Copy { dst: cap_dst, src: cap_src, len, name })
        {
            return r;
        }
        let end = |m: MemRef| match m {
            MemRef::Device(p) => End::Device(p.addr()),
            // SAFETY: the caller of `copy_async` guarantees host ends stay valid (and are not
            // otherwise accessed in a conflicting way) until the task completes; the span is
            // dropped by the worker when the task has run or been skipped.
            MemRef::Host(h) => End::Host(unsafe { HostSpan::new(h, n) }),
        };
        let (dst, src) = (end(dst), end(src));
        self.enqueue(|_| TaskKind::Copy { dst, src, len, name }).map(drop)
    }

    fn memset(&self, dst: DevicePtr, value: u8, len: u64) -> DriverResult<()> {
        let r = device_range(dst, len, AccessMode::Write)?;
        self.check_mapped(&[r])?;
        let dst = dst.addr();
        if let Some(r) = capture::push(&self.shared, || Op::Memset { dst, value, len }) {
            return r;
        }
        self.enqueue(|_| TaskKind::Memset { dst, value, len }).map(drop)
    }

    fn record(&self, event: &dyn EventHal) -> DriverResult<u64> {
        let ev = downcast_event(event)?;
        if let Some(r) = capture::record(&self.shared, ev) {
            return r.map(|()| self.enqueued());
        }
        if self.shared.san.is_none() && !self.core.faults.tasks_armed() {
            if let Some(pos) = self.record_idle(ev)? {
                return Ok(pos);
            }
        }
        // The event's latest record is replaced under the enqueue lock, so concurrent records
        // of one event on one stream leave it at the highest position.
        self.enqueue_stamped(|pos, stamp| {
            let clock = stamp.map(|st| Sanitizer::record_clock(&st.clock, self.shared.id, pos));
            let r = Arc::new(RecordState::new(Arc::clone(&self.shared), pos, clock));
            ev.set_latest(Arc::clone(&r));
            TaskKind::Record(r)
        })
    }

    fn wait(&self, event: &dyn EventHal) -> DriverResult<()> {
        let ev = downcast_event(event)?;
        if let Some(r) = capture::wait(&self.shared, ev) {
            return r;
        }
        let latest = ev.latest();
        if let (Some(san), Some(clock)) =
            (&self.shared.san, latest.as_ref().and_then(|r| r.clock.as_ref()))
        {
            // Later tasks of this stream are ordered after the record (even when it has
            // already completed and no wait task is needed).
            san.on_wait(self.shared.id, clock);
        }
        match latest {
            // Never recorded, or already complete: nothing to wait for.
            None => Ok(()),
            Some(r) if r.is_complete() => Ok(()),
            Some(r) => self.enqueue(|_| TaskKind::Wait(r)).map(drop),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
