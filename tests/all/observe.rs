//! Observability: history exports (JSON lines, Chrome trace, replay CSV, SVG), snapshots,
//! statistics and the out-of-memory report, checked against the pool's own state.

use std::collections::HashMap;

use serde_json::Value;
use soma::{Error, MemPool, ReusePolicy};
use soma_core::observe::{BlockStatus, PendingFree, RecordKind, SvgOptions};

use crate::common::{device_of, npu, Gate, TestRng};

const MIB: u64 = 1 << 20;

/// A small workload on two streams with a history, in a pool that it fills: allocations,
/// a same-stream reuse, an event-ordered cross-stream reuse, an out-of-memory and a trim.
fn workload(pool: &MemPool<'_>, s1: &soma::Stream<'_>, s2: &soma::Stream<'_>) {
    let a = pool.alloc_async::<u8>(3 * MIB as usize, s1).unwrap();
    let b = pool.alloc_async::<f32>(MIB as usize / 4, s2).unwrap();
    drop(a);
    let d = pool.alloc_async::<u8>(3 * MIB as usize, s1).unwrap(); // same-stream reuse
    drop(b);
    let ev = s2.record_event().unwrap();
    s1.wait_event(&ev).unwrap();
    let e = pool.alloc_async::<u8>(MIB as usize, s1).unwrap(); // ordered after b's free
    assert!(matches!(pool.alloc_async::<u8>(2 * MIB as usize, s1), Err(Error::OutOfMemory(_))));
    drop(d);
    drop(e);
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    pool.trim_to(0).unwrap();
}

fn pool_with_history(dev: &soma::Device) -> MemPool<'_> {
    MemPool::builder()
        .max_size(4 * MIB)
        .reuse(ReusePolicy::new(true, false, false))
        .history(1024)
        .build(dev)
        .unwrap()
}

#[test]
fn json_lines_have_one_typed_object_per_record() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with_history(&dev);
    workload(&pool, &s1, &s2);
    let (records, dropped) = pool.history();
    assert_eq!(dropped, 0);
    let text = pool.history_json_lines();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), records.len());
    assert!(text.ends_with('\n'));
    let kinds = ["alloc", "free", "map", "unmap", "trim", "oom", "alloc_failed"];
    let reuses = [
        "same_stream",
        "event_dependency",
        "opportunistic",
        "internal_dependency",
        "host_synchronized",
    ];
    let mut last_t = 0;
    for (line, r) in lines.iter().zip(&records) {
        let v: Value = serde_json::from_str(line).expect("each line is JSON");
        let o = v.as_object().expect("an object");
        for key in ["t_ns", "stream", "offset", "size", "requested", "used", "reserved"] {
            assert!(o[key].is_u64(), "{key} is an unsigned integer in {line}");
        }
        let kind = o["kind"].as_str().unwrap();
        assert!(kinds.contains(&kind), "{kind}");
        assert_eq!(kind, r.kind.as_str());
        assert_eq!(o["t_ns"].as_u64(), Some(r.t_ns));
        assert!(r.t_ns >= last_t, "records are in time order");
        last_t = r.t_ns;
        assert_eq!(o["used"].as_u64(), Some(r.used));
        assert_eq!(o["reserved"].as_u64(), Some(r.reserved));
        match &o["reuse"] {
            Value::Null => assert!(r.reuse.is_none()),
            Value::String(s) => assert!(reuses.contains(&s.as_str()), "{s}"),
            other => panic!("reuse {other}"),
        }
        match &o["location"] {
            Value::Null => assert!(r.location.is_none()),
            Value::Object(l) => {
                assert!(l["file"].as_str().unwrap().ends_with("observe.rs"), "{line}");
                assert!(l["line"].as_u64().unwrap() > 0 && l["column"].is_u64());
            }
            other => panic!("location {other}"),
        }
    }
    let count = |k: &str| lines.iter().filter(|l| l.contains(&format!("\"kind\":\"{k}\""))).count();
    assert_eq!(count("alloc"), 4);
    assert_eq!(count("free"), 4);
    assert_eq!(count("oom"), 1);
    assert!(count("map") >= 1 && count("unmap") >= 1 && count("trim") >= 1);
    assert!(text.contains("\"reuse\":\"same_stream\""), "{text}");
    assert!(text.contains("\"reuse\":\"event_dependency\""), "{text}");
}

