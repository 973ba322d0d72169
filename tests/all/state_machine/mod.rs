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

mod checks;
mod model;
mod program;
mod scripted;
mod steps;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use soma::{MemPool, ReusePolicy, Stream};

use checks::{check, finish};
use model::Model;
use program::{case_strategy, Case};
use steps::apply;

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
