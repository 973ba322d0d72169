//! Forgetting dropped streams changes no verdict: one random script of streams, pool
//! allocations and frees, uses, events and synchronisations, run once forgetting every dropped
//! stream as soon as it can and once never forgetting, gives the same reports.
//!
//! Each step runs to completion before the next (the script waits for the streams' counters,
//! which tells the sanitizer nothing), so both runs see the same interleaving. A stream can be
//! blocked by a gate: its queued tasks keep the clocks they were enqueued with while other
//! streams are dropped and forgotten, and are checked when the gate opens.

use std::collections::HashMap;
use std::sync::Arc;

use crossbeam_channel::Sender;
use proptest::prelude::*;
use soma_core::hal::{
    AccessMode, BufferAccess, DeviceHal, DevicePtr, EventHal, KernelBuffers, KernelLaunch,
    PoolAnnotation, StreamHal,
};

use crate::{Npu, SanitizerMode, SanitizerReport, SimDevice, SimEvent, SimStream};

const SLOT: u64 = 8 << 10;
const SLOTS: usize = 4;
const EVENTS: usize = 3;
const POOL: u64 = 1;

#[derive(Clone, Debug)]
enum Op {
    Create,
    Drop(usize),
    Alloc { stream: usize, slot: usize, size: u64 },
    Free { stream: usize, slot: usize },
    Use { stream: usize, slot: usize, offset: u64, len: u64, write: bool },
    Record { stream: usize, event: usize },
    Wait { stream: usize, event: usize },
    Sync(usize),
    Query(usize),
    SyncEvent(usize),
    DeviceSync,
    Block(usize),
    Unblock(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let stream = any::<usize>();
    prop_oneof![
        3 => Just(Op::Create),
        2 => stream.prop_map(Op::Drop),
        4 => (stream, 0..SLOTS, SLOT / 2..=SLOT)
            .prop_map(|(stream, slot, size)| Op::Alloc { stream, slot, size }),
        3 => (stream, 0..SLOTS).prop_map(|(stream, slot)| Op::Free { stream, slot }),
        6 => (stream, 0..SLOTS, 0..SLOT / 4, 1..=SLOT / 2, any::<bool>()).prop_map(
            |(stream, slot, offset, len, write)| Op::Use { stream, slot, offset, len, write }
        ),
        3 => (stream, 0..EVENTS).prop_map(|(stream, event)| Op::Record { stream, event }),
        3 => (stream, 0..EVENTS).prop_map(|(stream, event)| Op::Wait { stream, event }),
        1 => stream.prop_map(Op::Sync),
        1 => stream.prop_map(Op::Query),
        1 => (0..EVENTS).prop_map(Op::SyncEvent),
        1 => Just(Op::DeviceSync),
        1 => stream.prop_map(Op::Block),
        1 => stream.prop_map(Op::Unblock),
    ]
}

struct Stream {
    hal: SimStream,
    /// Open with the sender dropped; the gate task's position.
    gate: Option<(Sender<()>, u64)>,
}

impl Stream {
    /// The completed count once everything runnable has run.
    fn settled_at(&self) -> u64 {
        self.gate.as_ref().map_or_else(|| self.hal.enqueued(), |g| g.1 - 1)
    }

    fn is_blocked(&self) -> bool {
        self.gate.is_some()
    }
}

struct Run {
    dev: Arc<SimDevice>,
    base: u64,
    streams: Vec<Stream>,
    /// Stream id → creation number, to compare reports across runs.
    numbers: HashMap<u64, u64>,
    allocated: [bool; SLOTS],
    events: Vec<SimEvent>,
    forget: bool,
}

impl Run {
    fn new(strict: bool, forget: bool) -> Run {
        let npu = Npu::builder()
            .sanitizer(SanitizerMode::Report)
            .sanitizer_strict(strict)
            .build()
            .unwrap();
        let dev = npu.device(0).unwrap();
        dev.core.sanitizer.as_ref().unwrap().forget_only_when_told();
        let size = dev.info().granularity;
        let va = dev.reserve(size).unwrap();
        dev.map(va, dev.alloc_physical(size).unwrap()).unwrap();
        let events = (0..EVENTS).map(|_| SimEvent::new()).collect();
        Run {
            dev,
            base: va.addr(),
            streams: Vec::new(),
            numbers: HashMap::new(),
            allocated: [false; SLOTS],
            events,
            forget,
        }
    }

    fn stream(&self, i: usize) -> Option<&Stream> {
        (!self.streams.is_empty()).then(|| &self.streams[i % self.streams.len()])
    }

    fn slot(&self, slot: usize) -> DevicePtr {
        DevicePtr::new(self.base + slot as u64 * SLOT).unwrap()
    }

    fn annotate(&self, stream: &Stream, make: impl FnOnce(u64, u64) -> PoolAnnotation) {
        self.dev.annotate(make(stream.hal.id(), stream.hal.enqueued()));
    }

