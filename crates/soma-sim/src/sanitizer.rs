//! The stream-order sanitizer: checks every kernel, copy and memset access of device memory
//! against the pool allocations (and `malloc`s) of the device, in stream order.
//!
//! It is the software NPU's `compute-sanitizer --track-stream-ordered-races`. Turn it on with
//! [`NpuBuilder::sanitizer`](crate::NpuBuilder::sanitizer) (or the `SOMA_SANITIZER`
//! environment variable, see [`SanitizerMode::from_env`]); off, it costs nothing (pools are not
//! even asked to annotate).
//!
//! # Model
//!
//! * **Happens-before.** The sanitizer keeps its own vector clocks, independent of
//!   `soma-core`'s. Every stream has a current clock, captured by each task at enqueue; a
//!   `record` captures the recording stream's clock plus its own position; a `wait` joins the
//!   waited record's clock into the waiting stream's clock (also when the record has already
//!   completed). A point `(S, p)` (an allocation or a free, stamped with `S`'s enqueued count
//!   `p`) happens before task `(U, x)` iff `U == S && x > p` or `clock(U, x)[S] >= p + 1`;
//!   task `(U, x)` happens before the free point `(S, p)` iff `U == S && x <= p` or the free's
//!   clock has `[U] >= x`.
//! * **Host observation.** When the host observes completion — a stream synchronize (or a
//!   successful query), a device synchronize, an event synchronize (or a successful query), a
//!   stream drop — a device-wide *host-observed* clock is joined, and every task enqueued
//!   afterwards on any stream is ordered after it.
//! * **Generations.** Each allocation (pool block handed out, or `malloc`) is a generation:
//!   its range, its allocation point, its free point and clock once freed, the (stream,
//!   position) of the uses seen so far, and the earlier frees of its range that had not
//!   completed when it was allocated. A task's access is attributed to the newest generation
//!   covering its first byte that was allocated before the task was enqueued (host order).
//!   Freed generations are pruned once every pending and future task is ordered after their
//!   free.
//! * **Dropped streams.** A dropped stream has drained and the host observed it: every task
//!   enqueued afterwards is ordered after all of its points. Once its last task has run, the
//!   sanitizer forgets it (in batches): its points in the generations are marked with the
//!   drop's sequence number, which orders them before every later task as its clock entries
//!   did; its uses are dropped (every later free is ordered after them); and its entries
//!   leave every clock the sanitizer keeps, so that creating and dropping streams costs
//!   neither memory nor time that grows with the number of streams ever made.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;
use soma_core::hal::{AccessMode, DriverError, PoolAnnotation};

use crate::memory::{DeviceMemory, Owner, Range};
use crate::stream::StreamShared;
use output::ReportOutput;

mod output;

/// The stream id used in reports for the host (driver `malloc` / `free`, synchronous copies).
pub const HOST: u64 = 0;

/// What the sanitizer does (see [`NpuBuilder::sanitizer`](crate::NpuBuilder::sanitizer)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SanitizerMode {
    /// No checking, no annotations, no cost (the default).
    #[default]
    Off,
    /// Offending tasks run; reports are collected ([`SimDevice::sanitizer_reports`]).
    ///
    /// [`SimDevice::sanitizer_reports`]: crate::SimDevice::sanitizer_reports
    Report,
    /// Offending tasks are not executed: they fail their stream with
    /// [`DriverError::TaskFailed`] whose message is the report (seen at the next
    /// synchronize). Reports are collected too. Errors found at an allocation or a free fail
    /// that stream; errors of synchronous copies are returned by the call.
    FailStream,
}

impl SanitizerMode {
    /// Parses a mode: `off` / `0` / empty, `report`, `fail` (also `fail_stream`,
    /// `failstream`); case-insensitive.
    pub fn parse(s: &str) -> Option<SanitizerMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "off" | "none" => Some(SanitizerMode::Off),
            "report" | "1" => Some(SanitizerMode::Report),
            "fail" | "fail_stream" | "failstream" | "fail-stream" => {
                Some(SanitizerMode::FailStream)
            }
            _ => None,
        }
    }

    /// The mode from the `SOMA_SANITIZER` environment variable (`report` or `fail`), if set
    /// to a valid value. Read by [`Npu::builder`](crate::Npu::builder), so that a whole test
    /// suite runs with the sanitizer: `SOMA_SANITIZER=fail cargo test --workspace`.
    ///
    /// When the mode comes from the variable, every report is also printed to stderr as it is
    /// found, so that `SOMA_SANITIZER=report cargo test -- --nocapture` shows them. (With the
    /// `tracing` feature, every report is a `tracing` event instead, however the mode was
    /// set.)
    pub fn from_env() -> Option<SanitizerMode> {
        std::env::var("SOMA_SANITIZER").ok().and_then(|v| SanitizerMode::parse(&v))
    }

    /// Whether the sanitizer is on.
    pub fn is_on(self) -> bool {
        self != SanitizerMode::Off
    }
}

/// What a [`SanitizerReport`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReportKind {
    /// A use of a range after its free: the free happens before the task (or the task was
    /// enqueued after the free and is not ordered before it, or the memory was freed with
    /// the driver's `free`).
    UseAfterFree,
    /// A use by a stream that is not ordered after the allocation, where that can race with
    /// the block's previous owner (an earlier free of the range is not ordered before the
    /// use); with the strict option, every use not ordered after the allocation.
    NotOrderedAfterAlloc,
    /// A task enqueued before the allocation that covers its range was made.
    UseBeforeAlloc,
    /// An access of pool memory that no allocation covers.
    Unallocated,
    /// An access that starts inside an allocation and runs past its requested size.
    OutOfBounds,
    /// A free that is not ordered after a use of the allocation by another stream (a use
    /// that ran before the free was made), or a use running after the free was made that is
    /// neither ordered before nor after it.
    FreeNotOrderedAfterUse,
    /// A use of a block that its pool handed out while an earlier free of it was neither
    /// ordered before the allocation nor complete, where the use is not ordered after that
    /// free either: it can race with the previous owner's work (a pool bug, or a free made on
    /// a stream not ordered after its allocation).
    UnorderedReuse,
    /// A pool handed out a block that overlaps a live allocation (a pool bug).
    OverlappingAllocation,
}

