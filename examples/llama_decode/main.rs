//! LLaMA-7B-shaped decoding on the software NPU, with realistic driver latencies, three ways:
//! allocating every tensor through the plain driver (`malloc` / synchronise / `free`, as code
//! without a pool must), through soma's stream-ordered pools, and through the pools with the
//! decode step captured into a graph and launched at every step.
//!
//! ```sh
//! cargo run --release --example llama_decode                 # 6 + 64 + 64 decode steps
//! cargo run --release --example llama_decode -- --quick      # 2 + 8 + 8 steps
//! cargo run --release --example llama_decode -- --out DIR    # pictures into DIR
//! ```
//!
//! What it allocates, per decode step (batch 1, fp16 shapes stored as `f32` activations):
//! 32 layers × (norm, q, k, v, scores, probs, attention output, o-projection, residual,
//! norm, gate, up, activation, down, residual) plus a KV cache per layer that grows by
//! reallocation every 16 tokens, and the logits. The 13.5 GB of weights are allocated once
//! and never written, so the process stays small; the kernels compute real attention over
//! the KV cache, so every run must produce the same tokens.
//!
//! The graph run (`graph.rs`) captures the step once per KV-cache length bucket, its
//! activations allocated and freed inside the capture (served once, at capture time, from
//! memory the pool keeps for the graph), and launches the graph at every step; it ends by
//! comparing the graph memory of several buckets' graphs, each with its own region and all
//! in one shared graph pool. The latency model charges
//! the launch cost once per launch instead of once per task (420 tasks a step, about 2 ms at
//! 5 µs each), and the host enqueues one task instead of hundreds. The table shows each run's
//! host time per step; the kernels' real computation on the CPU dominates it, so the graph's
//! saving is of the order of those 2 ms, within the run-to-run noise of a loaded machine.
//!
//! The driver and pool runs also draw their memory timeline (used and reserved bytes over
//! time, live allocations stacked as bands) to `llama_decode_driver.svg` and
//! `llama_decode_pool.svg` in the output directory, which the demo prints: `--out DIR`, else
//! `llama_decode/` in the target directory (`$CARGO_TARGET_DIR`, else the workspace's
//! `target/`), so that a run never writes over files of the checkout. The pool run's picture
//! comes from the activation pool's own history, the driver run's from a
//! [`History`](soma_core::observe::History) that the demo fills itself at every allocation and
//! free. `scripts/refresh-doc-images.sh` runs the demo with `--out docs/img` to refresh the
//! pictures of the README.

mod eager;
mod graph;
mod kernels;
mod report;

use std::path::{Path, PathBuf};
use std::time::Duration;

use soma::sim::{LatencyModel, Npu};

use report::{gib, mib, write_timeline};

const HIDDEN: usize = 4096;
const LAYERS: usize = 32;
const HEADS: usize = 32;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 11008;
const VOCAB: usize = 32000;
const PROMPT: usize = 96;
const KV_BLOCK: usize = 16;
const WEIGHT_BYTES_PER_ELEM: usize = 2; // fp16
/// The weights' pool: room for the 13.5 GB of weights.
const WEIGHTS_POOL_MAX: u64 = 16 << 30;
/// The activations' and KV caches' pool.
const ACTIVATIONS_POOL_MAX: u64 = 8 << 30;
/// Events the activation pool's history keeps: enough for the whole run.
const HISTORY_EVENTS: usize = 1 << 17;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Element counts of the LLaMA-7B weights, one entry per tensor.
fn weight_shapes() -> Vec<usize> {
    let mut shapes = vec![VOCAB * HIDDEN]; // embedding
    for _ in 0..LAYERS {
        shapes.extend([HIDDEN * HIDDEN; 4]); // q, k, v, o
        shapes.extend([HIDDEN * FFN; 3]); // gate, up, down
        shapes.extend([HIDDEN; 2]); // norms
    }
    shapes.extend([HIDDEN, VOCAB * HIDDEN]); // final norm, lm head
    shapes
}

const USAGE: &str = "usage: llama_decode [--quick] [--out DIR]
  --quick    2 decode steps through the driver and 8 through the pools, without and with
             graph capture (default 6 and 64)
  --out DIR  where the memory timelines go (default: llama_decode/ in the target directory)";

/// The command line: decode steps of each run (the graph run does as many as the pool run)
/// and the output directory.
struct Options {
    driver_steps: usize,
    pool_steps: usize,
    out: PathBuf,
}

impl Options {
    fn parse() -> Result<Options> {
        let mut o = Options { driver_steps: 6, pool_steps: 64, out: default_out_dir() };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            match a.as_str() {
                "--quick" => (o.driver_steps, o.pool_steps) = (2, 8),
                "--out" => o.out = args.next().ok_or(USAGE)?.into(),
                "--help" | "-h" => {
                    println!("{USAGE}");
                    std::process::exit(0);
                }
                _ => return Err(format!("unknown argument {a:?}\n{USAGE}").into()),
            }
        }
        Ok(o)
    }
}

