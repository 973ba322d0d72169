//! `soma-replay`: replays one allocator trace on the software NPU through soma's public API
//! and prints what it cost.
//!
//! ```text
//! soma-replay TRACE.csv[.gz] [--alignment BYTES] [--max-size BYTES] [--release-threshold BYTES]
//!             [--streams N] [--shards S] [--sync-every K] [--capacity BYTES] [--recycle]
//!             [--replays R] [--resident] [--stream-per-replay] [--sync-per-replay] [--json]
//! ```
//!
//! The workspace's own traces are in `data/traces/` (their README gives the format), e.g.
//! `cargo run --release -p soma-tools --bin soma-replay -- data/traces/bert_base_infer.csv.gz`.
//!
//! Sizes accept `K`, `M`, `G` suffixes (powers of 1024). Without `--streams` the trace's
//! `stream` column decides: each distinct value is a stream of its own (the bundled traces
//! name one; a pool's `history_trace_csv` names the streams it saw), and an op runs on its
//! recorded stream. With `--streams N` op `k` of the trace runs on stream `k mod N`
//! instead: an allocation is made there, and a free on another stream than the allocation's
//! first hands the allocation off (an event recorded on its stream, waited on by the
//! freeing stream), so frees cross streams in stream order and their blocks are reused
//! across streams through those events. `--sync-every K` synchronizes the device every `K`
//! ops (that is where the release threshold applies); by default nothing synchronizes until
//! the end. `--recycle` builds the pool with `recycle_on_growth(true)`, `--shards S`
//! with `stream_shards(S)`. `--replays R` replays the trace `R` times on the same pool
//! (what is live at the end of a replay is freed before the next: the model unloaded and
//! loaded again); with `--resident` what the first replay leaves live (the weights, a
//! training run's optimizer state) stays allocated and later replays skip it, as a server
//! or a training loop running the model again does. With `--stream-per-replay` replay `r`
//! runs all its ops on stream `r mod N` instead of spreading them over the streams (a
//! server that runs each request on one stream and the requests on its streams in turn);
//! the frees of one replay are reused by the next through the opportunistic rule once they
//! have completed. `--sync-per-replay` synchronizes the device after each replay, once what
//! it leaves live has been freed (or kept, with `--resident`): a server that waits for each
//! request. The figures are those of the last replay, peaks over all; a table (in the JSON,
//! `replays`) gives every replay's ns per op, map and unmap calls and driver time modelled
//! with `soma_tools::driver_cost::DriverCostModel::ascend_like` (a replay's calls include
//! freeing what it leaves live and the synchronisation of `--sync-per-replay`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use soma::{MemPool, PoolAlloc, Stream};
use soma_tools::driver_cost::{DriverCalls, DriverCostModel};
use soma_tools::trace::{Op, Trace};

