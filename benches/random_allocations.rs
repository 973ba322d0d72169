//! Figure 2 — RAPIDS RMM's `random_allocations` benchmark, ported
//! ([`soma_tools::workload::random_allocations`]): `2 × n` steps, allocate with probability
//! 73 % (sizes uniform in 1 B … max_size), else free a random live allocation, live bytes
//! capped at 16 000 MiB; n ∈ {1 000, 10 000, 100 000} × max_size ∈ {1, 4, 64, 256} MiB;
//! fixed seed. The op sequence is generated before timing.
//!
//! RMM's methodology (`benchmarks/random_allocations/random_allocations.cpp`): the memory
//! resource is created once per benchmark, outside the timing loop, and every iteration
//! replays the whole sequence on that same resource (each replay frees everything it
//! allocated), so after the first iteration the pool is warm. Here likewise: one allocator
//! instance per (allocator, cell) — for the public API one `MemPool` per cell — and every
//! criterion iteration, warm-up included, is one whole replay on it; the time reported is
//! a replay's time divided by its number of ops (ns per op, warm). Ids:
//! `random_allocations/<allocator>/<n>x<max_size MiB>`.
//!
//! Allocators: the baselines (`soma_tools::baselines`, the replicas of torch_npu's and
//! llama.cpp's pools among them), `soma` (the public API on one stream, default pool),
//! `soma-4-streams` (the same, ops on 4 streams in turn), `soma-recycle` (built with
//! `recycle_on_growth(true)`: growth unmaps free segments to stay near the reserved
//! high-water mark) and the engine alone with its default settings and with recycling.
//!
//! Before criterion, each instance replays twice outside criterion: the first replay (on the
//! fresh instance, timed once) is the cold figure, the second (warm) gives the driver calls
//! of one warm replay. When that second replay takes longer than
//! [`common::slow_replay_limit`], criterion is skipped and the second replay's time stands
//! for the cell (recorded in `random_allocations_slow.json` with the first replay's).
//!
//! JSON (`<target>/soma-bench/random_allocations.json`), one object per cell: the workload's
//! facts (`cell`, `n`, `max_size_mib`, `ops`, `allocs`, `peak_live_bytes`,
//! `max_live_count`) and maps keyed by allocator name: `cold_ns_per_op` (first replay on a
//! fresh allocator), `cold_driver_calls` (driver calls of that first replay, by kind:
//! `soma_tools::driver_cost::DriverCalls`) and `warm_driver_calls` (of the second replay on
//! the same instance), `cold_driver_ns_per_op` / `warm_driver_ns_per_op` (their modelled
//! time per op, `DriverCostModel::ascend_like`, whose per-call costs are written to
//! `driver_cost_model.json`), `cold_reserved_high` / `warm_reserved_high` (peak reserved
//! after the first / second replay). A run with a benchmark filter measures only the
//! selected (allocator, cell) pairs and keeps the previous file's figures for the others.
//!
//! Interleaved rounds: after criterion, the cell's fast allocators (every one but the
//! first-fit free list, the driver path and any whose warm replay was too slow for
//! criterion) replay in [`common::ROUNDS`] rounds, one timed
//! replay each per round, in an order that rotates from round to round. On a shared machine
//! whose load moves between criterion's runs of two allocators, the ratio of two figures of
//! the same round is far steadier than the ratio of two criterion means taken minutes
//! apart. Recorded per cell as `paired_ns_per_op` (allocator → ns per op of each round's
//! warm replay, in round order) and `paired_cold_ns_per_op` (the same allocators, each
//! round on a fresh instance: the first replay's ns per op).
//!
//! The driver path runs only for n ≤ 10 000 (about 6 µs per call on soma-sim: the
//! n = 100 000 cells would take minutes); the first-fit free list only where its
//! O(free-list) cost keeps one replay under ~2 s (n ≤ 10 000, and n = 100 000 with
//! max_size ≥ 64 MiB, where the byte cap keeps the list short).

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use serde_json::{json, Map, Value};
use soma::Stream;
use soma_tools::baselines::{
    Allocator, DriverCalls, DriverPath, FirstFit, LlamaCppPrio, OffsetAlloc, SomaApi, SomaEngine,
    SomaReplica, SomaStreams, Tlsf, TorchNpu,
};
use soma_tools::driver_cost::DriverCostModel;
use soma_tools::workload::{free_all, random_allocations, replay, Workload, SEED};