    /// Whether waiting for the event's latest record could block on a gate.
    fn record_blocked(&self, event: usize) -> bool {
        let Some((id, pos)) = self.events[event].latest_record() else { return false };
        self.streams.iter().any(|s| s.hal.id() == id && s.is_blocked() && s.hal.completed() < pos)
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Create => {
                let hal = self.dev.create_sim_stream().unwrap();
                self.numbers.insert(hal.id(), self.numbers.len() as u64 + 1);
                self.streams.push(Stream { hal, gate: None });
            }
            Op::Drop(i) if !self.streams.is_empty() => {
                // Open the gate first: the drop drains the queue.
                let Stream { hal, gate } = self.streams.remove(i % self.streams.len());
                drop(gate);
                drop(hal);
            }
            Op::Alloc { stream, slot, size } if !self.allocated[slot] => {
                let Some(s) = self.stream(stream) else { return };
                let ptr = self.slot(slot);
                self.annotate(s, |stream, position| PoolAnnotation::Alloc {
                    pool: POOL,
                    ptr,
                    size,
                    stream,
                    position,
                });
                self.allocated[slot] = true;
            }
            Op::Free { stream, slot } if self.allocated[slot] => {
                let Some(s) = self.stream(stream) else { return };
                let ptr = self.slot(slot);
                self.annotate(s, |stream, position| PoolAnnotation::Free {
                    pool: POOL,
                    ptr,
                    stream,
                    position,
                });
                self.allocated[slot] = false;
            }
            Op::Use { stream, slot, offset, len, write } => {
                let Some(s) = self.stream(stream) else { return };
                let ptr = self.slot(slot).checked_add(offset).unwrap();
                if write {
                    s.hal.memset(ptr, 0xA5, len).unwrap();
                } else {
                    let buffers = vec![BufferAccess { ptr, len, mode: AccessMode::Read }];
                    let body = Box::new(|_: &dyn KernelBuffers| Ok(()));
                    s.hal.launch(KernelLaunch { name: "read", buffers, body }).unwrap();
                }
            }
            Op::Record { stream, event } => {
                if let Some(s) = self.stream(stream) {
                    s.hal.record(&self.events[event]).unwrap();
                }
            }
            Op::Wait { stream, event } if !self.record_blocked(event) => {
                if let Some(s) = self.stream(stream) {
                    s.hal.wait(&self.events[event]).unwrap();
                }
            }
            Op::Sync(i) => {
                if let Some(s) = self.stream(i).filter(|s| !s.is_blocked()) {
                    s.hal.synchronize().unwrap();
                }
            }
            Op::Query(i) => {
                if let Some(s) = self.stream(i) {
                    s.hal.query().unwrap();
                }
            }
            Op::SyncEvent(event) if !self.record_blocked(event) => {
                self.events[event].synchronize().unwrap();
            }
            Op::DeviceSync if !self.streams.iter().any(Stream::is_blocked) => {
                self.dev.synchronize().unwrap();
            }
            Op::Block(i) if !self.streams.is_empty() => {
                let n = self.streams.len();
                let s = &mut self.streams[i % n];
                if s.gate.is_none() {
                    let (tx, rx) = crossbeam_channel::bounded::<()>(0);
                    s.hal.host_fn(Box::new(move || _ = rx.recv())).unwrap();
                    s.gate = Some((tx, s.hal.enqueued()));
                }
            }
            Op::Unblock(i) if !self.streams.is_empty() => {
                let n = self.streams.len();
                self.streams[i % n].gate = None;
            }
            _ => {}
        }
        self.settle();
        if self.forget {
            self.dev.core.sanitizer.as_ref().unwrap().forget_now();
        }
    }

    /// Waits until every stream has run what it can, without telling the sanitizer.
    fn settle(&self) {
        for s in &self.streams {
            while s.hal.completed() < s.settled_at() {
                std::thread::yield_now();
            }
        }
    }

    /// Drops every stream; the reports, with stream ids and addresses made comparable.
    fn finish(mut self) -> (Vec<SanitizerReport>, usize) {
        while !self.streams.is_empty() {
            self.step(&Op::Drop(0));
        }
        let number = |id: u64| if id == crate::sanitizer::HOST { 0 } else { self.numbers[&id] };
        let reports = self
            .dev
            .take_sanitizer_reports()
            .into_iter()
            .map(|mut r| {
                r.stream = number(r.stream);
                r.addr -= self.base;
                if let Some(a) = &mut r.allocation {
                    a.stream = number(a.stream);
                    a.ptr -= self.base;
                }
                if let Some(o) = &mut r.other {
                    o.stream = number(o.stream);
                }
                r
            })
            .collect();
        (reports, self.dev.sanitizer_tracked_streams())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn forgetting_dropped_streams_changes_no_report(
        ops in prop::collection::vec(op(), 1..120),
        strict in any::<bool>(),
    ) {
        let mut forgetting = Run::new(strict, true);
        let mut keeping = Run::new(strict, false);
        for op in &ops {
            forgetting.step(op);
            keeping.step(op);
        }
        let (forgot, tracked_after_forgetting) = forgetting.finish();
        let (kept, _) = keeping.finish();
        prop_assert_eq!(forgot, kept);
        // Every stream was dropped and drained, and forgotten at once.
        prop_assert_eq!(tracked_after_forgetting, 0);
    }
}

#[test]
fn a_dropped_device_forgets_its_streams_everywhere() {
    let npu = Npu::builder().sanitizer(SanitizerMode::Report).build().unwrap();
    let dev = npu.device(0).unwrap();
    drop(npu);
    // Dropped, but fewer than a batch: not forgotten yet.
    let mut ids: Vec<u64> = (0..3).map(|_| dev.create_sim_stream().unwrap().id()).collect();
    let live = dev.create_sim_stream().unwrap();
    ids.push(live.id());
    let known = |id: &u64| super::streams::KNOWN_STREAMS.lock().contains(id);
    assert!(ids.iter().all(known));
    drop(dev);
    drop(live);
    assert!(!ids.iter().any(known));
}