impl ReportKind {
    fn describe(self) -> &'static str {
        match self {
            ReportKind::UseAfterFree => "use after free",
            ReportKind::NotOrderedAfterAlloc => "use not ordered after the allocation",
            ReportKind::UseBeforeAlloc => "use before the allocation",
            ReportKind::Unallocated => "use of unallocated pool memory",
            ReportKind::OutOfBounds => "out-of-bounds access",
            ReportKind::FreeNotOrderedAfterUse => "free not ordered after a use",
            ReportKind::UnorderedReuse => {
                "use of a block reused before its earlier free is ordered"
            }
            ReportKind::OverlappingAllocation => "allocation overlaps a live allocation",
        }
    }
}

/// The allocation a [`SanitizerReport`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    /// Pool id, or `None` for memory from the driver's `malloc`.
    pub pool: Option<u64>,
    /// First byte.
    pub ptr: u64,
    /// Requested size in bytes.
    pub size: u64,
    /// Stream the allocation was made for ([`HOST`] for `malloc`).
    pub stream: u64,
    /// That stream's enqueued position at the allocation.
    pub position: u64,
}

/// A position on a stream involved in a report (the free or allocation point).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPoint {
    /// What happened there: `"freed"`, `"alloc"`, or the name of the task that used it.
    pub what: &'static str,
    /// Stream id ([`HOST`] for driver calls).
    pub stream: u64,
    /// The stream's enqueued position at that point (the task position for a use).
    pub position: u64,
}

/// One finding of the stream-order sanitizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SanitizerReport {
    /// What is wrong.
    pub kind: ReportKind,
    /// The allocation involved, if any.
    pub allocation: Option<AllocationInfo>,
    /// The accessing stream ([`HOST`] for synchronous copies; the allocating or freeing
    /// stream for reports made at an allocation or a free).
    pub stream: u64,
    /// Position of the task on that stream (the stream's enqueued count for allocation and
    /// free reports).
    pub position: u64,
    /// Task name (kernel name, `copy_h2d`, `memset`…; `alloc` / `free` for pool calls).
    pub task: String,
    /// The other point involved: the free, the allocation, or the unordered use.
    pub other: Option<StreamPoint>,
    /// First byte of the access (the allocation's first byte for allocation / free reports).
    pub addr: u64,
    /// Length of the access in bytes.
    pub len: u64,
    /// Whether the access writes.
    pub write: bool,
}

fn who(stream: u64) -> String {
    if stream == HOST {
        "the host".into()
    } else {
        format!("stream {stream}")
    }
}

impl fmt::Display for SanitizerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream-order sanitizer: {}: ", self.kind.describe())?;
        let verb = if self.write { "writes" } else { "reads" };
        match self.task.as_str() {
            "alloc" | "free" => write!(
                f,
                "{} of {:#x} on {} at position {}",
                self.task,
                self.addr,
                who(self.stream),
                self.position
            )?,
            _ => write!(
                f,
                "{} task {} ({}) {verb} {:#x} (+{} bytes)",
                who(self.stream),
                self.position,
                self.task,
                self.addr,
                self.len
            )?,
        }
        match &self.allocation {
            Some(a) => {
                let pool = a.pool.map_or_else(|| "malloc".to_string(), |p| format!("pool {p}"));
                write!(
                    f,
                    "; allocation {:#x} (+{} bytes, {pool}) allocated on {} at position {}",
                    a.ptr,
                    a.size,
                    who(a.stream),
                    a.position
                )?;
            }
            None => write!(f, "; no allocation covers it")?,
        }
        if let Some(o) = &self.other {
            write!(f, "; {} on {} at position {}", o.what, who(o.stream), o.position)?;
        }
        let why = match self.kind {
            ReportKind::UseAfterFree => " (the task runs after the free)",
            ReportKind::NotOrderedAfterAlloc => {
                " (no event or synchronisation orders the task after the allocation, and an \
                 earlier free of the block is not ordered before it)"
            }
            ReportKind::UseBeforeAlloc => " (the task was enqueued before the allocation)",
            ReportKind::Unallocated => " (freed or never allocated)",
            ReportKind::OutOfBounds => " (the access runs past the requested size)",
            ReportKind::FreeNotOrderedAfterUse => {
                " (the use and the free are not ordered by stream order, events or \
                 synchronisation)"
            }
            ReportKind::UnorderedReuse => {
                " (the earlier free was neither ordered before the allocation nor complete, and \
                 is not ordered before this use)"
            }
            ReportKind::OverlappingAllocation => "",
        };
        f.write_str(why)
    }
}

/// A vector clock: for each stream id, the highest task position ordered before.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Clock(SmallVec<[(u64, u64); 4]>);

impl Clock {
    fn get(&self, stream: u64) -> u64 {
        match self.0.binary_search_by_key(&stream, |e| e.0) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }

    fn raise(&mut self, stream: u64, pos: u64) -> bool {
        match self.0.binary_search_by_key(&stream, |e| e.0) {
            Ok(i) if self.0[i].1 >= pos => false,
            Ok(i) => {
                self.0[i].1 = pos;
                true
            }
            Err(i) => {
                self.0.insert(i, (stream, pos));
                true
            }
        }
    }

    fn join(&mut self, other: &Clock) -> bool {
        let mut changed = false;
        for &(s, p) in &other.0 {
            changed |= self.raise(s, p);
        }
        changed
    }

    fn covers(&self, other: &Clock) -> bool {
        other.0.iter().all(|&(s, p)| self.get(s) >= p)
    }