/// Checks the Chrome trace event format: returns the events.
fn check_chrome_trace(text: &str) -> Vec<Value> {
    let doc: Value = serde_json::from_str(text).expect("the trace is JSON");
    let events = doc["traceEvents"].as_array().expect("traceEvents array").clone();
    assert!(doc["otherData"]["dropped_records"].is_u64());
    // Slices on one track must not overlap (Perfetto needs them nested).
    let mut per_tid: HashMap<u64, Vec<(f64, f64)>> = HashMap::new();
    for e in &events {
        let ph = e["ph"].as_str().expect("ph");
        assert!(["X", "B", "E", "C", "i", "M"].contains(&ph), "ph {ph}");
        assert!(e["pid"].is_u64() && e["tid"].is_u64(), "pid/tid in {e}");
        assert!(e["name"].is_string(), "name in {e}");
        if ph == "M" {
            assert!(e["args"].is_object());
            continue;
        }
        let ts = e["ts"].as_f64().expect("ts in µs");
        assert!(ts >= 0.0);
        match ph {
            "X" => {
                let dur = e["dur"].as_f64().expect("dur");
                assert!(dur >= 0.0);
                assert!(e["args"]["size"].is_u64() && e["args"]["offset"].is_u64());
                per_tid.entry(e["tid"].as_u64().unwrap()).or_default().push((ts, ts + dur));
            }
            "C" => {
                let args = e["args"].as_object().expect("counter args");
                assert!(args["used"].is_u64() && args["reserved"].is_u64());
            }
            "i" => assert!(["t", "p", "g"].contains(&e["s"].as_str().unwrap())),
            _ => {}
        }
    }
    for (tid, mut slices) in per_tid {
        slices.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in slices.windows(2) {
            assert!(w[0].1 <= w[1].0 + 1e-9, "slices overlap on track {tid}: {w:?}");
        }
    }
    events
}

#[test]
fn chrome_trace_has_counters_slices_per_stream_and_instants() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with_history(&dev);
    workload(&pool, &s1, &s2);
    let (records, _) = pool.history();
    let events = check_chrome_trace(&pool.history_chrome_trace());
    let of = |ph: &str| events.iter().filter(|e| e["ph"] == ph).cloned().collect::<Vec<_>>();
    // One slice per allocation, from its alloc to its free, in µs.
    let slices = of("X");
    assert_eq!(slices.len(), 4);
    let first_alloc = records.iter().find(|r| r.kind == RecordKind::Alloc).unwrap();
    let first_free = records.iter().find(|r| r.kind == RecordKind::Free).unwrap();
    let a = slices.iter().find(|e| e["args"]["size"] == 3 * MIB).expect("slice of a");
    assert!((a["ts"].as_f64().unwrap() - first_alloc.t_ns as f64 / 1e3).abs() < 1e-3);
    let end = a["ts"].as_f64().unwrap() + a["dur"].as_f64().unwrap();
    assert!((end - first_free.t_ns as f64 / 1e3).abs() < 2e-3);
    assert_eq!(a["args"]["stream"], s1.id());
    // Tracks are named after the streams.
    let names: Vec<String> = of("M")
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains(&format!("stream {}", s1.id())), "{names:?}");
    assert!(names.contains(&format!("stream {}", s2.id())), "{names:?}");
    let b = slices.iter().find(|e| e["args"]["stream"] == s2.id()).expect("slice of b");
    assert_eq!(b["args"]["size"], MIB);
    // Counters follow used / reserved; the last one is the pool's state.
    let counters = of("C");
    let last = counters.last().unwrap();
    let stats = pool.stats();
    assert_eq!(last["args"]["used"], stats.used);
    assert_eq!(last["args"]["reserved"], stats.reserved);
    // Map, unmap, trim and OOM are instants.
    let instants = of("i");
    for cat in ["map", "unmap", "trim", "oom"] {
        assert!(instants.iter().any(|e| e["cat"] == cat), "no {cat} instant");
    }
    let oom = instants.iter().find(|e| e["cat"] == "oom").unwrap();
    assert_eq!(oom["args"]["requested"], 2 * MIB);
    assert_eq!(oom["args"]["stream"], s1.id());
}