/// Replays one allocator trace on the software NPU through soma's public API and prints what
/// it cost: time per op, peak used and reserved memory, fragmentation, driver calls, reuses.
///
/// Sizes accept K, M, G suffixes (powers of 1024). The figures are those of the last replay,
/// peaks over all.
#[derive(Debug, Parser)]
#[command(name = "soma-replay", arg_required_else_help = true)]
struct Args {
    /// The allocation trace: CSV `op,id,bytes,stream`, gzipped or not. The workspace's own
    /// are data/traces/*.csv.gz (format in data/traces/README.md).
    #[arg(value_name = "TRACE.csv[.gz]")]
    trace: PathBuf,
    /// Alignment of every block [default: the pool's, 512 B].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    alignment: Option<u64>,
    /// Most memory the pool may hold [default: the pool's, the device's total memory].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    max_size: Option<u64>,
    /// Reserved bytes kept at a synchronization [default: the pool's, the max size].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    release_threshold: Option<u64>,
    /// Runs op k of the trace on stream k mod N; a free on another stream than its
    /// allocation's hands the allocation off first (an event recorded on its stream, waited
    /// on by the freeing stream) [default: the trace's `stream` column: one stream per
    /// distinct value, each op on its recorded stream].
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    streams: Option<usize>,
    /// Builds the pool with `stream_shards(S)`.
    #[arg(long, value_name = "S", default_value_t = 1)]
    shards: usize,
    /// Synchronizes the device every K ops of the trace (where the release threshold
    /// applies); 0: only at the end.
    #[arg(long, value_name = "K", default_value_t = 0)]
    sync_every: usize,
    /// Device memory of the software NPU.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, default_value = "64G")]
    capacity: u64,
    /// Builds the pool with `recycle_on_growth(true)` [default: the pool's, off].
    #[arg(long, overrides_with = "no_recycle")]
    recycle: bool,
    /// Builds the pool with `recycle_on_growth(false)`, the pool's default; the last of
    /// --recycle and --no-recycle counts.
    #[arg(long, overrides_with = "recycle")]
    no_recycle: bool,
    /// Replays the trace R times on the same pool; what is live at the end of a replay is
    /// freed before the next (the model unloaded and loaded again).
    #[arg(long, value_name = "R", value_parser = at_least_one, default_value_t = 1)]
    replays: usize,
    /// Keeps what the first replay leaves live (the weights, a training run's optimizer
    /// state) allocated, and later replays skip it, as a server or a training loop running
    /// the model again does [default: freed between replays].
    #[arg(long)]
    resident: bool,
    /// Runs all ops of replay r on stream r mod N instead of spreading them over the streams
    /// (a server that runs each request on one stream, its streams in turn); needs
    /// --streams [default: ops spread over the streams].
    #[arg(long, requires = "streams")]
    stream_per_replay: bool,
    /// Synchronizes the device after each replay, once what it leaves live has been freed
    /// (or kept, with --resident): a server that waits for each request [default: no
    /// synchronization between replays].
    #[arg(long)]
    sync_per_replay: bool,
    /// Prints the figures as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A byte count, with an optional `K`, `M` or `G` suffix (powers of 1024).
fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?} (bytes, with an optional K, M or G suffix)"))
}

/// A count of at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("soma-replay: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let trace = Trace::load(&args.trace)?;
    let npu = soma::sim::Npu::builder().capacity(args.capacity).build()?;
    let dev = npu.device(0)?;
    let (recorded, count) = recorded_streams(&trace.streams);
    let n = args.streams.unwrap_or(count);
    let streams: Vec<Stream<'_>> = (0..n).map(|_| dev.create_stream()).collect::<Result<_, _>>()?;
    // The stream of op `k` in replay `r`.
    let stream_of = |r: usize, k: usize| match args.streams {
        None => recorded[k],
        Some(_) if args.stream_per_replay => r % n,
        Some(_) => k % n,
    };
    let mut builder = MemPool::builder();
    if let Some(v) = args.alignment {
        builder = builder.alignment(v);
    }
    if let Some(v) = args.max_size {
        builder = builder.max_size(v);
    }
    if let Some(v) = args.release_threshold {
        builder = builder.release_threshold(v);
    }
    let pool = builder.recycle_on_growth(args.recycle).stream_shards(args.shards).build(&dev)?;
    let sim = npu.sim_device(0)?;
    let replayer = Replayer { args, trace: &trace, dev: &dev, pool: &pool, streams: &streams };
    // With `--resident`, what the first replay leaves live stays allocated and later replays
    // skip those slots: the run repeated with its weights (and a training run's optimizer
    // state) kept, as a server or a training loop does.
    let mut resident: Vec<Option<PoolAlloc<'_, u8>>> = Vec::new();
    let mut replays = Vec::with_capacity(args.replays);
    let mut last = None;
    for r in 0..args.replays {
        let pool_before = pool.stats();
        let sim_before = DriverCalls::of_sim(&sim.stats().calls);
        let mut hand_offs = 0u64;
        let skip = (args.resident && r > 0).then_some(&resident[..]);
        let on = |k| stream_of(r, k);
        let start = Instant::now();
        let handles = replayer.replay_once(&on, skip, &mut hand_offs)?;
        let elapsed = start.elapsed();
        // A replay's driver calls include its clean-up: freeing what it leaves live (or
        // keeping it, with `--resident`) and the synchronisation of `--sync-per-replay`.
        if r + 1 == args.replays {
            last = Some((since(pool.stats(), &pool_before), hand_offs, elapsed));
            drop(handles);
        } else {
            if args.resident && r == 0 {
                resident = handles;
            } else {
                drop(handles);
            }
            if args.sync_per_replay {
                dev.synchronize()?;
            }
        }
        let pool_after = pool.stats();
        replays.push(ReplayFigures {
            elapsed,
            maps: pool_after.map_calls - pool_before.map_calls,
            unmaps: pool_after.unmap_calls - pool_before.unmap_calls,
            calls: DriverCalls::of_sim(&sim.stats().calls) - sim_before,
        });
    }
    drop(resident);
    dev.synchronize()?;
    let (stats, hand_offs, elapsed) = last.expect("at least one replay");
    let measured = Measured { streams: n, elapsed, stats, hand_offs, replays };
    print_report(args, &trace, &pool, &measured)
}

