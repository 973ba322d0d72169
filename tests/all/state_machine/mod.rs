//! Property-based state-machine test of the pool on the software NPU.
//!
//! Random programs of stream creation / destruction, raw allocations and frees, event
//! records and waits, synchronisations (stream, event, device, queries), trims, reuse
//! switches, thresholds and host delays (sleeping host functions, gates held for a few steps)
//! run across 1–6 streams and 2–3 pools of one device. After every step the real pools are
//! checked against a **shadow model written here**, which shares no code with the engine:
//!
//! * it tracks every live allocation and every freed byte range with the tag of its last
//!   free (the freeing stream's incarnation and its enqueued position `m`);
//! * it keeps its own vector clocks over stream *incarnations* (a dropped stream's slot is
//!   reused by the engine; here every stream gets a fresh id): recording an event captures
//!   the recorder's clock plus its record position, waiting joins it, host synchronisations
//!   raise a per-incarnation "host observed" bound.
//!
//! Checked after every step: no two live allocations overlap (all pools), a new allocation
//! that overlaps a freed range is justified by an enabled rule (see [`Model::justify`]), used
//! = Σ rounded sizes of live allocations, `reserved >= used`, high-water marks ≥ currents,
//! `free_bytes = reserved - used`, `owns(ptr)` for every live allocation, and the device's
//! mapped and physical bytes equal the sum of the pools' reserved bytes. After a device
//! synchronisation and `trim_to(0)`, a pool without live allocations holds nothing; at the
//! end everything is given back to the device.
//!
//! The allocations are raw (`alloc_raw` / `free_raw` on `raw_pointers` pools) so that a
//! program can free an allocation on any stream and drop streams freely; the typed
//! `PoolAlloc` path is exercised by the `stress` module and the other integration tests.
//!
//! Cases: 64 by default (`PROPTEST_CASES` overrides), at most 40 steps each.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use soma::hal::{DevicePtr, StreamHal};
use soma::{attr, Event, MemPool, ReusePolicy, Stream};

const STREAM_SLOTS: u8 = 6;
const EVENTS: u8 = 4;
const MIB: u64 = 1 << 20;
/// Max size of a roomy pool: far above what 40 steps can allocate.
const POOL_MAX: u64 = 128 * MIB;
/// Max size of a tight pool: it runs out of room, so growth fails and the pool takes internal
/// dependencies, recycles segments, waits for pending frees or reports out of memory.
const TIGHT_MAX: u64 = 8 * MIB;
/// Longest a gate holds its stream. Bounded because the out-of-memory path synchronises the
/// streams that hold pending frees; gates are opened early before any blocking call.
const GATE_MAX: Duration = Duration::from_millis(100);

/// Holds a stream's worker in a host function until opened, dropped or [`GATE_MAX`] passed.
struct Gate {
    _tx: mpsc::Sender<()>,
}

impl Gate {
    fn close(stream: &Stream<'_>) -> Result<Gate, String> {
        let (tx, rx) = mpsc::channel::<()>();
        stream
            .host_fn(move || {
                let _ = rx.recv_timeout(GATE_MAX);
            })
            .map_err(|e| e.to_string())?;
        Ok(Gate { _tx: tx })
    }

    /// Opens the gate (dropping the sender wakes the host function).
    fn open(self) {}
}

/// One step of a program. Indices are taken modulo what exists, so that shrinking never
/// produces an invalid program.
#[derive(Clone, Debug)]
#[rustfmt::skip]
enum Op {
    CreateStream { slot: u8 },
    DestroyStream { slot: u8 },
    Alloc { pool: u8, stream: u8, bytes: u32 },
    Free { which: u8, stream: u8 },
    Record { stream: u8, event: u8 },
    Wait { stream: u8, event: u8 },
    /// `waiter.wait_stream(on)`: an event recorded on `on` and waited on by `waiter`.
    WaitStream { waiter: u8, on: u8 },
    SyncStream { stream: u8 },
    SyncEvent { event: u8 },
    SyncDevice,
    QueryStream { stream: u8 },
    QueryEvent { event: u8 },
    Trim { pool: u8, mib: u8 },
    SyncTrimAll,
    SetReuse { pool: u8, follow: bool, opportunistic: bool, internal: bool },
    SetThreshold { pool: u8, mib: u8 },
    ResetHighs { pool: u8 },
    Sleep { stream: u8, ms: u8 },
    Gate { stream: u8, steps: u8 },
}

#[derive(Clone, Debug)]
struct PoolCfg {
    tight: bool,
    alignment: u64,
    threshold_mib: u8,
    follow: bool,
    opportunistic: bool,
    internal: bool,
    /// `MemPoolBuilder::stream_shards`: 1 (one engine) or 2–3 shards by stream slot.
    shards: u8,
}

