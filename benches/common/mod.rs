//! Shared helpers of the side-by-side benches: criterion settings, output paths, the software
//! NPU used by the public-API and driver-path figures.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use criterion::{Criterion, SamplingMode};

/// `SOMA_BENCH_QUICK=1`: the ~2-minute smoke run.
pub fn quick() -> bool {
    std::env::var("SOMA_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// Criterion for fast, steady-state loops (hot path).
pub fn fast_config() -> Criterion {
    let c = Criterion::default().configure_from_args();
    if quick() {
        c.warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(500))
            .sample_size(10)
    } else {
        c.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2))
            .sample_size(30)
    }
}

/// Criterion for whole-sequence replays (one iteration = one replay, reported per op).
pub fn replay_config() -> Criterion {
    let c = Criterion::default().configure_from_args();
    if quick() {
        c.warm_up_time(Duration::from_millis(50))
            .measurement_time(Duration::from_millis(200))
            .sample_size(10)
    } else {
        c.warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_secs(1))
            .sample_size(10)
    }
}

/// Sampling mode for replays: flat (every sample the same number of replays).
pub const REPLAY_SAMPLING: SamplingMode = SamplingMode::Flat;

/// The repository root (the root package's manifest directory).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where the benches write their non-time figures (JSON): `<target>/soma-bench/`.
pub fn out_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let dir = target.join("soma-bench");
    std::fs::create_dir_all(&dir).expect("create the soma-bench output directory");
    dir
}

/// Writes `json` to `<out_dir>/<name>.json` and says where.
pub fn write_json(name: &str, json: &str) {
    let path = out_dir().join(format!("{name}.json"));
    std::fs::write(&path, json).expect("write bench JSON");
    println!("wrote {}", path.display());
}

/// A software NPU large enough for every workload here (address space only: memory that
/// is mapped but never touched costs no RAM).
pub fn npu() -> soma::sim::Npu {
    soma::sim::Npu::builder().capacity(512 << 30).build().expect("software NPU")
}

/// Pool range of the engine-alone and pure offset allocators: 1 TiB.
pub const RANGE: u64 = 1 << 40;

/// A replay slower than this is timed once and not handed to criterion (whose minimum of
/// 10 samples would take minutes); the benches record it in their JSON as a `slow` cell.
pub fn slow_replay_limit() -> std::time::Duration {
    if quick() {
        std::time::Duration::from_millis(300)
    } else {
        std::time::Duration::from_millis(1500)
    }
}
