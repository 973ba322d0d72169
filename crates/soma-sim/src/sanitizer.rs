//! The stream-order sanitizer: checks every kernel, copy and memset access of device memory
//! against the pool allocations (and `malloc`s) of the device, in stream order.
//!
//! It is the software NPU's `compute-sanitizer --track-stream-ordered-races`. Turn it on with
//! [`NpuBuilder::sanitizer`](crate::NpuBuilder::sanitizer) (or the `SOMA_SANITIZER`
//! environment variable, see [`SanitizerMode::from_env`]); off, it costs nothing (pools are not
//! even asked to annotate).
//!
//! There is one sanitizer per [`Npu`](crate::Npu), shared by its devices: a task of one
//! device may use a peer's memory (peer access), and is checked against that memory's
//! allocations; stream ids, addresses and the host's order are unique across the devices, so
//! clocks, generations and host observations mean the same on every device.
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
//! * **Graph memory.** A pool allocation made while capturing (`GraphAlloc`) is a *graph*
//!   generation: the launches of its graphs run its captured tasks at their own positions,
//!   long after the capture, so it stays valid for every launch until its region is released
//!   (`GraphRelease`), whatever the captures freed (`GraphFree`: the block went back to the
//!   region, which reuses it for later captured allocations — graph generations of one region
//!   may overlap). Work other than launches may use it from its allocation point until it
//!   went back; a use enqueued afterwards is a use after free. A task's access is attributed
//!   to the newest graph generation that covers it whole. At the release, the generations
//!   that went back are freed (every task enqueued afterwards comes after the free), the
//!   others become ordinary allocations. Launches record no uses on graph generations: the
//!   graph's drop waits for its launches before the release.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;
use soma_core::hal::{AccessMode, DriverError};

use crate::memory::{DeviceMemory, Owner, Range};
use crate::stream::StreamShared;
use output::ReportOutput;
use streams::DroppedStream;

pub(crate) use clock::Clock;
pub use report::{AllocationInfo, ReportKind, SanitizerReport, StreamPoint};

mod annotations;
mod check;
mod clock;
mod graph_memory;
mod output;
mod report;
mod streams;

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
}

struct FreeInfo {
    point: Point,
    clock: Arc<Clock>,
    /// Sequence number at which the host was seen to have observed the free.
    observed_seq: Option<u64>,
}

struct Gen {
    pool: Option<u64>,
    /// For a graph generation (see the module docs): its region, and when it went back.
    graph: Option<GraphMark>,
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

/// What a graph generation knows of its region.
#[derive(Clone, Copy, Debug)]
struct GraphMark {
    /// The region's key.
    region: u64,
    /// Sequence number at which the block went back to the region.
    returned: Option<u64>,
}

/// Which map of the state holds a generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Map {
    Live,
    Freed,
    Graph,
}

impl Gen {
    fn contains(&self, addr: u64) -> bool {
        self.ptr <= addr && addr - self.ptr < self.size
    }

    /// Whether `[addr, addr + len)` lies inside the generation.
    fn covers(&self, addr: u64, len: u64) -> bool {
        self.contains(addr) && addr.saturating_add(len) <= self.ptr.saturating_add(self.size)
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
    /// Graph generations (live or gone back to their region), by (address, id).
    graph: BTreeMap<(u64, u64), Gen>,
    graph_max_size: u64,
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

    /// Live (graph generations included) and freed generations tracked (diagnostics).
    pub(crate) fn generations(&self) -> (usize, usize) {
        let st = self.state.lock();
        (st.live.len() + st.graph.len(), st.freed.len())
    }

    pub(crate) fn reports(&self) -> Vec<SanitizerReport> {
        self.state.lock().reports.clone()
    }

    pub(crate) fn take_reports(&self) -> Vec<SanitizerReport> {
        std::mem::take(&mut self.state.lock().reports)
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
