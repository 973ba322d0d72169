//! Replays the real PyTorch allocator traces of `data/traces` at the workspace root (or of
//! `$SOMA_TRACES`), plain or gzipped, through the engine on one stream and reports peak
//! reserved / peak used.
//!
//! Run with `cargo test -p soma-engine --lib trace_fragmentation -- --nocapture` to see the
//! table. A missing directory skips the test with a printed reason.
//!
//! `recycle` says whether growth recycles (off by default). `complete = yes` replays as if
//! every free had completed on the device by the next request (a device keeping up with the
//! host), so fully free segments can be recycled; `no` as if none had (nothing can be
//! unmapped, only reused in place).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use super::*;
use crate::{Engine, EngineConfig, EngineStats, FreeTag};

/// `$SOMA_TRACES`, else `data/traces` at the workspace root.
fn trace_dir() -> PathBuf {
    std::env::var_os("SOMA_TRACES").map(PathBuf::from).unwrap_or_else(|| {
        // crates/soma-engine -> the workspace root
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/traces")
    })
}

/// The `*.csv` and `*.csv.gz` traces of [`trace_dir`], sorted (a trace present in both forms
/// once); `None` (after printing why the test is skipped) when the directory is absent or
/// holds none.
fn trace_paths() -> Option<Vec<PathBuf>> {
    let dir = trace_dir();
    let Ok(rd) = std::fs::read_dir(&dir) else {
        println!("skipped: trace directory {} is absent", dir.display());
        return None;
    };
    let mut paths: Vec<_> = rd
        .filter_map(|d| d.ok().map(|d| d.path()))
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.ends_with(".csv") || name.ends_with(".csv.gz")
        })
        .collect();
    paths.sort();
    let plain: Vec<PathBuf> = paths.iter().filter(|p| !is_gzip(p)).cloned().collect();
    paths.retain(|p| !is_gzip(p) || !plain.contains(&p.with_extension("")));
    if paths.is_empty() {
        println!("skipped: no *.csv trace in {}", dir.display());
        return None;
    }
    Some(paths)
}

fn is_gzip(p: &std::path::Path) -> bool {
    p.extension().is_some_and(|x| x == "gz")
}

/// The text of trace file `p`, gunzipped when it ends in `.gz`.
fn read_trace(p: &std::path::Path) -> String {
    let raw = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    if !is_gzip(p) {
        return String::from_utf8(raw).expect("a trace is UTF-8");
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::MultiGzDecoder::new(&raw[..]), &mut text)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text
}

/// One trace event: `Some(bytes)` allocates id, `None` frees it.
fn parse(text: &str) -> Result<Vec<(u64, Option<u64>)>, String> {
    let mut lines = text.lines();
    if lines.next() != Some("op,id,bytes,stream") {
        return Err("bad header".into());
    }
    let mut out = Vec::new();
    for (n, line) in lines.enumerate() {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 4 {
            return Err(format!("line {}: {line}", n + 2));
        }
        let id: u64 = f[1].parse().map_err(|e| format!("line {}: {e}", n + 2))?;
        let bytes: u64 = f[2].parse().map_err(|e| format!("line {}: {e}", n + 2))?;
        match f[0] {
            "a" => out.push((id, Some(bytes))),
            "f" => out.push((id, None)),
            op => return Err(format!("line {}: op {op}", n + 2)),
        }
    }
    Ok(out)
}

