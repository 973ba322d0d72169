//! `soma-hotpath`: runs the hot-path pair (alloc + free of 4 KiB, one stream) `PAIRS` times
//! on one allocator with `LIVE` other live blocks (the checkerboard of the hot-path bench),
//! for profilers. Instruction counts per pair are the difference of two runs with different
//! `PAIRS`, divided by the difference:
//!
//! ```text
//! valgrind --tool=callgrind soma-hotpath soma 64 100000
//! soma-hotpath ALLOCATOR LIVE PAIRS [BLOCK]   # ALLOCATOR: soma | soma-owned | soma-engine[-retain] | offset-allocator | tlsf | torch-npu | llama-cpp
//! soma-hotpath random ALLOCATOR N MAX_MIB [REPLAYS]   # RMM random_allocations replays instead
//!                                                     # (also soma-recycle | soma-engine-recycle |
//!                                                     #  torch-npu | llama-cpp | soma-replica)
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

use clap::{Parser, Subcommand, ValueEnum};
use soma::MemPool;
use soma_tools::baselines::{
    Allocator, LlamaCppPrio, OffsetAlloc, SomaApi, SomaEngine, SomaOwned, SomaReplica, Tlsf,
    TorchNpu,
};
use soma_tools::workload::{checkerboard, print_random_replays as random, replay};

/// Runs the hot-path pair (alloc + free of 4 KiB, one stream) PAIRS times on one allocator
/// with LIVE other live blocks, for profilers; `random` replays RMM's random_allocations
/// instead.
///
/// Instructions per pair are the difference of two runs with different PAIRS, divided by
/// the difference (e.g. `valgrind --tool=callgrind soma-hotpath soma 64 100000`). The
/// software NPU's memory is SOMA_HOTPATH_CAPACITY_MIB when set [default: 8192 for the pair,
/// 524288 for `random`; valgrind cannot reserve the latter: use 32768 there].
#[derive(Debug, Parser)]
#[command(
    name = "soma-hotpath",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    random: Option<Random>,
    /// The allocator.
    #[arg(value_enum, required = true)]
    allocator: Option<PairsAllocator>,
    /// Live blocks around the pair (the checkerboard of the hot-path bench).
    #[arg(required = true)]
    live: Option<usize>,
    /// Alloc + free pairs to run.
    #[arg(required = true)]
    pairs: Option<u64>,
    /// Bytes of each checkerboard block: with 4096 its holes can serve the request.
    #[arg(default_value_t = 512)]
    block: u64,
}

#[derive(Debug, Subcommand)]
enum Random {
    /// Replays RMM's random_allocations sequence REPLAYS times on the same allocator, as
    /// RMM's benchmark does: the first replay grows it, later ones run warm (the
    /// instructions of one warm replay are the difference of two runs with different
    /// REPLAYS).
    Random {
        /// The allocator (`-retain`: without recycling on growth, `-recycle`: with).
        #[arg(value_enum)]
        allocator: RandomAllocator,
        /// Allocations in the sequence.
        n: usize,
        /// Largest allocation, in MiB.
        max_mib: u64,
        /// Replays of the sequence.
        #[arg(default_value_t = 1)]
        replays: usize,
    },
}

/// The allocators of the hot-path pair.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PairsAllocator {
    /// The public API (`MemPool`, `PoolAlloc`) on the software NPU.
    Soma,
    /// The owned handles (`OwnedPool`, `OwnedAlloc`) on the software NPU.
    SomaOwned,
    /// The engine alone, on a fake backing, with its default settings.
    SomaEngine,
    /// The engine alone without recycling on growth.
    SomaEngineRetain,
    /// The offset-allocator crate.
    OffsetAllocator,
    /// A TLSF allocator.
    Tlsf,
    /// The replica of torch_npu's caching allocator.
    TorchNpu,
    /// The replica of llama.cpp's CANN priority pool.
    LlamaCpp,
}

/// The allocators of the random_allocations replays.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum RandomAllocator {
    /// The public API on the software NPU, a pool with the default settings.
    Soma,
    /// The public API, a pool built with `recycle_on_growth(true)`.
    SomaRecycle,
    /// The engine alone, on a fake backing, with its default settings.
    SomaEngine,
    /// The engine alone without recycling on growth.
    SomaEngineRetain,
    /// The engine alone, recycling on growth.
    SomaEngineRecycle,
    /// The offset-allocator crate.
    OffsetAllocator,
    /// A TLSF allocator.
    Tlsf,
    /// The replica of CANN SOMA's allocator.
    SomaReplica,
    /// The replica of torch_npu's caching allocator.
    TorchNpu,
    /// The replica of llama.cpp's CANN priority pool.
    LlamaCpp,
}

