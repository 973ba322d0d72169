//! Feature `serde`: a pool's statistics, history records and snapshot survive a round trip
//! through `serde_json`, and its out-of-memory report serializes with its numbers.

use serde_json::Value;
use soma_core::observe::{Record, Snapshot};
use soma_core::{Device, Error, MemPool, PoolStats, ReusePolicy};
use soma_sim::Npu;

const MIB: usize = 1 << 20;

#[test]
fn stats_records_and_snapshots_round_trip_through_serde_json() {
    let npu = Npu::builder().build().unwrap();
    let dev = Device::new(npu.device(0).unwrap());
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    // No cross-stream reuse: what is cached on s2 stays there, whenever its free completes.
    let pool = MemPool::builder()
        .max_size(4 * MIB as u64)
        .reuse(ReusePolicy::NONE)
        .history(256)
        .build(&dev)
        .unwrap();
    let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    drop(a);
    let c = pool.alloc_async::<u8>(MIB, &s1).unwrap(); // a same-stream reuse
    drop(b); // cached on s2
    let d = pool.alloc_async::<u8>(MIB / 2, &s1).unwrap();

    let stats = pool.stats();
    assert!(stats.allocations == 4 && stats.reuses.total() == 1, "{stats:?}");
    let json = serde_json::to_string(&stats).unwrap();
    assert_eq!(serde_json::from_str::<PoolStats>(&json).unwrap(), stats);

    let (records, _) = pool.history();
    let mut lines = String::new();
    for record in &records {
        let json = serde_json::to_string(record).unwrap();
        lines += &json;
        lines.push('\n');
        // The source location is read and dropped; every other field comes back.
        let back: Record = serde_json::from_str(&json).unwrap();
        assert_eq!(back, Record { location: None, ..*record });
    }
    assert!(records.iter().any(|r| r.location.is_some() && r.reuse.is_some()));
    assert_eq!(lines, pool.history_json_lines());

    let snapshot = pool.snapshot();
    assert!(snapshot.live_blocks() == 2 && snapshot.cached == MIB as u64, "{snapshot}");
    let json = serde_json::to_string(&snapshot).unwrap();
    assert_eq!(json, snapshot.to_json());
    assert_eq!(serde_json::from_str::<Snapshot>(&json).unwrap(), snapshot);
    drop((c, d));
}

#[test]
fn the_out_of_memory_report_serializes_with_its_numbers() {
    let npu = Npu::builder().build().unwrap();
    let dev = Device::new(npu.device(0).unwrap());
    let s = dev.create_stream().unwrap();
    let pool =
        MemPool::builder().max_size(2 * MIB as u64).reuse(ReusePolicy::NONE).build(&dev).unwrap();
    let live = pool.alloc_async::<u8>(MIB, &s).unwrap();
    let Err(Error::OutOfMemory(report)) = pool.alloc_async::<u8>(2 * MIB, &s) else {
        panic!("a request larger than what is left fails with out of memory");
    };
    let v: Value = serde_json::to_value(&*report).unwrap();
    assert_eq!(v["requested"], 2 * MIB as u64);
    assert_eq!(v["used"], MIB as u64);
    assert_eq!(v["max"], 2 * MIB as u64);
    assert_eq!(v["stream"], s.id());
    assert_eq!(v["pending"], Value::Array(Vec::new()));
    assert_eq!(v["retried"], false);
    assert_eq!(
        v["reuse"],
        serde_json::json!({
            "follow_event_dependencies": false,
            "opportunistic": false,
            "internal_dependencies": false
        })
    );
    drop(live);
}
