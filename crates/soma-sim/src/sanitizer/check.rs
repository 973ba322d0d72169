//! The checks of device accesses: tasks' ranges in stream order, synchronous host copies.

use smallvec::SmallVec;
use soma_core::hal::AccessMode;

use super::{
    point_before_task, task_before_free, Gen, ReportKind, Sanitizer, SanitizerReport, Stamp, State,
    StreamPoint, TaskView, HOST,
};
use crate::memory::Range;

impl Sanitizer {
    pub(super) fn candidates(st: &State, addr: u64) -> SmallVec<[(bool, (u64, u64)); 4]> {
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

    pub(super) fn gen<'a>(st: &'a State, c: &(bool, (u64, u64))) -> &'a Gen {
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
}