#[test]
fn the_ring_keeps_the_last_records_and_exports_stay_valid() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().history(8).build(&dev).unwrap();
    let keep = pool.alloc_async::<u8>(4096, &s).unwrap();
    for i in 0..20 {
        drop(pool.alloc_async::<u8>(512 * (i + 1), &s).unwrap());
    }
    drop(keep); // freed after its alloc left the ring
    let (records, dropped) = pool.history();
    assert_eq!(records.len(), 8);
    let log = pool.history_log().unwrap();
    assert_eq!((log.len(), log.capacity(), log.dropped()), (8, 8, dropped));
    assert_eq!(dropped + 8, 1 + 1 + 40 + 1); // a map, 21 allocs, 21 frees
    let events = check_chrome_trace(&log.to_chrome_trace());
    let before: Vec<&Value> =
        events.iter().filter(|e| e["args"]["allocated_before_window"] == true).collect();
    assert!(
        before.iter().any(|e| e["args"]["size"] == 4096
            && e["ts"].as_f64()
                == events
                    .iter()
                    .filter(|e| e["ph"] == "C")
                    .map(|e| e["ts"].as_f64())
                    .next()
                    .flatten()),
        "the free of `keep` is a slice from the window's start"
    );
    // The replay CSV leaves out the free of an allocation it never saw.
    let csv = log.to_trace_csv();
    let ops = parse_trace_csv(&csv);
    assert!(ops.iter().all(|op| op.0 == 'a' || ops.iter().any(|a| a.0 == 'a' && a.1 == op.1)));
    assert_eq!(serde_json::Value::Null, Value::Null);
    assert_eq!(log.to_json_lines().lines().count(), 8);
}

/// `(op, id, bytes, stream)` rows of a trace CSV, checking its format: the header
/// `op,id,bytes,stream`, then `a,<id>,<bytes>,<stream>` for an allocation (ids count up from
/// 0 in allocation order, bytes > 0) and `f,<id>,0,<stream>` for the free of a live one.
fn parse_trace_csv(text: &str) -> Vec<(char, u64, u64, u64)> {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("op,id,bytes,stream"));
    let mut live = std::collections::HashSet::new();
    let mut next_id = 0;
    let mut out = Vec::new();
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), 4, "{line}");
        let (id, bytes, stream): (u64, u64, u64) =
            (f[1].parse().unwrap(), f[2].parse().unwrap(), f[3].parse().unwrap());
        match f[0] {
            "a" => {
                assert_eq!(id, next_id, "ids count up from 0 in allocation order");
                next_id += 1;
                assert!(bytes > 0);
                live.insert(id);
                out.push(('a', id, bytes, stream));
            }
            "f" => {
                assert!(live.remove(&id), "free of a live allocation: {line}");
                assert_eq!(bytes, 0);
                out.push(('f', id, bytes, stream));
            }
            op => panic!("op {op}"),
        }
    }
    out
}