use common::RANGE;

const NS: [usize; 3] = [1_000, 10_000, 100_000];
const MAX_SIZES_MIB: [u64; 4] = [1, 4, 64, 256];
const MAX_USAGE_MIB: u64 = 16_000;

/// The per-allocator maps of one cell's JSON object.
const MAPS: [&str; 9] = [
    "cold_ns_per_op",
    "cold_driver_calls",
    "warm_driver_calls",
    "cold_driver_ns_per_op",
    "warm_driver_ns_per_op",
    "cold_reserved_high",
    "warm_reserved_high",
    "paired_ns_per_op",
    "paired_cold_ns_per_op",
];

/// What one run measured outside criterion: per cell, per map key, allocator → value.
#[derive(Default)]
struct Facts {
    cells: BTreeMap<String, BTreeMap<&'static str, Map<String, Value>>>,
    /// Entries of `random_allocations_slow.json` measured by this run.
    slow: Vec<Value>,
    /// (allocator, cell) pairs this run measured.
    measured: Vec<(String, String)>,
}

impl Facts {
    /// Whether `allocator`'s warm replay of `cell` was too slow for criterion (then it stays
    /// out of the interleaved rounds as well: its single timing stands).
    fn slow(&self, allocator: &str, cell: &str) -> bool {
        self.slow.iter().any(|e| e["allocator"] == allocator && e["cell"] == cell)
    }

    fn put(&mut self, cell: &str, key: &'static str, allocator: &str, value: Value) {
        self.cells
            .entry(cell.to_owned())
            .or_default()
            .entry(key)
            .or_default()
            .insert(allocator.to_owned(), value);
    }
}

/// One whole replay of `w` on `a`, everything freed afterwards (untimed); its duration.
fn timed_replay<A: Allocator>(a: &mut A, w: &Workload) -> Duration {
    let t = Instant::now();
    let handles = replay(a, &w.ops, w.slots);
    let d = t.elapsed();
    free_all(a, handles);
    d
}

fn ns_per_op(d: Duration, w: &Workload) -> f64 {
    d.as_nanos() as f64 / w.ops.len() as f64
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// `maps/unmaps/mallocs/frees` of `calls`, for the progress lines.
fn brief(c: &DriverCalls) -> String {
    format!("{}/{}/{}/{}", c.map, c.unmap, c.malloc, c.free)
}

/// One (allocator, cell): a cold replay on the fresh `a` and a second (warm) replay, both
/// outside criterion (recorded in `facts`), then criterion's iterations, each one replay on
/// the same `a` — or, when the warm replay is slower than [`common::slow_replay_limit`],
/// that replay's time alone (recorded as slow). Nothing runs when criterion's filter rules
/// the benchmark out.
fn bench<A: Allocator>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    facts: &mut Facts,
    cell: &str,
    w: &Workload,
    a: &mut A,
) {
    let name = a.name();
    if !common::maybe_selected(&format!("random_allocations/{name}/{cell}")) {
        return;
    }
    facts.measured.push((name.to_owned(), cell.to_owned()));

    let model = DriverCostModel::ascend_like();
    let ops = w.ops.len() as u64;
    let start = a.driver_calls();
    let cold = ns_per_op(timed_replay(a, w), w);
    let cold_calls = a.driver_calls() - start;
    facts.put(cell, "cold_ns_per_op", name, json!(round1(cold)));
    facts.put(cell, "cold_reserved_high", name, json!(a.reserved_high()));
    let second = ns_per_op(timed_replay(a, w), w);
    let warm_calls = a.driver_calls() - start - cold_calls;
    facts.put(cell, "warm_reserved_high", name, json!(a.reserved_high()));
    for (kind, calls) in [("cold", cold_calls), ("warm", warm_calls)] {
        let calls_json: Value = serde_json::from_str(&calls.to_json()).expect("calls JSON");
        let key = if kind == "cold" { "cold_driver_calls" } else { "warm_driver_calls" };
        facts.put(cell, key, name, calls_json);
        let key = if kind == "cold" { "cold_driver_ns_per_op" } else { "warm_driver_ns_per_op" };
        facts.put(cell, key, name, json!(round1(model.ns_per_op(&calls, ops))));
    }
    println!(
        "random_allocations/{name}/{cell}: first replay (cold) {cold:.1} ns/op, \
         second (warm) {second:.1} ns/op; driver calls {} cold, {} warm",
        brief(&cold_calls),
        brief(&warm_calls)
    );

    if second * w.ops.len() as f64 > common::slow_replay_limit().as_nanos() as f64 {
        println!(
            "random_allocations/{name}/{cell}: warm replay {second:.0} ns/op (too slow for \
             criterion; timed once)"
        );
        facts.slow.push(json!({
            "allocator": name,
            "cell": cell,
            "ns_per_op": round1(second),
            "cold_ns_per_op": round1(cold),
            "warm_ns_per_op": round1(second),
        }));
        return;
    }
    let ops = w.ops.len() as u32;
    g.bench_function(BenchmarkId::new(name, cell), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += timed_replay(a, w);
            }
            total / ops
        })
    });
}

