//! The software NPU backend (feature `sim`, on by default).
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use soma::sim::{LatencyModel, Npu, Product};
//! let npu = Npu::builder().devices(2).capacity(16 << 30).product(Product::AtlasA2)
//!     .latency(LatencyModel::none()).build()?;
//! let dev = npu.device(1)?;
//! assert_eq!(dev.info().total_memory, 16 << 30);
//! // The simulator's own counters and fault injection:
//! assert_eq!(npu.sim_device(1)?.stats().physical_bytes, 0);
//! # Ok(()) }
//! ```

use std::sync::Arc;

/// The stream-order sanitizer of the software NPU (see [`NpuBuilder::sanitizer`]).
pub use soma_sim::{sanitizer, ReportKind, SanitizerMode, SanitizerReport};
pub use soma_sim::{CallCounts, FaultKind, Faults, LatencyModel, Product, SimDevice, SimStats};

use crate::{Device, Result};

/// Configuration of a software [`Npu`]; see [`Npu::builder`].
#[derive(Clone, Debug, Default)]
#[must_use]
pub struct NpuBuilder {
    inner: soma_sim::NpuBuilder,
}

impl NpuBuilder {
    /// Number of devices (default 1).
    pub fn devices(self, n: u32) -> Self {
        NpuBuilder { inner: self.inner.devices(n) }
    }

    /// Memory capacity of each device (default 64 GiB).
    pub fn capacity(self, bytes: u64) -> Self {
        NpuBuilder { inner: self.inner.capacity(bytes) }
    }

    /// Physical allocation granularity (default 2 MiB, as on Ascend).
    pub fn granularity(self, bytes: u64) -> Self {
        NpuBuilder { inner: self.inner.granularity(bytes) }
    }

    /// Product model (default [`Product::AtlasA2`], which supports CANN's pool C API).
    pub fn product(self, product: Product) -> Self {
        NpuBuilder { inner: self.inner.product(product) }
    }

    /// Latency model (default none; [`LatencyModel::ascend_like`] for realistic driver costs).
    pub fn latency(self, model: LatencyModel) -> Self {
        NpuBuilder { inner: self.inner.latency(model) }
    }

    /// Turns the stream-order sanitizer on or off (default: off, unless the `SOMA_SANITIZER`
    /// environment variable says `report` or `fail`). Reports:
    /// [`SimDevice::sanitizer_reports`] of [`Npu::sim_device`].
    pub fn sanitizer(self, mode: SanitizerMode) -> Self {
        NpuBuilder { inner: self.inner.sanitizer(mode) }
    }

    /// Strict sanitizer: also report uses of fresh blocks by streams not ordered after the
    /// allocation (see [`soma_sim::NpuBuilder::sanitizer_strict`]).
    pub fn sanitizer_strict(self, strict: bool) -> Self {
        NpuBuilder { inner: self.inner.sanitizer_strict(strict) }
    }

    /// Poisons freed pool memory with `byte` once the free completes in stream order.
    pub fn sanitizer_poison(self, byte: Option<u8>) -> Self {
        NpuBuilder { inner: self.inner.sanitizer_poison(byte) }
    }

    /// Whether the devices offer virtual memory management (default on). Off models a
    /// product without it: pools fall back to one `malloc` segment of their max size.
    pub fn vmm(self, on: bool) -> Self {
        NpuBuilder { inner: self.inner.vmm(on) }
    }

    /// Creates the devices.
    ///
    /// # Errors
    /// Invalid configurations, or the OS refusing the address space.
    pub fn build(self) -> Result<Npu> {
        let sim = self.inner.build()?;
        let devices = (0..sim.device_count())
            .map(|i| {
                let sim_device = sim.device(i)?;
                let hal: Arc<dyn soma_core::hal::DeviceHal> = sim_device.clone();
                Ok((Device::new(hal), sim_device))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Npu { devices })
    }
}

/// A software NPU: devices that run every soma program without hardware.
pub struct Npu {
    devices: Vec<(Device, Arc<SimDevice>)>,
}

impl Npu {
    /// A builder with the defaults: 1 device of 64 GiB, 2 MiB granularity, Atlas A2, no latency.
    pub fn builder() -> NpuBuilder {
        NpuBuilder::default()
    }

    /// Number of devices.
    pub fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    /// Device `ordinal` (every call returns a handle to the same device).
    ///
    /// # Errors
    /// An ordinal out of range.
    pub fn device(&self, ordinal: u32) -> Result<Device> {
        Ok(self.entry(ordinal)?.0.clone())
    }

    /// The simulator behind device `ordinal`: counters, fault injection, latency.
    ///
    /// # Errors
    /// An ordinal out of range.
    pub fn sim_device(&self, ordinal: u32) -> Result<Arc<SimDevice>> {
        Ok(Arc::clone(&self.entry(ordinal)?.1))
    }

    fn entry(&self, ordinal: u32) -> Result<&(Device, Arc<SimDevice>)> {
        self.devices.get(ordinal as usize).ok_or_else(|| {
            crate::Error::Driver(crate::hal::DriverError::InvalidHandle(format!(
                "device {ordinal} (the NPU has {} devices)",
                self.devices.len()
            )))
        })
    }
}

impl std::fmt::Debug for Npu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Npu").field("devices", &self.devices.len()).finish()
    }
}