fn pairs<A: Allocator>(mut a: A, live: usize, n: u64, block: u64) {
    let w = checkerboard(live, block);
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
    let cli = Cli::parse();
    if let Some(Random::Random { allocator, n, max_mib: max, replays }) = cli.random {
        match allocator {
            RandomAllocator::Soma | RandomAllocator::SomaRecycle => {
                let npu =
                    soma::sim::Npu::builder().capacity(capacity(512 << 10)).build().expect("npu");
                let dev = npu.device(0).expect("device");
                let s = dev.create_stream().expect("stream");
                let recycle = matches!(allocator, RandomAllocator::SomaRecycle);
                let pool = MemPool::builder().recycle_on_growth(recycle).build(&dev).expect("pool");
                let name = if recycle { "soma-recycle" } else { "soma" };
                random(SomaApi::named(&pool, &s, name), n, max, replays);
            }
            RandomAllocator::SomaEngine => random(SomaEngine::new(1 << 40, 512), n, max, replays),
            RandomAllocator::SomaEngineRetain => {
                random(SomaEngine::with_recycling(1 << 40, 512, false), n, max, replays)
            }
            RandomAllocator::SomaEngineRecycle => {
                random(SomaEngine::with_recycling(1 << 40, 512, true), n, max, replays)
            }
            RandomAllocator::OffsetAllocator => {
                random(OffsetAlloc::new(1 << 40, (2 * n + 1024) as u32), n, max, replays)
            }
            RandomAllocator::Tlsf => random(Tlsf::new(1 << 40), n, max, replays),
            RandomAllocator::SomaReplica => random(SomaReplica::new(1 << 46), n, max, replays),
            RandomAllocator::TorchNpu => random(TorchNpu::new(1 << 40), n, max, replays),
            RandomAllocator::LlamaCpp => random(LlamaCppPrio::new(), n, max, replays),
        }
        return;
    }
    let block = cli.block;
    let (Some(which), Some(live), Some(n)) = (cli.allocator, cli.live, cli.pairs) else {
        unreachable!("clap requires ALLOCATOR, LIVE and PAIRS without a subcommand");
    };
    const RANGE: u64 = 1 << 40;
    match which {
        PairsAllocator::Soma => {
            let npu = soma::sim::Npu::builder().capacity(capacity(8192)).build().expect("npu");
            let dev = npu.device(0).expect("device");
            let s = dev.create_stream().expect("stream");
            let pool = MemPool::builder().build(&dev).expect("pool");
            pairs(SomaApi::new(&pool, &s), live, n, block);
        }
        PairsAllocator::SomaOwned => {
            let npu = soma::sim::Npu::builder().capacity(capacity(8192)).build().expect("npu");
            let dev = npu.device(0).expect("device");
            let s = dev.create_owned_stream().expect("stream");
            let pool = MemPool::builder().build_owned(&dev).expect("pool");
            pairs(SomaOwned::new(pool, s), live, n, block);
        }
        PairsAllocator::SomaEngine => pairs(SomaEngine::new(RANGE, 512), live, n, block),
        PairsAllocator::SomaEngineRetain => {
            pairs(SomaEngine::with_recycling(RANGE, 512, false), live, n, block)
        }
        PairsAllocator::OffsetAllocator => {
            pairs(OffsetAlloc::new(RANGE, (2 * live + 1024) as u32), live, n, block)
        }
        PairsAllocator::Tlsf => pairs(Tlsf::new(RANGE), live, n, block),
        PairsAllocator::TorchNpu => pairs(TorchNpu::new(RANGE), live, n, block),
        PairsAllocator::LlamaCpp => pairs(LlamaCppPrio::new(), live, n, block),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("soma-hotpath").chain(args.iter().copied()))
    }

    #[test]
    fn parses_both_forms() {
        let pairs = parse(&["soma-owned", "64", "100000"]).unwrap();
        assert!(pairs.random.is_none());
        assert!(matches!(pairs.allocator, Some(PairsAllocator::SomaOwned)));
        assert_eq!((pairs.live, pairs.pairs, pairs.block), (Some(64), Some(100_000), 512));
        let holey = parse(&["soma-engine-retain", "64", "10", "4096"]).unwrap();
        assert!(matches!(holey.allocator, Some(PairsAllocator::SomaEngineRetain)));
        assert_eq!(holey.block, 4096);
        let random = parse(&["random", "soma-engine-retain", "1000", "4"]).unwrap();
        let Some(Random::Random { allocator, n, max_mib, replays }) = random.random else {
            panic!("random: {random:?}");
        };
        assert!(matches!(allocator, RandomAllocator::SomaEngineRetain));
        assert_eq!((n, max_mib, replays), (1000, 4, 1));
        let Some(Random::Random { replays, .. }) =
            parse(&["random", "tlsf", "10", "1", "3"]).unwrap().random
        else {
            panic!("random with REPLAYS");
        };
        assert_eq!(replays, 3);
    }

    #[test]
    fn refuses_unknown_allocators_and_missing_counts() {
        for args in [
            &["soma", "64"][..],
            &["soma-recycle", "64", "10"],
            &["random", "soma-retain", "10", "1"],
            &["random", "soma-owned", "10", "1"],
            &["random", "soma", "10"],
            &["soma", "x", "10"],
            &[],
        ] {
            assert!(parse(args).is_err(), "{args:?}");
        }
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
