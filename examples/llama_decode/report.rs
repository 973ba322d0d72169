//! What a run measured, and its memory timeline.

use std::path::{Path, PathBuf};
use std::time::Duration;

use soma::sim::SimDevice;
use soma_core::observe::{History, SvgOptions};

use super::Result;

/// Figures of one run.
pub(super) struct RunReport {
    /// The run's name in the table.
    pub(super) name: &'static str,
    /// Decode steps after the prompt.
    pub(super) steps: usize,
    /// The token of each step.
    pub(super) tokens: Vec<u32>,
    /// Host time spent allocating and freeing activations and KV caches.
    pub(super) alloc_overhead: Duration,
    /// Driver calls that allocate, free, map or unmap memory, over the steps.
    pub(super) driver_calls: u64,
    /// Highest memory held for activations and KV caches.
    pub(super) reserved_high: u64,
    /// Highest memory in live activations and KV caches.
    pub(super) used_high: u64,
    /// Host time of the steps.
    pub(super) wall: Duration,
    /// Host time of the weights' allocation.
    pub(super) weights_load: Duration,
    /// The run's allocations and frees (activations and KV caches), for its picture.
    pub(super) history: History,
}

/// The driver calls that allocate, free, map or unmap memory, so far.
pub(super) fn driver_calls(sim: &SimDevice) -> u64 {
    let c = sim.stats().calls;
    c.malloc + c.free + c.alloc_physical + c.free_physical + c.map + c.unmap
}

/// Draws a run's memory timeline into `dir/<file>`.
pub(super) fn write_timeline(dir: &Path, file: &str, r: &RunReport) -> Result<PathBuf> {
    let title = format!(
        "LLaMA-7B decode, {}: activations and KV caches over {} steps after the prompt",
        r.name, r.steps
    );
    let path = dir.join(file);
    std::fs::create_dir_all(dir)?;
    std::fs::write(&path, r.history.to_svg(&SvgOptions::titled(title)))?;
    Ok(path)
}

/// Bytes in MiB, for the table.
pub(super) fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// Bytes in whole GiB, for the configuration.
pub(super) fn gib(b: u64) -> String {
    format!("{} GiB", b >> 30)
}