/// Replays `events` on a fresh engine that `configure` has set up; `complete` says whether
/// frees count as complete (a host that waits for the device) for recycling and release.
fn replay(
    events: &[(u64, Option<u64>)],
    complete: bool,
    configure: impl FnOnce(&mut Engine),
) -> (EngineStats, u64, usize) {
    let mut e = Engine::new(EngineConfig {
        range_size: 64 << 30,
        granularity: G,
        alignment: 512,
        index_by_offset: false,
    })
    .unwrap();
    configure(&mut e);
    let mut b = backing();
    let o = TestOrder { all_complete: complete, ..TestOrder::default() };
    let mut live = HashMap::new();
    let mut peak_live_requested = 0u64;
    let mut live_requested = 0u64;
    for (pos, &(id, op)) in events.iter().enumerate() {
        match op {
            Some(bytes) => {
                let a = e.alloc(bytes, 512, 0, &o, &mut b).expect("trace alloc");
                live.insert(id, (a, bytes));
                live_requested += bytes;
                peak_live_requested = peak_live_requested.max(live_requested);
            }
            None => {
                let (a, bytes) = live.remove(&id).expect("trace frees a live id");
                e.free(a.block, FreeTag { stream: 0, pos: pos as u64 }).unwrap();
                live_requested -= bytes;
            }
        }
        if cfg!(debug_assertions) && pos % 4096 == 0 {
            e.check_invariants().unwrap();
        }
    }
    e.check_invariants().unwrap();
    assert_eq!(b.total(), e.reserved());
    (e.stats(), peak_live_requested, e.slab.blocks.len())
}

#[test]
fn trace_fragmentation() {
    let Some(paths) = trace_paths() else { return };
    println!(
        "{:<26} {:>7} {:>8} {:>8} {:>12} {:>12} {:>12} {:>7} {:>6} {:>6}",
        "trace",
        "recycle",
        "complete",
        "segments",
        "peak live",
        "peak used",
        "peak resv",
        "ratio",
        "maps",
        "unmaps"
    );
    for p in &paths {
        let text = read_trace(p);
        let events = parse(&text).unwrap();
        // (recycling on growth, frees complete for recycling, segment cap)
        for (recycle, complete, seg) in
            [(false, true, 0), (true, true, 0), (true, false, 0), (true, true, G)]
        {
            let (s, peak_req, records) = replay(&events, complete, |e| {
                e.set_recycle_on_growth(recycle);
                e.set_max_segment(seg);
            });
            let ratio = s.reserved_high as f64 / s.used_high as f64;
            println!(
                "{:<26} {:>7} {:>8} {:>8} {:>12} {:>12} {:>12} {:>7.4} {:>6} {:>6} {:>8.1}",
                p.file_name().unwrap().to_string_lossy(),
                if recycle { "on" } else { "off" },
                if complete { "yes" } else { "no" },
                if seg == 0 { "n/4" } else { "granule" },
                peak_req,
                s.used_high,
                s.reserved_high,
                ratio,
                s.map_calls,
                s.unmap_calls,
                // block records ever needed per live block at the peak
                (records * std::mem::size_of::<crate::block::Block>()) as f64
                    / s.live_blocks_high as f64
            );
            let name = p.file_name().unwrap().to_string_lossy();
            // Recycling never becomes chronic on a real model's trace (`RECYCLE_BURST`).
            assert_eq!(s.recycling_pauses, 0, "{name}: recycling paused");
            let limit = match (recycle, complete) {
                (false, _) => without_recycling_limit(&name),
                (true, true) => 1.05,
                (true, false) => never_unmapping_limit(&name),
            };
            let in_whole_granules = in_granules(&s);
            assert!(
                in_whole_granules <= limit,
                "{name}: fragmentation regression: {in_whole_granules}"
            );
        }
    }
}

/// Peak reserved / peak used in whole granules (reserved memory is whole granules, so a
/// trace smaller than one granule is 1.0, not 4096): what the targets are stated in.
fn in_granules(s: &EngineStats) -> f64 {
    s.reserved_high as f64 / s.used_high.next_multiple_of(G) as f64
}

