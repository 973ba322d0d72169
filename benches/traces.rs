//! Figure 3 — the real PyTorch allocator traces of `data/traces/` (`$SOMA_TRACES` names
//! another directory; `.csv` and `.csv.gz`), replayed on every allocator.
//!
//! Time: one criterion iteration = one whole replay on a fresh allocator; the time reported
//! is divided by the trace's number of ops (ns per op). Ids: `trace/<allocator>/<trace>`.
//! Unlike `random_allocations` (RMM's warm methodology), every criterion iteration here is on
//! a fresh allocator: a trace is one program run, so cold is what it measures.
//!
//! Interleaved rounds: after criterion, every allocator runs [`common::ROUNDS`] rounds, the
//! order rotating from round to round; in each round it is built fresh, replays the trace
//! once (cold), frees what the trace leaves live and replays it again (warm: the same
//! program run again on the same allocator). Recorded per trace as
//! `paired_cold_ns_per_op` / `paired_warm_ns_per_op` (allocator → ns per op of each round).
//!
//! Memory and driver calls: one cold and one warm replay per allocator, outside any timing,
//! write `<target>/soma-bench/traces.json` (or `$SOMA_TRACES_JSON.json`): per allocator the
//! peak reserved after the cold replay (`peak_reserved`, defined per allocator in
//! `soma_tools::baselines`) and after the warm one (`warm_peak_reserved`), the driver calls
//! of each replay by kind (`cold_driver_calls`, `warm_driver_calls`) and their modelled time
//! per op (`cold_driver_ns_per_op`, `warm_driver_ns_per_op`; per-call costs in
//! `driver_cost_model.json`); for soma its own peak used and fragmentation too; per trace
//! its peak live requested bytes. Fragmentation = peak reserved / peak live requested bytes
//! (the same denominator for every allocator; soma's own `PoolStats::fragmentation` divides
//! by its rounded peak used).
//!
//! Allocators: the baselines (the replicas of torch_npu's and llama.cpp's pools among them),
//! `soma` (public API, one stream, default pool), `soma-4-streams` (ops on 4 streams in turn,
//! cross-stream frees handed off through events), `soma-engine` (default settings), and the
//! variants that recycle on growth (unmapping free segments to stay near the reserved
//! high-water mark), `soma-recycle` (a pool built with `recycle_on_growth(true)`) and
//! `soma-engine-recycle`.

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use soma::{MemPool, Stream};
use soma_tools::baselines::{
    Allocator, DriverPath, FirstFit, LlamaCppPrio, OffsetAlloc, SomaApi, SomaEngine, SomaReplica,
    SomaStreams, Tlsf, TorchNpu,
};
use soma_tools::driver_cost::DriverCostModel;
use soma_tools::trace::{default_trace_dir, find_traces, Trace};
use soma_tools::workload::{free_all, replay};

use common::RANGE;

/// One replay of `t` on `a`, what it leaves live freed afterwards (untimed); ns per op.
fn timed_replay<A: Allocator>(a: &mut A, t: &Trace) -> f64 {
    let start = Instant::now();
    let handles = replay(a, &t.ops, t.slots);
    let d = start.elapsed();
    free_all(a, handles);
    d.as_nanos() as f64 / t.ops.len() as f64
}

/// Times replays of `t`, each on a fresh allocator from `make`, under the allocator's name.
fn bench<A: Allocator>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    t: &Trace,
    mut make: impl FnMut() -> A,
) {
    let ops = t.ops.len() as u32;
    let name = make().name();
    g.bench_function(BenchmarkId::new(name, &t.name), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut a = make();
                let start = Instant::now();
                let handles = replay(&mut a, &t.ops, t.slots);
                total += start.elapsed();
                free_all(&mut a, handles);
            }
            total / ops
        })
    });
}

/// A cold and a warm replay for the memory and driver figures:
/// `"name":{"peak_reserved":…,…}`, with `extra(&a)` appended inside the object.
fn memory<A: Allocator>(mut a: A, t: &Trace, extra: impl FnOnce(&A) -> String) -> String {
    let model = DriverCostModel::ascend_like();
    let ops = t.ops.len() as u64;
    let start = a.driver_calls();
    let handles = replay(&mut a, &t.ops, t.slots);
    let cold = a.driver_calls() - start;
    let cold_reserved = a.reserved_high();
    let more = extra(&a);
    free_all(&mut a, handles);
    let before_warm = a.driver_calls();
    let handles = replay(&mut a, &t.ops, t.slots);
    let warm = a.driver_calls() - before_warm;
    free_all(&mut a, handles);
    format!(
        "\"{}\":{{\"peak_reserved\":{cold_reserved},\"warm_peak_reserved\":{},\
         \"cold_driver_calls\":{},\"warm_driver_calls\":{},\"cold_driver_ns_per_op\":{:.1},\
         \"warm_driver_ns_per_op\":{:.1}{more}}}",
        a.name(),
        a.reserved_high(),
        cold.to_json(),
        warm.to_json(),
        model.ns_per_op(&cold, ops),
        model.ns_per_op(&warm, ops)
    )
}

