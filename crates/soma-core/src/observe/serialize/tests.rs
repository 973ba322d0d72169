//! The `serde_json` exports against the hand-written writer, and the serde names against the
//! names the exports document.

use std::panic::Location;

use super::*;
use crate::engine::{BlockInfo, BlockState, FreeTag, ReuseKind};
use crate::observe::{export, json, json_lines, reuse_name, History, RecordKind};
use crate::{PoolStats, ReuseCounts};

const KINDS: [RecordKind; 7] = [
    RecordKind::Alloc,
    RecordKind::Free,
    RecordKind::Map,
    RecordKind::Unmap,
    RecordKind::Trim,
    RecordKind::Oom,
    RecordKind::AllocFailed,
];

/// A snapshot with every kind of block: two segments around an unmapped gap; live, free and
/// cached blocks, cached on a live stream (host-observed or not) and on a dropped one.
fn snapshot() -> Snapshot {
    let block = |offset, size, state| BlockInfo { offset, size, state };
    let cached = |stream, pos| BlockState::Free(Some(FreeTag { stream, pos }));
    let blocks = [
        block(0, 512, BlockState::Live),
        block(512, 1024, cached(0, 3)),
        block(1536, 512, cached(2, 9)),
        block(2048, 2048, BlockState::Free(None)),
        block(4096, 4096, BlockState::Unmapped),
        block(8192, 1024, BlockState::Live),
        block(9216, 1024, cached(0, 8)),
        block(10240, 6144, BlockState::Unmapped),
    ];
    // Slot 0 is stream 7, whose frees before position 5 the host has observed; slot 2's
    // stream has been dropped.
    let stream_of = |slot| if slot == 0 { (Some(7), 5) } else { (None, 0) };
    Snapshot::from_blocks(1_234_567, 16384, 512, blocks.into_iter(), stream_of)
}

/// A record of every kind, every reuse rule and none, with and without a source location.
fn records() -> Vec<Record> {
    let here = Location::caller();
    let reuses = ReuseKind::ALL.map(Some).into_iter().chain([None]).cycle();
    KINDS
        .into_iter()
        .chain(KINDS)
        .zip(reuses)
        .enumerate()
        .map(|(i, (kind, reuse))| {
            let n = i as u64;
            Record {
                t_ns: 1000 * n + 7,
                kind,
                stream: n % 3,
                offset: 512 * n,
                size: 1024 + n,
                requested: 1000 + n,
                used: 4096 * n,
                reserved: 1 << 20,
                reuse,
                location: (i % 2 == 0).then_some(here),
            }
        })
        .collect()
}

#[test]
fn snapshot_json_is_the_hand_written_one() {
    let snapshot = snapshot();
    let json = snapshot.to_json();
    assert_eq!(json, snapshot.to_json_by_hand());
    for part in [
        r#""cached_by_stream":[{"stream":7,"slot":0,"bytes":2048},{"stream":null,"slot":2,"bytes":512}]"#,
        r#"{"offset":0,"size":512,"state":"live"}"#,
        r#"{"offset":512,"size":1024,"state":"cached","stream":7,"slot":0,"pos":3,"host_observed":true}"#,
        r#"{"offset":2048,"size":2048,"state":"free"}"#,
    ] {
        assert!(json.contains(part), "missing {part} in {json}");
    }
}

#[test]
fn json_lines_are_the_hand_written_ones() {
    let records = records();
    let lines = json_lines(&records);
    assert_eq!(lines, export::json_lines_by_hand(&records));
    assert_eq!(lines.lines().count(), records.len());
    assert!(lines.contains(r#""location":{"file":""#) && lines.contains(r#""location":null"#));
    // A ring that has wrapped exports the records it holds, the same way.
    let mut history = History::new(5);
    records.iter().for_each(|r| history.push(*r));
    assert_eq!(history.to_json_lines(), export::json_lines_by_hand(&history.to_vec()));
}

#[test]
fn strings_are_escaped_as_the_hand_written_writer_escapes_them() {
    let text = "q\"b\\s/ \n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f} é \u{2028}\u{2029} 🦀 end";
    let mut by_hand = String::new();
    json::string(&mut by_hand, text);
    let mut out = Vec::new();
    write(&mut out, &text);
    assert_eq!(into_string(out), by_hand);
}

/// The serde names of the kinds and reuse rules are the names the exports document.
#[test]
fn kinds_and_reuse_rules_serialize_by_their_export_names() {
    for kind in KINDS {
        assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{}\"", kind.as_str()));
        assert_eq!(
            serde_json::from_str::<RecordKind>(&format!("\"{}\"", kind.as_str())).unwrap(),
            kind
        );
    }
    for rule in ReuseKind::ALL {
        assert_eq!(serde_json::to_string(&rule).unwrap(), format!("\"{}\"", reuse_name(rule)));
    }
}

/// The statistics' keys are their field names, in declaration order: a renamed field fails
/// here before it breaks a consumer's dashboard.
#[test]
fn pool_stats_serialize_under_their_field_names() {
    let stats = PoolStats {
        used: 1,
        used_high: 2,
        reserved: 3,
        reserved_high: 4,
        max_size: 5,
        live_allocations: 6,
        live_allocations_high: 7,
        allocations: 8,
        frees: 9,
        fresh_allocations: 10,
        reuses: ReuseCounts {
            same_stream: 11,
            event_dependency: 12,
            opportunistic: 13,
            internal_dependency: 14,
            host_synchronized: 15,
        },
        map_calls: 16,
        unmap_calls: 17,
        mapped_segments: 18,
        bytes_mapped_total: 19,
        bytes_unmapped_total: 20,
        recycling_pauses: 21,
        pending_bytes: 22,
        free_bytes: 23,
        largest_free_block: 24,
        ooms: 25,
        oom_retries: 26,
        graph_reserved: 27,
    };
    let expected = concat!(
        r#"{"used":1,"used_high":2,"reserved":3,"reserved_high":4,"max_size":5,"#,
        r#""live_allocations":6,"live_allocations_high":7,"allocations":8,"frees":9,"#,
        r#""fresh_allocations":10,"reuses":{"same_stream":11,"event_dependency":12,"#,
        r#""opportunistic":13,"internal_dependency":14,"host_synchronized":15},"#,
        r#""map_calls":16,"unmap_calls":17,"mapped_segments":18,"bytes_mapped_total":19,"#,
        r#""bytes_unmapped_total":20,"recycling_pauses":21,"pending_bytes":22,"free_bytes":23,"#,
        r#""largest_free_block":24,"ooms":25,"oom_retries":26,"graph_reserved":27}"#
    );
    assert_eq!(serde_json::to_string(&stats).unwrap(), expected);
}

/// Reading the export back gives the snapshot, whatever the counts it carries say.
#[test]
fn a_snapshot_reads_back_from_its_json() {
    let snapshot = snapshot();
    assert_eq!(serde_json::from_str::<Snapshot>(&snapshot.to_json()).unwrap(), snapshot);
    let edited = snapshot.to_json().replace(r#""live_blocks":2"#, r#""live_blocks":99"#);
    assert_ne!(edited, snapshot.to_json());
    assert_eq!(serde_json::from_str::<Snapshot>(&edited).unwrap(), snapshot);
}
