//! A workload run again on the same pool makes no driver call: the bundled PyTorch traces and
//! cells of RAPIDS RMM's `random_allocations`, each replayed several times on one default
//! pool through the public API (everything freed between replays; on one stream, each replay
//! on the next of four streams, or each op on the next of four streams, with no
//! synchronisation), counted by the pool and by the software NPU. Counts and ratios only,
//! never time.

use std::path::Path;

use soma::MemPool;
use soma_tools::baselines::{SomaApi, SomaStreams};
use soma_tools::trace::{bundled_trace_dir, find_traces, Op, Trace};
use soma_tools::workload::{free_all, random_allocations, replay, SEED};

use crate::common::{device_of, npu_with_capacity};

/// Map and unmap calls per replay, as the pool counted them and as the device saw them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Calls {
    pool_maps: u64,
    pool_unmaps: u64,
    device_maps: u64,
    device_unmaps: u64,
}

/// How the replays of one pool use its streams.
#[derive(Clone, Copy, Debug)]
struct Replays {
    /// Replays of the workload.
    count: usize,
    /// Streams: replay `r` runs on stream `r % streams`, without a synchronisation between
    /// replays (a server running each request on the next of its streams).
    streams: usize,
}

/// Replays `ops` on one default pool of a device of `capacity` bytes: the driver calls of
/// each replay, and the pool's peak reserved / peak used over all of them.
fn replay_on_one_pool(ops: &[Op], slots: usize, capacity: u64, how: Replays) -> (Vec<Calls>, f64) {
    let npu = npu_with_capacity(capacity);
    let dev = device_of(&npu);
    let sim = npu.sim_device(0).unwrap();
    let streams: Vec<_> = (0..how.streams).map(|_| dev.create_stream().unwrap()).collect();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut per_replay = Vec::new();
    for r in 0..how.count {
        let (before, device_before) = (pool.stats(), sim.stats().calls);
        let mut api = SomaApi::new(&pool, &streams[r % how.streams]);
        let left = replay(&mut api, ops, slots);
        free_all(&mut api, left);
        let (after, device_after) = (pool.stats(), sim.stats().calls);
        per_replay.push(Calls {
            pool_maps: after.map_calls - before.map_calls,
            pool_unmaps: after.unmap_calls - before.unmap_calls,
            device_maps: device_after.map - device_before.map,
            device_unmaps: device_after.unmap - device_before.unmap,
        });
    }
    (per_replay, pool.stats().fragmentation())
}

/// Replays `ops` `count` times on one default pool of a device of `capacity` bytes, each op
/// on the next of four streams (a free on another stream than the allocation's handed off
/// first), the sanitizer off: the map calls of each replay, and the pool's peak reserved /
/// peak used over all of them.
fn replay_spread_over_four_streams(
    ops: &[Op],
    slots: usize,
    capacity: u64,
    count: usize,
) -> (Vec<u64>, f64) {
    let npu = soma::sim::Npu::builder()
        .capacity(capacity)
        .sanitizer(soma::sim::SanitizerMode::Off)
        .build()
        .unwrap();
    let dev = device_of(&npu);
    let streams: Vec<_> = (0..4).map(|_| dev.create_stream().unwrap()).collect();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut maps = Vec::new();
    for _ in 0..count {
        let before = pool.stats().map_calls;
        let mut api = SomaStreams::new(&pool, &streams, "soma-4-streams");
        let left = replay(&mut api, ops, slots);
        free_all(&mut api, left);
        maps.push(pool.stats().map_calls - before);
    }
    (maps, pool.stats().fragmentation())
}

/// The first replay maps; the later ones make no call at all, and nothing is ever unmapped.
fn assert_warm_replays_make_no_calls(what: &str, calls: &[Calls]) {
    assert!(calls[0].pool_maps > 0 && calls[0].device_maps > 0, "{what}: {calls:?}");
    assert_eq!(calls[0].pool_unmaps, 0, "{what}: {calls:?}");
    let quiet = Calls { pool_maps: 0, pool_unmaps: 0, device_maps: 0, device_unmaps: 0 };
    for (r, c) in calls.iter().enumerate().skip(1) {
        assert_eq!(*c, quiet, "{what}: replay {r} of {calls:?}");
    }
}