    /// Removes the entries of the streams `keep` rejects, copying a shared clock only when
    /// it has such entries.
    fn retain_streams(clock: &mut Arc<Clock>, keep: impl Fn(u64) -> bool) {
        if clock.0.iter().any(|e| !keep(e.0)) {
            Arc::make_mut(clock).0.retain(|e| keep(e.0));
        }
    }
}

/// The streams of sanitized devices whose clock entries may still decide an ordering: live
/// streams, and dropped ones their sanitizer has not forgotten yet. Any other stream named in
/// a clock (of any device: events carry clocks across devices) has been forgotten by its own
/// sanitizer, whose marks now order its points: its entries are dropped wherever they are.
static KNOWN_STREAMS: Mutex<BTreeSet<u64>> = parking_lot::const_mutex(BTreeSet::new());

/// What a task carries from its enqueue: the host order and the stream's clock.
pub(crate) struct Stamp {
    /// Device-wide enqueue sequence number (host order).
    pub(crate) seq: u64,
    /// The stream's clock at the enqueue.
    pub(crate) clock: Arc<Clock>,
    /// Whether the task accesses device memory (tracked until it has run or been skipped).
    pub(crate) tracked: bool,
}

/// An allocation or free point.
#[derive(Clone, Copy, Debug)]
struct Point {
    /// Stream id, or [`HOST`] for driver calls.
    stream: u64,
    /// Enqueued count of the stream at the call.
    pos: u64,
    /// Device-wide sequence number at the call (host order).
    seq: u64,
    /// Once the sanitizer has forgotten the (dropped) stream: the sequence number of its
    /// drop. Every task enqueued after it is ordered after the point.
    dropped_at: Option<u64>,
}

impl Point {
    fn new(stream: u64, pos: u64, seq: u64) -> Point {
        Point { stream, pos, seq, dropped_at: None }
    }

    /// Marks the point if its stream is one of `dropped` (sorted by id).
    fn forget_stream(&mut self, dropped: &[DroppedStream]) {
        if self.dropped_at.is_none() {
            if let Ok(i) = dropped.binary_search_by_key(&self.stream, |d| d.id) {
                self.dropped_at = Some(dropped[i].seq);
            }
        }
    }
}

struct FreeInfo {
    point: Point,
    clock: Arc<Clock>,
    /// Sequence number at which the host was seen to have observed the free.
    observed_seq: Option<u64>,
}

struct Gen {
    pool: Option<u64>,
    ptr: u64,
    size: u64,
    alloc: Point,
    free: Option<FreeInfo>,
    /// Earlier frees of the range that had not completed when this allocation was made.
    /// With whether each was ordered before the allocation.
    preds: SmallVec<[(Point, bool); 1]>,
    /// Highest position per stream of the uses seen so far, with the task name.
    uses: SmallVec<[(u64, u64, &'static str); 2]>,
}

impl Gen {
    fn contains(&self, addr: u64) -> bool {
        self.ptr <= addr && addr - self.ptr < self.size
    }

    fn info(&self) -> AllocationInfo {
        AllocationInfo {
            pool: self.pool,
            ptr: self.ptr,
            size: self.size,
            stream: self.alloc.stream,
            position: self.alloc.pos,
        }
    }
}

/// A dropped stream the sanitizer has not forgotten yet.
struct DroppedStream {
    id: u64,
    /// Sequence number of the drop.
    seq: u64,
    /// Its tasks (enqueued before the drop), to tell when the last one has run.
    shared: Weak<StreamShared>,
    enqueued: u64,
}

impl DroppedStream {
    fn drained(&self) -> bool {
        self.shared.upgrade().is_none_or(|s| s.completed_pos() >= self.enqueued)
    }
}

struct StreamState {
    clock: Arc<Clock>,
    hobs_version: u64,
    /// Sequence numbers of access tasks not yet run or skipped, in order.
    pending: VecDeque<u64>,
    shared: Weak<StreamShared>,
    /// Frees to poison when the stream completes their position: (position, addr, len).
    poison: Vec<(u64, u64, u64)>,
}

#[derive(Default)]
struct State {
    seq: u64,
    streams: HashMap<u64, StreamState>,
    host_observed: Clock,
    hobs_version: u64,
    /// Ranges the sanitizer is responsible for (pool reservations, `malloc`s): start → end.
    tracked: BTreeMap<u64, u64>,
    live: BTreeMap<(u64, u64), Gen>,
    freed: BTreeMap<(u64, u64), Gen>,
    freed_max_size: u64,
    prune_at: usize,
    /// Dropped streams not forgotten yet, forgotten together when there are `forget_at`.
    dropped: Vec<DroppedStream>,
    forget_at: usize,
    next_gen: u64,
    reports: Vec<SanitizerReport>,
}

/// A task as the checks see it.
struct TaskView<'a> {
    stream: u64,
    pos: u64,
    seq: u64,
    clock: &'a Clock,
}

fn point_before_task(p: &Point, t: &TaskView<'_>) -> bool {
    if p.stream == HOST {
        return t.seq > p.seq;
    }
    (t.stream == p.stream && t.pos > p.pos)
        || t.clock.get(p.stream) > p.pos
        || p.dropped_at.is_some_and(|d| t.seq > d)
}

/// Whether task `t` is ordered before `free`. A clock entry `c` for a stream covers its tasks
/// at positions `< c` (a record at `c` covers the tasks before it; the host observing `n`
/// enqueued tasks gives `n + 1`), so the comparison is strict, as in [`point_before_task`].
fn task_before_free(t: &TaskView<'_>, free: &FreeInfo) -> bool {
    if free.point.stream == HOST {
        return false;
    }
    (t.stream == free.point.stream && t.pos <= free.point.pos) || free.clock.get(t.stream) > t.pos
}

const MIN_PRUNE_AT: usize = 256;

/// Dropped streams are forgotten in batches of at least this many (a batch visits every
/// generation and clock).
const MIN_FORGET_AT: usize = 64;

/// What to do after a report made outside a task (at an allocation or a free).
pub(crate) struct FailAction {
    stream: Weak<StreamShared>,
    error: DriverError,
}

impl FailAction {
    /// Fails the stream (FailStream mode).
    pub(crate) fn apply(self) {
        if let Some(s) = self.stream.upgrade() {
            s.fail(self.error);
        }
    }
}

/// The sanitizer of one device.
pub(crate) struct Sanitizer {
    mode: SanitizerMode,
    strict: bool,
    poison: Option<u8>,
    /// Where reports go as they are found.
    output: ReportOutput,
    state: Mutex<State>,
}

impl Drop for Sanitizer {
    /// The device is gone, and with it every stream of it: none needs clock entries.
    fn drop(&mut self) {
        let st = self.state.get_mut();
        let mut known = KNOWN_STREAMS.lock();
        for id in st.streams.keys().chain(st.dropped.iter().map(|d| &d.id)) {
            known.remove(id);
        }
    }
}

impl Sanitizer {
    pub(crate) fn new(mode: SanitizerMode, strict: bool, poison: Option<u8>, print: bool) -> Self {
        Sanitizer {
            mode,
            strict,
            poison,
            output: ReportOutput::new(print),
            state: Mutex::new(State {
                prune_at: MIN_PRUNE_AT,
                forget_at: MIN_FORGET_AT,
                ..State::default()
            }),
        }
    }

