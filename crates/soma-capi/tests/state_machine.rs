//! Property-based state-machine test of the pool C API (`aclrtMemPool*` and the stream /
//! event calls that order it), through the exported `extern "C"` functions.
//!
//! Random programs of stream creation / destruction (the null default stream plus 1–4
//! created streams), `aclrtMemPoolMallocAsync` (1 B … 8 MiB, two pools), `aclrtMemPoolFreeAsync`,
//! event records and waits, stream / event / device synchronisations, `aclrtMemPoolTrimTo`,
//! the three reuse switches and the release threshold (`aclrtMemPoolSetAttr`), host functions
//! that sleep, and the C contract's error paths run against a **shadow model written here**,
//! which shares no code with the engine:
//!
//! * it counts, per stream incarnation, the tasks *it* enqueued (records, host functions) as
//!   positions (a lower bound: waits and the pool's inserted tasks are not counted, which
//!   only makes the reuse checks more permissive); a free is tagged with its stream's
//!   position `m`, and a marker host function enqueued right after it (at `m + 1`) publishes
//!   that it ran;
//! * it keeps its own vector clocks: a record captures the recorder's clock plus its
//!   position, a wait joins it, host synchronisations raise a "host observed" bound;
//! * a second, *maybe* clock also joins the waits the pool may have inserted (internal
//!   dependencies); reuses justified only by it are verified by a host function on the
//!   allocating stream that checks that the free's marker has run.
//!
//! Checked after every step: every call that should succeed returns `ACL_SUCCESS`; no two
//! live allocations overlap; a new allocation overlapping a freed range is justified by an
//! enabled rule ([`Model::justify`]); `USED_MEM_CURRENT` = Σ live sizes rounded up to 512 B;
//! `RESERVED_MEM_CURRENT >= USED`, a whole number of 2 MiB granules, at most the pool size;
//! high-water marks ≥ currents (and equal after a reset); attributes read back as set; after
//! a stream / event / device synchronisation (or a trim), a pool without live allocations
//! whose frees the host observed reserves at most its threshold, 0 by CANN's default (or the
//! trim's bytes to keep). The C
//! contract: a double free, an interior pointer, a pointer of a destroyed pool, a threshold or
//! trim above the pool size are errors that change no attribute; `aclrtMemPoolDestroy` with
//! live allocations fails and the pool stays usable.
//!
//! One documented behaviour is accepted: once a complete free's granules have been recycled
//! (unmapped) — e.g. for a growth of the stream that freed them — their addresses are fresh
//! address space, which any stream may get mapped again (docs/semantics.md, "Recycled address
//! space is fresh"). The ignored test `recycled_addresses_are_fresh_for_every_stream` runs
//! such a program with the strict model that rejects it.
//!
//! Cases: 48 by default (`PROPTEST_CASES` overrides), at most 40 steps each. The tests of this
//! binary share one runtime and device, so they take a lock (a device synchronisation by one
//! test would be a host observation the other's model does not know about).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ascend_sys::{aclrtEvent, aclrtMemPool, aclrtMemPoolAttr, aclrtStream, AclError};
use ascendcl::*;
use common::*;
use proptest::prelude::*;

/// Stream slots: 0 is the null default stream (never destroyed), 1–4 created streams.
const SLOTS: u8 = 5;
const EVENTS: u8 = 3;
const MIB_U: u64 = 1 << 20;
const GRANULE: u64 = 2 * MIB_U;
const ALIGN: u64 = 512;
/// The two pools' sizes: roomy (40 steps of at most 8 MiB never run out), different.
const POOL_MAX: [u64; 2] = [512 * MIB_U, 384 * MIB_U];
/// How long a completion check waits for a free's marker: the engine may have seen the free
/// complete a moment before the marker (the next task on its stream) ran.
const GRACE: Duration = Duration::from_millis(25);

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn setup() {
    init(&[("SOMA_SIM_CAPACITY", "4G")]);
}

/// One step. Indices are taken modulo what exists, so shrinking never makes a program
/// invalid.
#[derive(Clone, Debug)]
#[rustfmt::skip]
enum Op {
    CreateStream { slot: u8 },
    DestroyStream { slot: u8 },
    Alloc { pool: u8, stream: u8, bytes: u32 },
    Free { which: u8, stream: u8 },
    Record { stream: u8, event: u8 },
    Wait { stream: u8, event: u8 },
    /// Record `event` on `on`, then make `waiter` wait on it.
    RecordWait { on: u8, waiter: u8, event: u8 },
    SyncStream { stream: u8 },
    SyncEvent { event: u8 },
    SyncDevice,
    Trim { pool: u8, mib: u16 },
    /// `attr`: 0 follow event dependencies, 1 opportunistic, 2 internal dependencies.
    SetReuse { pool: u8, attr: u8, on: bool },
    SetThreshold { pool: u8, mib: u16 },
    /// Set both high-water marks to 0 (reset: they restart from the current values).
    ResetHighs { pool: u8 },
    Sleep { stream: u8, ms: u8 },
    /// The host thread sleeps (queued work progresses; nothing is observed).
    HostSleep { ms: u8 },
    DoubleFree { which: u8, stream: u8 },
    InteriorFree { which: u8, offset: u32, stream: u8 },
    DestroyLivePool { pool: u8 },
    /// A third pool: alloc, destroy fails, still usable, free, destroy, free again fails.
    ScratchPool { bytes: u32, stream: u8 },
}

#[derive(Clone)]
struct Case {
    streams: u8,
    /// Initial reuse switches of the two pools (follow, opportunistic, internal).
    switches: [[bool; 3]; 2],
    ops: Vec<Op>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Case {{ streams: {}, switches: {:?},", self.streams, self.switches)?;
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  {i:>2}: {op:?}")?;
        }
        write!(f, "}}")
    }
}

fn bytes_strategy() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => 1u32..4096,
        2 => 4096u32..(256 << 10),
        2 => (256u32 << 10)..=(8 << 20),
        4 => prop_oneof![Just(1 << 20), Just(2 << 20), Just(4 << 20), Just(8 << 20)],
    ]
}

fn slot_strategy() -> impl Strategy<Value = u8> + Clone {
    prop_oneof![3 => 0..3u8, 1 => 0..SLOTS]
}

