//! Graph capture on the software NPU: the capture state of streams, the device's active
//! captures and the rules of their modes, streams joining a capture through events, and the
//! checks of `end_capture`. The graph a capture ends in, and its launches, are in
//! [`crate::graph`].
//!
//! Lock order: a capture's book, then a stream's capture state (joining); never the other way
//! round. Event slots are locked alone.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::ThreadId;

use parking_lot::Mutex;
use soma_core::hal::{
    CaptureErrorKind, CaptureInfo, CaptureMode, CaptureStatus, DriverError, DriverResult,
    ReplayableHostFn, ReplayableKernel,
};

use crate::event::{EventSlot, Latest, SimEvent};
use crate::stream::StreamShared;

static NEXT_CAPTURE_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The calling thread's capture mode (`aclmdlRICaptureThreadExchangeMode`).
    static THREAD_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// Sets the calling thread's capture mode; returns the previous one.
pub(crate) fn exchange_thread_mode(mode: CaptureMode) -> CaptureMode {
    THREAD_MODE.with(|m| m.replace(mode))
}

pub(crate) fn error(kind: CaptureErrorKind, message: String) -> DriverError {
    DriverError::Capture { kind, message }
}

/// One end of a captured copy.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CapEnd {
    /// A device address.
    Device(u64),
    /// Host memory the caller of `copy_async` keeps valid until the graph is dropped.
    Host {
        /// First byte.
        ptr: *mut u8,
        /// Length in bytes.
        len: usize,
    },
}

// SAFETY: a host end is only an address here; it is dereferenced by a graph launch's copy,
// whose validity the caller of the `unsafe` `copy_async` guaranteed until the graph is
// dropped (the HAL's contract for captured copies), on whatever thread runs it.
unsafe impl Send for CapEnd {}
// SAFETY: as above; a shared `CapEnd` gives no access to the memory.
unsafe impl Sync for CapEnd {}

/// A captured task, as a graph launch runs it again.
pub(crate) enum Op {
    Kernel(ReplayableKernel),
    Host(ReplayableHostFn),
    Copy {
        dst: CapEnd,
        src: CapEnd,
        len: u64,
        name: &'static str,
    },
    Memset {
        dst: u64,
        value: u8,
        len: u64,
    },
    /// Records the event again at every launch.
    Record(Arc<EventSlot>),
    /// Waits for the event's latest record at launch time (a record made outside the capture).
    ExternalWait(Arc<EventSlot>),
    /// A wait on a record of the same capture: ordered by the launch's capture order already.
    InternalWait,
}

struct Captured {
    stream: u64,
    /// The previous task of the same stream.
    prev: Option<usize>,
    /// For a wait on a record of this capture: that record.
    after: Option<usize>,
    op: Op,
}

struct Member {
    id: u64,
    stream: Weak<StreamShared>,
    last: Option<usize>,
}

enum Status {
    Active,
    Invalidated(String),
    Ended,
}

struct Book {
    status: Status,
    tasks: Vec<Captured>,
    members: Vec<Member>,
}

/// One capture: begun on its origin stream, joined by other streams through events.
pub(crate) struct Capture {
    pub(crate) id: u64,
    mode: CaptureMode,
    thread: ThreadId,
    origin: u64,
    book: Mutex<Book>,
}

impl Capture {
    fn invalidated_error(&self, reason: &str) -> DriverError {
        error(
            CaptureErrorKind::Invalidated,
            format!("capture {} was invalidated: {reason}", self.id),
        )
    }

    /// Invalidates the capture (if it is active) with `reason`.
    fn invalidate(&self, reason: String) {
        let mut b = self.book.lock();
        if matches!(b.status, Status::Active) {
            b.status = Status::Invalidated(reason);
        }
    }

    /// The error of a call forbidden on a capturing stream (`what`, on stream `stream`); the
    /// capture is invalidated.
    pub(crate) fn stream_captured(&self, what: &str, stream: u64) -> DriverError {
        let message = format!(
            "{what} of stream {stream} while it is capturing (capture {}): its captured work \
             does not run until the graph is launched",
            self.id
        );
        self.invalidate(message.clone());
        error(CaptureErrorKind::StreamCaptured, format!("{message}; the capture is invalidated"))
    }

    /// The error of synchronising, querying or timing an event whose latest record this
    /// capture holds; an active capture is invalidated.
    pub(crate) fn event_captured(&self, what: &str) -> DriverError {
        let active = !matches!(self.book.lock().status, Status::Ended);
        let message = format!(
            "{what} of an event whose latest record was captured (capture {}): it runs only when \
             the graph is launched",
            self.id
        );
        if active {
            self.invalidate(message.clone());
            error(CaptureErrorKind::EventCaptured, format!("{message}; the capture is invalidated"))
        } else {
            error(CaptureErrorKind::EventCaptured, format!("{message}; record the event again"))
        }
    }

