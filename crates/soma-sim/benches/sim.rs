//! Benchmarks of the software NPU: task round trip, task throughput, copy throughput.
//!
//! `SOMA_BENCH_QUICK=1` shortens the measurement (for CI smoke runs and quick tables).

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use soma_sim::hal::{DeviceHal, MemRef};
use soma_sim::Npu;

const MIB: u64 = 1 << 20;

fn config() -> Criterion {
    let c = Criterion::default();
    if std::env::var("SOMA_BENCH_QUICK").is_ok_and(|v| v == "1") {
        c.warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .sample_size(10)
    } else {
        c
    }
}

fn tasks(c: &mut Criterion) {
    let dev = Npu::builder().capacity(1 << 30).build().unwrap().device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let mut g = c.benchmark_group("tasks");
    g.bench_function("host_fn_enqueue_sync_round_trip", |b| {
        b.iter(|| {
            s.host_fn(Box::new(|| {})).unwrap();
            s.synchronize().unwrap();
        })
    });
    g.throughput(Throughput::Elements(10_000));
    g.bench_function("10k_empty_host_fns_then_sync", |b| {
        b.iter(|| {
            for _ in 0..10_000 {
                s.host_fn(Box::new(|| {})).unwrap();
            }
            s.synchronize().unwrap();
        })
    });
    g.finish();
}

fn copies(c: &mut Criterion) {
    let dev = Npu::builder().capacity(1 << 30).build().unwrap().device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let mut g = c.benchmark_group("copy");
    for size in [MIB, 64 * MIB] {
        let src = dev.malloc(size).unwrap();
        let dst = dev.malloc(size).unwrap();
        dev.memset_sync(src, 1, size).unwrap();
        dev.memset_sync(dst, 0, size).unwrap();
        let host = vec![7u8; size as usize];
        g.throughput(Throughput::Bytes(size));
        g.bench_with_input(BenchmarkId::new("d2d", size / MIB), &size, |b, &n| {
            b.iter(|| {
                s.copy_d2d(dst, src, n).unwrap();
                s.synchronize().unwrap();
            })
        });
        g.bench_with_input(BenchmarkId::new("h2d", size / MIB), &size, |b, &n| {
            b.iter(|| {
                // SAFETY: `host` outlives the copy: we synchronize before the next iteration
                // and before it is dropped; nothing writes it.
                unsafe {
                    s.copy_async(MemRef::Device(dst), MemRef::Host(host.as_ptr().cast_mut()), n)
                        .unwrap();
                }
                s.synchronize().unwrap();
            })
        });
        black_box(&host);
        s.synchronize().unwrap();
        dev.free(src).unwrap();
        dev.free(dst).unwrap();
    }
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = tasks, copies }
criterion_main!(benches);
