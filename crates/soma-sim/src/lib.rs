//! soma-sim: a software Ascend NPU.
//!
//! The device every soma test, demo and benchmark runs on. It implements the driver HAL of
//! `soma-core` ([`DeviceHal`](hal::DeviceHal), [`StreamHal`](hal::StreamHal),
//! [`EventHal`](hal::EventHal)) with:
//!
//! | NPU concept | software NPU |
//! |---|---|
//! | devices | up to [`MAX_DEVICES`] per [`Npu`], each with its own memory, streams and events; peer access per ordered pair lets one device's tasks use another's memory, copies between them costed at [`LatencyModel::peer_bandwidth`] |
//! | device memory | one `mmap` reservation per device; mapped granules are real, resident memory; physical memory is a memory file per allocation, which keeps its bytes while unmapped (mapped again, at any address, it shows them) and goes back to the OS when freed; `malloc`'s memory goes back at `free` |
//! | IPC (`aclrtMemExportToShareableHandle`, …) | an exported allocation's memory file is handed to a whitelisted process over a Unix socket (`SCM_RIGHTS`): both processes map the same bytes; streams and events stay per process |
//! | capacity | accounted per device (default 64 GiB); beyond it, [`OutOfMemory`](hal::DriverError::OutOfMemory) |
//! | stream | a worker thread executing tasks strictly in enqueue order |
//! | kernel | a Rust closure over device buffers ([`KernelLaunch`](hal::KernelLaunch)) |
//! | event | a position on a stream, stamped with an [`Instant`](std::time::Instant) when it completes |
//! | model runtime instance (`aclmdlRI`, "ACL graph") | a stream's tasks recorded between `begin_capture` and `end_capture` into a [`SimGraph`]; each launch is one task that runs them again in capture order |
//! | driver cost | a [`LatencyModel`], off by default |
//! | hardware faults | [`Faults`]: fail the k-th driver call or a chosen task |
//! | product model | [`Product`]: whether CANN's native pool API is supported |
//! | `compute-sanitizer` | the stream-order [`sanitizer`]: every kernel, copy and memset access checked against pool allocations in stream order ([`NpuBuilder::sanitizer`], `SOMA_SANITIZER`); one per NPU, so that a task's access of a peer's memory is checked against that memory's allocations |
//!
//! # Safety model
//!
//! Kernels get real `&[u8]` / `&mut [u8]` over device memory on worker threads. Every device
//! range a task or synchronous copy touches is checked to lie inside mapped memory (otherwise
//! [`InvalidAddress`](hal::DriverError::InvalidAddress), never a segfault) and registered in a
//! device-wide in-flight table: a task whose ranges conflict with another stream's task in
//! flight (one of them writes overlapping bytes) fails with a "concurrent conflicting access
//! (data race)" error instead of running, and unmapping or freeing memory in flight fails.
//! A range of a peer device's memory is checked and registered in that device's table.
//! All `unsafe` code dealing with memory, its mappings and the hand-off of memory files to
//! other processes is in one private module (`memory`).
//!
//! # Errors inside tasks
//!
//! A failing task never crashes the process. Its stream keeps a sticky
//! [`TaskFailed`](hal::DriverError::TaskFailed) error, reported by every later
//! `synchronize` / `query`, and skips later tasks; see [`SimStream`] (the stream stays failed,
//! as on CANN, until [`SimStream::clear_error`]).
//!
//! # Example
//!
//! ```
//! use soma_sim::hal::{AccessMode, BufferAccess, DeviceHal, KernelLaunch, MemRef, StreamHal};
//! use soma_sim::Npu;
//!
//! let npu = Npu::builder().capacity(1 << 30).build()?;
//! let dev = npu.device(0)?;
//! let stream = dev.create_stream()?;
//! let n = 1024;
//! let buf = dev.malloc(n * 4)?;
//!
//! // A kernel that writes `i * 2` into every element.
//! stream.launch(KernelLaunch {
//!     name: "iota2",
//!     buffers: vec![BufferAccess { ptr: buf, len: n * 4, mode: AccessMode::Write }],
//!     body: Box::new(|bufs| {
//!         for (i, x) in bufs.write::<u32>(0)?.iter_mut().enumerate() {
//!             *x = i as u32 * 2;
//!         }
//!         Ok(())
//!     }),
//! })?;
//!
//! // Copy back to the host and wait.
//! let mut host = vec![0u32; n as usize];
//! // SAFETY: `host` outlives the copy: we synchronize before reading or dropping it.
//! unsafe {
//!     stream.copy_async(MemRef::Host(host.as_mut_ptr().cast()), MemRef::Device(buf), n * 4)?;
//! }
//! stream.synchronize()?;
//! assert_eq!(host[10], 20);
//!
//! drop(stream);
//! dev.free(buf)?;
//! # Ok::<(), soma_sim::hal::DriverError>(())
//! ```

