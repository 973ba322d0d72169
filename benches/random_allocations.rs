//! Figure 2 — RAPIDS RMM's `random_allocations` benchmark, ported
//! ([`soma_tools::workload::random_allocations`]): `2 × n` steps, allocate with probability
//! 73 % (sizes uniform in 1 B … max_size), else free a random live allocation, live bytes
//! capped at 16 000 MiB; n ∈ {1 000, 10 000, 100 000} × max_size ∈ {1, 4, 64, 256} MiB;
//! fixed seed. The op sequence is generated before timing.
//!
//! One criterion iteration = one whole replay on a fresh allocator; the time reported is
//! that replay's time divided by its number of ops (ns per op). Ids:
//! `random_allocations/<allocator>/<n>x<max_size MiB>`.
//!
//! The driver path runs only for n ≤ 10 000 (about 6 µs per call on soma-sim: the
//! n = 100 000 cells would take minutes); the seed's first fit only where its O(free-list)
//! cost keeps one replay under ~2 s (n ≤ 10 000, and n = 100 000 with max_size ≥ 64 MiB,
//! where the byte cap keeps the list short).

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use soma::MemPool;
use soma_tools::baselines::{
    Allocator, DriverPath, OffsetAlloc, SeedFirstFit, SomaApi, SomaEngine, SomaReplica, Tlsf,
};
use soma_tools::workload::{random_allocations, replay, Workload, SEED};

use common::RANGE;

const NS: [usize; 3] = [1_000, 10_000, 100_000];
const MAX_SIZES_MIB: [u64; 4] = [1, 4, 64, 256];
const MAX_USAGE_MIB: u64 = 16_000;

/// Times one replay of `w` on a fresh allocator from `make` (ns per op).
fn once<A: Allocator>(w: &Workload, make: &mut impl FnMut() -> A) -> f64 {
    let mut a = make();
    let t = Instant::now();
    let handles = replay(&mut a, &w.ops, w.slots);
    let ns = t.elapsed().as_nanos() as f64 / w.ops.len() as f64;
    drop(handles);
    ns
}

/// Times replays of `w` on fresh allocators from `make`, reporting ns per op. A replay
/// slower than [`common::slow_replay_limit`] is timed once and recorded in `slow` instead.
fn bench<A: Allocator>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    slow: &mut Vec<String>,
    name: &str,
    cell: &str,
    w: &Workload,
    mut make: impl FnMut() -> A,
) {
    let first = once(w, &mut make);
    if first * w.ops.len() as f64 > common::slow_replay_limit().as_nanos() as f64 {
        println!("random_allocations/{name}/{cell}: one replay, {first:.0} ns/op (too slow for criterion)");
        slow.push(format!(
            "{{\"allocator\":\"{name}\",\"cell\":\"{cell}\",\"ns_per_op\":{first:.1}}}"
        ));
        return;
    }
    let ops = w.ops.len() as u32;
    g.bench_function(BenchmarkId::new(name, cell), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut a = make();
                let t = Instant::now();
                let handles = replay(&mut a, &w.ops, w.slots);
                total += t.elapsed();
                debug_assert!(handles.iter().all(Option::is_none));
                drop(handles);
                drop(a);
            }
            total / ops
        })
    });
}

fn random(c: &mut Criterion) {
    let npu = common::npu();
    let dev = npu.device(0).expect("device");
    let s = dev.create_stream().expect("stream");
    let mut slow: Vec<String> = Vec::new();
    let mut g = c.benchmark_group("random_allocations");
    g.sampling_mode(common::REPLAY_SAMPLING);
    let mut cells = Vec::new();
    for n in NS {
        for max in MAX_SIZES_MIB {
            let w = random_allocations(n, max, MAX_USAGE_MIB, SEED);
            let cell = format!("{n}x{max}");
            cells.push(format!(
                "{{\"cell\":\"{cell}\",\"n\":{n},\"max_size_mib\":{max},\"ops\":{},\"allocs\":{},\
                 \"peak_live_bytes\":{},\"max_live_count\":{}}}",
                w.ops.len(),
                w.stats.allocs,
                w.stats.peak_live_bytes,
                w.stats.max_live_count
            ));
            // soma's memory and driver-call figures for the cell (one untimed replay).
            let mut e = SomaEngine::new(RANGE, 512);
            drop(replay(&mut e, &w.ops, w.slots));
            let st = e.stats();
            let mut r = Tlsf::new(RANGE);
            drop(replay(&mut r, &w.ops, w.slots));
            cells.last_mut().expect("cell").pop();
            cells.last_mut().expect("cell").push_str(&format!(
                ",\"engine_map_calls\":{},\"engine_unmap_calls\":{},\"engine_reserved_high\":{},\
                 \"tlsf_reserved_high\":{}}}",
                st.map_calls,
                st.unmap_calls,
                st.reserved_high,
                r.reserved_high()
            ));
            // The public API: a fresh pool per replay (pool creation is not timed).
            let api_once = {
                let pool = MemPool::builder().build(&dev).expect("pool");
                let mut a = SomaApi::new(&pool, &s);
                let t = Instant::now();
                drop(replay(&mut a, &w.ops, w.slots));
                t.elapsed()
            };
            if api_once > common::slow_replay_limit() {
                let ns = api_once.as_nanos() as f64 / w.ops.len() as f64;
                println!("random_allocations/soma/{cell}: one replay, {ns:.0} ns/op (too slow for criterion)");
                slow.push(format!(
                    "{{\"allocator\":\"soma\",\"cell\":\"{cell}\",\"ns_per_op\":{ns:.1}}}"
                ));
            } else {
                g.bench_function(BenchmarkId::new("soma", &cell), |b| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let pool = MemPool::builder().build(&dev).expect("pool");
                            let mut a = SomaApi::new(&pool, &s);
                            let t = Instant::now();
                            let handles = replay(&mut a, &w.ops, w.slots);
                            total += t.elapsed();
                            drop(handles);
                        }
                        total / w.ops.len() as u32
                    })
                });
            }
            bench(&mut g, &mut slow, "soma-engine", &cell, &w, || SomaEngine::new(RANGE, 512));
            bench(&mut g, &mut slow, "offset-allocator", &cell, &w, || {
                OffsetAlloc::new(RANGE, (2 * n + 1024) as u32)
            });
            bench(&mut g, &mut slow, "tlsf", &cell, &w, || Tlsf::new(RANGE));
            bench(&mut g, &mut slow, "soma-replica", &cell, &w, || SomaReplica::new(1 << 46));
            if n <= 10_000 || max >= 64 {
                bench(&mut g, &mut slow, "seed-first-fit", &cell, &w, || SeedFirstFit::new(RANGE));
            }
            if n <= 10_000 {
                bench(&mut g, &mut slow, "driver", &cell, &w, || {
                    DriverPath::new(&**dev.hal(), dev.info().granularity)
                });
            }
        }
    }
    g.finish();
    common::write_json("random_allocations", &format!("[{}]\n", cells.join(",\n")));
    common::write_json("random_allocations_slow", &format!("[{}]\n", slow.join(",\n")));
}

fn config() -> Criterion {
    common::replay_config()
}

criterion_group! { name = benches; config = config(); targets = random }
criterion_main!(benches);
