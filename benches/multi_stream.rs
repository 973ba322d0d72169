//! Figure 4 — multi-stream: 4 threads, each with its own stream, allocating and freeing
//! concurrently from one pool through the public API, versus the same loop on 1 thread.
//!
//! Each thread replays its own RMM-style random sequence (sizes 1 B … 1 MiB, ≤ 256 MiB live
//! per thread, 4 096 allocations, its own seed), cyclically. Every 64 ops a thread's stream
//! waits on its neighbour's stream (`wait_stream`: an event recorded there, waited on here),
//! so blocks the neighbour freed before that point become reusable here (rule 2, follow
//! event dependencies; opportunistic reuse is switched off so that events are what allows
//! cross-stream reuse). The pool's reuse counters are written to
//! `<target>/soma-bench/multi_stream.json` to show that cross-stream reuse happened.
//!
//! The same two loops run on a pool split into 4 stream shards
//! (`MemPoolBuilder::stream_shards(4)`: one engine and lock per stream here, reuse across
//! shards before growth).
//!
//! One criterion iteration = one op on every thread; the time reported is wall time / (ops
//! of all threads): aggregate ns per op. Ids: `multi_stream/threads/<1|4>` (default pool)
//! and `multi_stream/sharded/<1|4>`.
//!
//! Interleaved rounds: after criterion, the four loops run again in [`common::ROUNDS`] rounds of
//! [`ROUND_OPS`] ops per thread each, in an order that rotates from round to round, so that
//! a ratio of two loops can be taken within one round (the same minutes of a shared
//! machine) instead of between criterion means measured minutes apart. Recorded in
//! `<target>/soma-bench/multi_stream_paired.json`: loop id → aggregate ns per op of each
//! round, in round order.

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use soma::{MemPool, PoolAlloc, ReusePolicy, Stream};
use soma_tools::trace::Op;
use soma_tools::workload::{random_allocations, Workload, SEED};

const THREADS: usize = 4;
const WAIT_EVERY: u64 = 64;
/// Ops per thread in one loop of a round.
const ROUND_OPS: u64 = 40_000;

fn thread_loop(pool: &MemPool<'_>, streams: &[Stream<'_>], i: usize, w: &Workload, iters: u64) {
    let s = &streams[i];
    let mut handles: Vec<Option<PoolAlloc<'_, u8>>> = Vec::with_capacity(w.slots);
    handles.resize_with(w.slots, || None);
    let mut k = 0;
    for n in 0..iters {
        match w.ops[k] {
            Op::Alloc { slot, bytes } => {
                handles[slot as usize] =
                    Some(pool.alloc_async::<u8>(bytes as usize, s).expect("alloc"));
            }
            Op::Free { slot } => drop(handles[slot as usize].take()),
        }
        k += 1;
        if k == w.ops.len() {
            k = 0;
        }
        if streams.len() > 1 && n % WAIT_EVERY == WAIT_EVERY - 1 {
            s.wait_stream(&streams[(i + 1) % streams.len()]).expect("wait_stream");
        }
    }
}

fn run(pool: &MemPool<'_>, streams: &[Stream<'_>], works: &[Workload], iters: u64) -> Duration {
    let start = Instant::now();
    std::thread::scope(|sc| {
        for (i, w) in works.iter().enumerate().take(streams.len()) {
            sc.spawn(move || thread_loop(pool, streams, i, w, iters));
        }
    });
    start.elapsed()
}

/// One measured loop: `streams.len()` threads on a pool of `shards` shards.
struct Loop<'d> {
    /// `threads` (the default pool) or `sharded`.
    name: &'static str,
    shards: usize,
    streams: Vec<Stream<'d>>,
    pool: MemPool<'d>,
}

impl Loop<'_> {
    /// `name/threads`, as in the benchmark id and the paired JSON.
    fn id(&self) -> String {
        format!("{}/{}", self.name, self.streams.len())
    }
}

fn multi(c: &mut Criterion) {
    let npu = common::npu();
    let dev = npu.device(0).expect("device");
    let works: Vec<Workload> =
        (0..THREADS).map(|t| random_allocations(4096, 1, 256, SEED + t as u64)).collect();
    let mut g = c.benchmark_group("multi_stream");
    let mut json = Vec::new();
    let loops: Vec<Loop<'_>> = [
        ("threads", 1, 1),
        ("threads", 1, THREADS),
        ("sharded", THREADS, 1),
        ("sharded", THREADS, THREADS),
    ]
    .into_iter()
    .map(|(name, shards, threads)| {
        let streams: Vec<Stream<'_>> =
            (0..threads).map(|_| dev.create_stream().expect("stream")).collect();
        let pool = MemPool::builder()
            .reuse(ReusePolicy::new(true, false, false))
            .stream_shards(shards)
            .build(&dev)
            .expect("pool");
        Loop { name, shards, streams, pool }
    })
    .collect();
    for Loop { name, shards, streams, pool } in &loops {
        let threads = streams.len();
        g.bench_function(BenchmarkId::new(*name, threads), |b| {
            b.iter_custom(|iters| run(pool, streams, &works, iters) / threads as u32)
        });
        let st = pool.stats();
        json.push(format!(
            "{{\"threads\":{threads},\"shards\":{shards},\"cores\":{},\"allocations\":{},\"same_stream\":{},\
             \"event_dependency\":{},\"opportunistic\":{},\"host_synchronized\":{},\"fresh\":{},\
             \"map_calls\":{},\"reserved_high\":{},\"used_high\":{}}}",
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            st.allocations,
            st.reuses.same_stream,
            st.reuses.event_dependency,
            st.reuses.opportunistic,
            st.reuses.host_synchronized,
            st.fresh_allocations,
            st.map_calls,
            st.reserved_high,
            st.used_high
        ));
    }
    g.finish();
    common::write_json("multi_stream", &format!("[{}]\n", json.join(",\n")));
    interleaved(&loops, &works);
    // Also when a filter ran fewer than two loops (no interleaved rounds).
    for s in loops.iter().flat_map(|l| &l.streams) {
        s.synchronize().expect("sync");
    }
}

/// [`common::interleaved_rounds`] over every loop the filter selects (none when fewer than
/// two are), [`ROUND_OPS`] ops per thread each.
fn interleaved(loops: &[Loop<'_>], works: &[Workload]) {
    let chosen: Vec<_> = loops
        .iter()
        .filter(|l| common::maybe_selected(&format!("multi_stream/{}", l.id())))
        .collect();
    if chosen.len() < 2 {
        return;
    }
    let ns = common::interleaved_rounds(chosen.len(), |j| {
        let l = chosen[j];
        let d = run(&l.pool, &l.streams, works, ROUND_OPS);
        d.as_nanos() as f64 / (ROUND_OPS * l.streams.len() as u64) as f64
    });
    let entries: Vec<String> = chosen
        .iter()
        .zip(&ns)
        .map(|(l, v)| {
            let v: Vec<String> = v.iter().map(|x| format!("{:.1}", x)).collect();
            format!("\"{}\":[{}]", l.id(), v.join(","))
        })
        .collect();
    common::write_json("multi_stream_paired", &format!("{{{}}}\n", entries.join(",\n")));
    println!("multi_stream: {} interleaved rounds of {} loops", ns[0].len(), ns.len());
}

fn config() -> Criterion {
    common::fast_config()
}

criterion_group! { name = benches; config = config(); targets = multi }
criterion_main!(benches);
