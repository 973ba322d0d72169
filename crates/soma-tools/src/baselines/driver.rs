//! The plain driver path: one `malloc` / `free` per allocation.

use soma::hal::{DeviceHal, DevicePtr};

use super::Allocator;
use crate::driver_cost::DriverCalls;
use crate::round_up;

/// One `DeviceHal::malloc` / `free` per allocation (no pool at all).
pub struct DriverPath<'a> {
    hal: &'a dyn DeviceHal,
    granularity: u64,
    live: u64,
    high: u64,
    calls: DriverCalls,
}

impl<'a> DriverPath<'a> {
    /// Allocates through `hal` (whose device has granularity `granularity`).
    pub fn new(hal: &'a dyn DeviceHal, granularity: u64) -> Self {
        DriverPath { hal, granularity, live: 0, high: 0, calls: DriverCalls::default() }
    }
}

impl std::fmt::Debug for DriverPath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverPath").field("live", &self.live).field("high", &self.high).finish()
    }
}

impl Allocator for DriverPath<'_> {
    type Handle = (DevicePtr, u64);
    fn name(&self) -> &'static str {
        "driver"
    }
    fn alloc(&mut self, bytes: u64) -> Option<(DevicePtr, u64)> {
        let p = self.hal.malloc(bytes).ok()?;
        self.calls.malloc += 1;
        let size = round_up(bytes, self.granularity);
        self.live += size;
        self.high = self.high.max(self.live);
        Some((p, size))
    }
    fn free(&mut self, (p, size): (DevicePtr, u64)) {
        self.hal.free(p).expect("driver free");
        self.calls.free += 1;
        self.live -= size;
    }
    fn reserved_high(&self) -> u64 {
        self.high
    }
    fn driver_calls(&self) -> DriverCalls {
        self.calls
    }
}
