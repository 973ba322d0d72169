//! The process-wide runtime: the software NPU, one [`Device`] per device, the handle
//! registries, the memory index and the per-thread current device.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use soma_core::hal::{DeviceHal, PhysicalHandle};
use soma_core::{Device, Event, MemPool, Stream};
use soma_sim::{LatencyModel, Npu, Product, SimDevice};

use crate::error::{AclErr, AclResult};
use crate::model::ModelObj;

/// Configuration read once, from the environment, when the runtime starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Config {
    pub(crate) devices: u32,
    pub(crate) capacity: u64,
    pub(crate) product: Product,
    pub(crate) latency: bool,
}

const GIB: u64 = 1 << 30;

fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

fn parse_product(s: &str) -> Option<Product> {
    let norm: String =
        s.chars().filter(|c| c.is_ascii_alphanumeric()).collect::<String>().to_ascii_lowercase();
    match norm.as_str() {
        "a2" | "atlasa2" => Some(Product::AtlasA2),
        "300iduo" | "atlas300iduo" | "duo" => Some(Product::Atlas300IDuo),
        _ => None,
    }
}

impl Config {
    /// Reads `SOMA_SIM_DEVICES` (1–16, default 1), `SOMA_SIM_CAPACITY` (bytes per device,
    /// suffixes K/M/G/T or KiB/MiB/GiB/TiB, default 64 GiB), `SOMA_SIM_PRODUCT` (`atlas-a2`,
    /// the default, or `atlas-300i-duo`) and `SOMA_SIM_LATENCY` (`none`, the default, or
    /// `ascend`).
    pub(crate) fn from_env() -> Result<Config, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let devices = match var("SOMA_SIM_DEVICES") {
            None => 1,
            Some(v) => {
                let max = soma_sim::MAX_DEVICES;
                v.trim().parse::<u32>().ok().filter(|n| (1..=max).contains(n)).ok_or_else(|| {
                    format!("SOMA_SIM_DEVICES={v:?}: expected a number from 1 to {max}")
                })?
            }
        };
        let capacity = match var("SOMA_SIM_CAPACITY") {
            None => 64 * GIB,
            Some(v) => parse_bytes(&v).filter(|&b| b > 0).ok_or_else(|| {
                format!("SOMA_SIM_CAPACITY={v:?}: expected a byte count such as 68719476736 or 64G")
            })?,
        };
        let product = match var("SOMA_SIM_PRODUCT") {
            None => Product::AtlasA2,
            Some(v) => parse_product(&v).ok_or_else(|| {
                format!("SOMA_SIM_PRODUCT={v:?}: expected atlas-a2 or atlas-300i-duo")
            })?,
        };
        let latency = match var("SOMA_SIM_LATENCY").map(|v| v.trim().to_ascii_lowercase()) {
            None => false,
            Some(v) if v == "none" || v == "off" || v == "0" => false,
            Some(v) if v == "ascend" || v == "on" || v == "1" => true,
            Some(v) => return Err(format!("SOMA_SIM_LATENCY={v:?}: expected none or ascend")),
        };
        Ok(Config { devices, capacity, product, latency })
    }
}

/// One device of the runtime.
pub(crate) struct DevEntry {
    pub(crate) index: u32,
    pub(crate) device: Device,
    /// The default stream (a null `aclrtStream`), created on first use.
    default_stream: Mutex<Option<Arc<StreamObj>>>,
}

impl DevEntry {
    pub(crate) fn hal(&self) -> &Arc<dyn DeviceHal> {
        self.device.hal()
    }

    /// The software NPU device behind this entry.
    pub(crate) fn sim(&self) -> AclResult<&SimDevice> {
        self.hal().as_any().downcast_ref::<SimDevice>().ok_or_else(|| {
            AclErr::new(
                crate::error::ACL_ERROR_RT_INTERNAL_ERROR,
                "the device is not a software NPU device",
            )
        })
    }

    /// Checks an unsafe call (`what`: a synchronous copy or memset, an asynchronous copy of
    /// pageable host memory) against the device's active captures and the thread's capture
    /// mode; a forbidden call invalidates the captures that forbid it.
    pub(crate) fn check_unsafe_call(&self, what: &str) -> AclResult {
        Ok(self.sim()?.check_unsafe_call(what)?)
    }

    pub(crate) fn granularity(&self) -> u64 {
        self.device.info().granularity
    }