/// A generated program: pool configurations, initial streams and steps. Its `Debug` prints
/// one step per line, so that a shrunk failure reads as a script.
#[derive(Clone)]
struct Case {
    pools: Vec<PoolCfg>,
    streams: u8,
    ops: Vec<Op>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Case {{ streams: {},", self.streams)?;
        for (i, p) in self.pools.iter().enumerate() {
            writeln!(f, "  pool {i}: {p:?}")?;
        }
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  {i:>2}: {op:?}")?;
        }
        write!(f, "}}")
    }
}

/// Sizes: small ones share granules; granule-sized ones exhaust the untagged memory, so
/// that requests reach the cross-stream rules (which come after own and never-used blocks).
fn bytes_strategy() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => 1u32..4096,
        2 => 4096u32..(256 << 10),
        2 => (256u32 << 10)..(3 << 20),
        3 => prop_oneof![Just(1 << 20), Just(2 << 20), Just(3 << 20)],
    ]
}

/// Streams: mostly the first three slots, so that streams meet each other's frees.
fn slot_strategy() -> impl Strategy<Value = u8> + Clone {
    prop_oneof![3 => 0..3u8, 1 => 0..STREAM_SLOTS]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let s = slot_strategy();
    let e = 0..EVENTS;
    let p = 0u8..3;
    prop_oneof![
        2 => s.clone().prop_map(|slot| Op::CreateStream { slot }),
        1 => s.clone().prop_map(|slot| Op::DestroyStream { slot }),
        12 => (p.clone(), s.clone(), bytes_strategy())
            .prop_map(|(pool, stream, bytes)| Op::Alloc { pool, stream, bytes }),
        9 => (any::<u8>(), s.clone()).prop_map(|(which, stream)| Op::Free { which, stream }),
        4 => (s.clone(), e.clone()).prop_map(|(stream, event)| Op::Record { stream, event }),
        4 => (s.clone(), e.clone()).prop_map(|(stream, event)| Op::Wait { stream, event }),
        3 => (s.clone(), s.clone()).prop_map(|(waiter, on)| Op::WaitStream { waiter, on }),
        1 => s.clone().prop_map(|stream| Op::SyncStream { stream }),
        1 => e.clone().prop_map(|event| Op::SyncEvent { event }),
        1 => Just(Op::SyncDevice),
        1 => s.clone().prop_map(|stream| Op::QueryStream { stream }),
        1 => e.clone().prop_map(|event| Op::QueryEvent { event }),
        1 => (p.clone(), 0u8..160).prop_map(|(pool, mib)| Op::Trim { pool, mib }),
        1 => Just(Op::SyncTrimAll),
        2 => (p.clone(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(pool, follow, opportunistic, internal)| Op::SetReuse {
                pool,
                follow,
                opportunistic,
                internal
            }
        ),
        1 => (p.clone(), 0u8..160).prop_map(|(pool, mib)| Op::SetThreshold { pool, mib }),
        1 => p.clone().prop_map(|pool| Op::ResetHighs { pool }),
        2 => (s.clone(), 0u8..3).prop_map(|(stream, ms)| Op::Sleep { stream, ms }),
        6 => (s, 2u8..12).prop_map(|(stream, steps)| Op::Gate { stream, steps }),
    ]
}

fn pool_strategy() -> impl Strategy<Value = PoolCfg> {
    (
        any::<bool>(),
        prop_oneof![4 => Just(512u64), 1 => Just(256), 1 => Just(4096)],
        prop_oneof![Just(0u8), Just(4), Just(128)],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![2 => Just(1u8), 1 => Just(2), 1 => Just(3)],
    )
        .prop_map(
            |(tight, alignment, threshold_mib, follow, opportunistic, internal, shards)| PoolCfg {
                tight,
                alignment,
                threshold_mib,
                follow,
                opportunistic,
                internal,
                shards,
            },
        )
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(pool_strategy(), 2..=3),
        1u8..=STREAM_SLOTS,
        prop::collection::vec(op_strategy(), 1..=40),
    )
        .prop_map(|(pools, streams, ops)| Case { pools, streams, ops })
}

/// A stream incarnation: a fresh id for every stream ever created in a case.
type Inc = u64;

/// The model's vector clock: `inc -> p` means "ordered after every task of `inc` at a
/// position `<= p`".
#[derive(Clone, Debug, Default)]
struct Vc(BTreeMap<Inc, u64>);