    pub(crate) fn fails(&self) -> bool {
        self.mode == SanitizerMode::FailStream
    }

    pub(crate) fn poisons(&self) -> bool {
        self.poison.is_some()
    }

    /// Live and freed generations tracked (diagnostics).
    pub(crate) fn generations(&self) -> (usize, usize) {
        let st = self.state.lock();
        (st.live.len(), st.freed.len())
    }

    /// How many streams the sanitizer keeps state for (diagnostics): its streams, the dropped
    /// ones not forgotten yet, and every stream an entry of its clocks or a recorded use
    /// names.
    pub(crate) fn tracked_streams(&self) -> usize {
        let st = self.state.lock();
        let mut ids: BTreeSet<u64> = st.streams.keys().copied().collect();
        ids.extend(st.dropped.iter().map(|d| d.id));
        let mut add = |c: &Clock| ids.extend(c.0.iter().map(|e| e.0));
        add(&st.host_observed);
        st.streams.values().for_each(|s| add(&s.clock));
        st.freed.values().filter_map(|g| g.free.as_ref()).for_each(|f| add(&f.clock));
        for g in st.live.values().chain(st.freed.values()) {
            ids.extend(g.uses.iter().map(|u| u.0));
        }
        ids.len()
    }

    pub(crate) fn reports(&self) -> Vec<SanitizerReport> {
        self.state.lock().reports.clone()
    }

    pub(crate) fn take_reports(&self) -> Vec<SanitizerReport> {
        std::mem::take(&mut self.state.lock().reports)
    }

    pub(crate) fn register_stream(&self, id: u64, shared: Weak<StreamShared>) {
        let mut st = self.state.lock();
        KNOWN_STREAMS.lock().insert(id);
        let clock = Arc::new(st.host_observed.clone());
        let version = st.hobs_version;
        st.streams.insert(
            id,
            StreamState {
                clock,
                hobs_version: version,
                pending: VecDeque::new(),
                shared,
                poison: Vec::new(),
            },
        );
    }

    /// The stream was dropped after draining `enqueued` tasks (still draining when it was
    /// dropped by its own worker).
    pub(crate) fn stream_dropped(&self, id: u64, enqueued: u64) {
        let mut st = self.state.lock();
        Self::observe_locked(&mut st, id, enqueued + 1);
        let Some(s) = st.streams.remove(&id) else { return };
        let seq = st.seq;
        st.dropped.push(DroppedStream { id, seq, shared: s.shared, enqueued });
        if st.dropped.len() >= st.forget_at {
            Self::forget_dropped(&mut st);
        }
    }

    /// Forgets the dropped streams whose last task has run (see the module docs): marks
    /// their points, drops their uses, and removes from every clock the entries of streams
    /// no sanitizer needs any more.
    fn forget_dropped(st: &mut State) {
        let (mut done, draining): (Vec<_>, Vec<_>) =
            std::mem::take(&mut st.dropped).into_iter().partition(DroppedStream::drained);
        st.dropped = draining;
        done.sort_unstable_by_key(|d| d.id);
        let is_done = |id: u64| done.binary_search_by_key(&id, |d| d.id).is_ok();
        for g in st.live.values_mut().chain(st.freed.values_mut()) {
            g.alloc.forget_stream(&done);
            if let Some(f) = &mut g.free {
                f.point.forget_stream(&done);
            }
            g.preds.iter_mut().for_each(|p| p.0.forget_stream(&done));
            g.uses.retain(|u| !is_done(u.0));
        }
        let known: Vec<u64> = {
            let mut known = KNOWN_STREAMS.lock();
            for d in &done {
                known.remove(&d.id);
            }
            known.iter().copied().collect()
        };
        let keep = |id: u64| known.binary_search(&id).is_ok();
        st.host_observed.0.retain(|e| keep(e.0));
        st.streams.values_mut().for_each(|s| Clock::retain_streams(&mut s.clock, keep));
        for f in st.freed.values_mut().filter_map(|g| g.free.as_mut()) {
            Clock::retain_streams(&mut f.clock, keep);
        }
        // A batch visits every generation: at least as many drops as the square root of
        // their number between batches keeps both that and the clocks' widths small.
        let gens = st.live.len() + st.freed.len();
        st.forget_at = (st.dropped.len() + gens.isqrt()).max(MIN_FORGET_AT);
    }