/// The bar on peak reserved / peak used with the default settings (no recycling on growth),
/// on one stream or several, from the first run on: 1.05 for every trace but BERT's. Without
/// recycling, peak reserved memory is the address space the placement spans, which
/// no driver call can shrink; on the BERT trace, 16 batches of padded lengths from 32 to 512,
/// every online placement policy tried (best fit, first fit, last fit, best fit with small
/// and large blocks at opposite ends, natural alignment, placing next to the most recently
/// allocated neighbour) spans at least 1.06 of the live bytes, best fit 1.084; the bar there
/// is that plus 0.01. Recycling (`set_recycle_on_growth(true)`) brings it to 1.008 at about
/// 700 remaps per run.
fn without_recycling_limit(trace: &str) -> f64 {
    match trace.trim_end_matches(".gz").trim_end_matches(".csv") {
        "bert_base_infer" => 1.084 + 0.01,
        _ => 1.05,
    }
}

/// The regression guard on peak reserved / peak used when nothing freed can be unmapped
/// (frees not complete): what a pool that never unmaps reaches. The four traces of
/// `data/traces` as measured (BERT 1.084) plus 0.01; other traces 1.30 (against gross
/// regressions: a RoBERTa trace of varying batch shapes gives 1.13, the pure offset
/// allocators 1.26). With completion known and recycling on, every trace must meet the 1.05
/// target.
fn never_unmapping_limit(trace: &str) -> f64 {
    let measured = match trace.trim_end_matches(".gz").trim_end_matches(".csv") {
        "bert_base_infer" => 1.084,
        "gpt2_small_infer" => 1.006,
        "gpt2_small_train" => 1.018,
        "llama_tinyllama_infer" => 1.002,
        _ => return 1.30,
    };
    measured + 0.01
}

/// With the default settings, a workload replayed again on the same engine (an inference
/// server serving the same model, a model loaded again) makes no driver call at all: from
/// empty, the second run places every block where the first did (the border block is served
/// last); with what a run leaves live kept, the third run (the second differs from the first
/// by the allocations it skips). Nothing is ever unmapped.
#[test]
fn trace_replayed_again_makes_no_driver_calls() {
    let Some(paths) = trace_paths() else { return };
    for p in &paths {
        let events = parse(&read_trace(p)).unwrap();
        let name = p.file_name().unwrap().to_string_lossy();
        for (rerun, quiet_from) in [(Rerun::FromEmpty, 1), (Rerun::Resident, 2)] {
            let runs = replay_repeatedly(&events, 3, rerun, Streams::One, |_| {});
            let calls: Vec<(u64, u64)> = runs.iter().map(|&(_, m, u)| (m, u)).collect();
            println!("{name}, {rerun:?}: maps / unmaps per replay {calls:?}");
            assert!(calls.iter().all(|&(_, u)| u == 0), "{name}, {rerun:?}: {calls:?}");
            assert!(calls[0].0 > 0, "{name}: the first run maps");
            assert!(
                calls[quiet_from..].iter().all(|&(m, _)| m == 0),
                "{name}, {rerun:?}: {calls:?}"
            );
            let ratio = runs[2].0;
            assert!(ratio <= without_recycling_limit(&name), "{name}, {rerun:?}: {ratio}");
        }
    }
}

/// The traces spread over two streams (allocation `id` on stream `id % 2`, freed on the
/// stream it was allocated on), with and without cross-stream reuse: how much per-stream
/// caching costs. Run with `--ignored --nocapture`.
#[test]
#[ignore = "measurement"]
fn trace_fragmentation_two_streams() {
    let Some(paths) = trace_paths() else { return };
    for p in &paths {
        let events = parse(&read_trace(p)).unwrap();
        for cross in [false, true] {
            let mut e = Engine::new(EngineConfig {
                range_size: 64 << 30,
                granularity: G,
                alignment: 512,
                index_by_offset: false,
            })
            .unwrap();
            let mut b = backing();
            let mut o = TestOrder::complete();
            if cross {
                // opportunistic: everything complete
                o.completed.insert(0, u64::MAX);
                o.completed.insert(1, u64::MAX);
            }
            let mut live = HashMap::new();
            for (pos, &(id, op)) in events.iter().enumerate() {
                let s = (id % 2) as u32;
                match op {
                    Some(bytes) => {
                        live.insert(id, e.alloc(bytes, 512, s, &o, &mut b).unwrap());
                    }
                    None => {
                        let a = live.remove(&id).unwrap();
                        e.free(a.block, FreeTag { stream: s, pos: pos as u64 }).unwrap();
                    }
                }
            }
            let st = e.stats();
            println!(
                "{:<26} cross-stream reuse {:<5} ratio {:.4} maps {} unmaps {} reuses {:?}",
                p.file_name().unwrap().to_string_lossy(),
                cross,
                st.reserved_high as f64 / st.used_high as f64,
                st.map_calls,
                st.unmap_calls,
                st.reuses
            );
        }
    }
}