/// An allocator of the interleaved rounds, its handle type hidden.
trait Replayer {
    fn name(&self) -> &'static str;
    /// One timed replay of `w` (everything freed afterwards, untimed): ns per op.
    fn replay_ns(&mut self, w: &Workload) -> f64;
}

impl<A: Allocator> Replayer for A {
    fn name(&self) -> &'static str {
        Allocator::name(self)
    }
    fn replay_ns(&mut self, w: &Workload) -> f64 {
        ns_per_op(timed_replay(self, w), w)
    }
}

/// [`common::interleaved_rounds`] of one cell over `allocators` (those the filter selects;
/// none when fewer than two are), one warm replay each per round.
fn interleaved(facts: &mut Facts, cell: &str, w: &Workload, allocators: &mut [&mut dyn Replayer]) {
    let mut chosen: Vec<&mut &mut dyn Replayer> = allocators
        .iter_mut()
        .filter(|a| common::maybe_selected(&format!("random_allocations/{}/{cell}", a.name())))
        .filter(|a| !facts.slow(a.name(), cell))
        .collect();
    if chosen.len() < 2 {
        return;
    }
    let ns = common::interleaved_rounds(chosen.len(), |j| chosen[j].replay_ns(w));
    let (rounds, k) = (ns[0].len(), ns.len());
    for (a, v) in chosen.iter().zip(ns) {
        let rounded: Vec<f64> = v.iter().copied().map(round1).collect();
        facts.put(cell, "paired_ns_per_op", a.name(), json!(rounded));
    }
    println!("random_allocations/{cell}: {rounds} interleaved rounds of {k} allocators");
}

/// A fresh allocator of the cold rounds: its name and a function that builds one, replays
/// `w` once on it and returns that replay's ns per op.
type ColdReplay<'a> = (&'static str, Box<dyn FnMut(&Workload) -> f64 + 'a>);