#[test]
fn trace_csv_round_trips_the_alloc_free_sequence() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = pool_with_history(&dev);
    workload(&pool, &s1, &s2);
    let (records, _) = pool.history();
    let ops = parse_trace_csv(&pool.history_trace_csv());
    // The same sequence: allocations with their requested bytes and stream, frees naming them.
    let mut ids_by_offset = HashMap::new();
    let mut next = 0;
    let expected: Vec<(char, u64, u64, u64)> = records
        .iter()
        .filter_map(|r| match r.kind {
            RecordKind::Alloc => {
                ids_by_offset.insert(r.offset, next);
                next += 1;
                Some(('a', next - 1, r.requested, r.stream))
            }
            RecordKind::Free => Some(('f', ids_by_offset.remove(&r.offset).unwrap(), 0, r.stream)),
            _ => None,
        })
        .collect();
    assert_eq!(ops, expected);
    assert_eq!(ops[0], ('a', 0, 3 * MIB, s1.id()));
    assert_eq!(ops[1], ('a', 1, MIB, s2.id()));
    assert_eq!(ops.iter().filter(|o| o.0 == 'a').count(), 4);
    // soma-replay's own parser reads it as the same sequence, streams included.
    let trace = soma_tools::trace::Trace::parse("history", &pool.history_trace_csv()).unwrap();
    let replayed: Vec<(char, u64, u64, u64)> = trace
        .ops
        .iter()
        .zip(&trace.streams)
        .map(|(op, &s)| match *op {
            soma_tools::trace::Op::Alloc { slot, bytes } => {
                ('a', u64::from(slot), bytes, u64::from(s))
            }
            soma_tools::trace::Op::Free { slot } => ('f', u64::from(slot), 0, u64::from(s)),
        })
        .collect();
    assert_eq!(replayed, ops);
    assert_eq!(trace.stats.peak_live_bytes, 4 * MIB);
    // Replaying it on a fresh pool gives the same used high-water mark.
    let replay = MemPool::builder().max_size(4 * MIB).build(&dev).unwrap();
    let streams: HashMap<u64, &soma::Stream<'_>> = [(s1.id(), &s1), (s2.id(), &s2)].into();
    let mut live = HashMap::new();
    for (op, id, bytes, stream) in ops {
        match op {
            'a' => {
                live.insert(
                    id,
                    replay.alloc_async::<u8>(bytes as usize, streams[&stream]).unwrap(),
                );
            }
            _ => drop(live.remove(&id)),
        }
    }
    assert_eq!(replay.stats().used_high, pool.stats().used_high);
}

#[test]
fn snapshot_json_has_segments_blocks_states_and_totals() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 * MIB).build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(MIB as usize, &s1).unwrap();
    let b = pool.alloc_async::<u8>(MIB as usize, &s2).unwrap();
    let c = pool.alloc_async::<u8>(512 * 1024, &s1).unwrap();
    let _gate = Gate::close(&s2); // keeps b's free pending on s2
    drop(b);
    let snap = pool.snapshot();
    let stats = pool.stats();
    assert_eq!(snap.used, stats.used);
    assert_eq!(snap.reserved, stats.reserved);
    assert_eq!(snap.largest_free_block, stats.largest_free_block);
    assert_eq!(snap.used + snap.cached + snap.free, snap.reserved);
    assert_eq!(snap.live_blocks(), 2);
    assert_eq!(snap.cached_by_stream(), vec![(Some(s2.id()), snap.cached_by_stream()[0].1, MIB)]);
    assert!(snap.blocks().any(|b| matches!(b.status,
        BlockStatus::Cached { stream: Some(id), host_observed: false, .. } if id == s2.id())));

    let v: Value = serde_json::from_str(&snap.to_json()).expect("snapshot JSON");
    for key in ["t_ns", "max_size", "alignment"] {
        assert!(v[key].is_u64(), "{key}");
    }
    assert_eq!(v["max_size"], 64 * MIB);
    let totals = &v["totals"];
    for key in [
        "used",
        "reserved",
        "cached",
        "free",
        "largest_free_block",
        "segments",
        "blocks",
        "live_blocks",
    ] {
        assert!(totals[key].is_u64(), "totals.{key}");
    }
    assert_eq!(totals["used"], stats.used);
    assert_eq!(totals["reserved"], stats.reserved);
    assert_eq!(totals["cached"], MIB);
    assert_eq!(totals["live_blocks"], 2);
    assert_eq!(v["cached_by_stream"][0]["stream"], s2.id());
    assert_eq!(v["cached_by_stream"][0]["bytes"], MIB);
    let segments = v["segments"].as_array().unwrap();
    assert_eq!(segments.len() as u64, totals["segments"].as_u64().unwrap());
    let (mut seg_sum, mut used, mut blocks) = (0, 0, 0);
    let mut prev_end = 0;
    for seg in segments {
        let (off, size) = (seg["offset"].as_u64().unwrap(), seg["size"].as_u64().unwrap());
        assert!(off >= prev_end, "segments in address order");
        prev_end = off + size;
        seg_sum += size;
        let mut at = off;
        for b in seg["blocks"].as_array().unwrap() {
            blocks += 1;
            assert_eq!(b["offset"].as_u64().unwrap(), at, "blocks tile their segment");
            let size = b["size"].as_u64().unwrap();
            at += size;
            match b["state"].as_str().unwrap() {
                "live" => used += size,
                "cached" => {
                    assert_eq!(b["stream"], s2.id());
                    assert!(b["slot"].is_u64() && b["pos"].is_u64());
                    assert_eq!(b["host_observed"], false);
                }
                "free" => assert!(b.get("stream").is_none()),
                s => panic!("state {s}"),
            }
        }
        assert_eq!(at, off + size);
    }
    assert_eq!(seg_sum, stats.reserved);
    assert_eq!(used, stats.used);
    assert_eq!(blocks, totals["blocks"].as_u64().unwrap());
    let text = snap.to_string();
    assert!(text.contains(&format!("cached on stream {}: 1.0 MiB", s2.id())), "{text}");
    drop((a, c));
}