#[test]
fn bundled_traces_replayed_again_make_no_driver_calls() {
    let dir = bundled_trace_dir(Path::new(env!("CARGO_MANIFEST_DIR")));
    let paths = find_traces(&dir).unwrap();
    assert!(paths.len() >= 4, "the four bundled traces: {paths:?}");
    for p in &paths {
        let trace = Trace::load(p).unwrap();
        let how = Replays { count: 3, streams: 1 };
        let (calls, fragmentation) = replay_on_one_pool(&trace.ops, trace.slots, 16 << 30, how);
        assert_warm_replays_make_no_calls(&trace.name, &calls);
        assert!(
            fragmentation <= fragmentation_bar(&trace.name),
            "{}: {fragmentation:.4}",
            trace.name
        );
    }
}

/// Peak reserved is the address space the placement spans: within 1.05 of peak used, but on
/// BERT, whose padded lengths leave holes no online placement closes (the engine's trace
/// tests, `without_recycling_limit`).
fn fragmentation_bar(trace: &str) -> f64 {
    if trace == "bert_base_infer" {
        1.094
    } else {
        1.05
    }
}

/// Each replay on the next of four streams, nothing synchronised: what a stream freed has
/// completed when the next one starts (no work was enqueued), and the next stream's frees
/// merge with it again, so later replays place as on one stream and make no driver call.
#[test]
fn bundled_traces_replayed_on_streams_in_turn_make_no_driver_calls() {
    let dir = bundled_trace_dir(Path::new(env!("CARGO_MANIFEST_DIR")));
    for p in &find_traces(&dir).unwrap() {
        let trace = Trace::load(p).unwrap();
        let how = Replays { count: 5, streams: 4 };
        let (calls, fragmentation) = replay_on_one_pool(&trace.ops, trace.slots, 16 << 30, how);
        assert_warm_replays_make_no_calls(&trace.name, &calls);
        let one =
            replay_on_one_pool(&trace.ops, trace.slots, 16 << 30, Replays { count: 1, streams: 1 });
        assert!(
            fragmentation <= one.1,
            "{}: {fragmentation:.4} vs {:.4} on one stream",
            trace.name,
            one.1
        );
    }
}

#[test]
fn random_allocations_replayed_again_make_no_driver_calls() {
    for (n, max_mib) in [(1_000, 64), (10_000, 4), (10_000, 256), (100_000, 1)] {
        let w = random_allocations(n, max_mib, 16_000, SEED);
        let how = Replays { count: 3, streams: 1 };
        let (calls, _) = replay_on_one_pool(&w.ops, w.slots, 32 << 30, how);
        assert_warm_replays_make_no_calls(&format!("{n} x {max_mib} MiB"), &calls);
    }
}

/// Ops of one replay on 4 streams in turn (a free on another stream than the allocation's
/// handed off through an event first), never a host synchronisation: before growing, the pool
/// settles what the other streams freed and completed, so warm replays reuse it instead of
/// growing at every replay. (With the sanitizer off, records on idle streams complete at once:
/// the replays are deterministic.)
#[test]
fn random_allocations_on_streams_in_turn_hardly_grow_once_warm() {
    let w = random_allocations(1_000, 64, 16_000, SEED);
    let (maps, _) = replay_spread_over_four_streams(&w.ops, w.slots, 64 << 30, 6);
    // Without settling before growth, every warm replay grew again (about 2 % of the first
    // replay's maps each, steadily); with it, the five together stay under 5 %.
    let warm: u64 = maps[1..].iter().sum();
    assert!(maps[0] > 0 && warm * 20 < maps[0], "maps per replay: {maps:?}");
}

/// Each op of a replay on the next of four streams (a free on another stream than the
/// allocation's handed off through an event first), nothing synchronised: what one stream
/// frees, the others may reuse once it completed, and an allocation settles it first while
/// several streams free, so that it merges with the memory beside it whoever freed that.
/// The bundled traces then place as on one stream and warm replays make no driver call.
/// (With the sanitizer off, records and waits on idle streams complete at once: the replays
/// are deterministic.)
#[test]
fn bundled_traces_with_ops_spread_over_four_streams_place_as_on_one_stream() {
    let dir = bundled_trace_dir(Path::new(env!("CARGO_MANIFEST_DIR")));
    for p in &find_traces(&dir).unwrap() {
        let trace = Trace::load(p).unwrap();
        let (maps, spread) = replay_spread_over_four_streams(&trace.ops, trace.slots, 16 << 30, 3);
        let one =
            replay_on_one_pool(&trace.ops, trace.slots, 16 << 30, Replays { count: 1, streams: 1 })
                .1;
        // Without settling at allocations, BERT reached 1.39 and GPT-2 training 1.68.
        assert!(
            spread <= one + 0.005,
            "{}: {spread:.4} spread over 4 streams vs {one:.4} on one",
            trace.name
        );
        assert!(maps[0] > 0 && maps[1..] == [0, 0], "{}: maps per replay {maps:?}", trace.name);
    }
}