/// [`common::interleaved_rounds`] of first replays: every round builds each allocator of
/// `fresh` (those the filter selects; none when fewer than two are) anew and times its
/// first replay.
fn cold_rounds(facts: &mut Facts, cell: &str, w: &Workload, fresh: &mut [ColdReplay<'_>]) {
    let mut chosen: Vec<&mut ColdReplay<'_>> = fresh
        .iter_mut()
        .filter(|(name, _)| common::maybe_selected(&format!("random_allocations/{name}/{cell}")))
        .filter(|(name, _)| !facts.slow(name, cell))
        .collect();
    if chosen.len() < 2 {
        return;
    }
    let ns = common::interleaved_rounds(chosen.len(), |j| (chosen[j].1)(w));
    for ((name, _), v) in chosen.iter().zip(ns) {
        let rounded: Vec<f64> = v.iter().copied().map(round1).collect();
        facts.put(cell, "paired_cold_ns_per_op", name, json!(rounded));
    }
    println!("random_allocations/{cell}: cold rounds of {} allocators", chosen.len());
}

/// The cold rounds' allocators, each built fresh for every replay: the same set as the warm
/// rounds.
fn fresh_allocators<'a>(
    dev: &'a soma::Device,
    s: &'a Stream<'a>,
    streams: &'a [Stream<'a>],
    n: usize,
) -> Vec<ColdReplay<'a>> {
    fn first<A: Allocator>(mut a: A, w: &Workload) -> f64 {
        ns_per_op(timed_replay(&mut a, w), w)
    }
    vec![
        (
            "soma",
            Box::new(move |w: &Workload| first(SomaApi::new(&common::soma_pool(dev, false), s), w)),
        ),
        (
            "soma-4-streams",
            Box::new(move |w: &Workload| {
                first(
                    SomaStreams::new(&common::soma_pool(dev, false), streams, "soma-4-streams"),
                    w,
                )
            }),
        ),
        (
            "soma-recycle",
            Box::new(move |w: &Workload| {
                first(SomaApi::named(&common::soma_pool(dev, true), s, "soma-recycle"), w)
            }),
        ),
        ("soma-engine", Box::new(|w: &Workload| first(SomaEngine::new(RANGE, 512), w))),
        (
            "soma-engine-recycle",
            Box::new(|w: &Workload| first(SomaEngine::with_recycling(RANGE, 512, true), w)),
        ),
        (
            "offset-allocator",
            Box::new(move |w: &Workload| first(OffsetAlloc::new(RANGE, (2 * n + 1024) as u32), w)),
        ),
        ("tlsf", Box::new(|w: &Workload| first(Tlsf::new(RANGE), w))),
        ("soma-replica", Box::new(|w: &Workload| first(SomaReplica::new(1 << 46), w))),
        ("torch-npu", Box::new(|w: &Workload| first(TorchNpu::new(RANGE), w))),
        ("llama-cpp", Box::new(|w: &Workload| first(LlamaCppPrio::new(), w))),
    ]
}

/// The previous run's JSON array at `<out_dir>/<name>.json` (empty when absent or invalid).
fn previous(name: &str) -> Vec<Value> {
    std::fs::read_to_string(common::out_dir().join(format!("{name}.json")))
        .ok()
        .and_then(|s| serde_json::from_str::<Vec<Value>>(&s).ok())
        .unwrap_or_default()
}

/// Writes both JSON files. With a benchmark filter, pairs this run did not measure keep the
/// previous run's figures.
fn write(workloads: &[(String, Value)], facts: Facts) {
    let merge = common::filtered();
    let old: BTreeMap<String, Value> = if merge {
        previous("random_allocations")
            .into_iter()
            .filter_map(|c| Some((c.get("cell")?.as_str()?.to_owned(), c)))
            .collect()
    } else {
        BTreeMap::new()
    };
    let mut cells = Vec::new();
    for (cell, workload) in workloads {
        let mut obj = match old.get(cell) {
            Some(Value::Object(o)) => o.clone(),
            _ => Map::new(),
        };
        if let Value::Object(w) = workload {
            obj.extend(w.clone());
        }
        let new = facts.cells.get(cell);
        for key in MAPS {
            let mut m = match obj.remove(key) {
                Some(Value::Object(m)) => m,
                _ => Map::new(),
            };
            if let Some(n) = new.and_then(|n| n.get(key)) {
                m.extend(n.clone());
            }
            obj.insert(key.to_owned(), Value::Object(m));
        }
        cells.push(Value::Object(obj));
    }
    let mut slow: Vec<Value> = if merge {
        previous("random_allocations_slow")
            .into_iter()
            .filter(|e| {
                let key = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                !facts.measured.contains(&(key("allocator"), key("cell")))
            })
            .collect()
    } else {
        Vec::new()
    };
    slow.extend(facts.slow);
    let lines = |v: &[Value]| {
        let rows: Vec<String> = v.iter().map(Value::to_string).collect();
        format!("[{}]\n", rows.join(",\n"))
    };
    common::write_json("random_allocations", &lines(&cells));
    common::write_json("random_allocations_slow", &lines(&slow));
}

