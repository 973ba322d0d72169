//! The checks of device accesses: tasks' ranges in stream order, synchronous host copies.

use smallvec::SmallVec;
use soma_core::hal::AccessMode;

use super::{
    point_before_task, task_before_free, Gen, Map, ReportKind, Sanitizer, SanitizerReport, Stamp,
    State, StreamPoint, TaskView, HOST,
};
use crate::memory::Range;

/// A generation: the map that holds it and its key there.
pub(super) type Candidate = (Map, (u64, u64));

impl Sanitizer {
    /// The generations whose range holds `addr`, newest first.
    pub(super) fn candidates(st: &State, addr: u64) -> SmallVec<[Candidate; 4]> {
        let mut v: SmallVec<[Candidate; 4]> = SmallVec::new();
        if let Some((k, g)) = st.live.range(..=(addr, u64::MAX)).next_back() {
            if g.contains(addr) {
                v.push((Map::Live, *k));
            }
        }
        let lo = addr.saturating_sub(st.freed_max_size);
        for (k, g) in st.freed.range((lo, 0)..=(addr, u64::MAX)) {
            if g.contains(addr) {
                v.push((Map::Freed, *k));
            }
        }
        let lo = addr.saturating_sub(st.graph_max_size);
        for (k, g) in st.graph.range((lo, 0)..=(addr, u64::MAX)) {
            if g.contains(addr) {
                v.push((Map::Graph, *k));
            }
        }
        // Newest first (generation ids increase).
        v.sort_by_key(|c| std::cmp::Reverse(c.1 .1));
        v
    }

    pub(super) fn gen<'a>(st: &'a State, c: &Candidate) -> &'a Gen {
        match c.0 {
            Map::Live => &st.live[&c.1],
            Map::Freed => &st.freed[&c.1],
            Map::Graph => &st.graph[&c.1],
        }
    }

    fn gen_mut<'a>(st: &'a mut State, c: &Candidate) -> Option<&'a mut Gen> {
        match c.0 {
            Map::Live => st.live.get_mut(&c.1),
            Map::Freed => st.freed.get_mut(&c.1),
            Map::Graph => st.graph.get_mut(&c.1),
        }
    }

    /// The generation an access of `r` by a task enqueued at `seq` is attributed to: the
    /// newest allocated before it — of graph generations, which overlap within their region,
    /// the newest that covers the access whole, if one does.
    fn attribute<'c>(
        st: &State,
        cands: &'c [Candidate],
        r: &Range,
        seq: u64,
    ) -> Option<&'c Candidate> {
        let before = |c: &&Candidate| Self::gen(st, c).alloc.seq < seq;
        let whole = |c: &&Candidate| {
            let g = Self::gen(st, c);
            g.graph.is_none() || g.covers(r.addr, r.len)
        };
        cands.iter().filter(before).find(whole).or_else(|| cands.iter().find(before))
    }

    /// Checks a task's device ranges before it runs (`replay`: a task of a graph launch).
    /// `Err` (FailStream mode only) carries the report(s) as the task's failure message.
    pub(crate) fn check_task(
        &self,
        stream: u64,
        pos: u64,
        stamp: &Stamp,
        task: (&'static str, bool),
        ranges: &[Range],
    ) -> Result<(), String> {
        let (name, replay) = task;
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
            let Some(sel) = Self::attribute(&st, &cands, r, t.seq) else {
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
            let returned = g.graph.and_then(|m| m.returned);
            if let Some(at) = returned.filter(|&at| !replay && t.seq > at) {
                // Back in graph memory, which only the graph's launches may use.
                let other =
                    StreamPoint { what: "returned to graph memory", stream: HOST, position: at };
                verdict = Some((ReportKind::UseAfterFree, Some(other)));
            } else if let Some(free) = &g.free {
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
                // The graph's drop waits for its launches before its memory is released.
                None if replay && g.graph.is_some() => {}
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
            let returned = g.and_then(|g| g.graph).and_then(|m| m.returned);
            let (kind, other) = match g {
                Some(_) if returned.is_some() => (
                    ReportKind::UseAfterFree,
                    Some(StreamPoint {
                        what: "returned to graph memory",
                        stream: HOST,
                        position: returned.unwrap_or(0),
                    }),
                ),
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
}