impl Vc {
    fn get(&self, inc: Inc) -> Option<u64> {
        self.0.get(&inc).copied()
    }
    fn raise(&mut self, inc: Inc, pos: u64) {
        let e = self.0.entry(inc).or_insert(pos);
        *e = (*e).max(pos);
    }
    fn join(&mut self, other: &Vc) {
        for (&inc, &pos) in &other.0 {
            self.raise(inc, pos);
        }
    }
}

#[derive(Clone, Debug)]
struct Live {
    pool: usize,
    ptr: DevicePtr,
    size: u64,
    inc: Inc,
}

/// A byte range whose last event was a free.
#[derive(Clone, Debug)]
struct Freed {
    start: u64,
    end: u64,
    inc: Inc,
    /// The freeing stream's enqueued position at the free.
    pos: u64,
    /// The pool's unmap count at the free (an unmap since means the range may be fresh).
    unmaps_at_free: u64,
}

struct StreamEntry<'d> {
    stream: Stream<'d>,
    inc: Inc,
    vc: Vc,
}

/// The shadow model plus the handles it drives.
struct Model<'d> {
    streams: Vec<Option<StreamEntry<'d>>>,
    /// Stream hals by incarnation (kept after the stream is dropped: its positions freeze).
    hals: BTreeMap<Inc, Arc<dyn StreamHal>>,
    destroyed: BTreeSet<Inc>,
    host_observed: BTreeMap<Inc, u64>,
    next_inc: Inc,
    events: Vec<(Event<'d>, Option<Vc>)>,
    live: Vec<Live>,
    freed: Vec<Vec<Freed>>,
    gates: Vec<(Gate, u8)>,
    /// Failures seen by host functions that check inserted dependencies.
    violations: Arc<Mutex<Vec<String>>>,
    log: Vec<String>,
}

impl<'d> Model<'d> {
    fn create_stream(&mut self, dev: &'d soma::Device, slot: usize) {
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
    fn pick(&self, slot: u8) -> Option<usize> {
        let n = self.streams.len();
        (0..n).map(|i| (slot as usize + i) % n).find(|&i| self.streams[i].is_some())
    }

    fn entry(&self, i: usize) -> &StreamEntry<'d> {
        self.streams[i].as_ref().expect("live stream")
    }

    fn open_gates(&mut self) {
        for (g, _) in self.gates.drain(..) {
            g.open();
        }
    }

    fn completed(&self, inc: Inc) -> u64 {
        if self.destroyed.contains(&inc) {
            u64::MAX
        } else {
            self.hals[&inc].completed()
        }
    }

    fn host_observed(&self, inc: Inc) -> u64 {
        if self.destroyed.contains(&inc) {
            u64::MAX
        } else {
            self.host_observed.get(&inc).copied().unwrap_or(0)
        }
    }