fn random(c: &mut Criterion) {
    let npu = common::npu();
    let dev = npu.device(0).expect("device");
    let s = dev.create_stream().expect("stream");
    let streams: Vec<Stream<'_>> = (0..4).map(|_| dev.create_stream().expect("stream")).collect();
    common::write_cost_model();
    let mut facts = Facts::default();
    let mut workloads = Vec::new();
    let mut g = c.benchmark_group("random_allocations");
    g.sampling_mode(common::REPLAY_SAMPLING);
    for n in NS {
        for max in MAX_SIZES_MIB {
            let w = random_allocations(n, max, MAX_USAGE_MIB, SEED);
            let cell = format!("{n}x{max}");
            workloads.push((
                cell.clone(),
                json!({
                    "cell": cell,
                    "n": n,
                    "max_size_mib": max,
                    "ops": w.ops.len(),
                    "allocs": w.stats.allocs,
                    "peak_live_bytes": w.stats.peak_live_bytes,
                    "max_live_count": w.stats.max_live_count,
                }),
            ));
            // The public API: one pool per cell, reused by every replay (pool creation is
            // not timed).
            let pool = common::soma_pool(&dev, false);
            let pool4 = common::soma_pool(&dev, false);
            let recycling = common::soma_pool(&dev, true);
            let mut api = SomaApi::new(&pool, &s);
            let mut api4 = SomaStreams::new(&pool4, &streams, "soma-4-streams");
            let mut api_recycle = SomaApi::named(&recycling, &s, "soma-recycle");
            let mut engine = SomaEngine::new(RANGE, 512);
            let mut engine_recycle = SomaEngine::with_recycling(RANGE, 512, true);
            let mut offset = OffsetAlloc::new(RANGE, (2 * n + 1024) as u32);
            let mut tlsf = Tlsf::new(RANGE);
            let mut replica = SomaReplica::new(1 << 46);
            let mut torch = TorchNpu::new(RANGE);
            let mut llama = LlamaCppPrio::new();
            bench(&mut g, &mut facts, &cell, &w, &mut api);
            bench(&mut g, &mut facts, &cell, &w, &mut api4);
            bench(&mut g, &mut facts, &cell, &w, &mut api_recycle);
            bench(&mut g, &mut facts, &cell, &w, &mut engine);
            bench(&mut g, &mut facts, &cell, &w, &mut engine_recycle);
            bench(&mut g, &mut facts, &cell, &w, &mut offset);
            bench(&mut g, &mut facts, &cell, &w, &mut tlsf);
            bench(&mut g, &mut facts, &cell, &w, &mut replica);
            bench(&mut g, &mut facts, &cell, &w, &mut torch);
            bench(&mut g, &mut facts, &cell, &w, &mut llama);
            if n <= 10_000 || max >= 64 {
                bench(&mut g, &mut facts, &cell, &w, &mut FirstFit::new(RANGE));
            }
            if n <= 10_000 {
                let mut d = DriverPath::new(&**dev.hal(), dev.info().granularity);
                bench(&mut g, &mut facts, &cell, &w, &mut d);
            }
            interleaved(
                &mut facts,
                &cell,
                &w,
                &mut [
                    &mut api,
                    &mut api4,
                    &mut api_recycle,
                    &mut engine,
                    &mut engine_recycle,
                    &mut offset,
                    &mut tlsf,
                    &mut replica,
                    &mut torch,
                    &mut llama,
                ],
            );
            cold_rounds(&mut facts, &cell, &w, &mut fresh_allocators(&dev, &s, &streams, n));
        }
    }
    g.finish();
    for st in std::iter::once(&s).chain(&streams) {
        st.synchronize().expect("sync");
    }
    write(&workloads, facts);
}

fn config() -> Criterion {
    common::replay_config()
}

criterion_group! { name = benches; config = config(); targets = random }
criterion_main!(benches);