mod capture;
mod device;
mod event;
mod faults;
mod graph;
mod ipc;
mod memory;
mod peer;
pub mod sanitizer;
mod stream;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

pub use device::{CallCounts, SimDevice, SimStats};
pub use event::SimEvent;
pub use faults::{FaultKind, Faults};
pub use graph::SimGraph;
pub use sanitizer::{ReportKind, SanitizerMode, SanitizerReport};
/// The driver HAL this crate implements (re-exported from `soma-core`).
pub use soma_core::hal;
pub use stream::SimStream;

use hal::{DeviceInfo, DriverError, DriverResult};

/// One GiB.
const GIB: u64 = 1 << 30;

/// The product model of a simulated device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Product {
    /// Atlas A2 training / inference card: supports CANN's native pool API.
    #[default]
    AtlasA2,
    /// Atlas 300I Duo inference card: no native pool API (the soma engine still works).
    Atlas300IDuo,
}

impl Product {
    /// The product name as the device reports it.
    pub fn name(self) -> &'static str {
        match self {
            Product::AtlasA2 => "Atlas A2",
            Product::Atlas300IDuo => "Atlas 300I Duo",
        }
    }

    /// Whether the product supports the `aclrtMemPool*` C API.
    pub fn supports_native_pool(self) -> bool {
        matches!(self, Product::AtlasA2)
    }
}

/// Simulated driver and task costs. All zero (off) by default.
///
/// Driver-call delays sleep in the calling thread (before any lock is taken); task delays
/// sleep on the stream's worker. The last 100 µs of a delay are spun, not slept: the OS wakes
/// a sleeping thread tens of microseconds late, which would turn a 5 µs launch into 50–100.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct LatencyModel {
    /// Per `alloc_physical` and per `malloc` call.
    pub driver_alloc: Duration,
    /// Per `map` and per `unmap` call.
    pub map: Duration,
    /// Per kernel, copy, memset or host function task.
    pub launch: Duration,
    /// Copy bandwidth in bytes per second, for copy tasks (on the worker) and `copy_sync`
    /// (in the calling thread); `0` means copies take no modelled time.
    pub copy_bandwidth: u64,
    /// Bandwidth of the link between two devices in bytes per second, for copies whose ends
    /// lie on different devices (peer access); `0` means such copies take no modelled time.
    pub peer_bandwidth: u64,
}

/// Waits `d`, as the latency model prescribes: sleeps all but the last stretch, spins that.
pub(crate) fn model_delay(d: Duration) {
    const SPIN: Duration = Duration::from_micros(100);
    if d.is_zero() {
        return;
    }
    let deadline = std::time::Instant::now() + d;
    if d > SPIN {
        std::thread::sleep(d - SPIN);
    }
    while std::time::Instant::now() < deadline {
        std::hint::spin_loop();
    }
}

impl LatencyModel {
    /// No modelled latency (the default).
    pub fn none() -> Self {
        Self::default()
    }

    /// Numbers in the range measured on Ascend: 1 ms per driver allocation (0.5–2 ms per
    /// `aclrtMalloc`), 0.1 ms per map / unmap, 5 µs per task launch, 25 GB/s copies, and
    /// 56 GB/s between two devices (one HCCS link).
    pub fn ascend_like() -> Self {
        Self {
            driver_alloc: Duration::from_millis(1),
            map: Duration::from_micros(100),
            launch: Duration::from_micros(5),
            copy_bandwidth: 25_000_000_000,
            peer_bandwidth: HCCS_BANDWIDTH,
        }
    }