    fn observe(&mut self, inc: Inc, pos: u64) {
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
    fn justify(
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

fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Runs one case; `Err` describes the first violated property.
fn run_case(case: &Case) -> Result<(), String> {
    let npu = soma::sim::Npu::builder().capacity(4 << 30).build().map_err(|e| e.to_string())?;
    let dev = npu.device(0).map_err(|e| e.to_string())?;
    let sim = npu.sim_device(0).map_err(|e| e.to_string())?;
    let pools: Vec<MemPool<'_>> = case
        .pools
        .iter()
        .map(|c| {
            MemPool::builder()
                .max_size(if c.tight { TIGHT_MAX } else { POOL_MAX })
                .alignment(c.alignment)
                .release_threshold((u64::from(c.threshold_mib) * MIB).min(if c.tight {
                    TIGHT_MAX
                } else {
                    POOL_MAX
                }))
                .reuse(ReusePolicy::new(c.follow, c.opportunistic, c.internal))
                .raw_pointers(true)
                .stream_shards(usize::from(c.shards))
                .build(&dev)
                .expect("pool")
        })
        .collect();
    let mut m = Model {
        streams: (0..STREAM_SLOTS).map(|_| None).collect(),
        hals: BTreeMap::new(),
        destroyed: BTreeSet::new(),
        host_observed: BTreeMap::new(),
        next_inc: 0,
        events: (0..EVENTS).map(|_| (dev.create_event().expect("event"), None)).collect(),
        live: Vec::new(),
        freed: vec![Vec::new(); pools.len()],
        gates: Vec::new(),
        violations: Arc::new(Mutex::new(Vec::new())),
        log: Vec::new(),
    };
    for slot in 0..case.streams as usize {
        m.create_stream(&dev, slot);
    }
    let result = (|| {
        for (step, op) in case.ops.iter().enumerate() {
            apply(&mut m, &dev, &pools, op).map_err(|e| format!("step {step} {op:?}: {e}"))?;
            // Gates open by themselves after their number of steps.
            let mut i = 0;
            while i < m.gates.len() {
                m.gates[i].1 = m.gates[i].1.saturating_sub(1);
                if m.gates[i].1 == 0 {
                    m.gates.swap_remove(i).0.open();
                } else {
                    i += 1;
                }
            }
            check(&m, &pools, &sim).map_err(|e| format!("after step {step} {op:?}: {e}"))?;
        }
        finish(&mut m, &dev, &pools, &sim)
    })();
    m.open_gates();
    if result.is_err() {
        return result.map_err(|e| format!("{e}\nlog:\n{}", m.log.join("\n")));
    }
    drop(m);
    drop(pools);
    let st = sim.stats();
    if st.physical_bytes != 0 || st.mapped_bytes != 0 {
        return Err(format!("device memory left after the pools were dropped: {st:?}"));
    }
    Ok(())
}

fn apply<'d>(
    m: &mut Model<'d>,
    dev: &'d soma::Device,
    pools: &[MemPool<'d>],
    op: &Op,
) -> Result<(), String> {
    let pool_of = |p: u8| p as usize % pools.len();
    match *op {
        Op::CreateStream { slot } => m.create_stream(dev, slot as usize % m.streams.len()),
        Op::DestroyStream { slot } => {
            if m.streams[slot as usize].is_some() {
                m.open_gates(); // dropping a stream drains it
                let e = m.streams[slot as usize].take().expect("live");
                drop(e.stream);
                m.destroyed.insert(e.inc);
            }
        }
        Op::Alloc { pool, stream, bytes } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let p = pool_of(pool);
            let pool = &pools[p];
            let policy = pool.reuse_policy();
            let before = pool.stats();
            let enqueued_before: Vec<(usize, u64)> = (0..m.streams.len())
                .filter_map(|i| m.streams[i].as_ref().map(|e| (i, e.stream.hal().enqueued())))
                .collect();
            let result = pool.alloc_raw(u64::from(bytes), &m.entry(t).stream);
            let after = pool.stats();
            if after.oom_retries > before.oom_retries {
                // The pool synchronised the streams holding pending frees: what has completed
                // by now is host-observed as far as the model knows.
                let done: Vec<(Inc, u64)> = m
                    .streams
                    .iter()
                    .flatten()
                    .map(|e| (e.inc, e.stream.hal().completed()))
                    .collect();
                for (inc, pos) in done {
                    m.observe(inc, pos);
                }
            }
            let (ptr, size) = match result {
                Ok(a) => a,
                Err(soma::Error::OutOfMemory(oom)) if pool.max_size() == TIGHT_MAX => {
                    cover("(out of memory)");
                    // A failed allocation changes nothing but the OOM counters; recyclable
                    // free segments may have been unmapped.
                    let same = after.used == before.used
                        && after.live_allocations == before.live_allocations
                        && after.allocations == before.allocations
                        && after.reserved <= before.reserved
                        && after.ooms == before.ooms + 1;
                    if !same || oom.rounded != round_up(u64::from(bytes), pool.alignment()) {
                        return Err(format!(
                            "out of memory changed the pool: {before:?} -> {after:?} ({oom:?})"
                        ));
                    }
                    m.log.push(format!("alloc p{p} {bytes} on slot {t}: out of memory"));
                    return Ok(());
                }
                Err(e) => return Err(format!("alloc_raw failed: {e}")),
            };
            let expect = round_up(u64::from(bytes), pool.alignment());
            if size != expect {
                return Err(format!("rounded size {size}, expected {expect}"));
            }
            let (start, end) = (ptr.addr(), ptr.addr() + size);
            let internal = after.reuses.internal_dependency > before.reuses.internal_dependency;
            let (t_inc, t_vc) = (m.entry(t).inc, m.entry(t).vc.clone());
            let mut overlapped = Vec::new();
            let mut kept = Vec::new();
            for f in std::mem::take(&mut m.freed[p]) {
                if f.end <= start || f.start >= end {
                    kept.push(f);
                    continue;
                }
                if f.start < start {
                    kept.push(Freed { end: start, ..f.clone() });
                }
                if f.end > end {
                    kept.push(Freed { start: end, ..f.clone() });
                }
                overlapped.push(f);
            }
            m.freed[p] = kept;
            let mut dependencies = BTreeMap::<Inc, u64>::new();
            for f in &overlapped {
                match m.justify(f, t_inc, &t_vc, policy, after.unmap_calls) {
                    Some(why) => {
                        cover(why);
                        m.log.push(format!("  reuse of {f:?} by inc {t_inc}: {why}"));
                    }
                    None if policy.internal_dependencies && internal => {
                        cover("internal dependency");
                        let d = dependencies.entry(f.inc).or_insert(f.pos);
                        *d = (*d).max(f.pos);
                    }
                    None => {
                        return Err(format!(
                            "allocation {ptr:?}+{size} on stream inc {t_inc} (clock {t_vc:?}) \
                             reuses {f:?} (completed {}, host observed {}) with no rule; \
                             policy {policy:?}; reuses before {:?} after {:?}",
                            m.completed(f.inc),
                            m.host_observed(f.inc),
                            before.reuses,
                            after.reuses
                        ));
                    }
                }
            }
            for (inc, pos) in dependencies {
                // The pool recorded an event on `inc` after the free and made `t` wait on it:
                // a host function on `t` must not run before `inc` has reached the free.
                let src = Arc::clone(&m.hals[&inc]);
                let violations = Arc::clone(&m.violations);
                let what =
                    format!("internal dependency: inc {t_inc} ran before inc {inc} reached {pos}");
                m.entry(t)
                    .stream
                    .host_fn(move || {
                        if src.completed() < pos {
                            violations.lock().unwrap().push(what);
                        }
                    })
                    .map_err(|e| e.to_string())?;
                m.log.push(format!(
                    "  internal dependency of inc {t_inc} on inc {inc} (free at {pos})"
                ));
            }
            if internal {
                // Learn the ordering the pool inserted, whatever justified the block in the
                // model: it recorded an event on the block's stream (the only other stream
                // whose queue grew during the call) and made `t` wait on it.
                for (i, n) in enqueued_before {
                    let Some(src) = m.streams[i].as_ref() else { continue };
                    let q = src.stream.hal().enqueued();
                    if i == t || q == n {
                        continue;
                    }
                    let (src_inc, src_vc) = (src.inc, src.vc.clone());
                    let e = m.streams[t].as_mut().expect("live");
                    e.vc.join(&src_vc);
                    e.vc.raise(src_inc, q);
                    m.log.push(format!("  inc {t_inc} now waits for inc {src_inc} up to {q}"));
                }
            }
            m.log.push(format!("alloc p{p} {ptr:?}+{size} on inc {t_inc} ({:?})", after.reuses));
            m.live.push(Live { pool: p, ptr, size, inc: t_inc });
        }
        Op::Free { which, stream } => {
            if m.live.is_empty() {
                return Ok(());
            }
            let live = m.live.swap_remove(which as usize % m.live.len());
            // Free on the named stream; if it is gone, on any live stream.
            let Some(t) = m.pick(stream) else {
                m.live.push(live);
                return Ok(());
            };
            let e = m.entry(t);
            let pool = &pools[live.pool];
            pool.free_raw(live.ptr, &e.stream).map_err(|e| format!("free_raw failed: {e}"))?;
            let pos = e.stream.hal().enqueued();
            let f = Freed {
                start: live.ptr.addr(),
                end: live.ptr.addr() + live.size,
                inc: e.inc,
                pos,
                unmaps_at_free: pool.stats().unmap_calls,
            };
            m.log.push(format!(
                "free p{} {:?} (of inc {}) on inc {} at {pos}",
                live.pool, live.ptr, live.inc, e.inc
            ));
            m.freed[live.pool].push(f);
        }
        Op::Record { stream, event } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let e = m.entry(t);
            let ev = event as usize;
            e.stream.record(&m.events[ev].0).map_err(|e| e.to_string())?;
            let q = e.stream.hal().enqueued();
            let mut clock = e.vc.clone();
            clock.raise(e.inc, q);
            m.log.push(format!("record e{ev} on inc {} at {q}", e.inc));
            m.events[ev].1 = Some(clock);
        }
        Op::Wait { stream, event } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let ev = event as usize;
            m.entry(t).stream.wait_event(&m.events[ev].0).map_err(|e| e.to_string())?;
            if let Some(clock) = m.events[ev].1.clone() {
                let e = m.streams[t].as_mut().expect("live");
                e.vc.join(&clock);
                m.log.push(format!("inc {} waits e{ev}: clock {:?}", e.inc, e.vc));
            }
        }
        Op::WaitStream { waiter, on } => {
            let (Some(w), Some(o)) = (m.pick(waiter), m.pick(on)) else { return Ok(()) };
            m.entry(w).stream.wait_stream(&m.entry(o).stream).map_err(|e| e.to_string())?;
            let src = m.entry(o);
            let mut clock = src.vc.clone();
            clock.raise(src.inc, src.stream.hal().enqueued());
            let e = m.streams[w].as_mut().expect("live");
            e.vc.join(&clock);
            m.log.push(format!("inc {} waits for stream inc: clock {:?}", e.inc, e.vc));
        }
        Op::SyncStream { stream } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            m.open_gates();
            let e = m.entry(t);
            let (inc, pos) = (e.inc, e.stream.hal().enqueued());
            e.stream.synchronize().map_err(|e| e.to_string())?;
            m.observe(inc, pos);
        }
        Op::SyncEvent { event } => {
            m.open_gates();
            let ev = event as usize;
            m.events[ev].0.synchronize().map_err(|e| e.to_string())?;
            if let Some(clock) = m.events[ev].1.clone() {
                for (inc, pos) in clock.0 {
                    m.observe(inc, pos);
                }
            }
        }
        Op::SyncDevice => {
            m.open_gates();
            sync_device(m, dev)?;
            // The release threshold applied at the synchronisation: with every free
            // host-observed and nothing enqueued since, trimming to the threshold now finds
            // nothing more to release.
            for (p, pool) in pools.iter().enumerate() {
                let threshold = pool.get::<attr::ReleaseThreshold>().map_err(|e| e.to_string())?;
                let released = pool.trim_to(threshold).map_err(|e| e.to_string())?;
                if released != 0 {
                    return Err(format!(
                        "pool {p}: device synchronize left {released} bytes above the \
                         threshold {threshold} that trim_to(threshold) then released"
                    ));
                }
            }
        }
        Op::QueryStream { stream } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let e = m.entry(t);
            let (inc, pos) = (e.inc, e.stream.hal().enqueued());
            if e.stream.query().map_err(|e| e.to_string())? {
                m.observe(inc, pos);
            }
        }
        Op::QueryEvent { event } => {
            let ev = event as usize;
            let clock = m.events[ev].1.clone();
            if m.events[ev].0.query().map_err(|e| e.to_string())? {
                for (inc, pos) in clock.map(|c| c.0).unwrap_or_default() {
                    m.observe(inc, pos);
                }
            }
        }
        Op::Trim { pool, mib } => {
            let pool = &pools[pool_of(pool)];
            let before = pool.stats().reserved;
            let released = pool
                .trim_to((u64::from(mib) * MIB).min(pool.max_size()))
                .map_err(|e| format!("trim_to: {e}"))?;
            let after = pool.stats().reserved;
            if before - after != released {
                return Err(format!("trim released {released}, reserved {before} -> {after}"));
            }
        }
        Op::SyncTrimAll => {
            m.open_gates();
            sync_device(m, dev)?;
            for (p, pool) in pools.iter().enumerate() {
                pool.trim_to(0).map_err(|e| format!("trim_to(0): {e}"))?;
                let st = pool.stats();
                if !m.live.iter().any(|l| l.pool == p) && st.reserved != 0 {
                    return Err(format!("pool {p}: no live allocation, all synchronised and trimmed, yet reserved {}", st.reserved));
                }
                if st.pending_bytes != 0 && m.live.iter().all(|l| l.pool != p) {
                    return Err(format!("pool {p}: pending bytes after a full trim: {st:?}"));
                }
            }
        }
        Op::SetReuse { pool, follow, opportunistic, internal } => {
            let pool = &pools[pool_of(pool)];
            pool.set_reuse_policy(ReusePolicy::new(follow, opportunistic, internal));
            let got = (
                pool.get::<attr::ReuseFollowEventDependencies>().map_err(|e| e.to_string())?,
                pool.get::<attr::ReuseAllowOpportunistic>().map_err(|e| e.to_string())?,
                pool.get::<attr::ReuseAllowInternalDependencies>().map_err(|e| e.to_string())?,
            );
            if got != (follow, opportunistic, internal) {
                return Err(format!("reuse attributes read back as {got:?}"));
            }
        }
        Op::ResetHighs { pool } => {
            let pool = &pools[pool_of(pool)];
            pool.reset::<attr::UsedMemHigh>().map_err(|e| e.to_string())?;
            pool.reset::<attr::ReservedMemHigh>().map_err(|e| e.to_string())?;
            let st = pool.stats();
            if st.used_high != st.used || st.reserved_high != st.reserved {
                return Err(format!("a reset high-water mark is not its current value: {st:?}"));
            }
        }
        Op::SetThreshold { pool, mib } => {
            let pool = &pools[pool_of(pool)];
            let v = (u64::from(mib) * MIB).min(pool.max_size());
            pool.set::<attr::ReleaseThreshold>(v).map_err(|e| e.to_string())?;
            if pool.get::<attr::ReleaseThreshold>().map_err(|e| e.to_string())? != v {
                return Err("threshold not stored".into());
            }
        }
        Op::Sleep { stream, ms } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let d = Duration::from_millis(u64::from(ms));
            m.entry(t).stream.host_fn(move || std::thread::sleep(d)).map_err(|e| e.to_string())?;
        }
        Op::Gate { stream, steps } => {
            let Some(t) = m.pick(stream) else { return Ok(()) };
            let g = Gate::close(&m.entry(t).stream)?;
            m.gates.push((g, steps));
        }
    }
    Ok(())
}

