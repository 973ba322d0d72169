//! Fake stream orders: one from fixed tables, one from a small model of streams.

use std::collections::BTreeMap;

use crate::{Eligibility, FreeTag, StreamOrder, StreamSlot};

/// A stream order read from tables: the default has nothing eligible, no internal
/// dependencies and nothing complete; fill in what a test needs.
#[derive(Clone, Debug, Default)]
pub struct TestOrder {
    /// [`Eligibility::host_observed`] per stream (0 when absent).
    pub host_observed: BTreeMap<StreamSlot, u64>,
    /// [`Eligibility::event`] per stream (0 when absent).
    pub event: BTreeMap<StreamSlot, u64>,
    /// [`Eligibility::completed`] per stream (0 when absent).
    pub completed: BTreeMap<StreamSlot, u64>,
    /// `is_complete(tag)` ⇔ `tag.pos < complete_bound[tag.stream]` (or `all_complete`).
    pub complete_bound: BTreeMap<StreamSlot, u64>,
    /// What [`StreamOrder::internal_dependencies`] answers.
    pub internal: bool,
    /// Every free is complete.
    pub all_complete: bool,
}

impl TestOrder {
    /// Every free complete, nothing of another stream eligible: one stream whose device
    /// keeps up (the trace replays and the benchmark of the engine alone).
    pub fn complete() -> TestOrder {
        TestOrder { all_complete: true, ..TestOrder::default() }
    }
}

impl StreamOrder for TestOrder {
    fn eligibility(&self, s: StreamSlot) -> Eligibility {
        Eligibility {
            host_observed: self.host_observed.get(&s).copied().unwrap_or(0),
            event: self.event.get(&s).copied().unwrap_or(0),
            completed: self.completed.get(&s).copied().unwrap_or(0),
        }
    }

    fn internal_dependencies(&self) -> bool {
        self.internal
    }

    fn is_complete(&self, tag: FreeTag) -> bool {
        self.all_complete || tag.pos < self.complete_bound.get(&tag.stream).copied().unwrap_or(0)
    }
}

/// A model of a few streams, from which the engine's view of stream order follows as a pool
/// derives it from the device: every task on a stream (work, a free, an event record) takes
/// the next position; a stream completes up to a position; the host observes completion up
/// to a position (a synchronisation); a stream waits on an event recorded on another, and so
/// learns what that one knew (vector clocks). Reuse switches as in a pool's policy.
///
/// A free at position `p` is complete once `completed >= p`, host-observed once
/// `host >= p`, and ordered before a stream that waited on an event recorded after it.
#[derive(Clone, Debug)]
pub struct StreamClocks {
    /// Tasks enqueued per stream.
    pub pos: Vec<u64>,
    /// Tasks completed per stream.
    pub completed: Vec<u64>,
    /// Tasks the host observed complete per stream.
    pub host: Vec<u64>,
    /// `vc[t][s]`: stream `t` waited on an event recorded on `s` after this many of its tasks.
    pub vc: Vec<Vec<u64>>,
    /// Rule 2: follow event dependencies.
    pub follow: bool,
    /// Rule 3: opportunistic reuse of completed frees.
    pub opportunistic: bool,
    /// Rule 4: internal dependencies.
    pub internal: bool,
}

impl StreamClocks {
    /// `streams` streams with nothing enqueued and every switch off.
    pub fn new(streams: usize) -> StreamClocks {
        StreamClocks {
            pos: vec![0; streams],
            completed: vec![0; streams],
            host: vec![0; streams],
            vc: vec![vec![0; streams]; streams],
            follow: false,
            opportunistic: false,
            internal: false,
        }
    }

