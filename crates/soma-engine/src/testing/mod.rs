//! Test doubles of the engine's two collaborators, and a test generator (feature `testing`).
//!
//! The engine's own tests, soma-tools' benchmark baselines and the fuzz targets share them,
//! so that every harness exercises the engine against the same fakes:
//!
//! * [`FakeBacking`]: the physical side. Counting only (the cheapest, for benchmarks), or
//!   checked: it records every mapping and asserts that the engine maps whole granules
//!   inside its range, never over a mapping, and unmaps exactly what it mapped. Both modes
//!   take a capacity and inject map and unmap failures.
//! * [`TestOrder`]: stream order from fixed tables (bounds per stream, switches).
//! * [`StreamClocks`]: stream order derived from a small model of streams — positions,
//!   completion, host observations, event waits — as a pool derives it from the device;
//!   [`StreamClocks::order`] is its view for one request.
//! * [`TestRng`]: a small deterministic generator (xorshift64).

mod backing;
mod order;
mod rng;

pub use backing::{FakeBacking, Injected};
pub use order::{ClockOrder, StreamClocks, TestOrder};
pub use rng::TestRng;
