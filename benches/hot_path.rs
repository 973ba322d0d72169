//! Figure 1 — the hot path: one allocation and its free, same size, one stream, steady
//! state, with 64, 10 000 and 1 000 000 other live blocks.
//!
//! The other live blocks are a checkerboard ([`checkerboard`]): `2n` blocks of 512 B
//! allocated in a row and every other one freed, so there are `n` live blocks *and* `n` free
//! 512 B holes in front of the hot request (4 KiB, which no hole fits). A first-fit free list
//! walks the holes; segregated fits do not see them.
//!
//! Ids: `hot/<allocator>/<live blocks>`; time = one alloc + free pair.
//! The driver path runs with 64 and 10 000 live blocks only: a million 2 MiB driver
//! allocations exceed the simulated device.

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;

use std::hint::black_box;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use soma::MemPool;
use soma_tools::baselines::{
    Allocator, DriverPath, FirstFit, LlamaCppPrio, OffsetAlloc, SomaApi, SomaEngine, SomaOwned,
    SomaReplica, Tlsf, TorchNpu, UNIT,
};
use soma_tools::workload::{checkerboard, free_all, replay};

use common::RANGE;

/// Size of the hot request.
const HOT: u64 = 4096;
/// Size of the background blocks.
const BLOCK: u64 = 512;
const LIVE: [usize; 3] = [64, 10_000, 1_000_000];

fn pair<A: Allocator>(g: &mut BenchmarkGroup<'_, WallTime>, a: &mut A, live: usize) {
    g.bench_function(BenchmarkId::new(a.name(), live), |b| {
        b.iter(|| {
            let h = a.alloc(black_box(HOT)).expect("hot alloc");
            a.free(black_box(h));
        })
    });
}

/// Sets `a` up with the checkerboard, measures the pair, frees the background.
fn run<A: Allocator>(g: &mut BenchmarkGroup<'_, WallTime>, mut a: A, live: usize) {
    let w = checkerboard(live, BLOCK);
    let handles = replay(&mut a, &w.ops, w.slots);
    pair(g, &mut a, live);
    free_all(&mut a, handles);
}

fn hot(c: &mut Criterion) {
    let npu = common::npu();
    let dev = npu.device(0).expect("device");
    let s = dev.create_stream().expect("stream");
    let mut g = c.benchmark_group("hot");
    for live in LIVE {
        {
            let pool = MemPool::builder().build(&dev).expect("pool");
            run(&mut g, SomaApi::new(&pool, &s), live);
        }
        {
            let pool = MemPool::builder().build_owned(&dev).expect("pool");
            let owned = dev.create_owned_stream().expect("stream");
            run(&mut g, SomaOwned::new(pool, owned), live);
        }
        run(&mut g, SomaEngine::new(RANGE, 512), live);
        run(&mut g, OffsetAlloc::new(RANGE, (2 * live + 1024) as u32), live);
        run(&mut g, Tlsf::new(RANGE), live);
        run(&mut g, SomaReplica::new(1 << 46), live);
        run(&mut g, TorchNpu::new(RANGE), live);
        run(&mut g, LlamaCppPrio::new(), live);
        // The first-fit free list's state is built directly (a million merge passes would
        // take hours); it is the state its API reaches: n holes of 512 B at every other
        // block, then the tail.
        let holes: Vec<(u64, u64)> = (0..live as u64)
            .map(|k| (2 * k * UNIT, UNIT))
            .chain(std::iter::once((2 * live as u64 * UNIT, RANGE - 2 * live as u64 * UNIT)))
            .collect();
        let mut first_fit = FirstFit::from_free_list(holes, 2 * live as u64 * UNIT);
        pair(&mut g, &mut first_fit, live);
        drop(first_fit);
        if live <= 10_000 {
            run(&mut g, DriverPath::new(&**dev.hal(), dev.info().granularity), live);
        }
    }
    g.finish();
}

fn config() -> Criterion {
    common::fast_config()
}

criterion_group! { name = benches; config = config(); targets = hot }
criterion_main!(benches);
