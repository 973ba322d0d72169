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

/// Interleaved rounds of the benches that report ratios within a round (5 with
/// `SOMA_BENCH_QUICK=1`).
pub const ROUNDS: usize = 15;

/// Runs `k` measurements in [`ROUNDS`] interleaved rounds: every round calls `measure(j)`
/// once for each `j` in `0..k`, round `r` starting at `r mod k` and going round, so that each
/// runs first, last and in between equally often. Returns, per `j`, its figure of each round
/// in round order.
pub fn interleaved_rounds(k: usize, mut measure: impl FnMut(usize) -> f64) -> Vec<Vec<f64>> {
    let rounds = if quick() { 5 } else { ROUNDS };
    let mut figures: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); k];
    for r in 0..rounds {
        for i in 0..k {
            let j = (r + i) % k;
            figures[j].push(measure(j));
        }
    }
    figures
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

/// Writes the per-call costs of the model behind every modelled driver time
/// (`DriverCostModel::ascend_like`, in ns) to `<out_dir>/driver_cost_model.json`.
pub fn write_cost_model() {
    let model = soma_tools::driver_cost::DriverCostModel::ascend_like();
    write_json("driver_cost_model", &format!("{}\n", model.to_json()));
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

/// criterion 0.5's options that take a value (the next argument, or `--opt=value`).
const VALUE_OPTIONS: &[&str] = &[
    "-c",
    "--color",
    "-s",
    "--save-baseline",
    "-b",
    "--baseline",
    "--baseline-lenient",
    "--format",
    "--profile-time",
    "--load-baseline",
    "--sample-size",
    "--warm-up-time",
    "--measurement-time",
    "--nresamples",
    "--noise-threshold",
    "--confidence-level",
    "--significance-level",
    "--plotting-backend",
    "--output-format",
];

/// criterion 0.5's flags (no value) other than `--exact`.
const FLAGS: &[&str] = &[
    "-v",
    "--verbose",
    "--quiet",
    "-n",
    "--noplot",
    "--discard-baseline",
    "--list",
    "--ignored",
    "--quick",
    "--test",
    "--bench",
    "--nocapture",
    "--show-output",
    "--include-ignored",
];

/// The benchmark filter on this process's command line, as criterion reads it.
enum Filter {
    /// No filter: every benchmark runs.
    None,
    /// A plain string (no regex metacharacters): criterion runs the ids that contain it,
    /// or with `--exact` the id equal to it.
    Plain { text: String, exact: bool },
    /// Anything this parser cannot decide (a regex, an unknown option).
    Unknown,
}

fn filter() -> Filter {
    let mut text = None;
    let mut exact = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if VALUE_OPTIONS.contains(&a.as_str()) {
            args.next();
        } else if a == "--exact" {
            exact = true;
        } else if FLAGS.contains(&a.as_str()) {
        } else if let Some((opt, _)) = a.split_once('=').filter(|_| a.starts_with("--")) {
            if !VALUE_OPTIONS.contains(&opt) {
                return Filter::Unknown;
            }
        } else if a.starts_with('-') || text.is_some() {
            return Filter::Unknown;
        } else {
            text = Some(a);
        }
    }
    match text {
        None => Filter::None,
        Some(t) if t.contains(|c: char| "\\.+*?()|[]{}^$".contains(c)) => Filter::Unknown,
        Some(text) => Filter::Plain { text, exact },
    }
}

/// Whether a benchmark filter was given on the command line (some benchmarks may not run).
pub fn filtered() -> bool {
    !matches!(filter(), Filter::None)
}

/// Whether criterion may run the benchmark `id` (`group/function/value`) under this
/// process's command line. `false` only when the filter is a plain string (no regex
/// metacharacters) that `id` does not contain (with `--exact`: is not equal to); anything
/// this cannot decide counts as selected. The benches use it to skip the work they do
/// outside criterion (untimed and cold replays) for benchmarks that will not run.
pub fn maybe_selected(id: &str) -> bool {
    match filter() {
        Filter::None | Filter::Unknown => true,
        Filter::Plain { text, exact: true } => id == text,
        Filter::Plain { text, exact: false } => id.contains(&text),
    }
}

/// A pool of the public API with the default settings, or (`recycle`) built with
/// `recycle_on_growth(true)`: the `soma` and `soma-recycle` allocators of the benches.
pub fn soma_pool(dev: &soma::Device, recycle: bool) -> soma::MemPool<'_> {
    soma::MemPool::builder().recycle_on_growth(recycle).build(dev).expect("pool")
}