fn mib_strategy() -> impl Strategy<Value = u16> + Clone {
    prop_oneof![3 => Just(0u16), 2 => 0u16..64, 1 => 0u16..600]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let s = slot_strategy();
    let e = 0..EVENTS;
    let p = 0u8..2;
    prop_oneof![
        2 => (1..SLOTS).prop_map(|slot| Op::CreateStream { slot }),
        1 => (1..SLOTS).prop_map(|slot| Op::DestroyStream { slot }),
        14 => (p.clone(), s.clone(), bytes_strategy())
            .prop_map(|(pool, stream, bytes)| Op::Alloc { pool, stream, bytes }),
        10 => (any::<u8>(), s.clone()).prop_map(|(which, stream)| Op::Free { which, stream }),
        4 => (s.clone(), e.clone()).prop_map(|(stream, event)| Op::Record { stream, event }),
        4 => (s.clone(), e.clone()).prop_map(|(stream, event)| Op::Wait { stream, event }),
        4 => (s.clone(), s.clone(), e.clone())
            .prop_map(|(on, waiter, event)| Op::RecordWait { on, waiter, event }),
        1 => s.clone().prop_map(|stream| Op::SyncStream { stream }),
        1 => e.clone().prop_map(|event| Op::SyncEvent { event }),
        1 => Just(Op::SyncDevice),
        1 => (p.clone(), mib_strategy()).prop_map(|(pool, mib)| Op::Trim { pool, mib }),
        3 => (p.clone(), 0u8..3, any::<bool>())
            .prop_map(|(pool, attr, on)| Op::SetReuse { pool, attr, on }),
        1 => (p.clone(), mib_strategy()).prop_map(|(pool, mib)| Op::SetThreshold { pool, mib }),
        3 => (s.clone(), prop_oneof![4 => 0u8..4, 1 => Just(60u8)])
            .prop_map(|(stream, ms)| Op::Sleep { stream, ms }),
        1 => (any::<u8>(), s.clone()).prop_map(|(which, stream)| Op::DoubleFree { which, stream }),
        1 => (any::<u8>(), any::<u32>(), s.clone())
            .prop_map(|(which, offset, stream)| Op::InteriorFree { which, offset, stream }),
        1 => p.clone().prop_map(|pool| Op::ResetHighs { pool }),
        1 => (1u8..8).prop_map(|ms| Op::HostSleep { ms }),
        1 => p.prop_map(|pool| Op::DestroyLivePool { pool }),
        1 => (bytes_strategy(), s).prop_map(|(bytes, stream)| Op::ScratchPool { bytes, stream }),
    ]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let sw = prop::array::uniform3(prop::bool::weighted(0.6));
    (1u8..SLOTS, prop::array::uniform2(sw), prop::collection::vec(op_strategy(), 1..=40))
        .prop_map(|(streams, switches, ops)| Case { streams, switches, ops })
}

/// A stream incarnation: a fresh id for every stream of a case (0 = the default stream).
type Inc = u64;

/// `inc -> p`: ordered after every task of `inc` at a model position `<= p`.
#[derive(Clone, Debug, Default)]
struct Vc(BTreeMap<Inc, u64>);

impl Vc {
    fn get(&self, inc: Inc) -> u64 {
        self.0.get(&inc).copied().unwrap_or(0)
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

/// The clocks (definite, maybe) captured by an event's last record.
type Clocks = (Vc, Vc);

#[derive(Clone)]
struct Live {
    pool: usize,
    ptr: u64,
    bytes: u64,
    size: u64,
    /// The model's event count when it was allocated.
    seq: u64,
}

/// A byte range whose last event was a free.
#[derive(Clone)]
struct Freed {
    start: u64,
    end: u64,
    inc: Inc,
    /// The freeing stream's model position at the free (its marker is `pos + 1`).
    pos: u64,
    /// The pool's unmap epoch at the free.
    epoch: u64,
    /// The model's event count at the free.
    seq: u64,
}

struct StreamState {
    handle: aclrtStream,
    inc: Inc,
    /// Tasks the model enqueued on this stream.
    tasks: u64,
    /// Highest marker that ran (set by host functions).
    done: Arc<AtomicU64>,
    vc: Vc,
    mvc: Vc,
}

struct PoolState {
    handle: aclrtMemPool,
    max: u64,
    /// follow, opportunistic, internal.
    switches: [bool; 3],
    threshold: u64,
    last_reserved: u64,
    /// Bumped whenever RESERVED was seen to go down (memory was unmapped).
    epoch: u64,
}

struct Model {
    slots: Vec<Option<Inc>>,
    streams: BTreeMap<Inc, StreamState>,
    destroyed: BTreeSet<Inc>,
    observed: BTreeMap<Inc, u64>,
    next_inc: Inc,
    /// Handle, and the clocks (definite, maybe) of its last record.
    events: Vec<Option<(aclrtEvent, Option<Clocks>)>>,
    pools: Vec<PoolState>,
    live: Vec<Live>,
    freed: Vec<Vec<Freed>>,
    freed_ptrs: Vec<u64>,
    violations: Arc<Mutex<Vec<String>>>,
    log: Vec<String>,
    /// The justifications this case needed.
    used: BTreeSet<&'static str>,
    /// A scratch pool and its live pointers while `Op::ScratchPool` runs (for teardown).
    scratch: Option<(aclrtMemPool, Vec<u64>)>,
    /// Reject reuses by recycling that no rule allows (the documented contract).
    strict_recycling: bool,
    /// Allocations and frees so far (orders `Live::seq` against `Freed::seq`).
    seq: u64,
}

extern "C" fn run_boxed(args: *mut c_void) {
    // SAFETY: `args` is the `Box<Box<dyn FnOnce() + Send>>` leaked by `launch`, run once.
    let f = unsafe { Box::from_raw(args.cast::<Box<dyn FnOnce() + Send>>()) };
    f();
}

/// `aclrtLaunchHostFunc` with a Rust closure.
fn launch(s: aclrtStream, f: impl FnOnce() + Send + 'static) -> AclError {
    let b: Box<Box<dyn FnOnce() + Send>> = Box::new(Box::new(f));
    let raw = Box::into_raw(b);
    // SAFETY: `run_boxed` may be called with `raw` on another thread (the closure is Send).
    let e = unsafe { aclrtLaunchHostFunc(s, Some(run_boxed), raw.cast()) };
    if e != AclError::SUCCESS {
        // SAFETY: not enqueued, so not run: reclaim it.
        drop(unsafe { Box::from_raw(raw) });
    }
    e
}

fn acl(e: AclError, what: &str) -> Result<(), String> {
    if e == AclError::SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {e} ({})", msg()))
    }
}

fn attr(pool: aclrtMemPool, a: aclrtMemPoolAttr) -> Result<u64, String> {
    try_get(pool, a).map_err(|e| format!("get {a:?}: {e} ({})", msg()))
}

fn attrs(pool: aclrtMemPool) -> Result<Vec<u64>, String> {
    ALL_ATTRS.iter().map(|&a| attr(pool, a)).collect()
}

fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

const SWITCHES: [aclrtMemPoolAttr; 3] = [FOLLOW, OPPORTUNISTIC, INTERNAL];

impl fmt::Debug for Freed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Freed {{ {:#x}..{:#x}, inc {}, pos {}, epoch {} }}",
            self.start, self.end, self.inc, self.pos, self.epoch
        )
    }
}

impl fmt::Debug for Live {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Live {{ p{} {:#x}+{} ({} B) }}", self.pool, self.ptr, self.size, self.bytes)
    }
}

impl Model {
    fn new() -> Result<Model, String> {
        let mut pools = Vec::new();
        for max in POOL_MAX {
            let h = try_pool(&props(max as usize))
                .map_err(|e| format!("aclrtMemPoolCreate: {e} ({})", msg()))?;
            pools.push(PoolState {
                handle: h,
                max,
                switches: [false; 3],
                threshold: 0,
                last_reserved: 0,
                epoch: 0,
            });
        }
        let mut m = Model {
            slots: vec![None; SLOTS as usize],
            streams: BTreeMap::new(),
            destroyed: BTreeSet::new(),
            observed: BTreeMap::new(),
            next_inc: 0,
            events: (0..EVENTS).map(|_| None).collect(),
            pools,
            live: Vec::new(),
            freed: vec![Vec::new(); POOL_MAX.len()],
            freed_ptrs: Vec::new(),
            violations: Arc::new(Mutex::new(Vec::new())),
            log: Vec::new(),
            used: BTreeSet::new(),
            scratch: None,
            strict_recycling: false,
            seq: 0,
        };
        m.add_stream(0, std::ptr::null_mut());
        Ok(m)
    }