#[test]
fn svg_timeline_draws_lines_bands_and_axes() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().history(4096).build(&dev).unwrap();
    let mut live = Vec::new();
    for i in 0..30usize {
        live.push(pool.alloc_async::<u8>((i % 5 + 1) * MIB as usize, &s).unwrap());
        if i % 3 == 2 {
            live.remove(i % live.len());
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    drop(live);
    let svg = pool.history_svg(&SvgOptions::titled("test <timeline> & co"));
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("test &lt;timeline&gt; &amp; co"), "title escaped");
    assert_eq!(svg.matches("<polyline class=\"used\"").count(), 1);
    assert_eq!(svg.matches("<polyline class=\"reserved\"").count(), 1);
    // One band per allocation (30 here, fewer than max_bands).
    assert_eq!(svg.matches("<path class=\"alloc\"").count(), 30);
    assert_eq!(svg.matches("<title>").count(), svg.matches("</title>").count());
    // Axis labels with units.
    assert!(svg.contains("memory (MiB)"), "y axis label");
    assert!(svg.contains(">0 MiB<") && svg.contains(" MiB</text>"));
    assert!(
        ["(ms)", "(µs)", "(s)"].iter().any(|u| svg.contains(&format!(">time {u}<"))),
        "x axis label"
    );
    // Capped bands: the rest goes into the "other" band.
    let mut few = SvgOptions::titled("capped");
    few.max_bands = 5;
    let svg = pool.history_log().unwrap().to_svg(&few);
    assert_eq!(svg.matches("<path class=\"alloc\"").count(), 5);
    assert_eq!(svg.matches("<path class=\"other\"").count(), 1);
}

#[test]
fn reset_highs_restarts_from_current_values() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().release_threshold(0).build(&dev).unwrap();
    let keep = pool.alloc_async::<u8>(MIB as usize, &s).unwrap();
    drop(pool.alloc_async::<u8>(8 * MIB as usize, &s).unwrap());
    let st = pool.stats();
    assert!(st.used_high >= 9 * MIB && st.reserved_high >= 9 * MIB);
    pool.trim_to(0).unwrap();
    pool.reset_highs().unwrap();
    let st = pool.stats();
    assert_eq!((st.used_high, st.reserved_high), (st.used, st.reserved));
    assert_eq!(st.used, MIB);
    drop(pool.alloc_async::<u8>(2 * MIB as usize, &s).unwrap());
    assert_eq!(pool.stats().used_high, 3 * MIB);
    drop(keep);
}

#[test]
fn stats_display_is_a_table_with_human_units() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(3 * MIB as usize / 2, &s).unwrap();
    drop(pool.alloc_async::<u8>(512, &s).unwrap());
    drop(pool.alloc_async::<u8>(512, &s).unwrap()); // reuses the block on the same stream
    let text = pool.stats().to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].contains("current") && lines[0].contains("high"), "{text}");
    let row = |label: &str| {
        lines
            .iter()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no {label} row in\n{text}"))
    };
    assert!(row("used").contains("1.5 MiB"), "{text}");
    assert!(row("reserved").contains("2.0 MiB"), "{text}");
    assert!(row("live allocations").contains(" 1 "), "{text}");
    assert!(row("allocations").trim_end().ends_with(" 3"), "{text}");
    assert!(row("reuses").contains("same stream 1"), "{text}");
    assert!(row("largest free block").contains("KiB") || row("largest free block").contains("MiB"));
    assert!(row("fragmentation").contains('.'), "{text}");
    // Values start in one column.
    let col = |l: &str| l.find(|c: char| c.is_ascii_digit()).unwrap();
    assert_eq!(col(row("allocations")), col(row("frees")));
    drop(a);
}