    /// Sets [`driver_alloc`](Self::driver_alloc).
    pub fn with_driver_alloc(mut self, d: Duration) -> Self {
        self.driver_alloc = d;
        self
    }

    /// Sets [`map`](Self::map).
    pub fn with_map(mut self, d: Duration) -> Self {
        self.map = d;
        self
    }

    /// Sets [`launch`](Self::launch).
    pub fn with_launch(mut self, d: Duration) -> Self {
        self.launch = d;
        self
    }

    /// Sets [`copy_bandwidth`](Self::copy_bandwidth) in bytes per second.
    pub fn with_copy_bandwidth(mut self, bytes_per_s: u64) -> Self {
        self.copy_bandwidth = bytes_per_s;
        self
    }

    /// Sets [`peer_bandwidth`](Self::peer_bandwidth) in bytes per second.
    pub fn with_peer_bandwidth(mut self, bytes_per_s: u64) -> Self {
        self.peer_bandwidth = bytes_per_s;
        self
    }

    /// Modelled time of a copy of `len` bytes.
    pub fn copy_time(&self, len: u64) -> Duration {
        transfer_time(len, self.copy_bandwidth)
    }

    /// Modelled time of a copy of `len` bytes between two devices.
    pub fn peer_copy_time(&self, len: u64) -> Duration {
        transfer_time(len, self.peer_bandwidth)
    }
}

/// The bandwidth of one HCCS link between two Ascend devices, in bytes per second:
/// [`LatencyModel::ascend_like`]'s [`peer_bandwidth`](LatencyModel::peer_bandwidth).
pub const HCCS_BANDWIDTH: u64 = 56_000_000_000;

/// Most devices one [`Npu`] has (an Ascend server has 8 or 16).
pub const MAX_DEVICES: u32 = 16;

/// `len` bytes at `bytes_per_s` (`0`: no modelled time).
fn transfer_time(len: u64, bytes_per_s: u64) -> Duration {
    if bytes_per_s == 0 || len == 0 {
        Duration::ZERO
    } else {
        Duration::from_secs_f64(len as f64 / bytes_per_s as f64)
    }
}

/// What an [`NpuBuilder`] builds from the devices it creates: [`Npu`] itself, or a wrapper
/// that a crate over the simulator defines (the `soma` crate's `soma::sim::Npu`), so that the
/// wrapper's builder is this builder, with every one of its settings.
pub trait FromSimNpu: Sized {
    /// The error [`NpuBuilder::build`] returns: driver errors convert into it.
    type Error: From<DriverError>;

    /// Makes the built value from the simulator's devices.
    ///
    /// # Errors
    /// Whatever the wrapper cannot set up over the devices.
    fn from_sim_npu(npu: Npu) -> Result<Self, Self::Error>;
}

impl FromSimNpu for Npu {
    type Error = DriverError;

    fn from_sim_npu(npu: Npu) -> DriverResult<Npu> {
        Ok(npu)
    }
}

/// Configuration of an [`Npu`] (or of what `T` makes of one, see [`FromSimNpu`]); see
/// [`Npu::builder`].
#[must_use]
pub struct NpuBuilder<T = Npu> {
    devices: u32,
    capacity: u64,
    granularity: u64,
    product: Product,
    latency: LatencyModel,
    address_space: Option<u64>,
    vmm: bool,
    sanitizer: SanitizerConfig,
    builds: PhantomData<fn() -> T>,
}

impl<T> Clone for NpuBuilder<T> {
    fn clone(&self) -> Self {
        Self { builds: PhantomData, ..*self }
    }
}

impl<T> fmt::Debug for NpuBuilder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NpuBuilder")
            .field("devices", &self.devices)
            .field("capacity", &self.capacity)
            .field("granularity", &self.granularity)
            .field("product", &self.product)
            .field("latency", &self.latency)
            .field("address_space", &self.address_space)
            .field("vmm", &self.vmm)
            .field("sanitizer", &self.sanitizer)
            .finish()
    }
}