/// No extra figures.
fn none<A>(_: &A) -> String {
    String::new()
}

/// An allocator of the interleaved rounds: its name and a function that builds one fresh
/// and returns the ns per op of its cold and warm replays of the trace.
type Fresh<'a> = (&'static str, Box<dyn FnMut(&Trace) -> (f64, f64) + 'a>);

/// Every allocator of the figure, as [`Fresh`] builders.
fn allocators<'a>(
    dev: &'a soma::Device,
    s: &'a Stream<'a>,
    streams: &'a [Stream<'a>],
    max_allocs: u32,
) -> Vec<Fresh<'a>> {
    fn cold_warm<A: Allocator>(mut a: A, t: &Trace) -> (f64, f64) {
        (timed_replay(&mut a, t), timed_replay(&mut a, t))
    }
    vec![
        (
            "soma",
            Box::new(move |t: &Trace| {
                cold_warm(SomaApi::new(&common::soma_pool(dev, false), s), t)
            }),
        ),
        (
            "soma-4-streams",
            Box::new(move |t: &Trace| {
                cold_warm(
                    SomaStreams::new(&common::soma_pool(dev, false), streams, "soma-4-streams"),
                    t,
                )
            }),
        ),
        (
            "soma-recycle",
            Box::new(move |t: &Trace| {
                cold_warm(SomaApi::named(&common::soma_pool(dev, true), s, "soma-recycle"), t)
            }),
        ),
        ("soma-engine", Box::new(|t: &Trace| cold_warm(SomaEngine::new(RANGE, 512), t))),
        (
            "soma-engine-recycle",
            Box::new(|t: &Trace| cold_warm(SomaEngine::with_recycling(RANGE, 512, true), t)),
        ),
        (
            "offset-allocator",
            Box::new(move |t: &Trace| cold_warm(OffsetAlloc::new(RANGE, max_allocs), t)),
        ),
        ("tlsf", Box::new(|t: &Trace| cold_warm(Tlsf::new(RANGE), t))),
        ("soma-replica", Box::new(|t: &Trace| cold_warm(SomaReplica::new(1 << 46), t))),
        ("torch-npu", Box::new(|t: &Trace| cold_warm(TorchNpu::new(RANGE), t))),
        ("llama-cpp", Box::new(|t: &Trace| cold_warm(LlamaCppPrio::new(), t))),
        ("first-fit", Box::new(|t: &Trace| cold_warm(FirstFit::new(RANGE), t))),
        (
            "driver",
            Box::new(move |t: &Trace| {
                cold_warm(DriverPath::new(&**dev.hal(), dev.info().granularity), t)
            }),
        ),
    ]
}