/// `now`'s counters since `before` (its peaks and current figures as they are).
fn since(mut now: soma::PoolStats, before: &soma::PoolStats) -> soma::PoolStats {
    now.map_calls -= before.map_calls;
    now.unmap_calls -= before.unmap_calls;
    now.reuses.same_stream -= before.reuses.same_stream;
    now.reuses.event_dependency -= before.reuses.event_dependency;
    now.reuses.opportunistic -= before.reuses.opportunistic;
    now.reuses.internal_dependency -= before.reuses.internal_dependency;
    now.reuses.host_synchronized -= before.reuses.host_synchronized;
    now.fresh_allocations -= before.fresh_allocations;
    now
}

/// The index among the trace's distinct stream values (in order of first appearance) of
/// each op's recorded stream, and how many there are (at least 1).
fn recorded_streams(column: &[u32]) -> (Vec<usize>, usize) {
    let mut seen: Vec<u32> = Vec::new();
    let index = column
        .iter()
        .map(|s| {
            seen.iter().position(|x| x == s).unwrap_or_else(|| {
                seen.push(*s);
                seen.len() - 1
            })
        })
        .collect();
    (index, seen.len().max(1))
}

/// What every replay of a run works on: the options, the trace, the device, the pool and the
/// streams.
struct Replayer<'s, 'd> {
    args: &'s Args,
    trace: &'s Trace,
    dev: &'s soma::Device,
    pool: &'s MemPool<'d>,
    streams: &'s [Stream<'d>],
}

impl<'s, 'd> Replayer<'s, 'd> {
    /// One replay of the trace on the pool, op `k` on `streams[stream_of(k)]`; returns the
    /// allocations still live at its end and counts frees on another stream than the
    /// allocation's in `hand_offs`. The slots that are `Some` in `resident` (kept from an
    /// earlier replay) are skipped.
    fn replay_once(
        &self,
        stream_of: &dyn Fn(usize) -> usize,
        resident: Option<&[Option<PoolAlloc<'s, u8>>]>,
        hand_offs: &mut u64,
    ) -> Result<Vec<Option<PoolAlloc<'s, u8>>>, Box<dyn std::error::Error>> {
        let Replayer { args, trace, dev, pool, streams } = *self;
        let mut handles: Vec<Option<PoolAlloc<'_, u8>>> = Vec::with_capacity(trace.slots);
        handles.resize_with(trace.slots, || None);
        let mut owner: Vec<u32> = vec![0; trace.slots];
        for (k, op) in trace.ops.iter().enumerate() {
            let s = stream_of(k);
            let (Op::Alloc { slot, .. } | Op::Free { slot }) = *op;
            let kept = resident.is_some_and(|r| r[slot as usize].is_some());
            match *op {
                _ if kept => {}
                Op::Alloc { slot, bytes } => {
                    let a = pool.alloc_async::<u8>(bytes as usize, &streams[s]).map_err(|e| {
                        format!("op {k}: allocation of {bytes} bytes on stream {s} failed: {e}")
                    })?;
                    handles[slot as usize] = Some(a);
                    owner[slot as usize] = s as u32;
                }
                Op::Free { slot } => {
                    if let Some(a) = handles[slot as usize].take() {
                        if owner[slot as usize] as usize != s {
                            *hand_offs += 1;
                            drop(a.hand_off(&streams[s])?);
                        } else {
                            drop(a);
                        }
                    }
                }
            }
            // After every `--sync-every` ops of the trace, the kept ones included.
            if args.sync_every > 0 && (k + 1) % args.sync_every == 0 {
                dev.synchronize()?;
            }
        }
        Ok(handles)
    }
}

