//! Figure 3 — the real PyTorch allocator traces of `data/traces/` (`$SOMA_TRACES` names
//! another directory; `.csv` and `.csv.gz`), replayed on every allocator.
//!
//! Time: one criterion iteration = one whole replay on a fresh allocator; the time reported
//! is divided by the trace's number of ops (ns per op). Ids: `trace/<allocator>/<trace>`.
//! Memory: one more replay per allocator writes `<target>/soma-bench/traces.json` (or
//! `$SOMA_TRACES_JSON.json`) with peak reserved (defined per allocator in
//! `soma_tools::baselines`), the trace's peak live requested bytes, soma's own peak used
//! (rounded sizes) and driver map / unmap calls.
//! Allocators: the baselines, `soma` and `soma-engine`, and their variants without
//! recycling on growth, `soma-retain` (a pool built with `recycle_on_growth(false)`) and
//! `soma-engine-retain`. Unlike `random_allocations` (RMM's warm methodology), every replay
//! here is on a fresh allocator: a trace is one program run, so cold is what it measures.
//! Fragmentation = peak reserved / peak live requested bytes (the same denominator for
//! every allocator; soma's own `PoolStats::fragmentation` divides by its rounded peak used).

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use soma::MemPool;
use soma_tools::baselines::{
    Allocator, DriverPath, FirstFit, OffsetAlloc, SomaApi, SomaEngine, SomaReplica, Tlsf,
};
use soma_tools::trace::{default_trace_dir, find_traces, Trace};
use soma_tools::workload::{free_all, replay};

use common::RANGE;

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

/// Times replays of `t` through the public API, each on a fresh pool (`recycle`: built with
/// `recycle_on_growth(recycle)`; pool creation is not timed).
fn bench_api<'d>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    t: &Trace,
    dev: &'d soma::Device,
    s: &soma::Stream<'d>,
    recycle: bool,
) {
    let name = if recycle { "soma" } else { "soma-retain" };
    g.bench_function(BenchmarkId::new(name, &t.name), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let pool = MemPool::builder().recycle_on_growth(recycle).build(dev).expect("pool");
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

/// One replay for the memory figures: `"name":{"peak_reserved":…}`.
fn memory<A: Allocator>(mut a: A, t: &Trace, extra: impl FnOnce(&A) -> String) -> String {
    let handles = replay(&mut a, &t.ops, t.slots);
    let json = format!("\"{}\":{{\"peak_reserved\":{}{}}}", a.name(), a.reserved_high(), extra(&a));
    free_all(&mut a, handles);
    json
}

fn traces(c: &mut Criterion) {
    let dir = default_trace_dir(&common::repo_root());
    let paths = find_traces(&dir).unwrap_or_else(|reason| panic!("trace benchmarks: {reason}"));
    let npu = common::npu();
    let dev = npu.device(0).expect("device");
    let s = dev.create_stream().expect("stream");
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
        // Memory figures first (one replay each).
        let mut entries = Vec::new();
        for (recycle, name) in [(true, "soma"), (false, "soma-retain")] {
            let pool = MemPool::builder().recycle_on_growth(recycle).build(&dev).expect("pool");
            entries.push(memory(SomaApi::named(&pool, &s, name), &t, |_| {
                let st = pool.stats();
                format!(
                    ",\"peak_used\":{},\"map_calls\":{},\"unmap_calls\":{},\"own_fragmentation\":{:.4}",
                    st.used_high,
                    st.map_calls,
                    st.unmap_calls,
                    st.fragmentation()
                )
            }));
        }
        for recycle in [true, false] {
            entries.push(memory(SomaEngine::with_recycling(RANGE, 512, recycle), &t, |e| {
                let st = e.stats();
                format!(
                    ",\"peak_used\":{},\"map_calls\":{},\"unmap_calls\":{}",
                    st.used_high, st.map_calls, st.unmap_calls
                )
            }));
        }
        let max_allocs = (t.stats.max_live_count * 2 + 1024) as u32;
        entries.push(memory(OffsetAlloc::new(RANGE, max_allocs), &t, |_| String::new()));
        entries.push(memory(Tlsf::new(RANGE), &t, |_| String::new()));
        entries.push(memory(SomaReplica::new(1 << 46), &t, |_| String::new()));
        entries.push(memory(FirstFit::new(RANGE), &t, |_| String::new()));
        entries.push(memory(DriverPath::new(&**dev.hal(), dev.info().granularity), &t, |_| {
            String::new()
        }));
        out.push(format!(
            "{{\"trace\":\"{}\",\"ops\":{},\"allocs\":{},\"peak_live_requested\":{},\
             \"max_live_count\":{},\"allocators\":{{{}}}}}",
            t.name,
            t.ops.len(),
            t.stats.allocs,
            t.stats.peak_live_bytes,
            t.stats.max_live_count,
            entries.join(",")
        ));

        // Time.
        bench_api(&mut g, &t, &dev, &s, true);
        bench_api(&mut g, &t, &dev, &s, false);
        bench(&mut g, &t, || SomaEngine::new(RANGE, 512));
        bench(&mut g, &t, || SomaEngine::with_recycling(RANGE, 512, false));
        bench(&mut g, &t, || OffsetAlloc::new(RANGE, max_allocs));
        bench(&mut g, &t, || Tlsf::new(RANGE));
        bench(&mut g, &t, || SomaReplica::new(1 << 46));
        bench(&mut g, &t, || FirstFit::new(RANGE));
        bench(&mut g, &t, || DriverPath::new(&**dev.hal(), dev.info().granularity));
    }
    g.finish();
    // `$SOMA_TRACES_JSON` names the file (without `.json`) for a second set of traces, so
    // that it does not overwrite the bundled traces' figures.
    let name = std::env::var("SOMA_TRACES_JSON").unwrap_or_else(|_| "traces".into());
    common::write_json(&name, &format!("[{}]\n", out.join(",\n")));
}

fn config() -> Criterion {
    common::replay_config()
}

criterion_group! { name = benches; config = config(); targets = traces }
criterion_main!(benches);