fn sync_device(m: &mut Model<'_>, dev: &soma::Device) -> Result<(), String> {
    let snapshot: Vec<(Inc, u64)> =
        m.streams.iter().flatten().map(|e| (e.inc, e.stream.hal().enqueued())).collect();
    dev.synchronize().map_err(|e| e.to_string())?;
    for (inc, pos) in snapshot {
        m.observe(inc, pos);
    }
    Ok(())
}

fn check(m: &Model<'_>, pools: &[MemPool<'_>], sim: &soma::sim::SimDevice) -> Result<(), String> {
    let mut all: Vec<&Live> = m.live.iter().collect();
    all.sort_by_key(|l| l.ptr);
    for w in all.windows(2) {
        if w[0].ptr.addr() + w[0].size > w[1].ptr.addr() {
            return Err(format!("live allocations overlap: {:?} and {:?}", w[0], w[1]));
        }
    }
    let mut reserved_total = 0;
    for (p, pool) in pools.iter().enumerate() {
        let st = pool.stats();
        let live: Vec<&Live> = m.live.iter().filter(|l| l.pool == p).collect();
        let used: u64 = live.iter().map(|l| l.size).sum();
        let bad = |what: &str| Err(format!("pool {p}: {what}: {st:?}"));
        if st.used != used {
            return bad(&format!("used {} != sum of live sizes {used}", st.used));
        }
        if st.live_allocations != live.len() as u64 {
            return bad(&format!("{} live allocations in the model", live.len()));
        }
        if st.reserved < st.used || st.reserved > st.max_size {
            return bad("reserved outside [used, max]");
        }
        if st.used_high < st.used || st.reserved_high < st.reserved {
            return bad("a high-water mark below its current value");
        }
        if st.free_bytes != st.reserved - st.used || st.pending_bytes > st.free_bytes {
            return bad("free / pending bytes inconsistent");
        }
        if st.allocations != st.fresh_allocations + st.reuses.total() {
            return bad("allocations != fresh + reuses");
        }
        if st.allocations - st.frees != st.live_allocations {
            return bad("allocations - frees != live allocations");
        }
        if st.largest_free_block > st.free_bytes {
            return bad("largest free block above the free bytes");
        }
        if st.reserved % (2 * MIB) != 0 {
            return bad("reserved is not a whole number of granules");
        }
        for l in live {
            if pool.owns(l.ptr) != Some(l.size) {
                return bad(&format!(
                    "owns({:?}) = {:?}, expected {}",
                    l.ptr,
                    pool.owns(l.ptr),
                    l.size
                ));
            }
        }
        reserved_total += st.reserved;
    }
    let sst = sim.stats();
    if sst.mapped_bytes != reserved_total || sst.physical_bytes != reserved_total {
        return Err(format!(
            "device mapped {} / physical {} bytes, pools reserve {reserved_total}",
            sst.mapped_bytes, sst.physical_bytes
        ));
    }
    let v = m.violations.lock().unwrap();
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}