/// The figures of one replay.
struct ReplayFigures {
    /// Wall time of its ops.
    elapsed: std::time::Duration,
    /// The pool's map and unmap calls.
    maps: u64,
    unmaps: u64,
    /// The simulator's driver calls by kind.
    calls: DriverCalls,
}

/// The figures of the run: of the last replay, and of every replay.
struct Measured {
    /// Streams the ops ran on.
    streams: usize,
    /// Wall time of the last replay's ops.
    elapsed: std::time::Duration,
    /// The pool's statistics, counters of the last replay only.
    stats: soma::PoolStats,
    /// Frees on another stream than the allocation's, in the last replay.
    hand_offs: u64,
    /// Every replay, in order.
    replays: Vec<ReplayFigures>,
}

fn print_report(
    args: &Args,
    trace: &Trace,
    pool: &MemPool<'_>,
    measured: &Measured,
) -> Result<(), Box<dyn std::error::Error>> {
    let Measured { streams: n, elapsed, ref stats, hand_offs, ref replays } = *measured;
    let model = DriverCostModel::ascend_like();
    let ops = trace.ops.len() as u64;
    let ns = |d: std::time::Duration| d.as_nanos() as f64 / ops.max(1) as f64;
    let ns_per_op = ns(elapsed);
    let last = replays.last().expect("at least one replay");
    let driver_ns = model.ns_per_op(&last.calls, ops);
    let frag_requested = stats.reserved_high as f64 / trace.stats.peak_live_bytes.max(1) as f64;
    if args.json {
        let per_replay: Vec<String> = replays
            .iter()
            .enumerate()
            .map(|(r, f)| {
                let driver = model.ns_per_op(&f.calls, ops);
                format!(
                    "{{\"replay\":{},\"ns_per_op\":{:.1},\"map_calls\":{},\"unmap_calls\":{},\
                     \"driver_calls\":{},\"driver_ns_per_op\":{driver:.1},\
                     \"total_ns_per_op\":{:.1}}}",
                    r + 1,
                    ns(f.elapsed),
                    f.maps,
                    f.unmaps,
                    f.calls.to_json(),
                    ns(f.elapsed) + driver
                )
            })
            .collect();
        println!(
            "{{\"trace\":{},\"ops\":{},\"streams\":{},\"ns_per_op\":{:.1},\
             \"peak_live_requested\":{},\"peak_used\":{},\"peak_reserved\":{},\
             \"fragmentation\":{:.4},\"fragmentation_vs_requested\":{:.4},\"map_calls\":{},\
             \"unmap_calls\":{},\"hand_offs\":{},\"reuses\":{},\"fresh\":{},\
             \"driver_calls\":{},\"driver_ns_per_op\":{driver_ns:.1},\"total_ns_per_op\":{:.1},\
             \"driver_cost_ns\":{},\"replays\":[{}]}}",
            serde_json::to_string(&trace.name)?,
            ops,
            n,
            ns_per_op,
            trace.stats.peak_live_bytes,
            stats.used_high,
            stats.reserved_high,
            stats.fragmentation(),
            frag_requested,
            stats.map_calls,
            stats.unmap_calls,
            hand_offs,
            stats.reuses.total(),
            stats.fresh_allocations,
            last.calls.to_json(),
            ns_per_op + driver_ns,
            model.to_json(),
            per_replay.join(",")
        );
        return Ok(());
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!("trace                 {} ({})", trace.name, args.trace.display());
    println!(
        "pool                  alignment {} B, max size {:.0} MiB, release threshold {:.0} MiB, \
         recycle on growth {}, {} stream(s){}, {} shard(s), replay {} of {}{}",
        pool.alignment(),
        mib(pool.max_size()),
        mib(pool.get::<soma::attr::ReleaseThreshold>()?),
        if args.recycle { "on" } else { "off" },
        n,
        if args.stream_per_replay && n > 1 { " (one per replay, in turn)" } else { "" },
        args.shards,
        args.replays,
        args.replays,
        if args.resident && args.replays > 1 { " (what the trace leaves live kept)" } else { "" }
    );
    println!(
        "ops                   {ops} ({} allocs, {} frees)",
        trace.stats.allocs, trace.stats.frees
    );
    println!("time                  {:.3} ms, {ns_per_op:.1} ns/op", elapsed.as_secs_f64() * 1e3);
    println!(
        "driver time           {driver_ns:.1} ns/op modelled (Ascend-like: 1 ms per allocation, \
         100 µs per map, unmap or free), {:.1} ns/op with the time above",
        ns_per_op + driver_ns
    );
    println!("peak live (requested) {:.1} MiB", mib(trace.stats.peak_live_bytes));
    println!("peak used             {:.1} MiB", mib(stats.used_high));
    println!("peak reserved         {:.1} MiB", mib(stats.reserved_high));
    println!(
        "fragmentation         {:.4} (peak reserved / peak used), {:.4} (/ peak requested)",
        stats.fragmentation(),
        frag_requested
    );
    println!(
        "driver map / unmap    {} / {} (recycling paused {}x)",
        stats.map_calls, stats.unmap_calls, stats.recycling_pauses
    );
    println!(
        "reuses                {} (same stream {}, event {}, opportunistic {}, host sync {}), fresh {}",
        stats.reuses.total(),
        stats.reuses.same_stream,
        stats.reuses.event_dependency,
        stats.reuses.opportunistic,
        stats.reuses.host_synchronized,
        stats.fresh_allocations
    );
    println!("cross-stream frees    {hand_offs} (hand-offs through events)");
    println!(
        "simulator             physical allocs {}, maps {}, unmaps {}, physical frees {}",
        last.calls.alloc_physical, last.calls.map, last.calls.unmap, last.calls.free_physical
    );
    println!("per replay            replay  ns/op  maps  unmaps  driver ns/op  total ns/op");
    for (r, f) in replays.iter().enumerate() {
        let driver = model.ns_per_op(&f.calls, ops);
        println!(
            "                      {:>6} {:>6.1} {:>5} {:>7} {:>13.1} {:>12.1}",
            r + 1,
            ns(f.elapsed),
            f.maps,
            f.unmaps,
            driver,
            ns(f.elapsed) + driver
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("soma-replay").chain(args.iter().copied()))
    }

    #[test]
    fn parses_sizes_and_options() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("2M").unwrap(), 2 << 20);
        assert_eq!(parse_size("8g").unwrap(), 8 << 30);
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999G").is_err());
        let a = parse(&[
            "t.csv",
            "--streams",
            "4",
            "--max-size",
            "1G",
            "--json",
            "--recycle",
            "--replays",
            "3",
            "--shards",
            "2",
            "--resident",
            "--stream-per-replay",
            "--sync-per-replay",
        ])
        .unwrap();
        assert_eq!((a.streams, a.max_size, a.json), (Some(4), Some(1 << 30), true));
        assert_eq!((a.recycle, a.replays, a.shards, a.resident), (true, 3, 2, true));
        assert!(!parse(&["t", "--recycle", "--no-recycle"]).unwrap().recycle);
        assert!(parse(&["t", "--no-recycle", "--recycle"]).unwrap().recycle);
        assert!(a.stream_per_replay && a.sync_per_replay);
        assert!(parse(&["--replays", "0", "t"]).is_err());
        assert!(parse(&["--streams", "0", "t"]).is_err());
        assert!(parse(&[]).is_err());
        assert!(parse(&["t", "u"]).is_err(), "one trace only");
        assert!(parse(&["t", "--stream-per-replay"]).is_err());
    }

    #[test]
    fn defaults_are_the_default_pool_on_the_recorded_streams() {
        let a = parse(&["t"]).unwrap();
        assert_eq!(
            (a.alignment, a.max_size, a.release_threshold, a.streams),
            (None, None, None, None)
        );
        assert_eq!((a.shards, a.sync_every, a.capacity, a.replays), (1, 0, 64 << 30, 1));
        assert!(!a.recycle && !a.resident && !a.stream_per_replay && !a.sync_per_replay && !a.json);
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }

    #[test]
    fn recorded_streams_are_numbered_in_order_of_first_appearance() {
        assert_eq!(recorded_streams(&[7, 7, 3, 7, 9, 3]), (vec![0, 0, 1, 0, 2, 1], 3));
        assert_eq!(recorded_streams(&[0, 0]), (vec![0, 0], 1));
        assert_eq!(recorded_streams(&[]), (vec![], 1));
    }
}