    fn add_stream(&mut self, slot: usize, handle: aclrtStream) {
        let inc = self.next_inc;
        self.next_inc += 1;
        self.slots[slot] = Some(inc);
        self.streams.insert(
            inc,
            StreamState {
                handle,
                inc,
                tasks: 0,
                done: Arc::new(AtomicU64::new(0)),
                vc: Vc::default(),
                mvc: Vc::default(),
            },
        );
    }

    /// The live stream at `slot`, else the next live one (slot 0 always is).
    fn pick(&self, slot: u8) -> Inc {
        let n = SLOTS as usize;
        (0..n).find_map(|i| self.slots[(slot as usize + i) % n]).expect("slot 0 is live")
    }

    fn st(&self, inc: Inc) -> &StreamState {
        &self.streams[&inc]
    }

    fn st_mut(&mut self, inc: Inc) -> &mut StreamState {
        self.streams.get_mut(&inc).expect("live stream")
    }

    fn observe(&mut self, inc: Inc, pos: u64) {
        let e = self.observed.entry(inc).or_insert(pos);
        *e = (*e).max(pos);
    }

    fn observe_all(&mut self) {
        let all: Vec<(Inc, u64)> = self.streams.values().map(|s| (s.inc, s.tasks)).collect();
        for (inc, pos) in all {
            self.observe(inc, pos);
        }
    }

    fn observed(&self, inc: Inc) -> u64 {
        if self.destroyed.contains(&inc) {
            u64::MAX
        } else {
            self.observed.get(&inc).copied().unwrap_or(0)
        }
    }

