//! Allocations and frees: pool annotations, the driver's `malloc` and `free`, released
//! reservations, and the pruning of freed generations.

use std::sync::Arc;

use parking_lot::MutexGuard;
use smallvec::SmallVec;
use soma_core::hal::{DriverError, PoolAnnotation};

use super::{
    point_before_task, poison, task_before_free, Clock, FailAction, FreeInfo, Gen, GraphMark,
    Point, ReportKind, Sanitizer, SanitizerReport, State, StreamPoint, TaskView, HOST,
    MIN_PRUNE_AT,
};

/// A block handed out, as an annotation tells it.
struct NewAlloc {
    /// Pool id (`None`: the driver's `malloc`).
    pool: Option<u64>,
    /// The graph region, for a block allocated while capturing.
    region: Option<u64>,
    ptr: u64,
    size: u64,
    stream: u64,
    position: u64,
}
use crate::memory::DeviceMemory;

impl Sanitizer {
    /// A pool annotation; `range` is the reservation containing the pointer.
    pub(crate) fn on_annotation(
        &self,
        a: PoolAnnotation,
        range: Option<(u64, u64)>,
        memory: &DeviceMemory,
    ) -> Option<FailAction> {
        match a {
            PoolAnnotation::Alloc { pool, ptr, size, stream, position } => {
                let ptr = ptr.addr();
                let a = NewAlloc { pool: Some(pool), region: None, ptr, size, stream, position };
                self.on_alloc(a, range)
            }
            PoolAnnotation::Free { pool: _, ptr, stream, position } => {
                self.on_free(ptr.addr(), stream, position, memory)
            }
            PoolAnnotation::GraphAlloc { pool, region, ptr, size, stream, position } => {
                let (pool, region, ptr) = (Some(pool), Some(region), ptr.addr());
                self.on_alloc(NewAlloc { pool, region, ptr, size, stream, position }, range)
            }
            PoolAnnotation::GraphFree { pool: _, region, ptr } => {
                self.on_graph_free(region, ptr.addr());
                None
            }
            PoolAnnotation::GraphRelease { pool: _, region } => {
                self.on_graph_release(region, memory);
                None
            }
        }
    }

    /// An allocation (`a`, in reservation `range`): a new generation, checked against the
    /// live ones it must not overlap.
    fn on_alloc(&self, a: NewAlloc, range: Option<(u64, u64)>) -> Option<FailAction> {
        let NewAlloc { pool, region, ptr, size, stream, position } = a;
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
            // A graph generation may overlap those of its region that went back to it; no
            // other allocation overlaps a graph generation.
            let lo = ptr.saturating_sub(st.graph_max_size);
            let live_graph = st.graph.range((lo, 0)..(end, 0)).map(|(_, g)| g).find(|g| {
                g.ptr.saturating_add(g.size) > ptr
                    && g.graph.is_some_and(|m| m.returned.is_none() || Some(m.region) != region)
            });
            let live = st.live.range(..(end, 0)).next_back().map(|(_, g)| g);
            let overlapped = live.filter(|g| g.ptr.saturating_add(g.size) > ptr).or(live_graph);
            if let Some(g) = overlapped {
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
        st.next_gen += 1;
        let id = st.next_gen;
        let graph = region.map(|region| GraphMark { region, returned: None });
        let g =
            Gen { pool, graph, ptr, size, alloc: point, free: None, preds, uses: SmallVec::new() };
        if graph.is_some() {
            st.graph_max_size = st.graph_max_size.max(size);
            st.graph.insert((ptr, id), g);
        } else {
            st.live.insert((ptr, id), g);
        }
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
        let _ = self.on_alloc(
            NewAlloc { pool: None, region: None, ptr, size, stream: HOST, position: 0 },
            None,
        );
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
        st.graph.retain(|_, g| g.ptr < start || g.ptr >= end);
    }

    /// Drops freed generations no task can be attributed to any more: those whose free every
    /// pending and future task is ordered after (the host observed it, and every task
    /// enqueued before that has run), and those superseded by a newer generation covering
    /// their whole range that every pending task was enqueued after.
    pub(super) fn prune(st: &mut State) {
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
}