/// Peak reserved / peak used and map / unmap calls per trace for the default (adaptive)
/// segments per growth and for fixed counts (`SOMA_SEGMENTS`, comma-separated, 0 = default;
/// default `0,4,8,16`): the measurement behind `growth::MAX_SPLIT_BOOST`. Run with
/// `--ignored --nocapture`.
#[test]
#[ignore = "measurement"]
fn trace_fragmentation_by_segments_per_growth() {
    let Some(paths) = trace_paths() else { return };
    let counts: Vec<u64> = std::env::var("SOMA_SEGMENTS")
        .unwrap_or_else(|_| "0,4,8,16".into())
        .split(',')
        .map(|v| v.trim().parse().expect("SOMA_SEGMENTS: comma-separated counts"))
        .collect();
    for p in &paths {
        let events = parse(&read_trace(p)).unwrap();
        let mut line = format!("{:<32}", p.file_name().unwrap().to_string_lossy());
        for &n in &counts {
            let (s, _, _) = replay(&events, true, |e| {
                if n > 0 {
                    e.set_segments_per_growth(n);
                }
            });
            let name = if n == 0 { "auto".to_string() } else { n.to_string() };
            line += &format!(
                "  {name:>4}: {:.4} {:>5}/{:<5}",
                s.reserved_high as f64 / s.used_high as f64,
                s.map_calls,
                s.unmap_calls
            );
        }
        println!("{line}");
    }
}

/// The streams the replays of a trace run on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Streams {
    /// All on stream 0.
    One,
    /// Replay `r` on stream `r % n`; it reuses the frees of the replays before it by the
    /// opportunistic rule (they are complete): a server running its requests on its streams
    /// in turn.
    InTurn(StreamSlot),
    /// As `InTurn`, with a host synchronisation between replays (the engine settles every
    /// free, as the pool does after one).
    InTurnSynchronized(StreamSlot),
}

/// The ways of running a trace again that the rerun tests replay: each way of starting the
/// next replay, on one stream and on four streams in turn.
const RERUNS: [(Rerun, Streams); 4] = [
    (Rerun::Resident, Streams::One),
    (Rerun::Resident, Streams::InTurn(4)),
    (Rerun::FromEmpty, Streams::One),
    (Rerun::FromEmpty, Streams::InTurn(4)),
];

/// How the next replay of a trace starts on the same engine.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Rerun {
    /// What is live at the end of the trace (the weights, a training run's optimizer
    /// state) stays allocated and later replays skip it: a server or training loop running
    /// the model again.
    Resident,
    /// Everything is freed between replays: the model unloaded and loaded again into the
    /// same pool (which packs its mapped memory when it empties, see `growth::pack_idle`).
    FromEmpty,
}