    /// Appends a task of member `stream`; returns its index.
    fn push(&self, stream: u64, op: Op, after: Option<usize>) -> DriverResult<usize> {
        let mut b = self.book.lock();
        match &b.status {
            Status::Active => {}
            Status::Invalidated(r) => return Err(self.invalidated_error(r)),
            Status::Ended => return Err(self.ended_error(stream)),
        }
        let index = b.tasks.len();
        let Some(m) = b.members.iter_mut().find(|m| m.id == stream) else {
            return Err(self.ended_error(stream));
        };
        let prev = m.last.replace(index);
        b.tasks.push(Captured { stream, prev, after, op });
        Ok(index)
    }

    fn ended_error(&self, stream: u64) -> DriverError {
        error(
            CaptureErrorKind::NotCapturing,
            format!("capture {} ended while stream {stream} was adding a task to it", self.id),
        )
    }

    /// Makes `stream` (not capturing) join the capture with a wait on its task `after`.
    fn join(self: &Arc<Self>, stream: &Arc<StreamShared>, after: usize) -> DriverResult<()> {
        let mut b = self.book.lock();
        match &b.status {
            Status::Active => {}
            Status::Invalidated(r) => return Err(self.invalidated_error(r)),
            Status::Ended => return Err(self.ended_record_error(stream.id())),
        }
        if let Err(other) = stream.capture.enter(self) {
            return Err(error(
                CaptureErrorKind::Dependency,
                format!(
                    "stream {} cannot join capture {}: it entered capture {} meanwhile",
                    stream.id(),
                    self.id,
                    other.id
                ),
            ));
        }
        let index = b.tasks.len();
        b.members.push(Member {
            id: stream.id(),
            stream: Arc::downgrade(stream),
            last: Some(index),
        });
        b.tasks.push(Captured {
            stream: stream.id(),
            prev: None,
            after: Some(after),
            op: Op::InternalWait,
        });
        Ok(())
    }

    fn ended_record_error(&self, stream: u64) -> DriverError {
        error(
            CaptureErrorKind::Dependency,
            format!(
                "stream {stream} waits on an event whose latest record was captured into capture \
                 {}, which has ended; record the event again (or launch the graph) first",
                self.id
            ),
        )
    }

    fn status(&self) -> CaptureStatus {
        match self.book.lock().status {
            Status::Active => CaptureStatus::Active,
            Status::Invalidated(_) => CaptureStatus::Invalidated,
            Status::Ended => CaptureStatus::None,
        }
    }

    /// Marks the capture ended and takes its streams out of it; returns its tasks.
    fn dissolve(&self, captures: &Captures) -> (Result<(), DriverError>, Vec<Captured>) {
        let (status, tasks, members) = {
            let mut b = self.book.lock();
            let status = std::mem::replace(&mut b.status, Status::Ended);
            (status, std::mem::take(&mut b.tasks), std::mem::take(&mut b.members))
        };
        captures.remove(self.id);
        for m in &members {
            if let Some(s) = m.stream.upgrade() {
                s.capture.leave(self.id);
            }
        }
        let result = match status {
            Status::Active => unjoined(self, &tasks, &members),
            Status::Invalidated(r) => Err(self.invalidated_error(&r)),
            Status::Ended => Err(error(
                CaptureErrorKind::NotCapturing,
                format!("capture {} was ended concurrently", self.id),
            )),
        };
        (result, tasks)
    }
}

/// The origin must wait, directly or through other streams, for every captured task: the
/// tasks reachable backwards from its last one (through stream order and record → wait
/// edges) must be all of them.
fn unjoined(cap: &Capture, tasks: &[Captured], members: &[Member]) -> Result<(), DriverError> {
    let start = members.iter().find(|m| m.id == cap.origin).and_then(|m| m.last);
    let mut seen = vec![false; tasks.len()];
    let mut stack: Vec<usize> = start.into_iter().collect();
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut seen[i], true) {
            continue;
        }
        stack.extend(tasks[i].prev);
        stack.extend(tasks[i].after);
    }
    let mut left: Vec<(u64, usize)> = Vec::new();
    for (t, _) in tasks.iter().zip(&seen).filter(|(_, &s)| !s) {
        match left.iter_mut().find(|l| l.0 == t.stream) {
            Some(l) => l.1 += 1,
            None => left.push((t.stream, 1)),
        }
    }
    if left.is_empty() {
        return Ok(());
    }
    let list: Vec<String> =
        left.iter().map(|(s, n)| format!("stream {s} has {n} captured task(s)")).collect();
    Err(error(
        CaptureErrorKind::Unjoined,
        format!(
            "{} that origin stream {} does not wait for; record an event after them and wait \
             for it on the origin (directly or through other streams) before ending capture {}",
            list.join(", "),
            cap.origin,
            cap.id
        ),
    ))
}