/// Frees everything, synchronises, trims to 0 and checks that the device got it all back.
fn finish<'d>(
    m: &mut Model<'d>,
    dev: &'d soma::Device,
    pools: &[MemPool<'d>],
    sim: &soma::sim::SimDevice,
) -> Result<(), String> {
    m.open_gates();
    if m.pick(0).is_none() {
        m.create_stream(dev, 0);
    }
    while !m.live.is_empty() {
        let n = m.live.len() as u8;
        apply(m, dev, pools, &Op::Free { which: n - 1, stream: n })?;
    }
    sync_device(m, dev)?;
    check(m, pools, sim)?;
    for (p, pool) in pools.iter().enumerate() {
        pool.trim_to(0).map_err(|e| e.to_string())?;
        let st = pool.stats();
        if st.reserved != 0 || st.used != 0 {
            return Err(format!(
                "pool {p} holds memory after free all + sync + trim_to(0): {st:?}"
            ));
        }
    }
    if sim.stats().mapped_bytes != 0 {
        return Err(format!("device still maps memory: {:?}", sim.stats()));
    }
    let v = m.violations.lock().unwrap();
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)
}

/// How often each justification was needed, over all cases of a run (printed at the end
/// with `--nocapture`, to see that the strategy reaches every rule).
static COVERAGE: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