    /// Called under the stream's enqueue lock: the stream's current clock (joined with the
    /// host-observed clock) and, for the task itself, its stamp.
    pub(crate) fn on_enqueue(&self, id: u64, tracked: bool) -> Stamp {
        let mut st = self.state.lock();
        st.seq += 1;
        let seq = st.seq;
        let version = st.hobs_version;
        let State { streams, host_observed, .. } = &mut *st;
        let Some(s) = streams.get_mut(&id) else {
            return Stamp { seq, clock: Arc::new(host_observed.clone()), tracked: false };
        };
        if s.hobs_version != version {
            s.hobs_version = version;
            if !s.clock.covers(host_observed) {
                Arc::make_mut(&mut s.clock).join(host_observed);
            }
        }
        if tracked {
            s.pending.push_back(seq);
        }
        Stamp { seq, clock: Arc::clone(&s.clock), tracked }
    }

    /// A wait enqueued on stream `id` on a record whose clock is `clock`.
    pub(crate) fn on_wait(&self, id: u64, clock: &Clock) {
        let mut st = self.state.lock();
        if let Some(s) = st.streams.get_mut(&id) {
            if !s.clock.covers(clock) {
                Arc::make_mut(&mut s.clock).join(clock);
            }
        }
    }

    /// The host observed that stream `id` completed every task below `bound`.
    pub(crate) fn observe(&self, id: u64, bound: u64) {
        let mut st = self.state.lock();
        Self::observe_locked(&mut st, id, bound);
    }

    fn observe_locked(st: &mut State, id: u64, bound: u64) {
        if st.host_observed.raise(id, bound) {
            st.hobs_version += 1;
        }
    }

    /// The host observed the completion of a record whose clock is `clock`.
    pub(crate) fn observe_clock(&self, clock: &Clock) {
        let mut st = self.state.lock();
        if st.host_observed.join(clock) {
            st.hobs_version += 1;
        }
    }

    /// A tracked task has run (or been skipped).
    pub(crate) fn retire(&self, id: u64, seq: u64) {
        let mut st = self.state.lock();
        if let Some(s) = st.streams.get_mut(&id) {
            if s.pending.front() == Some(&seq) {
                s.pending.pop_front();
            } else if let Some(i) = s.pending.iter().position(|&q| q == seq) {
                s.pending.remove(i);
            }
        }
    }

    fn candidates(st: &State, addr: u64) -> SmallVec<[(bool, (u64, u64)); 4]> {
        let mut v: SmallVec<[(bool, (u64, u64)); 4]> = SmallVec::new();
        if let Some((k, g)) = st.live.range(..=(addr, u64::MAX)).next_back() {
            if g.contains(addr) {
                v.push((true, *k));
            }
        }
        let lo = addr.saturating_sub(st.freed_max_size);
        for (k, g) in st.freed.range((lo, 0)..=(addr, u64::MAX)) {
            if g.contains(addr) {
                v.push((false, *k));
            }
        }
        // Newest first (generation ids increase).
        v.sort_by_key(|c| std::cmp::Reverse(c.1 .1));
        v
    }