/// `llama_decode/` in the target directory: `$CARGO_TARGET_DIR` (relative to the workspace
/// when relative), else the workspace's `target/`.
fn default_out_dir() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), |dir| workspace.join(dir));
    target.join("llama_decode")
}

/// The latency model in words.
fn describe_latency(m: &LatencyModel) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!(
        "{} ms per driver allocation, {} ms per map or unmap, {} µs per task launch, copies at {} GB/s",
        ms(m.driver_alloc),
        ms(m.map),
        m.launch.as_micros(),
        m.copy_bandwidth / 1_000_000_000
    )
}

/// What the demo runs, in words.
fn print_configuration(o: &Options, latency: &LatencyModel) {
    let shapes = weight_shapes();
    let weight_bytes = shapes.iter().sum::<usize>() * WEIGHT_BYTES_PER_ELEM;
    println!("LLaMA-7B decode on the software NPU, batch 1");
    println!(
        "  model:    {LAYERS} layers, hidden size {HIDDEN}, {HEADS} attention heads of \
         {HEAD_DIM}, feed-forward {FFN}, vocabulary {VOCAB}"
    );
    println!(
        "  weights:  {:.1} GB of fp16 in {} tensors, allocated once, never written",
        weight_bytes as f64 / 1e9,
        shapes.len()
    );
    println!("  prompt:   {PROMPT} tokens; each layer's KV cache grows by reallocation every {KV_BLOCK} tokens");
    println!(
        "  runs:     {} decode steps allocating through the driver (malloc, synchronize, free), \
         {} through soma pools, {} through soma pools with the step captured into a graph \
         (once per KV-cache bucket) and launched",
        o.driver_steps, o.pool_steps, o.pool_steps
    );
    println!(
        "  pools:    weights in a pool of {} that maps one segment per growth; activations \
         and KV caches in a pool of {} with the default reuse policy, keeping a history of \
         its last {HISTORY_EVENTS} events",
        gib(WEIGHTS_POOL_MAX),
        gib(ACTIVATIONS_POOL_MAX)
    );
    println!("  latency:  Ascend-like: {}", describe_latency(latency));
    println!("  pictures: {}\n", o.out.display());
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llama_decode: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let options = Options::parse()?;
    let latency = LatencyModel::ascend_like();
    let npu = Npu::builder().latency(latency).build()?;
    print_configuration(&options, &latency);

    let driver = eager::run_driver(&npu, options.driver_steps)?;
    let pool = eager::run_pool(&npu, options.pool_steps)?;
    let graph = graph::run_graph(&npu, options.pool_steps)?;

    println!(
        "{:<20} {:>6} {:>14} {:>13} {:>12} {:>12} {:>8} {:>12} {:>12}",
        "run",
        "steps",
        "alloc ms/step",
        "driver calls",
        "reserved hi",
        "used hi",
        "frag",
        "wall ms/step",
        "weights load"
    );
    for r in [&driver, &pool, &graph] {
        let per = |d: Duration| d.as_secs_f64() * 1e3 / r.steps as f64;
        println!(
            "{:<20} {:>6} {:>14.3} {:>13.1} {:>12} {:>12} {:>8.3} {:>12.2} {:>10.0}ms",
            r.name,
            r.steps,
            per(r.alloc_overhead),
            r.driver_calls as f64 / r.steps as f64,
            mib(r.reserved_high),
            mib(r.used_high),
            r.reserved_high as f64 / r.used_high.max(1) as f64,
            per(r.wall),
            r.weights_load.as_secs_f64() * 1e3,
        );
    }
    let common = driver.tokens.len().min(pool.tokens.len());
    if driver.tokens[..common] != pool.tokens[..common] || graph.tokens != pool.tokens {
        return Err(format!(
            "token mismatch: {:?} vs {:?} vs {:?}",
            driver.tokens, pool.tokens, graph.tokens
        )
        .into());
    }
    println!(
        "\ntokens of the three runs agree over the first {common} steps: {:?}",
        &pool.tokens[..common]
    );
    let driver_svg = write_timeline(&options.out, "llama_decode_driver.svg", &driver)?;
    let pool_svg = write_timeline(&options.out, "llama_decode_pool.svg", &pool)?;
    println!(
        "allocation overhead per step: {:.2} ms (driver) -> {:.3} ms (pool), {:.0}x less",
        driver.alloc_overhead.as_secs_f64() * 1e3 / driver.steps as f64,
        pool.alloc_overhead.as_secs_f64() * 1e3 / pool.steps as f64,
        (driver.alloc_overhead.as_secs_f64() / driver.steps as f64)
            / (pool.alloc_overhead.as_secs_f64() / pool.steps as f64).max(1e-12)
    );
    let per_step = |r: &report::RunReport| r.wall.as_secs_f64() * 1e3 / r.steps as f64;
    println!(
        "host time per step: {:.2} ms (driver), {:.2} ms (pool), {:.2} ms (pool + graph)",
        per_step(&driver),
        per_step(&pool),
        per_step(&graph)
    );
    println!("memory timelines: {} and {}", driver_svg.display(), pool_svg.display());
    Ok(())
}
