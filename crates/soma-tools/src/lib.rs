//! Benchmark and replay tooling for soma.
//!
//! * [`trace`]: the real PyTorch allocator traces (`op,id,bytes,stream`, `.csv` or
//!   `.csv.gz`) parsed into dense [`trace::Op`] sequences;
//! * [`workload`]: synthetic workloads (RAPIDS RMM's `random_allocations`, the hot-path
//!   checkerboard) as pre-generated op sequences, and the generic replay loop;
//! * [`baselines`]: the one [`baselines::Allocator`] trait every allocator under test is
//!   driven through — soma (public API and engine alone), `offset-allocator`, a TLSF over
//!   offsets, replicas of CANN SOMA's algorithm, of torch_npu's caching allocator and of
//!   llama.cpp's CANN pool, a first-fit free list and the plain driver path;
//! * [`driver_cost`]: driver calls by kind and the Ascend-like model of what they cost.
//!
//! The criterion benches in the workspace's top-level `benches/` and the `soma-replay`
//! binary both use this library, so every figure is measured by the same code.

pub mod baselines;
pub mod driver_cost;
pub mod trace;
pub mod workload;

/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// The Ascend mapping granularity (2 MiB), the unit in which reserved memory is counted.
pub const GRANULE: u64 = 2 * MIB;

/// `x` rounded up to a multiple of the power of two `a`.
#[inline]
pub fn round_up(x: u64, a: u64) -> u64 {
    (x + a - 1) & !(a - 1)
}
