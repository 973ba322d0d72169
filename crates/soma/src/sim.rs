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
pub use soma_sim::{
    CallCounts, FaultKind, Faults, LatencyModel, Product, SimDevice, SimStats, SimStream,
    HCCS_BANDWIDTH, MAX_DEVICES,
};

use crate::{Device, Result, Stream};

/// The software NPU's stream behind a soma [`Stream`], for work soma does not launch: tests
/// of the raw-stream contract enqueue "foreign" kernels on it
/// (`StreamHal::launch` of [`SimStream`]), which soma's bookkeeping does not see, as an
/// operator library's kernels on Ascend (see `soma::ascend::AscendStreamExt`).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use soma::hal::{AccessMode, BufferAccess, KernelLaunch, StreamHal};
/// use soma::sim::SimStreamExt as _;
/// use soma::{BufferOwner, DeviceBuffer, MemPool};
/// let npu = soma::sim::Npu::builder().build()?;
/// let dev = npu.device(0)?;
/// let (s1, s2) = (dev.create_stream()?, dev.create_stream()?);
/// let pool = MemPool::builder().build(&dev)?;
/// let x = pool.alloc_zeros::<f32>(256, &s1)?;
/// x.record_use(&s2)?;                 // the foreign kernel below runs on s2
/// s2.as_raw()?.launch(KernelLaunch {   // soma does not see this launch
///     name: "foreign_scale",
///     buffers: vec![BufferAccess { ptr: x.device_ptr(), len: x.byte_len(), mode: AccessMode::Write }],
///     body: Box::new(|b| Ok(b.write::<f32>(0)?.iter_mut().for_each(|v| *v *= 2.0))),
/// })?;
/// drop(x);                            // the free on s1 waits for s2's use
/// # Ok(()) }
/// ```
pub trait SimStreamExt {
    /// The [`SimStream`] behind this stream.
    ///
    /// # Errors
    /// A stream of another backend.
    fn as_raw(&self) -> Result<&SimStream>;
}

impl SimStreamExt for Stream<'_> {
    fn as_raw(&self) -> Result<&SimStream> {
        self.hal().as_any().downcast_ref::<SimStream>().ok_or_else(|| {
            crate::Error::Driver(crate::hal::DriverError::InvalidHandle(format!(
                "stream {} is not a software NPU stream",
                self.id()
            )))
        })
    }
}

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