    fn gen<'a>(st: &'a State, c: &(bool, (u64, u64))) -> &'a Gen {
        if c.0 {
            &st.live[&c.1]
        } else {
            &st.freed[&c.1]
        }
    }

    fn gen_mut<'a>(st: &'a mut State, c: &(bool, (u64, u64))) -> Option<&'a mut Gen> {
        if c.0 {
            st.live.get_mut(&c.1)
        } else {
            st.freed.get_mut(&c.1)
        }
    }

    /// Checks a task's device ranges before it runs. `Err` (FailStream mode only) carries
    /// the report(s) as the task's failure message.
    pub(crate) fn check_task(
        &self,
        stream: u64,
        pos: u64,
        stamp: &Stamp,
        name: &'static str,
        ranges: &[Range],
    ) -> Result<(), String> {
        let mut st = self.state.lock();
        let t = TaskView { stream, pos, seq: stamp.seq, clock: &stamp.clock };
        let mut found: SmallVec<[SanitizerReport; 1]> = SmallVec::new();
        for r in ranges.iter().filter(|r| r.len > 0) {
            let report = |kind, g: Option<&Gen>, other| SanitizerReport {
                kind,
                allocation: g.map(Gen::info),
                stream,
                position: pos,
                task: name.to_string(),
                other,
                addr: r.addr,
                len: r.len,
                write: r.mode == AccessMode::Write,
            };
            let cands = Self::candidates(&st, r.addr);
            let Some(sel) = cands.iter().find(|c| Self::gen(&st, c).alloc.seq < t.seq) else {
                if let Some(c) = cands.first() {
                    let g = Self::gen(&st, c);
                    let other = StreamPoint {
                        what: "alloc",
                        stream: g.alloc.stream,
                        position: g.alloc.pos,
                    };
                    found.push(report(ReportKind::UseBeforeAlloc, Some(g), Some(other)));
                } else if st
                    .tracked
                    .range(..=r.addr)
                    .next_back()
                    .is_some_and(|(_, &end)| r.addr < end)
                {
                    found.push(report(ReportKind::Unallocated, None, None));
                }
                continue;
            };
            let g = Self::gen(&st, sel);
            let mut verdict: Option<(ReportKind, Option<StreamPoint>)> = None;
            if let Some(free) = &g.free {
                let other = Some(StreamPoint {
                    what: "freed",
                    stream: free.point.stream,
                    position: free.point.pos,
                });
                if g.pool.is_none() || point_before_task(&free.point, &t) {
                    verdict = Some((ReportKind::UseAfterFree, other));
                } else if task_before_free(&t, free) {
                    // A use ordered before the free that runs late: fine.
                } else if t.seq > free.point.seq {
                    verdict = Some((ReportKind::UseAfterFree, other));
                } else {
                    verdict = Some((ReportKind::FreeNotOrderedAfterUse, other));
                }
            }
            if verdict.is_none() && !point_before_task(&g.alloc, &t) {
                let racing = g.preds.iter().map(|p| &p.0).find(|p| !point_before_task(p, &t));
                if let Some(p) = racing {
                    let other = StreamPoint {
                        what: "earlier free of the block",
                        stream: p.stream,
                        position: p.pos,
                    };
                    verdict = Some((ReportKind::NotOrderedAfterAlloc, Some(other)));
                } else if self.strict {
                    let other = StreamPoint {
                        what: "alloc",
                        stream: g.alloc.stream,
                        position: g.alloc.pos,
                    };
                    verdict = Some((ReportKind::NotOrderedAfterAlloc, Some(other)));
                }
            }
            if verdict.is_none() {
                // Ordered after the allocation, but the pool handed the block out before an
                // earlier free of it was ordered or complete: the use can race with the
                // previous owner's work.
                let racing = g
                    .preds
                    .iter()
                    .filter(|p| !p.1)
                    .map(|p| &p.0)
                    .find(|p| !point_before_task(p, &t));
                if let Some(p) = racing {
                    let other = StreamPoint {
                        what: "earlier free of the block",
                        stream: p.stream,
                        position: p.pos,
                    };
                    verdict = Some((ReportKind::UnorderedReuse, Some(other)));
                }
            }
            if verdict.is_none() && r.addr.saturating_add(r.len) > g.ptr + g.size {
                verdict = Some((ReportKind::OutOfBounds, None));
            }
            match verdict {
                Some((kind, other)) => found.push(report(kind, Some(g), other)),
                None if g.pool.is_some() => {
                    if let Some(g) = Self::gen_mut(&mut st, sel) {
                        match g.uses.iter_mut().find(|u| u.0 == stream) {
                            Some(u) if u.1 < pos => *u = (stream, pos, name),
                            Some(_) => {}
                            None => g.uses.push((stream, pos, name)),
                        }
                    }
                }
                None => {}
            }
        }
        if found.is_empty() {
            return Ok(());
        }
        let message = self.publish(st, found);
        if self.fails() {
            Err(message)
        } else {
            Ok(())
        }
    }

    /// Checks a synchronous host copy or memset: coverage, frees and bounds (no ordering:
    /// the host is ordered after nothing it has not observed).
    pub(crate) fn check_host(&self, name: &'static str, ranges: &[Range]) -> Result<(), String> {
        let st = self.state.lock();
        let mut found: SmallVec<[SanitizerReport; 1]> = SmallVec::new();
        for r in ranges.iter().filter(|r| r.len > 0) {
            let cands = Self::candidates(&st, r.addr);
            let g = cands.first().map(|c| Self::gen(&st, c));
            let (kind, other) = match g {
                None => {
                    let tracked = st
                        .tracked
                        .range(..=r.addr)
                        .next_back()
                        .is_some_and(|(_, &end)| r.addr < end);
                    if !tracked {
                        continue;
                    }
                    (ReportKind::Unallocated, None)
                }
                Some(g) => match &g.free {
                    Some(f) => (
                        ReportKind::UseAfterFree,
                        Some(StreamPoint {
                            what: "freed",
                            stream: f.point.stream,
                            position: f.point.pos,
                        }),
                    ),
                    None if r.addr.saturating_add(r.len) > g.ptr + g.size => {
                        (ReportKind::OutOfBounds, None)
                    }
                    None => continue,
                },
            };
            found.push(SanitizerReport {
                kind,
                allocation: g.map(Gen::info),
                stream: HOST,
                position: 0,
                task: name.into(),
                other,
                addr: r.addr,
                len: r.len,
                write: r.mode == AccessMode::Write,
            });
        }
        if found.is_empty() {
            return Ok(());
        }
        let message = self.publish(st, found);
        if self.fails() {
            Err(message)
        } else {
            Ok(())
        }
    }

    /// Keeps new reports and hands them to the output once the state is unlocked (a
    /// `tracing` subscriber may call back into the device); returns them as one message.
    fn publish(
        &self,
        mut st: MutexGuard<'_, State>,
        found: SmallVec<[SanitizerReport; 1]>,
    ) -> String {
        let message = found.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
        st.reports.extend(found.iter().cloned());
        drop(st);
        self.output.emit(&found, &message);
        message
    }

    fn stream_completed(st: &State, id: u64) -> Option<u64> {
        match st.streams.get(&id) {
            // A stream the sanitizer does not know any more was dropped: it drained.
            None => None,
            Some(s) => s.shared.upgrade().map(|s| s.completed_pos()),
        }
    }

    fn is_complete(st: &State, p: &Point) -> bool {
        if p.stream == HOST || st.host_observed.get(p.stream) > p.pos {
            return true;
        }
        Self::stream_completed(st, p.stream).is_none_or(|c| c >= p.pos)
    }

    fn current_clock(st: &State, id: u64) -> Clock {
        let mut c = st.streams.get(&id).map(|s| (*s.clock).clone()).unwrap_or_default();
        c.join(&st.host_observed);
        c
    }

    /// A pool annotation; `range` is the reservation containing the pointer.
    pub(crate) fn on_annotation(
        &self,
        a: PoolAnnotation,
        range: Option<(u64, u64)>,
        memory: &DeviceMemory,
    ) -> Option<FailAction> {
        match a {
            PoolAnnotation::Alloc { pool, ptr, size, stream, position } => {
                self.on_alloc(Some(pool), ptr.addr(), size, stream, position, range)
            }
            PoolAnnotation::Free { pool: _, ptr, stream, position } => {
                self.on_free(ptr.addr(), stream, position, memory)
            }
        }
    }

    fn on_alloc(
        &self,
        pool: Option<u64>,
        ptr: u64,
        size: u64,
        stream: u64,
        position: u64,
        range: Option<(u64, u64)>,
    ) -> Option<FailAction> {
        let mut st = self.state.lock();
        st.seq += 1;
        let point = Point::new(stream, position, st.seq);
        if let Some((start, end)) = range {
            st.tracked.insert(start, end);
        }
        let size = size.max(1);
        let end = ptr.saturating_add(size);
        let mut reports: SmallVec<[SanitizerReport; 1]> = SmallVec::new();
        let mut preds: SmallVec<[(Point, bool); 1]> = SmallVec::new();
        if pool.is_some() {
            let clock = Self::current_clock(&st, stream);
            let alloc_view = TaskView { stream, pos: position + 1, seq: point.seq, clock: &clock };
            let lo = ptr.saturating_sub(st.freed_max_size);
            for g in st.freed.range((lo, 0)..(end, 0)).map(|(_, g)| g) {
                if g.ptr.saturating_add(g.size) <= ptr || g.pool.is_none() {
                    continue;
                }
                let Some(free) = &g.free else { continue };
                if Self::is_complete(&st, &free.point) {
                    continue;
                }
                // Not ordered before the allocation either: a use of the new block that is
                // not ordered after this free can race with the previous owner's work.
                preds.push((free.point, point_before_task(&free.point, &alloc_view)));
            }
            // A pool on a device without VMM carves its blocks from one driver `malloc`
            // segment: the first pool allocation inside a live malloc adopts it (the malloc
            // stops being an allocation of its own; the pool's blocks are tracked instead).
            let adopt = st.live.range(..(end, 0)).next_back().and_then(|(k, g)| {
                (g.pool.is_none() && g.ptr <= ptr && end <= g.ptr.saturating_add(g.size))
                    .then_some(*k)
            });
            if let Some(key) = adopt {
                st.live.remove(&key);
            }
            if let Some((_, g)) = st.live.range(..(end, 0)).next_back() {
                if g.ptr.saturating_add(g.size) > ptr {
                    reports.push(SanitizerReport {
                        kind: ReportKind::OverlappingAllocation,
                        allocation: Some(g.info()),
                        stream,
                        position,
                        task: "alloc".into(),
                        other: None,
                        addr: ptr,
                        len: size,
                        write: false,
                    });
                }
            }
        }
        st.next_gen += 1;
        let id = st.next_gen;
        st.live.insert(
            (ptr, id),
            Gen { pool, ptr, size, alloc: point, free: None, preds, uses: SmallVec::new() },
        );
        self.finish_host_reports(st, reports, stream, position, "pool alloc")
    }

    fn finish_host_reports(
        &self,
        st: MutexGuard<'_, State>,
        reports: SmallVec<[SanitizerReport; 1]>,
        stream: u64,
        position: u64,
        name: &str,
    ) -> Option<FailAction> {
        if reports.is_empty() {
            return None;
        }
        let shared = st.streams.get(&stream).map(|s| s.shared.clone());
        let message = self.publish(st, reports);
        if !self.fails() {
            return None;
        }
        Some(FailAction {
            stream: shared?,
            error: DriverError::TaskFailed { stream, task: position, name: name.into(), message },
        })
    }

    fn on_free(
        &self,
        ptr: u64,
        stream: u64,
        position: u64,
        memory: &DeviceMemory,
    ) -> Option<FailAction> {
        let mut st = self.state.lock();
        st.seq += 1;
        let point = Point::new(stream, position, st.seq);
        let key = st.live.range((ptr, 0)..=(ptr, u64::MAX)).next_back().map(|(k, _)| *k)?;
        let mut g = st.live.remove(&key)?;
        let clock = Arc::new(Self::current_clock(&st, stream));
        let mut reports: SmallVec<[SanitizerReport; 1]> = SmallVec::new();
        for &(u, x, name) in &g.uses {
            let free = FreeInfo { point, clock: Arc::clone(&clock), observed_seq: None };
            let t = TaskView { stream: u, pos: x, seq: 0, clock: &clock };
            if u != stream && !task_before_free(&t, &free) {
                reports.push(SanitizerReport {
                    kind: ReportKind::FreeNotOrderedAfterUse,
                    allocation: Some(g.info()),
                    stream,
                    position,
                    task: "free".into(),
                    other: Some(StreamPoint { what: name, stream: u, position: x }),
                    addr: g.ptr,
                    len: g.size,
                    write: false,
                });
            }
        }
        g.uses = SmallVec::new();
        g.free = Some(FreeInfo { point, clock, observed_seq: None });
        if let Some(value) = self.poison {
            let done = Self::stream_completed(&st, stream).is_none_or(|c| c >= position);
            if done {
                poison(memory, g.ptr, g.size, value);
            } else if let Some(s) = st.streams.get_mut(&stream) {
                s.poison.push((position, g.ptr, g.size));
            }
        }
        st.freed_max_size = st.freed_max_size.max(g.size);
        st.freed.insert(key, g);
        if st.freed.len() > st.prune_at {
            Self::prune(&mut st);
        }
        self.finish_host_reports(st, reports, stream, position, "pool free")
    }

    /// A driver `malloc` of `size` bytes (`len` after rounding) at `ptr`.
    pub(crate) fn on_malloc(&self, ptr: u64, size: u64, len: u64) {
        {
            let mut st = self.state.lock();
            st.tracked.insert(ptr, ptr.saturating_add(len));
        }
        let _ = self.on_alloc(None, ptr, size, HOST, 0, None);
    }

    /// A driver `free` of `ptr` succeeded.
    pub(crate) fn on_driver_free(&self, ptr: u64) {
        let mut st = self.state.lock();
        st.seq += 1;
        let point = Point::new(HOST, 0, st.seq);
        st.tracked.remove(&ptr);
        let Some(key) = st.live.range((ptr, 0)..=(ptr, u64::MAX)).next_back().map(|(k, _)| *k)
        else {
            return;
        };
        if let Some(mut g) = st.live.remove(&key) {
            g.free =
                Some(FreeInfo { point, clock: Arc::new(Clock::default()), observed_seq: None });
            st.freed_max_size = st.freed_max_size.max(g.size);
            st.freed.insert(key, g);
        }
        if st.freed.len() > st.prune_at {
            Self::prune(&mut st);
        }
    }

    /// A reservation `[start, end)` was released or made: forget everything inside it.
    pub(crate) fn on_release(&self, start: u64, end: u64) {
        let mut st = self.state.lock();
        st.tracked.remove(&start);
        st.live.retain(|_, g| g.ptr < start || g.ptr >= end);
        st.freed.retain(|_, g| g.ptr < start || g.ptr >= end);
    }

    /// Drops freed generations no task can be attributed to any more: those whose free every
    /// pending and future task is ordered after (the host observed it, and every task
    /// enqueued before that has run), and those superseded by a newer generation covering
    /// their whole range that every pending task was enqueued after.
    fn prune(st: &mut State) {
        let min_pending = st.streams.values().filter_map(|s| s.pending.front().copied()).min();
        let now = st.seq;
        let host_observed = st.host_observed.clone();
        // Superseded: a newer generation covers the whole range and every pending task was
        // enqueued after it was allocated, so no task can be attributed to the old one.
        let mut superseded: Vec<(u64, u64)> = Vec::new();
        for (k, g) in &st.freed {
            let newer = Self::candidates(st, g.ptr).into_iter().any(|c| {
                let n = Self::gen(st, &c);
                c.1 .1 > k.1
                    && n.ptr <= g.ptr
                    && n.ptr.saturating_add(n.size) >= g.ptr.saturating_add(g.size)
                    && min_pending.is_none_or(|m| m > n.alloc.seq)
            });
            if newer {
                superseded.push(*k);
            }
        }
        for k in superseded {
            st.freed.remove(&k);
        }
        st.freed.retain(|_, g| {
            let Some(free) = g.free.as_mut() else { return true };
            if free.point.stream == HOST {
                free.observed_seq.get_or_insert(free.point.seq);
            } else if free.observed_seq.is_none()
                && (host_observed.get(free.point.stream) > free.point.pos
                    || free.point.dropped_at.is_some())
            {
                free.observed_seq = Some(now);
            }
            match free.observed_seq {
                Some(obs) => min_pending.is_some_and(|m| m <= obs),
                None => true,
            }
        });
        st.freed_max_size = st.freed.values().map(|g| g.size).max().unwrap_or(0);
        st.prune_at = (st.freed.len() * 2).max(MIN_PRUNE_AT);
    }

    /// Completes task `pos` of stream `id` (`finish`), first poisoning the frees it
    /// completes, atomically with respect to new frees.
    pub(crate) fn finish_with_poison(
        &self,
        id: u64,
        pos: u64,
        memory: &DeviceMemory,
        finish: impl FnOnce(),
    ) {
        let mut st = self.state.lock();
        if let (Some(value), Some(s)) = (self.poison, st.streams.get_mut(&id)) {
            if !s.poison.is_empty() {
                let mut due = Vec::new();
                s.poison.retain(|&(p, addr, len)| {
                    if p <= pos {
                        due.push((addr, len));
                        false
                    } else {
                        true
                    }
                });
                for (addr, len) in due {
                    poison(memory, addr, len, value);
                }
            }
        }
        finish();
        drop(st);
    }

    /// Clock of a record enqueued at `pos` on stream `id`, from the stream's clock.
    pub(crate) fn record_clock(clock: &Arc<Clock>, id: u64, pos: u64) -> Arc<Clock> {
        let mut c = (**clock).clone();
        c.raise(id, pos);
        Arc::new(c)
    }
}

