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

mod apply;
#[path = "../common/mod.rs"]
mod common;
mod model;

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

use apply::{apply, check, finish, teardown};

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

static COVERAGE: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

fn cover(what: &'static str) {
    *COVERAGE.lock().unwrap_or_else(|e| e.into_inner()).entry(what).or_insert(0) += 1;
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
            // The free observed, its memory kept under the threshold.
            Op::SetThreshold { pool: 1, mib: 64 },
            Op::SyncStream { stream: 0 },
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

/// A program the property test found: destroying a pool on a stream does not wait for that
/// stream, so a free pending there on another pool is not observed, and that pool need not
/// release it at the next synchronisation of another stream.
#[test]
fn destroying_a_pool_observes_nothing_of_its_stream() {
    let _g = lock();
    let case = Case {
        streams: 2,
        switches: [[false, false, false], [true, false, false]],
        ops: vec![
            Op::Sleep { stream: 2, ms: 0 },
            Op::CreateStream { slot: 1 },
            Op::Alloc { pool: 0, stream: 0, bytes: 1 },
            Op::Free { which: 0, stream: 2 },
            Op::Alloc { pool: 1, stream: 0, bytes: 1 },
            Op::ScratchPool { bytes: 1, stream: 2 },
            Op::SyncStream { stream: 0 },
        ],
    };
    run_case(&case).unwrap_or_else(|e| panic!("{e}"));
}