/// Per replay of `events`, `replays` times on one engine (every free complete; `configure`
/// first, e.g. to turn recycling off): (peak reserved / peak used in granules so far, map
/// calls, unmap calls), the replays on `streams`. Checks the engine's invariants at the end.
fn replay_repeatedly(
    events: &[(u64, Option<u64>)],
    replays: usize,
    rerun: Rerun,
    streams: Streams,
    configure: impl FnOnce(&mut Engine),
) -> Vec<(f64, u64, u64)> {
    let mut e = Engine::new(EngineConfig::new(64 << 30, G)).unwrap();
    configure(&mut e);
    let mut b = backing();
    let (n, synchronized) = match streams {
        Streams::One => (1, false),
        Streams::InTurn(n) => (n, false),
        Streams::InTurnSynchronized(n) => (n, true),
    };
    let mut o = TestOrder::complete();
    o.completed = (0..n).map(|s| (s, u64::MAX)).collect();
    let mut observed = TestOrder::complete();
    observed.host_observed = (0..n).map(|s| (s, u64::MAX)).collect();
    let mut at_end = HashSet::new();
    for &(id, op) in events {
        if op.is_some() {
            at_end.insert(id);
        } else {
            at_end.remove(&id);
        }
    }
    let mut resident = Vec::new();
    let mut pos = 0;
    let mut per_replay = Vec::new();
    for r in 0..replays {
        let stream = r as StreamSlot % n;
        if r > 0 && synchronized {
            e.settle(&observed);
        }
        let before = e.stats();
        let mut live = HashMap::new();
        for &(id, op) in events {
            if rerun == Rerun::Resident && r > 0 && at_end.contains(&id) {
                continue;
            }
            pos += 1;
            match op {
                Some(bytes) => {
                    live.insert(id, e.alloc(bytes, 512, stream, &o, &mut b).unwrap());
                }
                None => {
                    let a = live.remove(&id).unwrap();
                    e.free(a.block, FreeTag { stream, pos }).unwrap();
                }
            }
        }
        // In id order: the engine's placement must not depend on the hash map's order.
        let mut live: Vec<_> = live.into_iter().collect();
        live.sort_by_key(|&(id, _)| id);
        for (id, a) in live {
            if rerun == Rerun::Resident && at_end.contains(&id) {
                resident.push(a);
                continue;
            }
            pos += 1;
            e.free(a.block, FreeTag { stream, pos }).unwrap();
        }
        let s = e.stats();
        per_replay.push((
            in_granules(&s),
            s.map_calls - before.map_calls,
            s.unmap_calls - before.unmap_calls,
        ));
    }
    e.check_invariants().unwrap();
    per_replay
}

/// The bar of [`trace_reruns_stay_within_target`] for runs on `streams`, recycling or not.
///
/// On one stream: [`without_recycling_limit`] by default (every run places as the first or
/// the second did), 1.05 with recycling (BERT 1.007 -> 1.011 by the tenth run resident,
/// at most 1.040 from empty; GPT-2 training at most 1.022; without packing when the engine
/// empties, BERT crept to 1.058-1.072 within 5-20 runs).
///
/// On four streams in turn, without a synchronisation, the frees of one run stay tagged
/// with its stream: the next run reuses them by the opportunistic rule but they do not merge
/// with its own, so the next run places differently. By default GPT-2 training from empty
/// reaches 1.056 by the second run (1.019 on one stream, and with a synchronisation between
/// runs), BERT 1.091, the others at most 1.008; with recycling GPT-2 training 1.053 by the
/// tenth run (without reuse of the other streams' completed frees BERT reaches 1.26 on the
/// second run). The bar there is 1.06, or the one-stream bar when that is higher.
fn rerun_limit(trace: &str, recycle: bool, streams: Streams) -> f64 {
    let one_stream = if recycle { 1.05 } else { without_recycling_limit(trace) };
    match streams {
        Streams::One => one_stream,
        _ => one_stream.max(1.06),
    }
}