    /// The device's memory rounded down to the granularity.
    pub(crate) fn total_rounded(&self) -> u64 {
        let g = self.granularity();
        self.device.info().total_memory / g * g
    }

    /// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` unless the product supports the pool API.
    pub(crate) fn require_pool_support(&self) -> AclResult {
        let info = self.device.info();
        if info.supports_native_pool {
            Ok(())
        } else {
            Err(AclErr::unsupported(format!(
                "the stream-ordered pool API is supported on Atlas A2 products only; device {} \
                 is an {} (SOMA_SIM_PRODUCT)",
                self.index, info.product
            )))
        }
    }
}

/// A stream created by `aclrtCreateStream` (or a device's default stream).
pub(crate) struct StreamObj {
    pub(crate) dev: u32,
    pub(crate) stream: Stream<'static>,
}

/// An event created by `aclrtCreateEvent`.
pub(crate) struct EventObj {
    pub(crate) dev: u32,
    pub(crate) event: Event<'static>,
}

/// A context: only its device matters here.
pub(crate) struct ContextObj {
    pub(crate) dev: u32,
}

/// A physical allocation made by `aclrtMallocPhysical`.
pub(crate) struct PhysObj {
    pub(crate) dev: u32,
    pub(crate) handle: PhysicalHandle,
    pub(crate) size: u64,
}

/// Book-keeping of a pool beside the engine: its live pointers and calls in progress.
#[derive(Default)]
pub(crate) struct PoolState {
    pub(crate) destroyed: bool,
    /// Live allocations: start address → rounded size.
    pub(crate) live: BTreeMap<u64, u64>,
    /// Allocations and frees between their two critical sections.
    pub(crate) in_progress: usize,
}

/// A pool created by `aclrtMemPoolCreate`.
pub(crate) struct PoolObj {
    pub(crate) dev: u32,
    pub(crate) pool: MemPool<'static>,
    pub(crate) state: Mutex<PoolState>,
}

/// A table of live objects of one kind, keyed by the opaque handle given to C.
pub(crate) struct Registry<T> {
    kind: &'static str,
    map: Mutex<HashMap<usize, Arc<T>>>,
}

/// Handle values: unique over the process (never reused), 16-byte spaced, never null.
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(0x5A00_0000);

impl<T> Registry<T> {
    fn new(kind: &'static str) -> Self {
        Registry { kind, map: Mutex::new(HashMap::new()) }
    }

    /// Registers `obj` and returns its new handle.
    pub(crate) fn insert(&self, obj: T) -> *mut c_void {
        let h = NEXT_HANDLE.fetch_add(0x10, Ordering::Relaxed);
        self.map.lock().insert(h, Arc::new(obj));
        h as *mut c_void
    }

    /// The live object behind `h`; null → `ACL_ERROR_INVALID_PARAM`, unknown →
    /// `ACL_ERROR_RT_INVALID_HANDLE`.
    pub(crate) fn get(&self, h: *mut c_void) -> AclResult<Arc<T>> {
        if h.is_null() {
            return Err(AclErr::param(format!("the {} handle is null", self.kind)));
        }
        self.map.lock().get(&(h as usize)).cloned().ok_or_else(|| self.unknown(h))
    }

    /// Removes `h` from the table (the object lives on while calls in flight hold it).
    pub(crate) fn remove(&self, h: *mut c_void) -> AclResult<Arc<T>> {
        if h.is_null() {
            return Err(AclErr::param(format!("the {} handle is null", self.kind)));
        }
        self.map.lock().remove(&(h as usize)).ok_or_else(|| self.unknown(h))
    }

    /// The first live object for which `f` gives `Some`, with that value; `f` runs under
    /// the table's lock (it may take the object's own locks, never the table's).
    pub(crate) fn find_map<R>(
        &self,
        mut f: impl FnMut(&Arc<T>) -> Option<R>,
    ) -> Option<(Arc<T>, R)> {
        self.map.lock().values().find_map(|obj| f(obj).map(|r| (Arc::clone(obj), r)))
    }

    fn unknown(&self, h: *mut c_void) -> AclErr {
        AclErr::handle(format!(
            "{h:p} is not a live {} handle (already destroyed, or never created by this runtime)",
            self.kind
        ))
    }
}

/// An allocation of `aclrtMalloc`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MallocRec {
    pub(crate) dev: u32,
}