    /// Has the free `f` completed (its marker ran)? Waits up to `grace` for it.
    fn completed(&self, f: &Freed, grace: Duration) -> bool {
        let Some(s) = self.streams.get(&f.inc) else { return true }; // destroyed: drained
        let deadline = Instant::now() + grace;
        loop {
            if s.done.load(Ordering::SeqCst) > f.pos {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Enqueues the model's own task `f` on `inc` (counted as one position).
    /// When it has run it publishes its position in the stream's `done`.
    fn task(&mut self, inc: Inc, f: impl FnOnce() + Send + 'static) -> Result<(), String> {
        let s = self.st(inc);
        let (h, pos, done) = (s.handle, s.tasks + 1, Arc::clone(&s.done));
        let f = move || {
            f();
            done.fetch_max(pos, Ordering::SeqCst);
        };
        acl(launch(h, f), "aclrtLaunchHostFunc")?;
        self.st_mut(inc).tasks += 1;
        Ok(())
    }

    /// Why the new allocation on `t` may overlap the freed range `f`; `Ok(None)` if no
    /// enabled rule allows it. Permissive where the engine is conservative, never beyond
    /// what is safe:
    /// * same stream; host observed (a synchronisation covering `m`, or the stream was
    ///   destroyed); follow event dependencies (if on): `t`'s clock covers `m` (a record
    ///   right before the free, with no task between, counts: as safe as one after it);
    /// * opportunistic (if on) or recycled (RESERVED went down since the free: remapped
    ///   memory is fresh): the free has completed — checked after the call returned, with a
    ///   grace period, since the model sees completion only through its marker (the task
    ///   right after the free);
    /// * internal dependencies (if on), or rule 2 through a wait the pool may have inserted
    ///   earlier: accepted, and a host function on `t` then checks the free's marker ran.
    fn justify(
        &self,
        f: &Freed,
        t: Inc,
        sw: [bool; 3],
        epoch: u64,
        free_granules: bool,
    ) -> Option<&'static str> {
        let ts = self.st(t);
        if f.inc == t {
            return Some("same stream");
        }
        if self.observed(f.inc) >= f.pos {
            return Some("host observed");
        }
        if sw[0] && ts.vc.get(f.inc) >= f.pos {
            return Some("event dependency");
        }
        let by_completion = sw[1] || epoch > f.epoch;
        let why_done = if sw[1] { "opportunistic" } else { "recycled" };
        // Before the verified rules: a reuse the engine made because the free had completed
        // must not be verified as an inserted wait (the marker may run a moment late).
        if by_completion && self.completed(f, GRACE) {
            return Some(why_done);
        }
        // Complete frees in granules without live allocations may have been recycled
        // (unmapped) meanwhile; their addresses are then fresh address space for every
        // stream (docs/semantics.md). `strict_recycling` rejects it.
        if !self.strict_recycling && free_granules && self.completed(f, GRACE) {
            return Some("recycled address space (complete, unmapped, mapped again)");
        }
        if sw[2] {
            return Some("internal dependency (verified)");
        }
        if sw[0] && ts.mvc.get(f.inc) >= f.pos {
            return Some("event dependency through an inserted wait (verified)");
        }
        None
    }

    /// Reads RESERVED of every pool and bumps a pool's epoch when it went down.
    fn note_reserved(&mut self) -> Result<(), String> {
        for p in &mut self.pools {
            let r = attr(p.handle, RESERVED)?;
            if r < p.last_reserved {
                p.epoch += 1;
            }
            p.last_reserved = r;
        }
        Ok(())
    }

    fn all_attrs(&self) -> Result<Vec<Vec<u64>>, String> {
        self.pools.iter().map(|p| attrs(p.handle)).collect()
    }

    /// Calls `f`, expecting `want`, and checks that no attribute of any pool changed.
    fn must_fail(
        &self,
        want: AclError,
        what: &str,
        f: impl FnOnce() -> AclError,
    ) -> Result<(), String> {
        let before = self.all_attrs()?;
        let e = f();
        if e != want {
            return Err(format!("{what}: returned {e}, expected {want} ({})", msg()));
        }
        if msg().is_empty() {
            return Err(format!("{what}: no error message"));
        }
        let after = self.all_attrs()?;
        if before != after {
            return Err(format!("{what}: attributes changed: {before:?} -> {after:?}"));
        }
        Ok(())
    }
}

static COVERAGE: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

fn cover(what: &'static str) {
    *COVERAGE.lock().unwrap_or_else(|e| e.into_inner()).entry(what).or_insert(0) += 1;
}

fn apply(m: &mut Model, op: &Op) -> Result<(), String> {
    let pool_of = |p: u8| p as usize % POOL_MAX.len();
    match *op {
        Op::CreateStream { slot } => {
            let slot = 1 + (slot as usize - 1) % (SLOTS as usize - 1);
            if m.slots[slot].is_none() {
                let mut h = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                acl(unsafe { aclrtCreateStream(&mut h) }, "aclrtCreateStream")?;
                m.add_stream(slot, h);
            }
        }
        Op::DestroyStream { slot } => {
            let slot = 1 + (slot as usize - 1) % (SLOTS as usize - 1);
            if let Some(inc) = m.slots[slot].take() {
                let s = m.streams.remove(&inc).expect("live");
                acl(aclrtDestroyStream(s.handle), "aclrtDestroyStream")?;
                m.destroyed.insert(inc);
                m.log.push(format!("destroy stream inc {inc}"));
            }
        }
        Op::Alloc { pool, stream, bytes } => {
            let t = m.pick(stream);
            let p = pool_of(pool);
            let (ph, sw) = (m.pools[p].handle, m.pools[p].switches);
            let reserved_before = attr(ph, RESERVED)?;
            let ptr = try_alloc(bytes as usize, ph, m.st(t).handle)
                .map_err(|e| format!("aclrtMemPoolMallocAsync: {e} ({})", msg()))?;
            let size = round_up(u64::from(bytes), ALIGN);
            // Granules of live allocations of this pool before this one, with when each was
            // allocated: only a block live since before a free pins its granules (one
            // allocated later may sit in a granule recycled and mapped again after the free).
            let busy: Vec<(u64, u64)> = m
                .live
                .iter()
                .filter(|l| l.pool == p)
                .flat_map(|l| {
                    (l.ptr / GRANULE..=(l.ptr + l.size - 1) / GRANULE).map(|g| (g, l.seq))
                })
                .collect();
            m.seq += 1;
            // Tracked at once, so that a case failing below still frees it at teardown (a
            // pool with live allocations cannot be destroyed: its address space would leak).
            m.live.push(Live { pool: p, ptr, bytes: u64::from(bytes), size, seq: m.seq });
            if ptr == 0 || ptr % ALIGN != 0 {
                return Err(format!("pointer {ptr:#x} not {ALIGN}-aligned"));
            }
            if attr(ph, RESERVED)? < reserved_before {
                m.pools[p].epoch += 1;
            }
            let epoch = m.pools[p].epoch;
            let (start, end) = (ptr, ptr + size);
            let mut overlapped = Vec::new();
            let mut kept = Vec::new();
            let mut others: BTreeSet<Inc> = BTreeSet::new();
            for f in std::mem::take(&mut m.freed[p]) {
                if f.inc != t {
                    others.insert(f.inc);
                }
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
            for f in &overlapped {
                let (a, b) = (f.start.max(start), f.end.min(end));
                let free_granules = (a / GRANULE..=(b - 1) / GRANULE)
                    .all(|g| !busy.iter().any(|&(bg, seq)| bg == g && seq < f.seq));
                match m.justify(f, t, sw, epoch, free_granules) {
                    Some(why) => {
                        cover(why);
                        m.used.insert(why);
                        m.log.push(format!("  reuse of {f:?} by inc {t}: {why}"));
                        if why.ends_with("(verified)") {
                            let done = Arc::clone(&m.st(f.inc).done);
                            let violations = Arc::clone(&m.violations);
                            let (inc, pos) = (f.inc, f.pos);
                            let what = format!(
                                "{why}: inc {t} ran before inc {inc} completed its free at {pos} \
                                 ({:#x}..{:#x})",
                                f.start, f.end
                            );
                            m.task(t, move || {
                                if done.load(Ordering::SeqCst) <= pos {
                                    violations.lock().unwrap_or_else(|e| e.into_inner()).push(what);
                                }
                            })?;
                        }
                    }
                    None => {
                        let ts = m.st(t);
                        return Err(format!(
                            "allocation {ptr:#x}+{size} on stream inc {t} (clock {:?}, maybe \
                             {:?}) reuses {f:?} with no rule (switches {sw:?}, observed {}, \
                             marker {}, epoch now {epoch})",
                            ts.vc,
                            ts.mvc,
                            m.observed(f.inc),
                            m.streams
                                .get(&f.inc)
                                .map_or(u64::MAX, |s| s.done.load(Ordering::SeqCst)),
                        ));
                    }
                }
            }
            if sw[2] {
                // The pool may have made `t` wait on an event recorded at the end of any
                // stream holding freed memory of this pool: learn it as a *maybe* ordering.
                for s in others {
                    let Some(src) = m.streams.get(&s) else { continue };
                    let (mut clock, tasks) = (src.mvc.clone(), src.tasks);
                    clock.join(&src.vc);
                    clock.raise(s, tasks);
                    m.st_mut(t).mvc.join(&clock);
                }
            }
            m.log.push(format!("alloc p{p} {bytes} -> {ptr:#x}+{size} on inc {t}"));
        }
        Op::Free { which, stream } => {
            if m.live.is_empty() {
                return Ok(());
            }
            let l = m.live.swap_remove(which as usize % m.live.len());
            let t = m.pick(stream);
            acl(free(l.ptr, m.st(t).handle), "aclrtMemPoolFreeAsync")?;
            let pos = m.st(t).tasks;
            m.task(t, || {})?; // the free's marker, at `pos + 1`
            let epoch = m.pools[l.pool].epoch;
            m.seq += 1;
            let seq = m.seq;
            m.freed[l.pool].push(Freed {
                start: l.ptr,
                end: l.ptr + l.size,
                inc: t,
                pos,
                epoch,
                seq,
            });
            m.freed_ptrs.push(l.ptr);
            m.log.push(format!("free p{} {:#x} on inc {t} at {pos}", l.pool, l.ptr));
        }
        Op::Record { stream, event } => {
            let t = m.pick(stream);
            let ev = event_handle(m, event)?;
            acl(aclrtRecordEvent(ev, m.st(t).handle), "aclrtRecordEvent")?;
            let s = m.st_mut(t);
            s.tasks += 1;
            let (mut vc, mut mvc) = (s.vc.clone(), s.mvc.clone());
            vc.raise(t, s.tasks);
            mvc.raise(t, s.tasks);
            m.log.push(format!("record e{event} on inc {t}: {vc:?}"));
            m.events[event as usize] = Some((ev, Some((vc, mvc))));
        }
        Op::Wait { stream, event } => {
            let t = m.pick(stream);
            let ev = event_handle(m, event)?;
            acl(aclrtStreamWaitEvent(m.st(t).handle, ev), "aclrtStreamWaitEvent")?;
            if let Some((_, Some((vc, mvc)))) = m.events[event as usize].clone() {
                let s = m.st_mut(t);
                s.vc.join(&vc);
                s.mvc.join(&vc);
                s.mvc.join(&mvc);
                m.log.push(format!("inc {t} waits e{event}: {vc:?}"));
            }
        }
        Op::RecordWait { on, waiter, event } => {
            apply(m, &Op::Record { stream: on, event })?;
            apply(m, &Op::Wait { stream: waiter, event })?;
        }
        Op::ResetHighs { pool } => {
            let h = m.pools[pool_of(pool)].handle;
            for a in [RESERVED_HIGH, USED_HIGH] {
                acl(set_u64(h, a, 0), "aclrtMemPoolSetAttr(high, 0)")?;
            }
            let v = attrs(h)?;
            if v[5] != v[4] || v[7] != v[6] {
                return Err(format!("a reset high-water mark is not its current value: {v:?}"));
            }
        }
        Op::SyncStream { stream } => {
            let t = m.pick(stream);
            acl(aclrtSynchronizeStream(m.st(t).handle), "aclrtSynchronizeStream")?;
            let pos = m.st(t).tasks;
            m.observe(t, pos);
            released(m, "stream synchronised", None)?;
        }
        Op::SyncEvent { event } => {
            let ev = event_handle(m, event)?;
            acl(aclrtSynchronizeEvent(ev), "aclrtSynchronizeEvent")?;
            if let Some((_, Some((vc, _)))) = m.events[event as usize].clone() {
                for (inc, pos) in vc.0 {
                    m.observe(inc, pos);
                }
            }
            released(m, "event synchronised", None)?;
        }
        Op::SyncDevice => sync_device(m)?,
        Op::Trim { pool, mib } => {
            let p = pool_of(pool);
            let (h, max) = (m.pools[p].handle, m.pools[p].max);
            let n = u64::from(mib) * MIB_U;
            if n > max {
                m.must_fail(AclError::ERROR_INVALID_PARAM, "trim above the pool size", || {
                    aclrtMemPoolTrimTo(h, n as usize)
                })?;
            } else {
                acl(aclrtMemPoolTrimTo(h, n as usize), "aclrtMemPoolTrimTo")?;
                released(m, "trimmed", Some((p, n)))?;
            }
        }
        Op::SetReuse { pool, attr: a, on } => {
            let p = pool_of(pool);
            let a = a as usize % 3;
            let h = m.pools[p].handle;
            acl(set_u32(h, SWITCHES[a], if on { 7 } else { 0 }), "aclrtMemPoolSetAttr")?;
            m.pools[p].switches[a] = on;
        }
        Op::SetThreshold { pool, mib } => {
            let p = pool_of(pool);
            let (h, max) = (m.pools[p].handle, m.pools[p].max);
            let n = u64::from(mib) * MIB_U;
            if n > max {
                m.must_fail(
                    AclError::ERROR_INVALID_PARAM,
                    "threshold above the pool size",
                    || set_u64(h, THRESHOLD, n),
                )?;
            } else {
                acl(set_u64(h, THRESHOLD, n), "aclrtMemPoolSetAttr(threshold)")?;
                m.pools[p].threshold = n;
            }
        }
        Op::Sleep { stream, ms } => {
            let t = m.pick(stream);
            let d = Duration::from_millis(u64::from(ms));
            m.task(t, move || std::thread::sleep(d))?;
        }
        Op::HostSleep { ms } => std::thread::sleep(Duration::from_millis(u64::from(ms))),
        Op::DoubleFree { which, stream } => {
            let live: BTreeSet<u64> = m.live.iter().map(|l| l.ptr).collect();
            let cands: Vec<u64> =
                m.freed_ptrs.iter().copied().filter(|p| !live.contains(p)).collect();
            if cands.is_empty() {
                return Ok(());
            }
            let ptr = cands[which as usize % cands.len()];
            let h = m.st(m.pick(stream)).handle;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "double free", || free(ptr, h))?;
            cover("(double free rejected)");
        }
        Op::InteriorFree { which, offset, stream } => {
            let cands: Vec<&Live> = m.live.iter().filter(|l| l.bytes >= 2).collect();
            if cands.is_empty() {
                return Ok(());
            }
            let l = cands[which as usize % cands.len()];
            let ptr = l.ptr + 1 + u64::from(offset) % (l.bytes - 1);
            let h = m.st(m.pick(stream)).handle;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "interior free", || free(ptr, h))?;
            cover("(interior free rejected)");
        }
        Op::DestroyLivePool { pool } => {
            let p = pool_of(pool);
            if !m.live.iter().any(|l| l.pool == p) {
                return Ok(());
            }
            let h = m.pools[p].handle;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "destroy with live allocations", || {
                aclrtMemPoolDestroy(h)
            })?;
            cover("(destroy of a live pool rejected)");
        }
        Op::ScratchPool { bytes, stream } => {
            let t = m.pick(stream);
            let s = m.st(t).handle;
            let h = try_pool(&props(64 << 20))
                .map_err(|e| format!("aclrtMemPoolCreate: {e} ({})", msg()))?;
            m.scratch = Some((h, Vec::new()));
            let alloc = |m: &mut Model, n: usize| {
                let p =
                    try_alloc(n, h, s).map_err(|e| format!("scratch alloc: {e} ({})", msg()))?;
                m.scratch.as_mut().expect("scratch").1.push(p);
                Ok::<u64, String>(p)
            };
            let a = alloc(m, bytes as usize)?;
            let before = attrs(h)?;
            m.must_fail(AclError::ERROR_INVALID_PARAM, "destroy of a scratch pool in use", || {
                aclrtMemPoolDestroy(h)
            })?;
            if attrs(h)? != before {
                return Err("a failed destroy changed the scratch pool".into());
            }
            let b = alloc(m, 512)?;
            acl(free(b, s), "scratch free")?;
            m.scratch.as_mut().expect("scratch").1.retain(|&p| p != b);
            acl(free(a, s), "scratch free")?;
            m.scratch.as_mut().expect("scratch").1.clear();
            acl(aclrtMemPoolDestroy(h), "aclrtMemPoolDestroy")?;
            m.scratch = None;
            // The destroy waited for the frees pending on `t`: the engine may count that as
            // a host observation of `t`.
            let pos = m.st(t).tasks;
            m.observe(t, pos);
            m.must_fail(AclError::ERROR_INVALID_PARAM, "free after pool destroy", || free(a, s))?;
            m.must_fail(AclError::ERROR_RT_INVALID_HANDLE, "alloc from a destroyed pool", || {
                try_alloc(512, h, s).err().unwrap_or(AclError::SUCCESS)
            })?;
        }
    }
    Ok(())
}

fn event_handle(m: &mut Model, event: u8) -> Result<aclrtEvent, String> {
    let i = event as usize;
    if m.events[i].is_none() {
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        acl(unsafe { aclrtCreateEvent(&mut e) }, "aclrtCreateEvent")?;
        m.events[i] = Some((e, None));
    }
    Ok(m.events[i].as_ref().expect("created").0)
}

/// `aclrtSynchronizeDevice` (then the release thresholds apply).
fn sync_device(m: &mut Model) -> Result<(), String> {
    acl(aclrtSynchronizeDevice(), "aclrtSynchronizeDevice")?;
    m.observe_all();
    released(m, "device synchronised", None)
}

/// After a synchronisation (`trim: None`: down to the release threshold) or a trim: a pool
/// without live allocations whose every free the host has observed complete holds at most
/// the threshold / the trim's bytes to keep.
///
/// Observed here means strictly after the free: a stream synchronisation or an event record
/// at a position above the free's (after its marker), or the stream destroyed. (The model's
/// positions miss waits and inserted tasks, and the engine may learn of a completion later
/// than a host function runs, so neither `>=` nor the markers are evidence enough.)
fn released(m: &Model, what: &str, trim: Option<(usize, u64)>) -> Result<(), String> {
    let complete = |f: &Freed| m.observed(f.inc) > f.pos;
    for (p, pool) in m.pools.iter().enumerate() {
        if trim.is_some_and(|(q, _)| q != p) || m.live.iter().any(|l| l.pool == p) {
            continue;
        }
        if !m.freed[p].iter().all(complete) {
            continue;
        }
        // A trim keeps at least its argument rounded up to the granularity (CUDA's and
        // CANN's `minBytesToKeep`, docs/c-api.md); the threshold releases down to itself.
        let bound = trim.map_or(pool.threshold, |(_, n)| n.next_multiple_of(GRANULE));
        let r = attr(pool.handle, RESERVED)?;
        if r > bound {
            return Err(format!(
                "pool {p}: no live allocation, every free completed, {what}: reserved {r} > {bound} \
                 (threshold {})",
                pool.threshold
            ));
        }
    }
    Ok(())
}

fn check(m: &mut Model) -> Result<(), String> {
    let mut all: Vec<&Live> = m.live.iter().collect();
    all.sort_by_key(|l| l.ptr);
    for w in all.windows(2) {
        if w[0].ptr + w[0].size > w[1].ptr {
            return Err(format!("live allocations overlap: {:?} and {:?}", w[0], w[1]));
        }
    }
    m.note_reserved()?;
    for (p, pool) in m.pools.iter().enumerate() {
        let v = attrs(pool.handle)?;
        let [follow, opp, internal, threshold, reserved, reserved_high, used, used_high] = v[..]
        else {
            unreachable!()
        };
        let want_used: u64 = m.live.iter().filter(|l| l.pool == p).map(|l| l.size).sum();
        let bad = |what: String| Err(format!("pool {p}: {what}; attributes {v:?}"));
        if used != want_used {
            return bad(format!("USED {used} != Σ live sizes rounded to 512 B {want_used}"));
        }
        if reserved < used || reserved > pool.max || reserved % GRANULE != 0 {
            return bad(format!("RESERVED {reserved} not a granule multiple in [USED, max]"));
        }
        if reserved_high < reserved || used_high < used {
            return bad("a high-water mark below its current value".into());
        }
        let sw = pool.switches.map(u64::from);
        if [follow, opp, internal] != sw || threshold != pool.threshold {
            return bad(format!("switches / threshold read back, model {sw:?} {}", pool.threshold));
        }
    }
    let v = m.violations.lock().unwrap_or_else(|e| e.into_inner());
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}

/// Frees everything, synchronises, trims, destroys the pools, streams and events; checks
/// that the memory went back and that the destroyed pools' pointers are rejected.
fn finish(m: &mut Model) -> Result<(), String> {
    while !m.live.is_empty() {
        apply(m, &Op::Free { which: 0, stream: 0 })?;
    }
    sync_device(m)?;
    check(m)?;
    for (p, pool) in m.pools.iter().enumerate() {
        acl(aclrtMemPoolTrimTo(pool.handle, 0), "aclrtMemPoolTrimTo(0)")?;
        let v = attrs(pool.handle)?;
        if v[4] != 0 || v[6] != 0 {
            return Err(format!("pool {p} holds memory after free all + sync + trim: {v:?}"));
        }
    }
    for p in std::mem::take(&mut m.pools) {
        acl(aclrtMemPoolDestroy(p.handle), "aclrtMemPoolDestroy")?;
    }
    if let Some(&ptr) = m.freed_ptrs.last() {
        fails_now(free(ptr, std::ptr::null_mut()), "free after the pool was destroyed")?;
    }
    let v = m.violations.lock().unwrap_or_else(|e| e.into_inner());
    if !v.is_empty() {
        return Err(format!("ordering violations: {v:?}"));
    }
    Ok(())
}

fn fails_now(e: AclError, what: &str) -> Result<(), String> {
    if e != AclError::ERROR_INVALID_PARAM {
        return Err(format!("{what}: returned {e}, expected ERROR_INVALID_PARAM"));
    }
    Ok(())
}

/// Releases what a case created, whatever happened.
fn teardown(m: &mut Model) {
    let _ = aclrtSynchronizeDevice();
    for l in std::mem::take(&mut m.live) {
        let _ = free(l.ptr, std::ptr::null_mut());
    }
    if let Some((h, ptrs)) = m.scratch.take() {
        for p in ptrs {
            let _ = free(p, std::ptr::null_mut());
        }
        let _ = aclrtSynchronizeDevice();
        let _ = aclrtMemPoolDestroy(h);
    }
    let _ = aclrtSynchronizeDevice();
    for p in std::mem::take(&mut m.pools) {
        let _ = aclrtMemPoolDestroy(p.handle);
    }
    for (_, s) in std::mem::take(&mut m.streams) {
        if !s.handle.is_null() {
            let _ = aclrtDestroyStream(s.handle);
        }
    }
    for (e, _) in m.events.drain(..).flatten() {
        let _ = aclrtDestroyEvent(e);
    }
}

/// Runs one case; `Err` describes the first violated property; `Ok` gives the
/// justifications the case needed.
fn run_case(case: &Case) -> Result<BTreeSet<&'static str>, String> {
    run_case_with(case, false)
}

fn run_case_with(case: &Case, strict_recycling: bool) -> Result<BTreeSet<&'static str>, String> {
    setup();
    acl(aclrtSynchronizeDevice(), "aclrtSynchronizeDevice")?;
    let mut m = Model::new()?;
    m.strict_recycling = strict_recycling;
    let result = (|| {
        for slot in 1..=case.streams {
            apply(&mut m, &Op::CreateStream { slot })?;
        }
        for (pool, sw) in case.switches.iter().enumerate() {
            for (attr, &on) in sw.iter().enumerate() {
                apply(&mut m, &Op::SetReuse { pool: pool as u8, attr: attr as u8, on })?;
            }
        }
        for (step, op) in case.ops.iter().enumerate() {
            apply(&mut m, op).map_err(|e| format!("step {step} {op:?}: {e}"))?;
            check(&mut m).map_err(|e| format!("after step {step} {op:?}: {e}"))?;
        }
        finish(&mut m)
    })();
    teardown(&mut m);
    if std::env::var_os("SM_LOG").is_some() {
        eprintln!("{}", m.log.join("\n"));
    }
    result.map(|()| std::mem::take(&mut m.used)).map_err(|e| {
        let n = m.log.len().saturating_sub(60);
        format!("{e}\nlog (last 60):\n{}", m.log[n..].join("\n"))
    })
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48)
}