/// `"paired_cold_ns_per_op":{…},"paired_warm_ns_per_op":{…}` of [`common::interleaved_rounds`]
/// over `fresh` (empty when a filter selects fewer than two of them).
fn rounds(t: &Trace, fresh: &mut [Fresh<'_>]) -> String {
    let mut chosen: Vec<&mut Fresh<'_>> = fresh
        .iter_mut()
        .filter(|(name, _)| common::maybe_selected(&format!("trace/{name}/{}", t.name)))
        .collect();
    if chosen.len() < 2 {
        return String::new();
    }
    let mut warm: Vec<Vec<f64>> = vec![Vec::new(); chosen.len()];
    let cold = common::interleaved_rounds(chosen.len(), |j| {
        let (c, w) = (chosen[j].1)(t);
        warm[j].push(w);
        c
    });
    let list = |v: &[f64]| v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(",");
    let map = |figures: &[Vec<f64>]| {
        let entries: Vec<String> = chosen
            .iter()
            .zip(figures)
            .map(|((name, _), v)| format!("\"{name}\":[{}]", list(v)))
            .collect();
        entries.join(",")
    };
    println!("trace/{}: {} interleaved rounds of {} allocators", t.name, cold[0].len(), cold.len());
    format!(
        ",\"paired_cold_ns_per_op\":{{{}}},\"paired_warm_ns_per_op\":{{{}}}",
        map(&cold),
        map(&warm)
    )
}

fn traces(c: &mut Criterion) {
    let dir = default_trace_dir(&common::repo_root());
    let paths = find_traces(&dir).unwrap_or_else(|reason| panic!("trace benchmarks: {reason}"));
    let npu = common::npu();
    let dev = npu.device(0).expect("device");
    let s = dev.create_stream().expect("stream");
    let streams: Vec<Stream<'_>> = (0..4).map(|_| dev.create_stream().expect("stream")).collect();
    common::write_cost_model();
    let mut g = c.benchmark_group("trace");
    g.sampling_mode(common::REPLAY_SAMPLING);
    let mut out = Vec::new();
    for p in &paths {
        let t = match Trace::load(p) {
            Ok(t) => t,
            Err(e) => {
                println!("skipped {}: {e}", p.display());
                continue;
            }
        };
        // Memory and driver figures first (untimed).
        let mut entries = Vec::new();
        let soma_extra = |pool: &MemPool<'_>| {
            let st = pool.stats();
            format!(
                ",\"peak_used\":{},\"own_fragmentation\":{:.4}",
                st.used_high,
                st.fragmentation()
            )
        };
        for (recycle, name) in [(false, "soma"), (true, "soma-recycle")] {
            let pool = common::soma_pool(&dev, recycle);
            entries.push(memory(SomaApi::named(&pool, &s, name), &t, |_| soma_extra(&pool)));
        }
        let pool = common::soma_pool(&dev, false);
        entries.push(memory(SomaStreams::new(&pool, &streams, "soma-4-streams"), &t, |_| {
            soma_extra(&pool)
        }));
        for engine in [SomaEngine::new(RANGE, 512), SomaEngine::with_recycling(RANGE, 512, true)] {
            entries.push(memory(engine, &t, |e| format!(",\"peak_used\":{}", e.stats().used_high)));
        }
        let max_allocs = (t.stats.max_live_count * 2 + 1024) as u32;
        entries.push(memory(OffsetAlloc::new(RANGE, max_allocs), &t, none));
        entries.push(memory(Tlsf::new(RANGE), &t, none));
        entries.push(memory(SomaReplica::new(1 << 46), &t, none));
        entries.push(memory(TorchNpu::new(RANGE), &t, none));
        entries.push(memory(LlamaCppPrio::new(), &t, none));
        entries.push(memory(FirstFit::new(RANGE), &t, none));
        entries.push(memory(DriverPath::new(&**dev.hal(), dev.info().granularity), &t, none));

        // Time: criterion (cold), then the interleaved rounds (cold and warm).
        bench_api(&mut g, &t, &dev, &s, false);
        bench_api(&mut g, &t, &dev, &s, true);
        bench(&mut g, &t, || SomaEngine::new(RANGE, 512));
        bench(&mut g, &t, || SomaEngine::with_recycling(RANGE, 512, true));
        bench(&mut g, &t, || OffsetAlloc::new(RANGE, max_allocs));
        bench(&mut g, &t, || Tlsf::new(RANGE));
        bench(&mut g, &t, || SomaReplica::new(1 << 46));
        bench(&mut g, &t, || TorchNpu::new(RANGE));
        bench(&mut g, &t, LlamaCppPrio::new);
        bench(&mut g, &t, || FirstFit::new(RANGE));
        bench(&mut g, &t, || DriverPath::new(&**dev.hal(), dev.info().granularity));
        let paired = rounds(&t, &mut allocators(&dev, &s, &streams, max_allocs));

        out.push(format!(
            "{{\"trace\":\"{}\",\"ops\":{},\"allocs\":{},\"peak_live_requested\":{},\
             \"max_live_count\":{},\"allocators\":{{{}}}{paired}}}",
            t.name,
            t.ops.len(),
            t.stats.allocs,
            t.stats.peak_live_bytes,
            t.stats.max_live_count,
            entries.join(",")
        ));
    }
    g.finish();
    for st in std::iter::once(&s).chain(&streams) {
        st.synchronize().expect("sync");
    }
    // `$SOMA_TRACES_JSON` names the file (without `.json`) for a second set of traces, so
    // that it does not overwrite the bundled traces' figures.
    let name = std::env::var("SOMA_TRACES_JSON").unwrap_or_else(|_| "traces".into());
    common::write_json(&name, &format!("[{}]\n", out.join(",\n")));
}

/// Times replays of `t` through the public API, each on a fresh pool: the default one, or
/// with `recycle` one built with `recycle_on_growth(true)` (pool creation is not timed).
fn bench_api<'d>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    t: &Trace,
    dev: &'d soma::Device,
    s: &soma::Stream<'d>,
    recycle: bool,
) {
    let name = if recycle { "soma-recycle" } else { "soma" };
    g.bench_function(BenchmarkId::new(name, &t.name), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let pool = common::soma_pool(dev, recycle);
                let mut a = SomaApi::named(&pool, s, name);
                let start = Instant::now();
                let handles = replay(&mut a, &t.ops, t.slots);
                total += start.elapsed();
                free_all(&mut a, handles);
            }
            total / t.ops.len() as u32
        })
    });
}

fn config() -> Criterion {
    common::replay_config()
}

criterion_group! { name = benches; config = config(); targets = traces }
criterion_main!(benches);