/// What the runtime knows about addresses: `aclrtMalloc` blocks, reservations, and the hull
/// of every device address it has handed out per device (the software NPU keeps each device's
/// memory in one contiguous region, so an address inside the hull is device memory of that
/// device, possibly unmapped — never host memory).
#[derive(Default)]
pub(crate) struct MemIndex {
    pub(crate) mallocs: BTreeMap<u64, MallocRec>,
    /// Reservations of `aclrtReserveMemAddress`: base → (device, size).
    pub(crate) reservations: BTreeMap<u64, (u32, u64)>,
    hulls: Vec<Option<(u64, u64)>>,
}

impl MemIndex {
    /// Notes that `[start, start + len)` is device memory of `dev`.
    pub(crate) fn note_device_range(&mut self, dev: u32, start: u64, len: u64) {
        let end = start.saturating_add(len.max(1));
        let i = dev as usize;
        if self.hulls.len() <= i {
            self.hulls.resize(i + 1, None);
        }
        let h = &mut self.hulls[i];
        *h = Some(match *h {
            None => (start, end),
            Some((lo, hi)) => (lo.min(start), hi.max(end)),
        });
    }

    /// The device whose memory region contains `addr`, if any.
    pub(crate) fn device_of(&self, addr: u64) -> Option<u32> {
        self.hulls.iter().position(|h| h.is_some_and(|(lo, hi)| addr >= lo && addr < hi)).map(|i| {
            // At most 16 devices: the index fits.
            i as u32
        })
    }

    /// The reservation containing `addr`: (base, device, size).
    pub(crate) fn reservation_of(&self, addr: u64) -> Option<(u64, u32, u64)> {
        let (&base, &(dev, size)) = self.reservations.range(..=addr).next_back()?;
        (addr < base.saturating_add(size)).then_some((base, dev, size))
    }
}

/// The runtime: everything the exported functions share.
pub(crate) struct Runtime {
    /// Keeps the software NPU (its devices and memory) alive for the process.
    _npu: Npu,
    pub(crate) devices: Vec<DevEntry>,
    pub(crate) streams: Registry<StreamObj>,
    pub(crate) events: Registry<EventObj>,
    pub(crate) contexts: Registry<ContextObj>,
    pub(crate) pools: Registry<PoolObj>,
    pub(crate) physical: Registry<PhysObj>,
    pub(crate) models: Registry<ModelObj>,
    /// The model handle of every capture that has not ended: capture id → handle.
    pub(crate) capture_models: Mutex<HashMap<u64, usize>>,
    pub(crate) mem: Mutex<MemIndex>,
    /// `aclrtMallocHost` blocks: address → size.
    pub(crate) host: Mutex<BTreeMap<usize, usize>>,
    /// Between `aclInit` and `aclFinalize` (informational: calls outside work regardless).
    pub(crate) initialized: AtomicBool,
}

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