/// The sanitizer options of a device.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SanitizerConfig {
    pub(crate) mode: SanitizerMode,
    pub(crate) strict: bool,
    pub(crate) poison: Option<u8>,
    /// Print reports to stderr (the mode came from `SOMA_SANITIZER`).
    pub(crate) print: bool,
}

impl SanitizerConfig {
    /// The sanitizer these options describe, if it is on.
    fn build(&self) -> Option<Arc<sanitizer::Sanitizer>> {
        self.mode.is_on().then(|| {
            Arc::new(sanitizer::Sanitizer::new(self.mode, self.strict, self.poison, self.print))
        })
    }
}

impl<T> Default for NpuBuilder<T> {
    /// The defaults; the sanitizer mode comes from the `SOMA_SANITIZER` environment variable
    /// (`report` or `fail`; off when unset), see [`SanitizerMode::from_env`].
    fn default() -> Self {
        Self {
            devices: 1,
            capacity: 64 * GIB,
            granularity: 2 << 20,
            product: Product::AtlasA2,
            latency: LatencyModel::none(),
            address_space: None,
            vmm: true,
            sanitizer: match SanitizerMode::from_env() {
                Some(mode) => SanitizerConfig { mode, print: true, ..SanitizerConfig::default() },
                None => SanitizerConfig::default(),
            },
            builds: PhantomData,
        }
    }
}

impl<T> NpuBuilder<T> {
    /// Number of devices (default 1, at most [`MAX_DEVICES`]). Each has its own memory,
    /// streams and events; work on one device may use another's memory once peer access is
    /// enabled ([`DeviceHal::enable_peer_access`](hal::DeviceHal::enable_peer_access)).
    pub fn devices(mut self, n: u32) -> Self {
        self.devices = n;
        self
    }