/// A trace run again and again on one engine stays within its bar ([`rerun_limit`]), both
/// with what it leaves live kept (a server or a training loop) and from empty (a model
/// loaded again), on one stream and on four in turn, with and without recycling.
#[test]
fn trace_reruns_stay_within_target() {
    let Some(paths) = trace_paths() else { return };
    // Debug builds replay fewer times (the GPT-2 training trace is 27k events per run).
    let replays = if cfg!(debug_assertions) { 4 } else { 12 };
    for p in &paths {
        let events = parse(&read_trace(p)).unwrap();
        let name = p.file_name().unwrap().to_string_lossy();
        for (rerun, streams) in RERUNS {
            for recycle in [false, true] {
                let limit = rerun_limit(&name, recycle, streams);
                let runs = replay_repeatedly(&events, replays, rerun, streams, |e| {
                    e.set_recycle_on_growth(recycle)
                });
                for (r, &(ratio, _, _)) in runs.iter().enumerate() {
                    assert!(
                        ratio <= limit,
                        "{name}, {rerun:?} on {streams:?}, recycling {recycle}: run {r} \
                         reaches {ratio:.4}"
                    );
                }
            }
        }
    }
}

/// Peak reserved / peak used (and map / unmap calls) over repeated replays for each way of
/// starting the next one ([`Rerun`]). Run with `--ignored --nocapture`; `SOMA_REPLAYS`
/// (default 20), `SOMA_RECYCLE=1` to recycle on growth.
#[test]
#[ignore = "measurement"]
fn trace_fragmentation_over_replays() {
    let Some(paths) = trace_paths() else { return };
    let replays: usize =
        std::env::var("SOMA_REPLAYS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let recycle = std::env::var("SOMA_RECYCLE").is_ok_and(|v| v == "1");
    for p in &paths {
        let events = parse(&read_trace(p)).unwrap();
        let synchronized = [Rerun::Resident, Rerun::FromEmpty]
            .map(|rerun| (rerun, Streams::InTurnSynchronized(4)));
        for (rerun, streams) in RERUNS.into_iter().chain(synchronized) {
            let name = p.file_name().unwrap().to_string_lossy();
            let mut line =
                format!("{name:<32} {:<10} {:<10}", format!("{rerun:?}"), format!("{streams:?}"));
            for (r, (ratio, maps, unmaps)) in
                replay_repeatedly(&events, replays, rerun, streams, |e| {
                    e.set_recycle_on_growth(recycle)
                })
                .into_iter()
                .enumerate()
            {
                if r < 3 || r + 1 == replays || r % 5 == 4 {
                    line += &format!(" {r}:{ratio:.3}({maps}/{unmaps})");
                }
            }
            println!("{line}");
        }
    }
}

/// With a host synchronisation between runs, runs on four streams in turn place within
/// half a percent of runs on one stream: every free has settled by the next run, so the
/// streams' frees merge as one stream's do (12 runs of the 20 traces: the highest peak of
/// each equal to one stream's on 16, at most 0.4 % apart on the rest). Without settling
/// GPT-2 training from empty reaches 1.024 instead of 1.017 by the eighth run, and the beam-search,
/// ResNet-50 and Whisper traces of `scripts/extra_trace_recipes.py` 1.053-1.063 resident
/// (one stream: 1.032, 1.049, 1.030).
#[test]
fn synchronized_runs_on_streams_in_turn_place_as_on_one_stream() {
    let Some(paths) = trace_paths() else { return };
    // Fewer runs would not tell: without settling the gap opens from the fifth run.
    let replays = 8;
    for p in &paths {
        let events = parse(&read_trace(p)).unwrap();
        let name = p.file_name().unwrap().to_string_lossy();
        for rerun in [Rerun::Resident, Rerun::FromEmpty] {
            let highest = |streams| -> f64 {
                replay_repeatedly(&events, replays, rerun, streams, |_| {})
                    .into_iter()
                    .map(|(ratio, _, _)| ratio)
                    .fold(0.0, f64::max)
            };
            let (one, in_turn) = (highest(Streams::One), highest(Streams::InTurnSynchronized(4)));
            assert!(
                in_turn <= one + 0.005,
                "{name}, {rerun:?}: {in_turn:.4} on four streams in turn, {one:.4} on one"
            );
        }
    }
}
