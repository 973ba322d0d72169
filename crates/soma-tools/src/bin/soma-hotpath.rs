//! `soma-hotpath`: runs the hot-path pair (alloc + free of 4 KiB, one stream) `PAIRS` times
//! on one allocator with `LIVE` other live blocks (the checkerboard of the hot-path bench),
//! for profilers. Instruction counts per pair are the difference of two runs with different
//! `PAIRS`, divided by the difference:
//!
//! ```text
//! valgrind --tool=callgrind soma-hotpath soma 64 100000
//! soma-hotpath ALLOCATOR LIVE PAIRS     # ALLOCATOR: soma | soma-owned | soma-engine | offset-allocator | tlsf | torch-npu | llama-cpp
//! soma-hotpath random ALLOCATOR N MAX_MIB [REPLAYS]   # RMM random_allocations replays instead
//!                                                     # (also torch-npu | llama-cpp | soma-replica)
//! ```
//!
//! `random` replays the sequence `REPLAYS` times (default 1) on the same allocator, as RMM's
//! benchmark does (the first replay grows it, later ones run warm); the instructions of one
//! warm replay are the difference of two runs with different `REPLAYS`.
//!
//! `soma-handles` runs the same replays on the engine with handles as large as a `PoolAlloc`
//! (a separate binary, so that its extra callers of the engine do not change what the
//! compiler inlines here).

use std::hint::black_box;
use std::time::Instant;

use soma::MemPool;
use soma_tools::baselines::{
    Allocator, LlamaCppPrio, OffsetAlloc, SomaApi, SomaEngine, SomaOwned, SomaReplica, Tlsf,
    TorchNpu,
};
use soma_tools::workload::{checkerboard, print_random_replays as random, replay};

fn pairs<A: Allocator>(mut a: A, live: usize, n: u64) {
    let w = checkerboard(live, 512);
    let handles = replay(&mut a, &w.ops, w.slots);
    let t = Instant::now();
    for _ in 0..n {
        let h = a.alloc(black_box(4096)).expect("alloc");
        a.free(black_box(h));
    }
    let ns = t.elapsed().as_nanos() as f64 / n.max(1) as f64;
    println!("{}: {n} pairs with {live} live blocks: {ns:.1} ns/pair", a.name());
    drop(handles);
}

/// The software NPU's memory: `SOMA_HOTPATH_CAPACITY_MIB`, else `default_mib` (valgrind
/// cannot reserve the default address space of the random replays: use 32768 there).
fn capacity(default_mib: u64) -> u64 {
    std::env::var("SOMA_HOTPATH_CAPACITY_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(default_mib)
        << 20
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("random") {
        let (which, n, max, replays) = match args.as_slice() {
            [_, which, n, max] => (which, n, max, "1"),
            [_, which, n, max, replays] => (which, n, max, replays.as_str()),
            _ => {
                eprintln!(
                    "usage: soma-hotpath random soma[-retain]|soma-engine[-retain]|offset-allocator|tlsf|soma-replica|torch-npu|llama-cpp N MAX_MIB [REPLAYS]"
                );
                std::process::exit(2);
            }
        };
        let (n, max) = (n.parse().expect("N"), max.parse().expect("MAX_MIB"));
        let replays = replays.parse().expect("REPLAYS");
        match which.as_str() {
            "soma" | "soma-retain" => {
                let npu =
                    soma::sim::Npu::builder().capacity(capacity(512 << 10)).build().expect("npu");
                let dev = npu.device(0).expect("device");
                let s = dev.create_stream().expect("stream");
                let recycle = which == "soma";
                let pool = MemPool::builder().recycle_on_growth(recycle).build(&dev).expect("pool");
                let name = if recycle { "soma" } else { "soma-retain" };
                random(SomaApi::named(&pool, &s, name), n, max, replays);
            }
            "soma-engine" => random(SomaEngine::new(1 << 40, 512), n, max, replays),
            "soma-engine-retain" => {
                random(SomaEngine::with_recycling(1 << 40, 512, false), n, max, replays)
            }
            "offset-allocator" => {
                random(OffsetAlloc::new(1 << 40, (2 * n + 1024) as u32), n, max, replays)
            }
            "soma-replica" => random(SomaReplica::new(1 << 46), n, max, replays),
            "torch-npu" => random(TorchNpu::new(1 << 40), n, max, replays),
            "llama-cpp" => random(LlamaCppPrio::new(), n, max, replays),
            _ => random(Tlsf::new(1 << 40), n, max, replays),
        }
        return;
    }
    let [which, live, n] = args.as_slice() else {
        eprintln!(
            "usage: soma-hotpath soma|soma-owned|soma-engine|offset-allocator|tlsf|torch-npu|llama-cpp LIVE PAIRS"
        );
        std::process::exit(2);
    };
    let live: usize = live.parse().expect("LIVE");
    let n: u64 = n.parse().expect("PAIRS");
    const RANGE: u64 = 1 << 40;
    match which.as_str() {
        "soma" => {
            let npu = soma::sim::Npu::builder().capacity(capacity(8192)).build().expect("npu");
            let dev = npu.device(0).expect("device");
            let s = dev.create_stream().expect("stream");
            let pool = MemPool::builder().build(&dev).expect("pool");
            pairs(SomaApi::new(&pool, &s), live, n);
        }
        "soma-owned" => {
            let npu = soma::sim::Npu::builder().capacity(capacity(8192)).build().expect("npu");
            let dev = npu.device(0).expect("device");
            let s = dev.create_owned_stream().expect("stream");
            let pool = MemPool::builder().build_owned(&dev).expect("pool");
            pairs(SomaOwned::new(pool, s), live, n);
        }
        "soma-engine" => pairs(SomaEngine::new(RANGE, 512), live, n),
        "offset-allocator" => pairs(OffsetAlloc::new(RANGE, (2 * live + 1024) as u32), live, n),
        "tlsf" => pairs(Tlsf::new(RANGE), live, n),
        "torch-npu" => pairs(TorchNpu::new(RANGE), live, n),
        "llama-cpp" => pairs(LlamaCppPrio::new(), live, n),
        other => {
            eprintln!("unknown allocator {other}");
            std::process::exit(2);
        }
    }
}