/// Fills freed memory with the poison pattern, if nothing is using it right now.
fn poison(memory: &DeviceMemory, addr: u64, len: u64, value: u8) {
    let r = Range { addr, len, mode: AccessMode::Write };
    if let Ok(mut acc) = memory.acquire(Owner::Host("sanitizer poison"), &[r], false) {
        let _ = acc.fill(addr, value, len);
    }
}

#[cfg(test)]
mod forget_tests;

#[cfg(test)]
impl Sanitizer {
    /// Forgets dropped streams only when [`forget_now`](Self::forget_now) is called.
    fn forget_only_when_told(&self) {
        self.state.lock().forget_at = usize::MAX;
    }

    /// Forgets the drained dropped streams now.
    fn forget_now(&self) {
        let mut st = self.state.lock();
        Self::forget_dropped(&mut st);
        st.forget_at = usize::MAX;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks() {
        let mut a = Clock::default();
        assert!(a.raise(3, 5));
        assert!(!a.raise(3, 4));
        assert!(a.raise(1, 2));
        assert_eq!(a.get(3), 5);
        assert_eq!(a.get(2), 0);
        let mut b = Clock::default();
        b.raise(2, 7);
        assert!(!a.covers(&b));
        assert!(a.join(&b));
        assert!(a.covers(&b));
        assert_eq!(a.0.as_slice(), &[(1, 2), (2, 7), (3, 5)]);
    }

    #[test]
    fn points() {
        let mut c = Clock::default();
        c.raise(1, 4);
        let t = TaskView { stream: 2, pos: 10, seq: 100, clock: &c };
        assert!(point_before_task(&Point::new(1, 3, 1), &t));
        assert!(!point_before_task(&Point::new(1, 4, 1), &t));
        assert!(point_before_task(&Point::new(2, 9, 1), &t));
        assert!(!point_before_task(&Point::new(2, 10, 1), &t));
        assert!(point_before_task(&Point::new(HOST, 0, 99), &t));
        assert!(!point_before_task(&Point::new(HOST, 0, 101), &t));
        assert_eq!(SanitizerMode::parse("FAIL"), Some(SanitizerMode::FailStream));
        assert_eq!(SanitizerMode::parse("report"), Some(SanitizerMode::Report));
        assert_eq!(SanitizerMode::parse("bogus"), None);
    }
}