    /// The order a request of stream `requester` sees.
    pub fn order(&self, requester: StreamSlot) -> ClockOrder<'_> {
        ClockOrder { clocks: self, requester: Some(requester as usize) }
    }

    /// The order of a call on behalf of no stream (release, settling after a host
    /// synchronisation): no event knowledge.
    pub fn no_requester(&self) -> ClockOrder<'_> {
        ClockOrder { clocks: self, requester: None }
    }

    /// Frees of stream `s` below this are host-observed.
    pub fn host_bound(&self, s: usize) -> u64 {
        self.host[s] + 1
    }

    /// Frees of stream `s` below this are complete.
    pub fn complete_bound(&self, s: usize) -> u64 {
        self.completed[s] + 1
    }

    /// A free on stream `s`: a task at the stream's next position; its tag.
    pub fn free_tag(&mut self, s: usize) -> FreeTag {
        let tag = FreeTag { stream: s as StreamSlot, pos: self.pos[s] };
        self.pos[s] += 1;
        tag
    }

    /// Other work enqueued on stream `s`.
    pub fn work(&mut self, s: usize) {
        self.pos[s] += 1;
    }

    /// Stream `s` completes everything enqueued so far.
    pub fn complete(&mut self, s: usize) {
        self.completed[s] = self.pos[s];
    }

    /// The host synchronises with stream `s`: complete and observed.
    pub fn host_sync(&mut self, s: usize) {
        self.completed[s] = self.pos[s];
        self.host[s] = self.pos[s];
    }

    /// An event recorded on `on` (a task), then `waiter` waits on it: the frees of `on`
    /// before the record become ordered before `waiter`'s later work, and `waiter` learns
    /// what `on` knew of the other streams. Nothing when they are the same stream.
    pub fn event_wait(&mut self, waiter: usize, on: usize) {
        if waiter == on {
            return;
        }
        let recorded = self.pos[on];
        self.pos[on] += 1;
        self.vc[waiter][on] = self.vc[waiter][on].max(recorded);
        for x in 0..self.pos.len() {
            let known = self.vc[on][x];
            if x != waiter && known > self.vc[waiter][x] {
                self.vc[waiter][x] = known;
            }
        }
    }
}

/// [`StreamClocks`] as the engine sees them for one call.
#[derive(Clone, Copy, Debug)]
pub struct ClockOrder<'a> {
    clocks: &'a StreamClocks,
    requester: Option<usize>,
}

impl StreamOrder for ClockOrder<'_> {
    /// # Panics
    ///
    /// When asked about the requesting stream itself (the engine never should).
    fn eligibility(&self, s: StreamSlot) -> Eligibility {
        let i = s as usize;
        assert_ne!(Some(i), self.requester, "eligibility asked for the requesting stream");
        let c = self.clocks;
        let event = match self.requester {
            Some(t) if c.follow => c.vc[t][i],
            _ => 0,
        };
        Eligibility { event, ..self.completion(s) }
    }

    fn internal_dependencies(&self) -> bool {
        self.clocks.internal
    }

    fn is_complete(&self, tag: FreeTag) -> bool {
        tag.pos < self.clocks.complete_bound(tag.stream as usize)
    }

    fn completion(&self, s: StreamSlot) -> Eligibility {
        let c = self.clocks;
        let s = s as usize;
        Eligibility {
            host_observed: c.host_bound(s),
            event: 0,
            completed: if c.opportunistic { c.complete_bound(s) } else { 0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_becomes_eligible_by_each_rule() {
        let mut c = StreamClocks::new(2);
        let tag = c.free_tag(1);
        let bound = |c: &StreamClocks| c.order(0).eligibility(1);
        assert_eq!(bound(&c), Eligibility { host_observed: 1, event: 0, completed: 0 });
        assert!(tag.pos < bound(&c).host_observed, "position 0 counts as observed");
        let tag = c.free_tag(1);
        assert!(tag.pos >= bound(&c).host_observed);
        c.follow = true;
        c.event_wait(0, 1);
        assert!(tag.pos < bound(&c).event, "recorded after the free");
        c.opportunistic = true;
        assert!(!c.order(0).is_complete(tag));
        c.complete(1);
        assert!(tag.pos < bound(&c).completed && c.order(0).is_complete(tag));
        c.host_sync(1);
        assert!(tag.pos < bound(&c).host_observed);
    }

    #[test]
    fn event_waits_are_transitive() {
        let mut c = StreamClocks::new(3);
        c.free_tag(2);
        c.event_wait(1, 2);
        c.event_wait(0, 1);
        assert_eq!(c.vc[0][2], c.vc[1][2]);
        assert!(c.vc[0][2] > 0);
    }

    #[test]
    fn the_table_order_reads_its_tables() {
        let mut o = TestOrder::default();
        o.event.insert(3, 5);
        o.complete_bound.insert(3, 2);
        assert_eq!(o.eligibility(3), Eligibility { host_observed: 0, event: 5, completed: 0 });
        assert!(o.is_complete(FreeTag { stream: 3, pos: 1 }));
        assert!(!o.is_complete(FreeTag { stream: 3, pos: 2 }));
        assert!(TestOrder::complete().is_complete(FreeTag { stream: 3, pos: 9 }));
    }
}