#[test]
fn pool_c_api_matches_the_shadow_model() {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let _g = lock();
    let config = Config {
        cases: cases(),
        max_shrink_iters: 1000,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result =
        runner.run(&case_strategy(), |case| run_case(&case).map(drop).map_err(TestCaseError::fail));
    eprintln!("justifications needed: {:?}", COVERAGE.lock().unwrap_or_else(|e| e.into_inner()));
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A fixed program reaching every rule and error path, so that a plain run exercises the
/// model deterministically too.
#[test]
fn scripted_program_covers_every_rule() {
    let _g = lock();
    let case = Case {
        streams: 2,
        switches: [[true, false, false], [false, false, true]],
        ops: vec![
            Op::Sleep { stream: 1, ms: 30 },
            Op::Alloc { pool: 0, stream: 1, bytes: 2 << 20 },
            Op::Free { which: 0, stream: 1 },
            Op::Record { stream: 1, event: 0 },
            Op::Wait { stream: 2, event: 0 },
            Op::Alloc { pool: 0, stream: 2, bytes: 2 << 20 }, // event dependency
            Op::Alloc { pool: 1, stream: 1, bytes: 8 << 20 },
            Op::InteriorFree { which: 1, offset: 77, stream: 0 },
            Op::Free { which: 1, stream: 1 },
            Op::DoubleFree { which: 0, stream: 2 },
            Op::DestroyLivePool { pool: 0 },
            Op::SyncStream { stream: 1 },
            Op::SetThreshold { pool: 1, mib: 64 },
            Op::Alloc { pool: 1, stream: 2, bytes: 8 << 20 }, // host observed
            Op::Sleep { stream: 2, ms: 30 },
            Op::Free { which: 1, stream: 2 },
            Op::Alloc { pool: 1, stream: 0, bytes: 8 << 20 }, // internal dependency
            Op::ScratchPool { bytes: 1000, stream: 1 },
            Op::Trim { pool: 1, mib: 500 },
            Op::SetThreshold { pool: 0, mib: 513 },
            Op::SetThreshold { pool: 0, mib: 4 },
            Op::SyncDevice,
        ],
    };
    let used = run_case(&case).unwrap_or_else(|e| panic!("{e}"));
    for why in ["event dependency", "host observed", "internal dependency (verified)"] {
        assert!(used.contains(why), "{why} not reached: {used:?}");
    }
}

/// A program the property test found: a trim to 1 MiB of a pool that cached a 2 MiB + 1
/// allocation (freed on another stream) keeps one 2 MiB granule — `minBytesToKeep` rounded
/// up to the granularity — which the model had taken for a trim that released too little.
#[test]
fn trim_to_less_than_a_granule_keeps_one_granule() {
    let _g = lock();
    let case = Case {
        streams: 1,
        switches: [[false, false, false], [false, false, false]],
        ops: vec![
            Op::Alloc { pool: 1, stream: 0, bytes: (2 << 20) + 1 },
            Op::Free { which: 0, stream: 2 },
            Op::ScratchPool { bytes: 1, stream: 0 },
            Op::Trim { pool: 1, mib: 1 },
            Op::Trim { pool: 1, mib: 0 },
        ],
    };
    run_case(&case).unwrap_or_else(|e| panic!("{e}"));
}

/// A program the property test found (shrunk by hand), kept to show the strict model's view.
/// What happens: the default stream's 8 MiB growth recycles (unmaps) the fully free first
/// granule — its own complete free, which it may reuse — and stream 2's later 2 MiB request
/// gets that unmapped, fresh address space. docs/semantics.md documents this ("Recycled
/// address space is fresh"); the strict model, which treats any matching address as a reuse,
/// rejects it. The helper's original reading follows. All reuse switches are off;
/// stream 2 waits on an event recorded on the default stream after the frees, but without
/// FOLLOW_EVENT_DEPENDENCIES that gives no right. Its 2 MiB request cannot be served from
/// cached or never-used memory, growth would raise RESERVED above its all-time high, so the
/// engine recycles the fully free first granule — which holds a block freed on the default
/// stream — and maps the request there: stream 2 gets addresses freed on another stream with
/// no enabled rule (the free is complete, so no in-flight work touches the new memory).
/// `docs/semantics.md` (search order, step 4) says only segments whose frees are complete
/// **and** reusable by the requesting stream are recycled, "because recycling may hand the
/// same addresses out again", and the engine's unit test
/// `recycling_unmaps_complete_free_segments_before_mapping` asserts that case maps fresh
/// memory; the engine's module doc says "untagged or complete". The property test tolerates
/// this reuse for complete frees; this test checks the documented rule.
#[test]
#[ignore = "the strict model treats recycled (unmapped, fresh) address space as a reuse; \
            docs/semantics.md permits it"]
fn recycled_addresses_are_fresh_for_every_stream() {
    let _g = lock();
    let case = Case {
        streams: 2,
        switches: [[false; 3], [false; 3]],
        ops: vec![
            Op::Record { stream: 0, event: 1 },
            Op::Alloc { pool: 0, stream: 0, bytes: 4131 },
            Op::Free { which: 0, stream: 0 },
            Op::Alloc { pool: 0, stream: 1, bytes: 2318829 },
            Op::Alloc { pool: 0, stream: 0, bytes: 8 << 20 },
            Op::RecordWait { on: 0, waiter: 2, event: 0 },
            Op::Free { which: 1, stream: 0 },
            Op::HostSleep { ms: 50 },
            Op::Alloc { pool: 0, stream: 2, bytes: 2 << 20 },
        ],
    };
    // Whether the engine sees the first free complete at that moment varies from run to run
    // (in about half of them here): try a few times.
    for attempt in 0..20 {
        if let Err(e) = run_case_with(&case, true) {
            panic!("attempt {attempt}: {e}");
        }
    }
}

/// A case the property test reported once: the default stream's growth recycled a granule of
/// its own completed free and a later extension mapped it again, so another stream's fresh
/// block sat inside the old free's range next to a block allocated after the free. The model
/// once counted that later block as pinning the granule; only blocks live since before the
/// free do.
#[test]
fn recycled_granule_remapped_next_to_a_newer_block() {
    let _g = lock();
    let case = Case {
        streams: 4,
        switches: [[false; 3], [false; 3]],
        ops: vec![
            Op::Alloc { pool: 1, stream: 2, bytes: 1048576 },
            Op::Alloc { pool: 0, stream: 2, bytes: 167997 },
            Op::Alloc { pool: 0, stream: 1, bytes: 4194304 },
            Op::Free { which: 216, stream: 0 },
            Op::Free { which: 204, stream: 0 },
            Op::Wait { stream: 1, event: 0 },
            Op::Alloc { pool: 0, stream: 1, bytes: 8388608 },
            Op::Record { stream: 1, event: 0 },
            Op::SetReuse { pool: 1, attr: 2, on: true },
            Op::RecordWait { on: 0, waiter: 2, event: 1 },
            Op::Alloc { pool: 1, stream: 2, bytes: 1048576 },
            Op::Record { stream: 0, event: 0 },
            Op::Alloc { pool: 1, stream: 1, bytes: 8388608 },
            Op::Alloc { pool: 0, stream: 4, bytes: 20418 },
            Op::Wait { stream: 3, event: 0 },
            Op::Alloc { pool: 0, stream: 0, bytes: 7557476 },
            Op::RecordWait { on: 0, waiter: 0, event: 2 },
            Op::ResetHighs { pool: 1 },
            Op::Alloc { pool: 0, stream: 0, bytes: 2097152 },
            Op::DestroyStream { slot: 4 },
            Op::Free { which: 68, stream: 2 },
            Op::Record { stream: 0, event: 0 },
            Op::Alloc { pool: 0, stream: 2, bytes: 299 },
            Op::SyncDevice,
        ],
    };
    for attempt in 0..50 {
        if let Err(e) = run_case_with(&case, false) {
            panic!("attempt {attempt}: {e}");
        }
    }
}