impl Runtime {
    fn start() -> Result<Runtime, String> {
        let config = Config::from_env()?;
        let mut builder = Npu::builder()
            .devices(config.devices)
            .capacity(config.capacity)
            .product(config.product);
        if config.latency {
            builder = builder.latency(LatencyModel::ascend_like());
        }
        let npu = builder.build().map_err(|e| format!("starting the software NPU failed: {e}"))?;
        let devices = (0..npu.device_count())
            .map(|i| {
                let sim = npu.device(i).map_err(|e| e.to_string())?;
                Ok(DevEntry {
                    index: i,
                    device: Device::new(sim),
                    default_stream: Mutex::new(None),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Runtime {
            _npu: npu,
            devices,
            streams: Registry::new("stream"),
            events: Registry::new("event"),
            contexts: Registry::new("context"),
            pools: Registry::new("memory pool"),
            physical: Registry::new("physical memory"),
            models: Registry::new("model runtime instance"),
            capture_models: Mutex::new(HashMap::new()),
            mem: Mutex::new(MemIndex::default()),
            host: Mutex::new(BTreeMap::new()),
            initialized: AtomicBool::new(false),
        })
    }

    /// Device `id`, or `ACL_ERROR_INVALID_PARAM`.
    pub(crate) fn device(&'static self, id: i64) -> AclResult<&'static DevEntry> {
        usize::try_from(id).ok().and_then(|i| self.devices.get(i)).ok_or_else(|| {
            AclErr::param(format!(
                "device id {id} is out of range (this runtime has {} device(s); SOMA_SIM_DEVICES)",
                self.devices.len()
            ))
        })
    }

    /// The calling thread's current device (device 0 when none was set).
    pub(crate) fn current(&'static self) -> &'static DevEntry {
        let i = CURRENT_DEVICE.with(Cell::get).unwrap_or(0) as usize;
        // The current device is only ever set to a valid index.
        &self.devices[i.min(self.devices.len() - 1)]
    }

    /// The default stream of `dev`, created on first use.
    pub(crate) fn default_stream(
        &'static self,
        dev: &'static DevEntry,
    ) -> AclResult<Arc<StreamObj>> {
        let mut slot = dev.default_stream.lock();
        if let Some(s) = &*slot {
            return Ok(Arc::clone(s));
        }
        let stream = dev.device.create_stream()?;
        let s = Arc::new(StreamObj { dev: dev.index, stream });
        *slot = Some(Arc::clone(&s));
        Ok(s)
    }

    /// The stream behind a C handle: null → the current device's default stream, which may
    /// not be used while a capture is active on the device (`ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT`).
    pub(crate) fn stream(&'static self, h: *mut c_void) -> AclResult<Arc<StreamObj>> {
        if h.is_null() {
            let dev = self.current();
            let active = dev.sim()?.active_captures();
            if active > 0 {
                return Err(AclErr::new(
                    ascend_sys::AclError::ERROR_RT_STREAM_CAPTURE_IMPLICIT,
                    format!(
                        "the default stream (null) cannot be used while {active} capture(s) are                          active on device {}",
                        dev.index
                    ),
                ));
            }
            self.default_stream(dev)
        } else {
            self.streams.get(h)
        }
    }

    /// The entry of `obj`'s device.
    pub(crate) fn dev(&'static self, index: u32) -> &'static DevEntry {
        &self.devices[index as usize]
    }
}

/// The runtime, started on first use (by `aclInit` or by any other call: calls before
/// `aclInit` are accepted). A bad environment variable fails every call with
/// `ACL_ERROR_UNINITIALIZE` and a message naming it.
pub(crate) fn rt() -> AclResult<&'static Runtime> {
    RUNTIME.get_or_init(Runtime::start).as_ref().map_err(|e| {
        AclErr::new(
            ascend_sys::AclError::ERROR_UNINITIALIZE,
            format!("the runtime cannot start: {e}"),
        )
    })
}

thread_local! {
    /// The calling thread's current device (`aclrtSetDevice`, `aclrtSetCurrentContext`).
    static CURRENT_DEVICE: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Sets (or clears) the calling thread's current device.
pub(crate) fn set_current(dev: Option<u32>) {
    CURRENT_DEVICE.with(|c| c.set(dev));
}

/// The calling thread's current device as set, if any.
pub(crate) fn current_set() -> Option<u32> {
    CURRENT_DEVICE.with(Cell::get)
}

/// Checks a C out-pointer.
pub(crate) fn out_ptr<T>(p: *mut T, name: &str) -> AclResult<*mut T> {
    if p.is_null() {
        Err(AclErr::param(format!("{name} is null")))
    } else {
        Ok(p)
    }
}

/// Writes `value` through a checked out-pointer.
///
/// # Safety
/// `p` must be valid for a write of a `T` (it need not be aligned).
pub(crate) unsafe fn write_out<T>(p: *mut T, value: T) {
    // SAFETY: the caller guarantees `p` is valid for writes; unaligned writes are allowed.
    unsafe { p.write_unaligned(value) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_and_products_parse() {
        assert_eq!(parse_bytes("1024"), Some(1024));
        assert_eq!(parse_bytes("64G"), Some(64 << 30));
        assert_eq!(parse_bytes("512 MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("12x"), None);
        assert_eq!(parse_bytes("99999999999T"), None);
        assert_eq!(parse_product("Atlas-300I-Duo"), Some(Product::Atlas300IDuo));
        assert_eq!(parse_product("atlas_a2"), Some(Product::AtlasA2));
        assert_eq!(parse_product("910"), None);
    }

    #[test]
    fn hull_and_reservations() {
        let mut m = MemIndex::default();
        m.note_device_range(1, 0x1000, 0x100);
        m.note_device_range(1, 0x4000, 0x100);
        assert_eq!(m.device_of(0x2000), Some(1));
        assert_eq!(m.device_of(0x4100), None);
        m.reservations.insert(0x8000, (0, 0x1000));
        assert_eq!(m.reservation_of(0x8fff), Some((0x8000, 0, 0x1000)));
        assert_eq!(m.reservation_of(0x9000), None);
    }
}
