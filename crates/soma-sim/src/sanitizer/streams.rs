//! The sanitizer's streams: registration, drop, and forgetting dropped streams once nothing
//! can need their state (see the module docs of [`sanitizer`](super)).

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::{Clock, Point, Sanitizer, State, StreamState, MIN_FORGET_AT};
use crate::stream::StreamShared;

/// The streams of sanitized devices whose clock entries may still decide an ordering: live
/// streams, and dropped ones their sanitizer has not forgotten yet. Any other stream named in
/// a clock (of any device: events carry clocks across devices) has been forgotten by its own
/// sanitizer, whose marks now order its points: its entries are dropped wherever they are.
pub(super) static KNOWN_STREAMS: Mutex<BTreeSet<u64>> = parking_lot::const_mutex(BTreeSet::new());

/// A dropped stream the sanitizer has not forgotten yet.
pub(super) struct DroppedStream {
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

impl Point {
    /// Marks the point if its stream is one of `dropped` (sorted by id).
    fn forget_stream(&mut self, dropped: &[DroppedStream]) {
        if self.dropped_at.is_none() {
            if let Ok(i) = dropped.binary_search_by_key(&self.stream, |d| d.id) {
                self.dropped_at = Some(dropped[i].seq);
            }
        }
    }
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
        for g in st.live.values().chain(st.freed.values()).chain(st.graph.values()) {
            ids.extend(g.uses.iter().map(|u| u.0));
        }
        ids.len()
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
    pub(super) fn forget_dropped(st: &mut State) {
        let (mut done, draining): (Vec<_>, Vec<_>) =
            std::mem::take(&mut st.dropped).into_iter().partition(DroppedStream::drained);
        st.dropped = draining;
        done.sort_unstable_by_key(|d| d.id);
        let is_done = |id: u64| done.binary_search_by_key(&id, |d| d.id).is_ok();
        let gens = st.live.values_mut().chain(st.freed.values_mut()).chain(st.graph.values_mut());
        for g in gens {
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
        let gens = st.live.len() + st.freed.len() + st.graph.len();
        st.forget_at = (st.dropped.len() + gens.isqrt()).max(MIN_FORGET_AT);
    }
}
