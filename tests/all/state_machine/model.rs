//! The shadow model: stream incarnations, vector clocks, live allocations and freed ranges,
//! and the rules that justify a reuse.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use soma::hal::{DevicePtr, StreamHal};
use soma::{Event, ReusePolicy, Stream};

use super::Gate;

/// A stream incarnation: a fresh id for every stream ever created in a case.
pub(super) type Inc = u64;

/// The model's vector clock: `inc -> p` means "ordered after every task of `inc` at a
/// position `<= p`".
#[derive(Clone, Debug, Default)]
pub(super) struct Vc(pub(super) BTreeMap<Inc, u64>);

impl Vc {
    fn get(&self, inc: Inc) -> Option<u64> {
        self.0.get(&inc).copied()
    }
    pub(super) fn raise(&mut self, inc: Inc, pos: u64) {
        let e = self.0.entry(inc).or_insert(pos);
        *e = (*e).max(pos);
    }
    pub(super) fn join(&mut self, other: &Vc) {
        for (&inc, &pos) in &other.0 {
            self.raise(inc, pos);
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct Live {
    pub(super) pool: usize,
    pub(super) ptr: DevicePtr,
    pub(super) size: u64,
    pub(super) inc: Inc,
}

/// A byte range whose last event was a free.
#[derive(Clone, Debug)]
pub(super) struct Freed {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) inc: Inc,
    /// The freeing stream's enqueued position at the free.
    pub(super) pos: u64,
    /// The pool's unmap count at the free (an unmap since means the range may be fresh).
    pub(super) unmaps_at_free: u64,
}

pub(super) struct StreamEntry<'d> {
    pub(super) stream: Stream<'d>,
    pub(super) inc: Inc,
    pub(super) vc: Vc,
}

/// The shadow model plus the handles it drives.
pub(super) struct Model<'d> {
    pub(super) streams: Vec<Option<StreamEntry<'d>>>,
    /// Stream hals by incarnation (kept after the stream is dropped: its positions freeze).
    pub(super) hals: BTreeMap<Inc, Arc<dyn StreamHal>>,
    pub(super) destroyed: BTreeSet<Inc>,
    pub(super) host_observed: BTreeMap<Inc, u64>,
    pub(super) next_inc: Inc,
    pub(super) events: Vec<(Event<'d>, Option<Vc>)>,
    pub(super) live: Vec<Live>,
    pub(super) freed: Vec<Vec<Freed>>,
    pub(super) gates: Vec<(Gate, u8)>,
    /// Failures seen by host functions that check inserted dependencies.
    pub(super) violations: Arc<Mutex<Vec<String>>>,
    pub(super) log: Vec<String>,
}

impl<'d> Model<'d> {
    pub(super) fn create_stream(&mut self, dev: &'d soma::Device, slot: usize) {
        if self.streams[slot].is_some() {
            return;
        }
        let stream = dev.create_stream().expect("create stream");
        let inc = self.next_inc;
        self.next_inc += 1;
        self.hals.insert(inc, Arc::clone(stream.hal()));
        self.streams[slot] = Some(StreamEntry { stream, inc, vc: Vc::default() });
    }

    /// The live stream at `slot`, or the next live one after it.
    pub(super) fn pick(&self, slot: u8) -> Option<usize> {
        let n = self.streams.len();
        (0..n).map(|i| (slot as usize + i) % n).find(|&i| self.streams[i].is_some())
    }

    pub(super) fn entry(&self, i: usize) -> &StreamEntry<'d> {
        self.streams[i].as_ref().expect("live stream")
    }

    pub(super) fn open_gates(&mut self) {
        for (g, _) in self.gates.drain(..) {
            g.open();
        }
    }

    pub(super) fn completed(&self, inc: Inc) -> u64 {
        if self.destroyed.contains(&inc) {
            u64::MAX
        } else {
            self.hals[&inc].completed()
        }
    }

    pub(super) fn host_observed(&self, inc: Inc) -> u64 {
        if self.destroyed.contains(&inc) {
            u64::MAX
        } else {
            self.host_observed.get(&inc).copied().unwrap_or(0)
        }
    }

    pub(super) fn observe(&mut self, inc: Inc, pos: u64) {
        let e = self.host_observed.entry(inc).or_insert(pos);
        *e = (*e).max(pos);
    }

    /// Why the new allocation `[start, end)` on stream slot `t` may overlap the freed range
    /// `f`, or `None` if no enabled rule allows it.
    ///
    /// Rules (permissive where the engine is conservative, never beyond what is safe):
    /// * same stream incarnation;
    /// * host observed: a synchronisation / successful query covered position `>= m`, or the
    ///   stream was dropped (which drains it);
    /// * follow event dependencies (if on): `t`'s clock has an entry `>= m` for the freeing
    ///   stream (an entry equal to `m` means a record right before the free with no task in
    ///   between: as safe as one after it);
    /// * opportunistic (if on): the free has completed, checked **after** the allocation
    ///   returned (completion only moves forward, so this is the permissive bound: the engine
    ///   may have seen an earlier, smaller completed position);
    /// * recycled: the pool unmapped something since the free and the free has completed
    ///   (the engine unmaps only completed frees, and a remapped range is fresh memory);
    /// * internal dependency: returned as a candidate; the caller then checks that the pool
    ///   really ordered `t` after the free.
    pub(super) fn justify(
        &self,
        f: &Freed,
        t_inc: Inc,
        t_vc: &Vc,
        policy: ReusePolicy,
        unmaps_now: u64,
    ) -> Option<&'static str> {
        if f.inc == t_inc {
            return Some("same stream");
        }
        if self.host_observed(f.inc) >= f.pos {
            return Some("host observed");
        }
        if policy.follow_event_dependencies && t_vc.get(f.inc).is_some_and(|q| q >= f.pos) {
            return Some("event dependency");
        }
        let completed = self.completed(f.inc) >= f.pos;
        if policy.opportunistic && completed {
            return Some("opportunistic");
        }
        if unmaps_now > f.unmaps_at_free && completed {
            return Some("recycled");
        }
        None
    }
}

pub(super) fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}