    /// Memory capacity of each device in bytes (default 64 GiB; rounded down to the
    /// granularity).
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = bytes;
        self
    }

    /// Physical allocation granularity (default 2 MiB; a power of two, at least the host page
    /// size).
    pub fn granularity(mut self, bytes: u64) -> Self {
        self.granularity = bytes;
        self
    }

    /// Product model of every device (default [`Product::AtlasA2`]).
    pub fn product(mut self, p: Product) -> Self {
        self.product = p;
        self
    }

    /// Latency model of every device (default none).
    pub fn latency(mut self, m: LatencyModel) -> Self {
        self.latency = m;
        self
    }

    /// Virtual address space per device (default 9 × capacity: room for eight pools as large
    /// as the device plus `malloc`). Only address space: no memory is committed.
    pub fn address_space(mut self, bytes: u64) -> Self {
        self.address_space = Some(bytes);
        self
    }

    /// Whether the devices offer virtual memory management (reserve / physical allocation /
    /// map, default on, as on Atlas A2). Off models a product without it: those calls answer
    /// `Unsupported` and pools fall back to one `malloc` segment.
    pub fn vmm(mut self, on: bool) -> Self {
        self.vmm = on;
        self
    }

    /// Turns the stream-order sanitizer on ([`SanitizerMode::Report`] or
    /// [`SanitizerMode::FailStream`]) or off. Default: off, unless the `SOMA_SANITIZER`
    /// environment variable says `report` or `fail`. See the [`sanitizer`] module.
    ///
    /// ```
    /// use soma_sim::{Npu, SanitizerMode};
    /// use soma_sim::hal::{DeviceHal, StreamHal};
    /// let npu = Npu::builder().sanitizer(SanitizerMode::Report).build()?;
    /// let dev = npu.device(0)?;
    /// let s = dev.create_stream()?;
    /// let p = dev.malloc(4096)?;
    /// s.memset(p, 0, 4097)?; // one byte past the allocation
    /// s.synchronize()?;
    /// let reports = dev.take_sanitizer_reports();
    /// assert_eq!(reports[0].kind, soma_sim::ReportKind::OutOfBounds);
    /// # drop(s); dev.free(p)?;
    /// # Ok::<(), soma_sim::hal::DriverError>(())
    /// ```
    pub fn sanitizer(mut self, mode: SanitizerMode) -> Self {
        self.sanitizer.mode = mode;
        self.sanitizer.print = false;
        self
    }

    /// Strict sanitizer: also report every use by a stream that is not ordered after the
    /// allocation, even when the block has no earlier free it could race with (a fresh
    /// block). Default: off (such uses are reported only when they can race).
    pub fn sanitizer_strict(mut self, strict: bool) -> Self {
        self.sanitizer.strict = strict;
        self
    }

    /// With the sanitizer on, fill freed pool memory with `byte` once the free completes in
    /// stream order (no task is added: stream positions do not change). Default: none.
    pub fn sanitizer_poison(mut self, byte: Option<u8>) -> Self {
        self.sanitizer.poison = byte;
        self
    }

    /// Creates the devices (and, for a wrapper `T`, what it makes of them).
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for zero devices or more than [`MAX_DEVICES`], a granularity that is not a power of two
    /// of at least the page size, a capacity below one granule or an address space below the
    /// capacity; [`DriverError::Native`] if the OS refuses the address space; and the errors
    /// of [`T::from_sim_npu`](FromSimNpu::from_sim_npu).
    pub fn build(self) -> Result<T, T::Error>
    where
        T: FromSimNpu,
    {
        T::from_sim_npu(self.build_sim()?)
    }

    fn build_sim(self) -> DriverResult<Npu> {
        let page = memory::page_size();
        let g = self.granularity;
        if self.devices == 0 {
            return Err(DriverError::InvalidValue("an Npu needs at least one device".into()));
        }
        if self.devices > MAX_DEVICES {
            return Err(DriverError::InvalidValue(format!(
                "{} devices: an Npu has at most {MAX_DEVICES}",
                self.devices
            )));
        }
        if !g.is_power_of_two() || g < page {
            return Err(DriverError::InvalidValue(format!(
                "granularity {g} is not a power of two >= the page size {page}"
            )));
        }
        let capacity = self.capacity / g * g;
        if capacity == 0 {
            return Err(DriverError::InvalidValue(format!(
                "capacity {} is below one granule",
                self.capacity
            )));
        }
        let space = match self.address_space {
            Some(s) => s / g * g,
            None => capacity
                .checked_mul(9)
                .ok_or_else(|| DriverError::InvalidValue("capacity too large".into()))?,
        };
        if space < capacity {
            return Err(DriverError::InvalidValue(format!(
                "address space {space} is below the capacity {capacity}"
            )));
        }
        // One sanitizer for every device: a task of one device may use a peer's memory, and
        // the host's order and observations hold across devices.
        let sanitizer = self.sanitizer.build();
        let peers = peer::Peers::new(self.devices);
        let devices = (0..self.devices)
            .map(|ordinal| {
                let info = DeviceInfo {
                    ordinal,
                    total_memory: capacity,
                    granularity: g,
                    product: self.product.name().into(),
                    supports_native_pool: self.product.supports_native_pool(),
                    supports_vmm: self.vmm,
                };
                let shared = device::Shared {
                    sanitizer: sanitizer.clone(),
                    sanitizer_mode: self.sanitizer.mode,
                    peers: Arc::clone(&peers),
                };
                SimDevice::new(info, space, self.latency, shared).map(Arc::new)
            })
            .collect::<DriverResult<Vec<_>>>()?;
        peers.set_devices(devices.iter().map(|d| Arc::downgrade(&d.core)).collect());
        Ok(Npu { devices })
    }
}

/// A software NPU: a set of devices.
#[derive(Debug)]
pub struct Npu {
    devices: Vec<Arc<SimDevice>>,
}

impl Npu {
    /// A builder with the defaults (1 device, 64 GiB, 2 MiB granularity, Atlas A2, no
    /// latency).
    pub fn builder() -> NpuBuilder {
        NpuBuilder::default()
    }

    /// Number of devices.
    pub fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    /// Device `ordinal`.
    ///
    /// # Errors
    /// [`DriverError::InvalidHandle`] for an ordinal out of range.
    pub fn device(&self, ordinal: u32) -> DriverResult<Arc<SimDevice>> {
        self.devices.get(ordinal as usize).cloned().ok_or_else(|| {
            DriverError::InvalidHandle(format!(
                "device {ordinal} (the Npu has {} devices)",
                self.devices.len()
            ))
        })
    }
}
