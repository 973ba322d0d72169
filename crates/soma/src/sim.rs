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

/// Configuration of a software [`Npu`]; see [`Npu::builder`]. It is the simulator's own
/// builder, building this crate's [`Npu`]: every setting of [`soma_sim::NpuBuilder`] is here.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use soma::sim::{LatencyModel, Npu, Product, SanitizerMode};
/// let npu: Npu = Npu::builder()
///     .devices(2)
///     .capacity(1 << 30)
///     .granularity(2 << 20)
///     .product(Product::Atlas300IDuo)
///     .latency(LatencyModel::none())
///     .address_space(4 << 30)
///     .vmm(true)
///     .sanitizer(SanitizerMode::Report)
///     .sanitizer_strict(true)
///     .sanitizer_poison(Some(0xA5))
///     .build()?;
/// assert_eq!(npu.device_count(), 2);
/// assert_eq!(npu.device(1)?.info().total_memory, 1 << 30);
/// assert_eq!(npu.sim_device(0)?.sanitizer_mode(), SanitizerMode::Report);
/// # Ok(()) }
/// ```
pub type NpuBuilder = soma_sim::NpuBuilder<Npu>;

impl soma_sim::FromSimNpu for Npu {
    type Error = crate::Error;

    /// Wraps each simulated device in a [`Device`].
    fn from_sim_npu(sim: soma_sim::Npu) -> Result<Npu> {
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