#[test]
fn stats_snapshot_and_history_agree_under_a_random_workload() {
    let npu = npu();
    let dev = device_of(&npu);
    let streams = [dev.create_stream().unwrap(), dev.create_stream().unwrap()];
    let pool = MemPool::builder().max_size(48 * MIB).history(1 << 16).build(&dev).unwrap();
    let mut rng = TestRng::new(1); // the same workload every run
    let mut live: Vec<soma::PoolAlloc<'_, u8>> = Vec::new();
    let (mut allocs, mut frees, mut ooms) = (0u64, 0u64, 0u64);
    let mut max_used = 0;
    for step in 0..600 {
        let stream = &streams[rng.index(2)];
        match rng.below(10) {
            0..=4 => {
                let bytes = 1 + rng.below(3 * MIB) as usize;
                match pool.alloc_async::<u8>(bytes, stream) {
                    Ok(a) => {
                        allocs += 1;
                        live.push(a);
                    }
                    Err(Error::OutOfMemory(_)) => ooms += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            5..=8 if !live.is_empty() => {
                let i = rng.index(live.len());
                drop(live.swap_remove(i));
                frees += 1;
            }
            9 => {
                let ev = streams[0].record_event().unwrap();
                streams[1].wait_event(&ev).unwrap();
            }
            _ => {}
        }
        let st = pool.stats();
        let live_bytes: u64 = live.iter().map(|a| pool.owns_size(a)).sum();
        assert_eq!(st.used, live_bytes, "step {step}");
        max_used = max_used.max(st.used);
        assert!(st.used <= st.reserved && st.reserved <= st.max_size);
        assert!(st.used_high >= st.used && st.reserved_high >= st.reserved);
        assert_eq!(st.live_allocations, live.len() as u64);
        assert_eq!((st.allocations, st.frees, st.ooms), (allocs, frees, ooms));
        assert_eq!(st.allocations, st.fresh_allocations + st.reuses.total());
        assert_eq!(st.free_bytes, st.reserved - st.used);
        assert!(st.pending_bytes <= st.free_bytes && st.largest_free_block <= st.free_bytes);
        if step % 25 == 0 {
            let snap = pool.snapshot();
            assert_eq!((snap.used, snap.reserved), (st.used, st.reserved));
            assert_eq!(snap.largest_free_block, st.largest_free_block);
            assert_eq!(snap.live_blocks() as u64, st.live_allocations);
            assert_eq!(snap.segments.iter().map(|s| s.size).sum::<u64>(), st.reserved);
        }
        let (records, _) = pool.history();
        if let Some(last) = records.last() {
            assert_eq!((last.used, last.reserved), (st.used, st.reserved), "step {step}");
        }
    }
    let st = pool.stats();
    assert_eq!(st.used_high, max_used);
    let (records, dropped) = pool.history();
    assert_eq!(dropped, 0);
    let count = |k: RecordKind| records.iter().filter(|r| r.kind == k).count() as u64;
    assert_eq!((count(RecordKind::Alloc), count(RecordKind::Free)), (allocs, frees));
    assert_eq!(count(RecordKind::Oom), ooms);
    let mapped: u64 = records.iter().filter(|r| r.kind == RecordKind::Map).map(|r| r.size).sum();
    let unmapped: u64 =
        records.iter().filter(|r| r.kind == RecordKind::Unmap).map(|r| r.size).sum();
    assert_eq!(mapped - unmapped, st.reserved);
    assert_eq!((st.bytes_mapped_total, st.bytes_unmapped_total), (mapped, unmapped));
    assert_eq!(records.iter().map(|r| r.used).max().unwrap(), max_used);
    // The exports of a long random history are valid too.
    check_chrome_trace(&pool.history_chrome_trace());
    let ops = parse_trace_csv(&pool.history_trace_csv());
    assert_eq!(ops.len() as u64, allocs + frees);
    drop(live);
}

/// Rounded size of a live allocation, as the pool accounts it.
trait OwnsSize {
    fn owns_size(&self, a: &soma::PoolAlloc<'_, u8>) -> u64;
}

impl OwnsSize for MemPool<'_> {
    fn owns_size(&self, a: &soma::PoolAlloc<'_, u8>) -> u64 {
        (a.len() as u64).div_ceil(self.alignment()) * self.alignment()
    }
}

#[test]
fn oom_report_names_the_stream_holding_the_memory_and_the_exact_bytes() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(8 * MIB).reuse(ReusePolicy::NONE).build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(2 * MIB as usize, &s2).unwrap();
    let b = pool.alloc_async::<u8>(2 * MIB as usize, &s2).unwrap();
    let c = pool.alloc_async::<u8>(2 * MIB as usize, &s2).unwrap();
    let d = pool.alloc_async::<u8>(2 * MIB as usize, &s2).unwrap();
    // a's and c's frees stay pending on s2 (not complete) until the gate opens.
    let gate = Gate::close(&s2);
    drop(a);
    drop(c);
    assert_eq!(pool.stats().pending_bytes, 4 * MIB);
    // The pool waits for s2 before its retry: open the gate a little later.
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        gate.open();
    });
    let err = pool.alloc_async::<u8>(4 * MIB as usize, &s1).unwrap_err();
    opener.join().unwrap();
    let Error::OutOfMemory(oom) = &err else { panic!("expected OOM, got {err}") };
    // What was pending, by stream id, and the numbers after the retry.
    assert_eq!(oom.pending, vec![PendingFree { stream: s2.id(), bytes: 4 * MIB }]);
    assert_eq!(oom.pending_bytes, 4 * MIB);
    assert!(oom.retried);
    assert_eq!(oom.reuse, ReusePolicy::NONE);
    assert_eq!(oom.stream, s1.id());
    let st = pool.stats();
    assert_eq!((oom.used, oom.reserved, oom.max), (st.used, st.reserved, st.max_size));
    assert_eq!(oom.largest_free_block, st.largest_free_block);
    let mem = dev.mem_info().unwrap();
    assert_eq!(oom.device_total, mem.total);
    let msg = err.to_string();
    let b_ = |n: u64| soma::Bytes(n).to_string();
    for part in [
        format!("cannot allocate 4.0 MiB (4.0 MiB rounded) on stream {}", s1.id()),
        format!(
            "used {}, reserved {}, max {}, free in pool {}, largest free block {}",
            b_(st.used),
            b_(st.reserved),
            b_(st.max_size),
            b_(st.reserved - st.used),
            b_(st.largest_free_block)
        ),
        format!("device: {} free of {}", b_(oom.device_free), b_(mem.total)),
        format!(
            "pending frees: 4.0 MiB on stream {} (the pool waited for them and retried once)",
            s2.id()
        ),
        "reuse policy: follow_event_dependencies off, opportunistic off, internal_dependencies off"
            .into(),
        format!(
            "hint: 4.0 MiB is cached on stream {} and not reusable on stream {}: enable \
             follow_event_dependencies or wait on an event",
            s2.id(),
            s1.id()
        ),
        "fragmented".into(),
        "hint: compact live allocations".into(),
    ] {
        assert!(msg.contains(&part), "missing {part:?} in:\n{msg}");
    }
    // The pool stays usable.
    drop((b, d));
    s2.synchronize().unwrap();
    drop(pool.alloc_async::<u8>(4 * MIB as usize, &s1).unwrap());
}

#[test]
fn oom_report_with_the_rust_defaults_asks_for_an_event() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(4 * MIB).build(&dev).unwrap();
    let a = pool.alloc_async::<u8>(MIB as usize, &s2).unwrap();
    let b = pool.alloc_async::<u8>(2 * MIB as usize, &s2).unwrap();
    let c = pool.alloc_async::<u8>(MIB as usize, &s2).unwrap();
    let gate = Gate::close(&s2);
    drop(a);
    drop(c);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        gate.open();
    });
    let err = pool.alloc_async::<u8>(2 * MIB as usize, &s1).unwrap_err();
    opener.join().unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains(&format!(
            "hint: 2.0 MiB is cached on stream {} and not reusable on stream {}: stream {} is not \
             ordered after those frees: record an event on stream {}",
            s2.id(),
            s1.id(),
            s1.id(),
            s2.id()
        )),
        "{msg}"
    );
    drop(b);
}