fn cover(what: &'static str) {
    *COVERAGE.lock().unwrap().entry(what).or_insert(0) += 1;
}

#[test]
fn pool_matches_the_shadow_model() {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let config = Config {
        cases: cases(),
        max_shrink_iters: 2000,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&case_strategy(), |case| run_case(&case).map_err(TestCaseError::fail));
    eprintln!("justifications needed: {:?}", COVERAGE.lock().unwrap());
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A fixed program covering every rule once, so that a plain `cargo test` exercises the
/// model deterministically too.
/// Run with one engine and with the pool split into 2 and 3 stream shards (every reuse then
/// crosses shards: stream slots 0, 1, 2 allocate in different ones).
#[test]
fn scripted_program_covers_every_rule() {
    for shards in 1..=3 {
        scripted_program_covers_every_rule_with(shards);
    }
}

fn scripted_program_covers_every_rule_with(shards: u8) {
    let all = PoolCfg {
        tight: false,
        alignment: 512,
        threshold_mib: 128,
        follow: true,
        opportunistic: true,
        internal: true,
        shards,
    };
    let none = PoolCfg { follow: false, opportunistic: false, internal: false, ..all.clone() };
    let case = Case {
        pools: vec![all, none],
        streams: 3,
        ops: vec![
            Op::Gate { stream: 0, steps: 6 },
            Op::Alloc { pool: 0, stream: 0, bytes: 4096 },
            Op::Free { which: 0, stream: 0 },
            Op::Record { stream: 0, event: 0 },
            Op::Wait { stream: 1, event: 0 },
            Op::Alloc { pool: 0, stream: 1, bytes: 4096 }, // event dependency
            Op::Alloc { pool: 0, stream: 0, bytes: 1 << 20 },
            Op::Free { which: 1, stream: 0 },
            Op::Alloc { pool: 0, stream: 2, bytes: 1 << 20 }, // growth, not reuse
            Op::SyncDevice,
            Op::Alloc { pool: 1, stream: 2, bytes: 8192 },
            Op::Free { which: 0, stream: 2 },
            Op::SyncStream { stream: 2 },
            Op::Alloc { pool: 1, stream: 1, bytes: 8192 }, // host observed
            Op::SyncTrimAll,
        ],
    };
    run_case(&case).unwrap();
}

/// A tight pool with only internal dependencies on: the second stream can only get memory
/// by waiting for the first one's frees (the pool must really order it after them) — with
/// one engine, and with two shards, where the frees are in the other stream's shard.
#[test]
fn scripted_internal_dependency() {
    for shards in 1..=2 {
        scripted_internal_dependency_with(shards);
    }
}

fn scripted_internal_dependency_with(shards: u8) {
    let tight = PoolCfg {
        tight: true,
        alignment: 512,
        threshold_mib: 128,
        follow: false,
        opportunistic: false,
        internal: true,
        shards,
    };
    let case = Case {
        pools: vec![tight.clone(), tight],
        streams: 2,
        ops: vec![
            Op::Gate { stream: 0, steps: 8 },
            Op::Alloc { pool: 0, stream: 0, bytes: 3 << 20 },
            Op::Alloc { pool: 0, stream: 0, bytes: 3 << 20 },
            Op::Free { which: 0, stream: 0 },
            Op::Free { which: 0, stream: 0 },
            Op::Alloc { pool: 0, stream: 1, bytes: 3 << 20 },
            Op::SyncDevice,
        ],
    };
    run_case(&case).unwrap();
}

/// Found by the property test (5000 cases): after an internal dependency, the requesting
/// stream is ordered after the block's stream up to the inserted record, so a later block
/// freed there before that record is reusable by rule 2. The model must learn the inserted
/// wait even when it justified the first block by another rule.
#[test]
fn scripted_rule_two_after_an_internal_dependency() {
    let pool = PoolCfg {
        tight: false,
        alignment: 512,
        threshold_mib: 4,
        follow: true,
        opportunistic: false,
        internal: true,
        shards: 1,
    };
    let other = PoolCfg { threshold_mib: 0, follow: false, internal: false, ..pool.clone() };
    let case = Case {
        pools: vec![pool, other],
        streams: 3,
        ops: vec![
            Op::Alloc { pool: 0, stream: 0, bytes: 1 },
            Op::Free { which: 0, stream: 0 },
            Op::Alloc { pool: 0, stream: 0, bytes: 1048576 },
            Op::Free { which: 0, stream: 2 },
            Op::Record { stream: 2, event: 0 },
            Op::Alloc { pool: 0, stream: 0, bytes: 1045505 },
            Op::Free { which: 0, stream: 2 },
            Op::Alloc { pool: 2, stream: 0, bytes: 1048576 },
            Op::Alloc { pool: 0, stream: 0, bytes: 2561 },
        ],
    };
    run_case(&case).unwrap();
}