/// A stream's capture state.
#[derive(Default)]
pub(crate) struct StreamCapture {
    current: Mutex<Option<Arc<Capture>>>,
    /// Entries and exits so far: odd while capturing.
    epoch: AtomicU64,
}

impl StreamCapture {
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The capture the stream belongs to (one atomic load when none).
    pub(crate) fn current(&self) -> Option<Arc<Capture>> {
        if self.epoch() % 2 == 0 {
            return None;
        }
        self.current.lock().clone()
    }

    /// Enters `capture`; `Err` with the capture the stream is in already.
    fn enter(&self, capture: &Arc<Capture>) -> Result<(), Arc<Capture>> {
        let mut cur = self.current.lock();
        if let Some(c) = &*cur {
            return Err(Arc::clone(c));
        }
        *cur = Some(Arc::clone(capture));
        self.epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Leaves capture `id`, if the stream is in it.
    fn leave(&self, id: u64) {
        let mut cur = self.current.lock();
        if cur.as_ref().is_some_and(|c| c.id == id) {
            *cur = None;
            self.epoch.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// The active (begun, not ended) captures of a device.
#[derive(Default)]
pub(crate) struct Captures {
    active: Mutex<Vec<Arc<Capture>>>,
    count: AtomicUsize,
}

impl Captures {
    /// How many captures are active.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    fn add(&self, c: Arc<Capture>) {
        let mut a = self.active.lock();
        a.push(c);
        self.count.store(a.len(), Ordering::Release);
    }

    fn remove(&self, id: u64) {
        let mut a = self.active.lock();
        a.retain(|c| c.id != id);
        self.count.store(a.len(), Ordering::Release);
    }

    /// Checks an unsafe call (`what`: a synchronous copy or memset) against the modes: see
    /// [`CaptureMode`]. A forbidden call invalidates the captures that forbid it.
    pub(crate) fn check_unsafe_call(&self, what: &str) -> DriverResult<()> {
        if self.count() == 0 {
            return Ok(());
        }
        let mode = THREAD_MODE.with(Cell::get);
        if mode == CaptureMode::Relaxed {
            return Ok(());
        }
        let me = std::thread::current().id();
        let forbidding: Vec<Arc<Capture>> = self
            .active
            .lock()
            .iter()
            .filter(|c| {
                (c.thread == me && c.mode != CaptureMode::Relaxed)
                    || (mode == CaptureMode::Global
                        && c.thread != me
                        && c.mode == CaptureMode::Global)
            })
            .cloned()
            .collect();
        if forbidding.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> =
            forbidding.iter().map(|c| format!("{} ({} mode)", c.id, c.mode)).collect();
        let message = format!(
            "{what} is an unsafe call while capture(s) {} are active and the calling thread is \
             in {mode} capture mode",
            ids.join(", ")
        );
        for c in &forbidding {
            c.invalidate(message.clone());
        }
        Err(error(
            CaptureErrorKind::NotCapturable,
            format!(
                "{message}; the capture(s) are invalidated (a thread in relaxed mode may make it: \
                 exchange_capture_mode)"
            ),
        ))
    }
}

/// Begins a capture on `stream` in `mode`.
pub(crate) fn begin(
    stream: &Arc<StreamShared>,
    captures: &Captures,
    mode: CaptureMode,
) -> DriverResult<()> {
    let capture = Arc::new(Capture {
        id: NEXT_CAPTURE_ID.fetch_add(1, Ordering::Relaxed),
        mode,
        thread: std::thread::current().id(),
        origin: stream.id(),
        book: Mutex::new(Book {
            status: Status::Active,
            tasks: Vec::new(),
            members: vec![Member { id: stream.id(), stream: Arc::downgrade(stream), last: None }],
        }),
    });
    if let Err(other) = stream.capture.enter(&capture) {
        return Err(error(
            CaptureErrorKind::StreamCaptured,
            format!("stream {} is capturing already (capture {})", stream.id(), other.id),
        ));
    }
    captures.add(capture);
    Ok(())
}

/// The tasks of an ended capture, for its graph.
pub(crate) struct Ended {
    pub(crate) id: u64,
    pub(crate) ops: Vec<Op>,
}

/// Ends the capture begun on `stream`.
pub(crate) fn end(stream: &StreamShared, captures: &Captures) -> DriverResult<Ended> {
    let Some(cap) = stream.capture.current() else {
        return Err(error(
            CaptureErrorKind::NotCapturing,
            format!("stream {} is not capturing", stream.id()),
        ));
    };
    if cap.origin != stream.id() {
        return Err(error(
            CaptureErrorKind::Unmatched,
            format!(
                "stream {} joined capture {} through an event; end it on its origin stream {}",
                stream.id(),
                cap.id,
                cap.origin
            ),
        ));
    }
    if cap.mode != CaptureMode::Relaxed && std::thread::current().id() != cap.thread {
        return Err(error(
            CaptureErrorKind::Unmatched,
            format!(
                "capture {} was begun in {} mode on another thread; end it on that thread",
                cap.id, cap.mode
            ),
        ));
    }
    let (result, tasks) = cap.dissolve(captures);
    result?;
    Ok(Ended { id: cap.id, ops: tasks.into_iter().map(|t| t.op).collect() })
}

/// The capture state of `stream`.
pub(crate) fn info(stream: &StreamShared) -> CaptureInfo {
    match stream.capture.current() {
        None => CaptureInfo::NONE,
        Some(c) => match c.status() {
            CaptureStatus::None => CaptureInfo::NONE,
            status => CaptureInfo { status, capture: Some(c.id) },
        },
    }
}

/// Records `op` into the capture of `stream`, if it is capturing.
pub(crate) fn push(stream: &StreamShared, op: impl FnOnce() -> Op) -> Option<DriverResult<()>> {
    let cap = stream.capture.current()?;
    Some(cap.push(stream.id(), op(), None).map(drop))
}

/// Refuses, on a capturing stream, `what`: work that runs once (an `FnOnce` body).
pub(crate) fn refuse_once(stream: &StreamShared, what: &str) -> DriverResult<()> {
    let Some(cap) = stream.capture.current() else { return Ok(()) };
    if let Status::Invalidated(r) = &cap.book.lock().status {
        return Err(cap.invalidated_error(r));
    }
    Err(error(
        CaptureErrorKind::NotCapturable,
        format!(
            "{what} on stream {}, which is capturing (capture {}), cannot be recorded into a \
             graph: its body runs once (FnOnce); use the replayable form (an Fn body)",
            stream.id(),
            cap.id
        ),
    ))
}

/// A record of `ev` on `stream`, if it is capturing: the event's latest record becomes the
/// captured one.
pub(crate) fn record(stream: &StreamShared, ev: &SimEvent) -> Option<DriverResult<()>> {
    let cap = stream.capture.current()?;
    Some(cap.push(stream.id(), Op::Record(Arc::clone(ev.slot())), None).map(|task| {
        ev.slot().set_captured(Arc::clone(&cap), task);
    }))
}

/// A wait of `stream` on `ev`, when capture is involved: the stream is capturing (the wait
/// is captured), or the event's latest record was captured (the stream joins that capture).
/// `None`: an ordinary wait.
pub(crate) fn wait(stream: &Arc<StreamShared>, ev: &SimEvent) -> Option<DriverResult<()>> {
    let entry = ev.slot().entry();
    if let Some(cap) = stream.capture.current() {
        let id = stream.id();
        return Some(match entry {
            Some(Latest::Captured { capture, task }) if capture.id == cap.id => {
                cap.push(id, Op::InternalWait, Some(task)).map(drop)
            }
            Some(Latest::Captured { capture, .. }) => Err(error(
                CaptureErrorKind::Dependency,
                format!(
                    "stream {id} (capture {}) waits on an event whose latest record was captured \
                     into another capture ({})",
                    cap.id, capture.id
                ),
            )),
            _ => cap.push(id, Op::ExternalWait(Arc::clone(ev.slot())), None).map(drop),
        });
    }
    match entry {
        Some(Latest::Captured { capture, task }) => Some(capture.join(stream, task)),
        _ => None,
    }
}

/// `stream` is being dropped: a capture begun on it ends (without a graph); one it joined is
/// invalidated.
pub(crate) fn stream_dropped(stream: &StreamShared, captures: &Captures) {
    let Some(cap) = stream.capture.current() else { return };
    if cap.origin == stream.id() {
        drop(cap.dissolve(captures));
    } else {
        cap.invalidate(format!("stream {}, which had joined it, was destroyed", stream.id()));
        stream.capture.leave(cap.id);
    }
}
