//! The stream-ordered memory pool: [`MemPool`], its builder, attributes and statistics.

mod alloc;
pub mod attr;
pub mod free_ring;
mod observe_api;
mod passthrough;
mod shards;
mod stats;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use std::sync::{Mutex, MutexGuard, PoisonError};

pub use alloc::PoolAlloc;
use alloc::StreamUse;

pub use stats::{PoolStats, ReuseCounts};

use crate::buffer::bytes_for;
use crate::device::{Device, DeviceShared, LiveStream};
use crate::engine::{
    AllocError, Allocation, Backing, BackingError, BlockId, Eligibility, Engine, EngineConfig,
    EngineStats, FreeTag, StreamOrder, StreamSlot,
};
use crate::error::{Error, OutOfMemory, Result};
use crate::hal::{DeviceHal, DevicePtr, PhysicalHandle};
use crate::observe::{History, Record, RecordKind};
use crate::stream::Stream;
use attr::Attribute as _;
use std::panic::Location;
use std::time::Instant;

pub(crate) const FOLLOW_EVENT_DEPENDENCIES: u32 = 1 << 0;
pub(crate) const OPPORTUNISTIC: u32 = 1 << 1;
pub(crate) const INTERNAL_DEPENDENCIES: u32 = 1 << 2;

/// A block handed out by [`PoolCore::allocate`]: from the engine (`block`) or from the
/// device's native pool (`block == None`, freed by pointer).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Granted {
    pub(crate) block: Option<BlockId>,
    pub(crate) ptr: DevicePtr,
    pub(crate) size: u64,
    /// The shard whose engine holds `block` (0 unless the pool is sharded).
    pub(crate) shard: u8,
}

/// What an out-of-memory hook asks the pool to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomAction {
    /// Report the error.
    Fail,
    /// The hook freed memory: try the allocation once more.
    Retry,
}

/// A hook called when an allocation is about to fail with out of memory.
pub type OomHook = Arc<dyn Fn(&OutOfMemory) -> OomAction + Send + Sync>;

/// Which cross-stream reuse rules a pool applies (same-stream reuse is always on).
///
/// See `docs/semantics.md` for the rules; the switches are the C API's attributes 0x1–0x3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReusePolicy {
    /// Rule 2: reuse a block freed on stream S on stream T when T waited on an event recorded
    /// on S after the free (directly or through a chain of streams).
    pub follow_event_dependencies: bool,
    /// Rule 3: reuse a block whose free has already completed on the device.
    pub opportunistic: bool,
    /// Rule 4: reuse another stream's block by inserting an event dependency.
    pub internal_dependencies: bool,
}

impl ReusePolicy {
    /// All cross-stream rules off: what CANN's C API starts with.
    pub const NONE: ReusePolicy = ReusePolicy {
        follow_event_dependencies: false,
        opportunistic: false,
        internal_dependencies: false,
    };

    /// All cross-stream rules on.
    pub const ALL: ReusePolicy = ReusePolicy {
        follow_event_dependencies: true,
        opportunistic: true,
        internal_dependencies: true,
    };

    /// A policy from the three switches.
    pub const fn new(
        follow_event_dependencies: bool,
        opportunistic: bool,
        internal_dependencies: bool,
    ) -> Self {
        ReusePolicy { follow_event_dependencies, opportunistic, internal_dependencies }
    }

    fn bits(self) -> u32 {
        let bit = |on: bool, bit: u32| if on { bit } else { 0 };
        bit(self.follow_event_dependencies, FOLLOW_EVENT_DEPENDENCIES)
            | bit(self.opportunistic, OPPORTUNISTIC)
            | bit(self.internal_dependencies, INTERNAL_DEPENDENCIES)
    }

    fn from_bits(bits: u32) -> Self {
        ReusePolicy {
            follow_event_dependencies: bits & FOLLOW_EVENT_DEPENDENCIES != 0,
            opportunistic: bits & OPPORTUNISTIC != 0,
            internal_dependencies: bits & INTERNAL_DEPENDENCIES != 0,
        }
    }
}

impl Default for ReusePolicy {
    /// The Rust default: follow event dependencies and opportunistic reuse on (both free of
    /// hidden synchronisation), internal dependencies off (they add waits the program did not
    /// ask for).
    fn default() -> Self {
        ReusePolicy {
            follow_event_dependencies: true,
            opportunistic: true,
            internal_dependencies: false,
        }
    }
}

/// Builds a [`MemPool`]; invalid combinations are rejected by [`build`](Self::build).
#[derive(Clone)]
#[must_use]
pub struct MemPoolBuilder {
    max_size: u64,
    release_threshold: Option<u64>,
    reuse: ReusePolicy,
    alignment: u64,
    index_by_offset: bool,
    history: usize,
    on_oom: Option<OomHook>,
    native: bool,
    passthrough: bool,
    segments_per_growth: u64,
    recycle_on_growth: bool,
    stream_shards: usize,
}

impl std::fmt::Debug for MemPoolBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemPoolBuilder")
            .field("max_size", &self.max_size)
            .field("release_threshold", &self.release_threshold)
            .field("reuse", &self.reuse)
            .field("alignment", &self.alignment)
            .field("raw_pointers", &self.index_by_offset)
            .field("history", &self.history)
            .field("on_oom", &self.on_oom.is_some())
            .field("native", &self.native)
            .field("segments_per_growth", &self.segments_per_growth)
            .field("passthrough", &self.passthrough)
            .field("recycle_on_growth", &self.recycle_on_growth)
            .field("stream_shards", &self.stream_shards)
            .finish()
    }
}

impl Default for MemPoolBuilder {
    fn default() -> Self {
        MemPoolBuilder {
            max_size: 0,
            release_threshold: None,
            reuse: ReusePolicy::default(),
            alignment: 512,
            index_by_offset: false,
            history: 0,
            on_oom: None,
            native: false,
            passthrough: false,
            segments_per_growth: 0,
            recycle_on_growth: true,
            stream_shards: 1,
        }
    }
}

impl MemPoolBuilder {
    /// Most physical memory the pool may hold, rounded up to the device granularity; `0`
    /// (the default) means the device's total memory.
    pub fn max_size(mut self, bytes: u64) -> Self {
        self.max_size = bytes;
        self
    }

    /// Reserved bytes kept at a synchronisation. Default: the max size (keep everything
    /// cached — an inference engine should not lose its cache at every synchronize).
    pub fn release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = Some(bytes);
        self
    }

    /// Cross-stream reuse rules. Default: [`ReusePolicy::default`].
    pub fn reuse(mut self, policy: ReusePolicy) -> Self {
        self.reuse = policy;
        self
    }

    /// Alignment of every block: a power of two ≥ 32, at most the granularity. Default 512.
    pub fn alignment(mut self, bytes: u64) -> Self {
        self.alignment = bytes;
        self
    }

    /// CANN's C API defaults: every cross-stream reuse switch off, release threshold 0
    /// (cached memory is released at every synchronisation).
    pub fn cann_defaults(mut self) -> Self {
        self.reuse = ReusePolicy::NONE;
        self.release_threshold = Some(0);
        self
    }

    /// Keeps an address index so that [`MemPool::free_raw`] can free by pointer (the C API
    /// path); costs a hash-map update per allocation and free.
    pub fn raw_pointers(mut self, on: bool) -> Self {
        self.index_by_offset = on;
        self
    }

    /// Keeps the last `capacity` pool events (alloc, free, map, unmap, trim, OOM) with
    /// timestamps, streams, sizes, offsets and caller locations; 0 (the default) keeps none
    /// and costs nothing on the hot path.
    pub fn history(mut self, capacity: usize) -> Self {
        self.history = capacity;
        self
    }

    /// A hook called (without the pool's lock) when an allocation is about to fail with out
    /// of memory, after the pool's own wait-and-retry; if it returns [`OomAction::Retry`] the
    /// allocation is tried once more. See also [`MemPool::alloc_async_or`].
    pub fn on_oom(
        mut self,
        hook: impl Fn(&OutOfMemory) -> OomAction + Send + Sync + 'static,
    ) -> Self {
        self.on_oom = Some(Arc::new(hook));
        self
    }

    /// Pass-through mode, for debugging (default off): no caching. Every allocation maps
    /// fresh memory and every free gives its memory back to the device once the free has
    /// completed in stream order (granules shared with live blocks stay mapped). Implies
    /// [`ReusePolicy::NONE`] and a release threshold of 0. A free is handed to the pool when
    /// a host function enqueued on its stream after it runs, and the memory is released at
    /// the pool's next `alloc_async`, `trim_to` or synchronisation; until then it counts as
    /// used. Slow: meant for use with the software NPU's stream-order sanitizer.
    pub fn passthrough(mut self, on: bool) -> Self {
        self.passthrough = on;
        self
    }

    /// Into how many separately releasable segments each growth is mapped (default 4, doubled
    /// up to 16 while recycling falls short for want of finer segments: parts of a large free
    /// block can be recycled piecewise, which keeps reserved memory close to used memory).
    /// Setting it fixes the count. 1 makes one driver map call per growth — the right choice for a pool of
    /// long-lived memory such as model weights, where it cuts loading time on real drivers.
    /// Segments are never smaller than 1/512 of the memory reserved when they are mapped
    /// (so the count only applies while growths are small against the pool: below 1 GiB of
    /// 2 MiB granules, always).
    pub fn segments_per_growth(mut self, n: u64) -> Self {
        self.segments_per_growth = n;
        self
    }

    /// Whether growth keeps peak reserved memory down by *recycling* (default `true`): before
    /// mapping beyond the pool's all-time reserved high, fully free segments elsewhere whose
    /// frees have completed are unmapped, so that reserved memory tracks used memory even
    /// when allocation sizes vary. The price is driver calls in steady state for workloads
    /// whose shapes keep changing (an unmap and a map per recycled segment). A recycling
    /// pool also *packs* when it empties: the first allocation after nothing was live moves
    /// the free segments above its reserved size into the holes recycling left below, so the
    /// next workload starts from one mapped run (see `docs/semantics.md`).
    ///
    /// `false`: growth only maps. After a warm-up in which the pool maps what the workload's
    /// fragmentation needs, a repeating workload runs without driver calls; peak reserved is
    /// then what a pool that never gives memory back reaches (on the PyTorch BERT trace 1.084×
    /// the live bytes instead of 1.008×). Memory pressure, the release threshold and
    /// [`MemPool::trim_to`] still release free memory.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// let s = dev.create_stream()?;
    /// for recycle in [true, false] {
    ///     let pool = soma_core::MemPool::builder()
    ///         .segments_per_growth(1)
    ///         .recycle_on_growth(recycle)
    ///         .build(&dev)?;
    ///     let a = pool.alloc_async::<u8>(4 << 20, &s)?; // two 2 MiB granules
    ///     let _b = pool.alloc_async::<u8>(2 << 20, &s)?;
    ///     drop(a);
    ///     s.synchronize()?; // a's free has completed
    ///     let _c = pool.alloc_async::<u8>(6 << 20, &s)?; // a's space is too small
    ///     let st = pool.stats();
    ///     // recycling unmaps a's granules (reserved stays at its 6 MiB high + what c
    ///     // adds beyond it); without it they stay mapped, cached for later requests
    ///     assert_eq!(st.unmap_calls > 0, recycle);
    ///     assert_eq!(st.reserved, if recycle { 8 << 20 } else { 12 << 20 });
    /// }
    /// # Ok(()) }
    /// ```
    pub fn recycle_on_growth(mut self, on: bool) -> Self {
        self.recycle_on_growth = on;
        self
    }

    /// Into how many shards the pool is split by stream (default 1: one engine and one lock
    /// for all streams). With `n > 1`, stream slot `s` allocates from shard `s % n`, each
    /// shard with its own engine and lock over its own reserved address range, so
    /// that streams driven from different threads do not wait for each other's allocations.
    /// Reuse still crosses shards: before any shard maps fresh memory, every shard's cached
    /// memory is tried under the same reuse rules, and a shard out of memory first releases
    /// the other shards' idle memory and retries. `max_size`, the release threshold and every
    /// counter (`used`, `reserved` and their high-water marks) stay the pool's as a whole.
    ///
    /// The price: a stream prefers its own shard's cached memory to a better fit in another
    /// shard, and each shard recycles against its own high-water mark, so peak reserved memory
    /// of a multi-stream program can be higher than with one shard; each shard reserves
    /// `max_size` of address space when its first stream allocates (a shard whose range cannot
    /// be reserved is skipped: its streams use shard 0). Shards need virtual memory
    /// management and are not available with [`native`](Self::native),
    /// [`passthrough`](Self::passthrough) or a [`history`](Self::history) (whose offsets and
    /// counters are one engine's); `n` is 1 to 64.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// // consecutive stream slots: one stream in each shard
    /// let (s1, s2) = (dev.create_stream()?, dev.create_stream()?);
    /// let pool = soma_core::MemPool::builder().stream_shards(2).build(&dev)?;
    /// let a = pool.alloc_async::<u8>(2 << 20, &s1)?; // one 2 MiB granule each
    /// let b = pool.alloc_async::<u8>(2 << 20, &s2)?;
    /// assert_eq!(pool.stats().used, 4 << 20); // counted for the pool as a whole
    /// let a_ptr = a.device_ptr();
    /// drop(a);
    /// s2.wait_stream(&s1)?; // s1's free is ordered before s2's later work
    /// let c = pool.alloc_async::<u8>(2 << 20, &s2)?; // rule 2, across shards
    /// assert_eq!(c.device_ptr(), a_ptr);
    /// assert_eq!(pool.stats().reuses.event_dependency, 1);
    /// # drop((b, c)); Ok(()) }
    /// ```
    pub fn stream_shards(mut self, n: usize) -> Self {
        self.stream_shards = n;
        self
    }

    /// Delegates to the device's own stream-ordered pool (CANN's `aclrtMemPool*`, through the
    /// `ascend` backend) behind the same typed API. Support is detected at `build()`: a device
    /// or product without it (`ACL_ERROR_RT_FEATURE_NOT_SUPPORT`) gives an
    /// [`Error::Driver`] `Unsupported` error that says so. Errors are the engine's: a size
    /// above the max size is [`Error::InvalidSize`], a full pool [`Error::OutOfMemory`] (with
    /// the driver pool's counters; no largest free block or pending frees) after the
    /// out-of-memory hooks. Not available: `compact`, history, `raw_pointers` lookups of
    /// foreign pointers (CANN validates them), `owns`, most of `stats()`.
    pub fn native(mut self) -> Self {
        self.native = true;
        self
    }

    /// Creates the pool on `device`: reserves its virtual range, maps nothing yet.
    ///
    /// On a device without virtual memory management (`DeviceInfo::supports_vmm` false) the
    /// pool falls back to one driver `malloc` segment of its whole max size, taken now and
    /// held until the pool is dropped: blocks are carved from it exactly as usual, but trim
    /// and the release threshold cannot give memory back to the device (reserved then counts
    /// the granules the pool uses, not what the device holds for it).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad alignment, a max size above device memory or a
    /// threshold above the max size; backend failures.
    pub fn build(mut self, device: &Device) -> Result<MemPool<'_>> {
        if self.passthrough {
            self.reuse = ReusePolicy::NONE;
            self.release_threshold = Some(0);
        }
        let info = device.info();
        let granularity = info.granularity;
        let total = info.total_memory / granularity * granularity;
        if !self.alignment.is_power_of_two() || self.alignment < 32 {
            return Err(Error::InvalidConfig(format!(
                "alignment {} is not a power of two >= 32",
                self.alignment
            )));
        }
        if self.alignment > granularity {
            return Err(Error::InvalidConfig(format!(
                "alignment {} exceeds the device granularity {granularity}",
                self.alignment
            )));
        }
        let max_size = if self.max_size == 0 {
            total
        } else {
            self.max_size.checked_next_multiple_of(granularity).ok_or_else(|| {
                Error::InvalidConfig(format!("max_size {} overflows", self.max_size))
            })?
        };
        if max_size > total || max_size == 0 {
            return Err(Error::InvalidConfig(format!(
                "max_size {max_size} (rounded to the {granularity}-byte granularity) exceeds device memory {total}"
            )));
        }
        if max_size > alloc::MAX_POOL_BYTES {
            // A handle keeps its length in 56 bits (see `PoolAlloc`).
            return Err(Error::InvalidConfig(format!(
                "max_size {max_size} exceeds the largest pool, {} bytes",
                alloc::MAX_POOL_BYTES
            )));
        }
        let threshold = self.release_threshold.unwrap_or(max_size);
        if threshold > max_size {
            return Err(Error::InvalidConfig(format!(
                "release threshold {threshold} exceeds max_size {max_size}"
            )));
        }
        if self.stream_shards == 0 || self.stream_shards > MAX_STREAM_SHARDS {
            return Err(Error::InvalidConfig(format!(
                "stream_shards({}) is not in 1..={MAX_STREAM_SHARDS}",
                self.stream_shards
            )));
        }
        if self.stream_shards > 1
            && (self.native || self.passthrough || self.history > 0 || !info.supports_vmm)
        {
            return Err(Error::InvalidConfig(
                "stream_shards above 1 needs virtual memory management and is not available \
                 with a native or pass-through pool or with a history"
                    .into(),
            ));
        }
        let settings = Arc::new(Settings {
            reuse: AtomicU32::new(self.reuse.bits()),
            release_threshold: AtomicU64::new(threshold),
        });
        let budget = (self.stream_shards > 1).then(|| Arc::new(shards::Budget::new(max_size)));
        let spec = CoreSpec {
            max_size,
            granularity,
            settings,
            created: Instant::now(),
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
        };
        let core = self.create_core(device, &spec, 0, budget.as_ref())?;
        crate::observe::trace_pool_created(core.id, max_size, threshold, self.alignment);
        let n = self.stream_shards;
        let shards = budget.map(|budget| Box::new(shards::Shards::new(budget, n, self, spec)));
        Ok(MemPool { device, core, shards })
    }

    /// Creates shard `shard` of a pool (the whole pool when it is not sharded, `budget`
    /// `None`): its engine, its address range, its state; registered with the device for the
    /// release threshold.
    fn create_core(
        &self,
        device: &Device,
        spec: &CoreSpec,
        shard: u8,
        budget: Option<&Arc<shards::Budget>>,
    ) -> Result<Arc<PoolCore>> {
        let info = device.info();
        let (max_size, granularity) = (spec.max_size, spec.granularity);
        let threshold = spec.settings.release_threshold.load(Ordering::Relaxed);
        let mut engine = Engine::new(EngineConfig {
            range_size: max_size,
            granularity,
            alignment: self.alignment,
            index_by_offset: self.index_by_offset,
        })
        .map_err(Error::InvalidConfig)?;
        // DESIGN.md §4: every enabled rule, internal dependencies included, is tried before
        // fresh memory is mapped.
        engine.set_dependency_before_growth(true);
        if self.segments_per_growth > 0 {
            engine.set_segments_per_growth(self.segments_per_growth);
        }
        engine.set_recycle_on_growth(self.recycle_on_growth);
        let hal = Arc::clone(device.hal());
        let native = if self.native {
            let native = hal.create_native_pool(max_size)?;
            native.set_attr(
                attr::ReuseFollowEventDependencies::ID,
                self.reuse.follow_event_dependencies.into(),
            )?;
            native.set_attr(attr::ReuseAllowOpportunistic::ID, self.reuse.opportunistic.into())?;
            native.set_attr(
                attr::ReuseAllowInternalDependencies::ID,
                self.reuse.internal_dependencies.into(),
            )?;
            native.set_attr(attr::ReleaseThreshold::ID, threshold)?;
            Some(native)
        } else {
            None
        };
        // A native pool owns its address space; the engine's range stays unreserved.
        let base = match &native {
            Some(_) => DevicePtr::new(u64::MAX)
                .ok_or_else(|| Error::InvalidConfig("no sentinel address".into()))?,
            // Without VMM: one malloc segment of the whole range, held for the pool's life.
            None if !info.supports_vmm => hal.malloc(max_size)?,
            None => hal.reserve(max_size)?,
        };
        let ring_possible = native.is_none();
        let annotate = device.hal().wants_annotations();
        let core = Arc::new(PoolCore {
            hal,
            base,
            max_size,
            alignment: self.alignment,
            id: spec.id,
            shard,
            settings: Arc::clone(&spec.settings),
            budget: budget.cloned(),
            torn_down: AtomicBool::new(false),
            inner: Mutex::new(PoolInner {
                engine,
                sticky: None,
                oom_retries: 0,
                ooms: 0,
                history: (self.history > 0).then(|| History::new(self.history)),
                raw_blocks: std::collections::HashSet::new(),
                ring_accounted: 0,
                budget_base: (0, 0),
            }),
            created: spec.created,
            on_oom: self.on_oom.clone(),
            annotate,
            preallocated: native.is_none() && !info.supports_vmm,
            native,
            passthrough: self.passthrough.then(passthrough::Passthrough::default),
            history_on: self.history > 0,
            // Every free must reach the engine at once for the sanitizer's annotations, the
            // history and pass-through mode; a native pool has no engine. In a sharded pool a
            // ring would be drained only when its own shard is locked, so the pool-wide `used`
            // (and its high-water mark) would count frees waiting there: frees lock instead.
            free_ring: (ring_possible
                && !self.passthrough
                && self.history == 0
                && !annotate
                && budget.is_none())
            .then(free_ring::FreeRing::new),
            sticky_hint: AtomicBool::new(false),
        });
        device.shared.register_pool(&core);
        Ok(core)
    }
}

/// The most shards a pool may have ([`MemPoolBuilder::stream_shards`]).
pub const MAX_STREAM_SHARDS: usize = 64;

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// Settings of a pool that every shard reads (set through any of them).
pub(crate) struct Settings {
    reuse: AtomicU32,
    release_threshold: AtomicU64,
}

/// What the shards of one pool share, fixed at build.
struct CoreSpec {
    max_size: u64,
    granularity: u64,
    settings: Arc<Settings>,
    created: Instant,
    id: u64,
}

pub(crate) struct PoolInner {
    pub(crate) engine: Engine,
    /// An error from a `Drop` that could not be reported; returned by the next fallible call.
    sticky: Option<Error>,
    oom_retries: u64,
    /// Allocations that failed with out of memory (after the retry, if any).
    ooms: u64,
    pub(crate) history: Option<History>,
    /// Blocks handed out by `alloc_raw` (by block id): only these may be freed by pointer,
    /// never the block of a live typed `PoolAlloc`.
    raw_blocks: std::collections::HashSet<BlockId>,
    /// Free-ring tickets accounted in the engine (drained, or counted as handed out again).
    ring_accounted: u64,
    /// A sharded pool's shard: its `(used, live blocks)` when it was last locked, for
    /// [`Locked`]'s drop. Kept here, under the lock, rather than in the guard: a smaller
    /// guard is moved for less on every lock.
    budget_base: (u64, u64),
}

impl PoolInner {
    /// Splits the engine from a backing that maps through `core` and records into the history.
    fn parts<'a>(&'a mut self, core: &'a PoolCore) -> (&'a mut Engine, HalBacking<'a>) {
        let (used, reserved) = (self.engine.used(), self.engine.reserved());
        let backing = HalBacking { core, history: self.history.as_mut(), used, reserved };
        (&mut self.engine, backing)
    }

    fn record(
        &mut self,
        core: &PoolCore,
        kind: RecordKind,
        stream: u64,
        offset: u64,
        size: u64,
        requested: u64,
    ) {
        self.record_full(core, kind, stream, offset, size, requested, None, None);
    }

    #[allow(clippy::too_many_arguments)]
    fn record_full(
        &mut self,
        core: &PoolCore,
        kind: RecordKind,
        stream: u64,
        offset: u64,
        size: u64,
        requested: u64,
        reuse: Option<crate::engine::ReuseKind>,
        location: Option<&'static Location<'static>>,
    ) {
        if let Some(history) = self.history.as_mut() {
            history.push(Record {
                t_ns: core.created.elapsed().as_nanos() as u64,
                kind,
                stream,
                offset,
                size,
                requested,
                used: self.engine.used(),
                reserved: self.engine.reserved(),
                reuse,
                location,
            });
        }
    }
}

/// The locked state of one core. In a sharded pool, unlocking applies what the critical
/// section changed in the shard's used bytes and live blocks to the pool-wide counters.
pub(crate) struct Locked<'a> {
    guard: MutexGuard<'a, PoolInner>,
    /// The pool's counters (the shard's own at locking are in `PoolInner::budget_base`).
    budget: Option<&'a shards::Budget>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = PoolInner;

    fn deref(&self) -> &PoolInner {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut PoolInner {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some(budget) = self.budget {
            let (used, live) = self.guard.budget_base;
            let engine = &self.guard.engine;
            // Both are below 2^63 (bounded by the range and the slab).
            let d_used = engine.used() as i64 - used as i64;
            let d_live = engine.live_blocks() as i64 - live as i64;
            budget.add_used(d_used, d_live);
        }
    }
}

/// The shared part of a pool (also reachable from the device, for release at synchronize).
pub(crate) struct PoolCore {
    hal: Arc<dyn DeviceHal>,
    base: DevicePtr,
    max_size: u64,
    alignment: u64,
    id: u64,
    /// This core's index among the pool's shards (0 when the pool is not sharded).
    shard: u8,
    settings: Arc<Settings>,
    /// The pool-wide limit and counters of a sharded pool (`None`: one shard, whose engine
    /// keeps them), shared with the other shards: every map claims its size from it first.
    budget: Option<Arc<shards::Budget>>,
    torn_down: AtomicBool,
    pub(crate) inner: Mutex<PoolInner>,
    created: Instant,
    on_oom: Option<OomHook>,
    /// Whether the device's sanitizer wants to hear about allocations and frees.
    annotate: bool,
    /// The range is one `malloc` segment (a device without VMM): the engine's maps and unmaps
    /// only account, the memory stays allocated until the pool is dropped.
    preallocated: bool,
    /// The device's own pool, for `MemPoolBuilder::native()`; the engine is then unused.
    pub(crate) native: Option<Box<dyn crate::hal::NativePoolHal>>,
    /// Deferred frees of a pass-through pool.
    passthrough: Option<passthrough::Passthrough>,
    /// Whether the pool keeps a history (fixed at creation: the hot path checks this flag,
    /// not the locked state).
    history_on: bool,
    /// Typed frees waiting for the engine (see `free_ring.rs`); `None` when every free must
    /// reach the engine at once (annotations, history, pass-through, native pools).
    free_ring: Option<free_ring::FreeRing>,
    /// Set whenever a sticky error is stored (cleared when it is taken): the lock-free
    /// allocation path leaves it to the locked one to report.
    sticky_hint: AtomicBool,
}

/// Maps the engine's offsets onto the device: one physical allocation per mapped run.
///
/// Built on every allocation, so it holds the core rather than copies of the core's fields
/// (its device, range base and budget are read only when the engine maps or unmaps).
struct HalBacking<'a> {
    core: &'a PoolCore,
    history: Option<&'a mut History>,
    /// The engine's used and reserved bytes, for the history records of this call's maps.
    used: u64,
    reserved: u64,
}

impl HalBacking<'_> {
    fn record(&mut self, kind: RecordKind, offset: u64, size: u64) {
        if let Some(history) = self.history.as_deref_mut() {
            history.push(Record {
                t_ns: self.core.created.elapsed().as_nanos() as u64,
                kind,
                stream: 0,
                offset,
                size,
                requested: 0,
                used: self.used,
                reserved: self.reserved,
                reuse: None,
                location: None,
            });
        }
    }
}

impl Backing for HalBacking<'_> {
    fn map(&mut self, offset: u64, size: u64) -> std::result::Result<u64, BackingError> {
        let va = self
            .core
            .base
            .checked_add(offset)
            .ok_or_else(|| BackingError::Failed("offset overflow".into()))?;
        if self.core.preallocated {
            self.reserved += size;
            self.record(RecordKind::Map, offset, size);
            return Ok(0);
        }
        if self.core.budget.as_deref().is_some_and(|b| !b.try_map(size)) {
            // The other shards hold the rest of the pool's limit.
            return Err(BackingError::OutOfMemory);
        }
        let mapped = self.core.hal.alloc_physical(size).and_then(|handle| {
            match self.core.hal.map(va, handle) {
                Ok(()) => Ok(handle),
                Err(e) => {
                    // The physical allocation is ours alone; give it back before reporting.
                    let _ = self.core.hal.free_physical(handle);
                    Err(e)
                }
            }
        });
        let handle = match mapped {
            Ok(handle) => handle,
            Err(e) => {
                if let Some(b) = self.core.budget.as_deref() {
                    b.unmapped(size);
                }
                return Err(map_backing_error(e));
            }
        };
        self.reserved += size;
        self.record(RecordKind::Map, offset, size);
        crate::observe::trace_map(offset, size, self.reserved);
        Ok(handle.0)
    }

    fn unmap(
        &mut self,
        offset: u64,
        size: u64,
        token: u64,
    ) -> std::result::Result<(), BackingError> {
        let va = self
            .core
            .base
            .checked_add(offset)
            .ok_or_else(|| BackingError::Failed("offset overflow".into()))?;
        if self.core.preallocated {
            self.reserved = self.reserved.saturating_sub(size);
            self.record(RecordKind::Unmap, offset, size);
            return Ok(());
        }
        let handle = self.core.hal.unmap(va).map_err(map_backing_error)?;
        debug_assert_eq!(handle, PhysicalHandle(token));
        self.core.hal.free_physical(handle).map_err(map_backing_error)?;
        if let Some(b) = self.core.budget.as_deref() {
            // Accounted as the engine accounts it: released once the free succeeded.
            b.unmapped(size);
        }
        self.reserved = self.reserved.saturating_sub(size);
        self.record(RecordKind::Unmap, offset, size);
        Ok(())
    }
}

/// Maps driver errors of the physical side: `OutOfMemory` stays OOM (the engine may recycle
/// and retry); everything else is a failure carried as text.
fn map_backing_error(e: crate::hal::DriverError) -> BackingError {
    match e {
        crate::hal::DriverError::OutOfMemory { .. } => BackingError::OutOfMemory,
        other => BackingError::Failed(other.to_string()),
    }
}

/// The stream-order knowledge the engine consults for one request (or release).
struct Order<'a> {
    device: &'a DeviceShared,
    requester: Option<&'a Stream<'a>>,
    reuse: u32,
}

impl StreamOrder for Order<'_> {
    fn eligibility(&self, s: StreamSlot) -> Eligibility {
        let host_observed = self.device.slot(s).observed.load(Ordering::Acquire);
        let event = match self.requester {
            Some(t) if self.reuse & FOLLOW_EVENT_DEPENDENCIES != 0 => t.clock().get(s),
            _ => 0,
        };
        let completed = if self.reuse & OPPORTUNISTIC != 0 {
            self.device.live_stream(s).map_or(0, |l| l.completed() + 1)
        } else {
            0
        };
        Eligibility { host_observed, event, completed }
    }

    fn internal_dependencies(&self) -> bool {
        self.requester.is_some() && self.reuse & INTERNAL_DEPENDENCIES != 0
    }

    fn is_complete(&self, tag: FreeTag) -> bool {
        if tag.pos < self.device.slot(tag.stream).observed.load(Ordering::Acquire) {
            return true;
        }
        self.device.live_stream(tag.stream).is_some_and(|l| tag.pos <= l.completed())
    }
}

impl PoolCore {
    /// Locks the pool's state, first handing the frees waiting in the free ring to the
    /// engine: whatever runs under the lock sees every free that returned before it.
    #[inline]
    pub(crate) fn lock(&self) -> Locked<'_> {
        // std's mutex: under oversubscription (more allocating threads than cores) it beat
        // parking_lot's by ~10-25 % on the multi-stream bench. Poisoning is ignored, as with
        // parking_lot before: the engine does not panic on any input (the bad-input and
        // fuzz tests check it), and a pool that refused every later call would be worse.
        let mut guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let budget = self.budget.as_deref();
        if budget.is_some() {
            guard.budget_base = (guard.engine.used(), guard.engine.live_blocks());
        }
        let mut inner = Locked { guard, budget };
        if let Some(ring) = &self.free_ring {
            if ring.produced() != inner.ring_accounted {
                self.drain_ring(ring, &mut inner);
            }
        }
        inner
    }

    #[cold]
    #[inline(never)]
    fn drain_ring(&self, ring: &free_ring::FreeRing, inner: &mut PoolInner) {
        let mut failed = None;
        let engine = &mut inner.engine;
        let drained = ring.drain(|f| {
            if let Err(e) = engine.free(f.block, f.tag) {
                failed.get_or_insert((f.block, e));
            }
        });
        // Tickets taken by allocations of the same stream and size: a free and an
        // allocation the engine never saw.
        let consumed = ring.consumed();
        engine.count_repeated_pairs(consumed - inner.ring_accounted - drained);
        inner.ring_accounted = consumed;
        if let Some((block, e)) = failed {
            self.put_sticky(
                inner,
                Error::InvalidArgument(format!("free of block {block:?} failed: {e:?}")),
            );
        }
    }

    /// Stores `error` for the next fallible call (the first one stays).
    fn put_sticky(&self, inner: &mut PoolInner, error: Error) {
        inner.sticky.get_or_insert(error);
        self.sticky_hint.store(true, Ordering::Relaxed);
    }

    /// Takes the stored error, if any.
    ///
    /// The hint is read first: it is written under the lock with the error, which the caller
    /// holds, so it is exact here, and the common case (no error) does not move an `Error`.
    #[inline]
    fn take_sticky(&self, inner: &mut PoolInner) -> Option<Error> {
        if !self.sticky_hint.load(Ordering::Relaxed) {
            return None;
        }
        self.take_stored_sticky(inner)
    }

    #[cold]
    #[inline(never)]
    fn take_stored_sticky(&self, inner: &mut PoolInner) -> Option<Error> {
        let e = inner.sticky.take();
        if e.is_some() {
            self.sticky_hint.store(false, Ordering::Relaxed);
        }
        e
    }

    /// The size of the block a request of `bytes` gets (the engine's rounding to the pool's
    /// alignment); `None` when rounding overflows.
    #[inline]
    fn block_size(&self, bytes: u64) -> Option<u64> {
        crate::engine::checked_align_up(bytes, self.alignment)
    }

    /// The lock-free allocation path: the free ring's only free, if it was made on `stream`
    /// with the size a request of `bytes` gets — what the engine's search would hand out (the
    /// latest exact fit freed on the requesting stream), without taking the lock. With more
    /// frees waiting, the engine decides (after the lock's drain), so that placement — and
    /// fragmentation — stay the engine's.
    #[inline]
    pub(crate) fn reuse_ringed(&self, bytes: u64, stream: &Stream<'_>) -> Option<Granted> {
        let ring = self.free_ring.as_ref()?;
        if self.sticky_hint.load(Ordering::Relaxed) {
            return None;
        }
        let size = self.block_size(bytes)?;
        let slot = stream.slot();
        let f = ring.pop_only_if(|f| f.tag.stream == slot && f.size == size)?;
        Some(Granted { block: Some(f.block), ptr: self.ptr_at(f.offset), size, shard: self.shard })
    }

    /// Frees a typed allocation (`PoolAlloc`): through the free ring when the pool has one
    /// (no lock), else as [`PoolCore::free_block`].
    #[inline]
    pub(crate) fn free_typed(
        &self,
        device: &DeviceShared,
        granted: (Option<BlockId>, DevicePtr),
        bytes: u64,
        stream: &Stream<'_>,
        other_uses: &[StreamUse],
        location: Option<&'static Location<'static>>,
    ) -> Result<()> {
        stream.refuse_in_capture("a pool free")?;
        let (Some(ring), (Some(block), ptr)) = (&self.free_ring, granted) else {
            return self.free_block(device, granted, stream, other_uses, location);
        };
        // `bytes` was rounded when the block was allocated, so this never falls back.
        let Some(size) = self.block_size(bytes) else {
            return self.free_block(device, granted, stream, other_uses, location);
        };
        self.wait_for_uses(device, stream, other_uses)?;
        let f = free_ring::RingedFree {
            block,
            offset: ptr.offset_from(self.base).unwrap_or(0),
            size,
            tag: FreeTag { stream: stream.slot(), pos: stream.position() },
        };
        if ring.push(f).is_err() {
            // Full: drain it (the lock does) and free directly.
            let mut inner = self.lock();
            inner.engine.free(f.block, f.tag).map_err(|e| free_failed(block, &e))?;
        }
        Ok(())
    }

    fn reuse_policy(&self) -> ReusePolicy {
        ReusePolicy::from_bits(self.settings.reuse.load(Ordering::Relaxed))
    }

    pub(crate) fn reuse_flag(&self, bit: u32) -> bool {
        self.settings.reuse.load(Ordering::Relaxed) & bit != 0
    }

    pub(crate) fn set_reuse_flag(&self, bit: u32, on: bool) {
        if on {
            self.settings.reuse.fetch_or(bit, Ordering::Relaxed);
        } else {
            self.settings.reuse.fetch_and(!bit, Ordering::Relaxed);
        }
    }

    pub(crate) fn release_threshold(&self) -> u64 {
        self.settings.release_threshold.load(Ordering::Relaxed)
    }

    pub(crate) fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        if bytes > self.max_size {
            return Err(Error::InvalidArgument(format!(
                "release threshold {bytes} exceeds the pool's max size {}",
                self.max_size
            )));
        }
        self.settings.release_threshold.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    pub(crate) fn ptr_at(&self, offset: u64) -> DevicePtr {
        // The engine hands out offsets inside the reserved range, which does not wrap.
        self.base.checked_add(offset).unwrap_or(self.base)
    }

    /// Pass-through mode: hands the frees that completed to the engine and releases every
    /// fully free granule.
    #[inline]
    fn drain_passthrough(&self, device: &DeviceShared, inner: &mut PoolInner) {
        if let Some(p) = &self.passthrough {
            self.drain_passthrough_slow(device, inner, p);
        }
    }

    #[cold]
    #[inline(never)]
    fn drain_passthrough_slow(
        &self,
        device: &DeviceShared,
        inner: &mut PoolInner,
        p: &passthrough::Passthrough,
    ) {
        let done = p.take_done();
        if done.is_empty() {
            return;
        }
        for (block, tag) in done {
            let _ = inner.engine.free(block, tag);
        }
        let order = Order { device, requester: None, reuse: 0 };
        let (engine, mut backing) = inner.parts(self);
        if let Err(e) = engine.release(0, &order, &mut backing) {
            self.put_sticky(
                inner,
                Error::Driver(crate::hal::DriverError::Native {
                    code: -1,
                    message: format!("pass-through release failed: {e:?}"),
                }),
            );
        }
    }

    /// The pool locked with every host-observed free settled (the deferred frees of a
    /// passthrough pool handed over first); `None` for a pool torn down or native (the
    /// native pool keeps its own books).
    fn lock_settled(&self, device: &DeviceShared) -> Option<Locked<'_>> {
        if self.torn_down.load(Ordering::Acquire) || self.native.is_some() {
            return None;
        }
        let mut inner = self.lock();
        self.drain_passthrough(device, &mut inner);
        settle(device, &mut inner.engine);
        Some(inner)
    }

    /// Settles the host-observed frees (after a stream was dropped).
    pub(crate) fn settle_observed(&self, device: &DeviceShared) {
        self.lock_settled(device);
    }

    /// After a host synchronisation: settles the frees it made host-observed (they merge
    /// with free neighbours of any stream, see [`Engine::settle`]), then releases free memory
    /// down to the threshold.
    pub(crate) fn apply_release_threshold(&self, device: &DeviceShared) {
        let threshold = self.release_threshold();
        let reserved =
            self.budget.as_ref().map_or_else(|| self.lock().engine.reserved(), |b| b.reserved());
        if reserved > threshold {
            // Only when something may be released: the poll is a driver call per stream.
            self.poll_freeing_streams(device);
        }
        let Some(mut inner) = self.lock_settled(device) else { return };
        // A shard releases what the pool as a whole holds above the threshold (the device
        // calls every shard in turn).
        let pool_reserved = self.budget.as_ref().map_or(inner.engine.reserved(), |b| b.reserved());
        if pool_reserved <= threshold {
            return;
        }
        let keep = self.keep_for(inner.engine.reserved(), threshold);
        let order = Order { device, requester: None, reuse: 0 };
        let (engine, mut backing) = inner.parts(self);
        match engine.release(keep, &order, &mut backing) {
            Ok(released) => {
                crate::observe::trace_trim("threshold", released, inner.engine.reserved());
                inner.record(self, RecordKind::Trim, 0, 0, released, 0)
            }
            Err(e) => {
                let error = Error::Driver(crate::hal::DriverError::Native {
                    code: -1,
                    message: format!("releasing memory at the threshold failed: {e:?}"),
                });
                self.put_sticky(&mut inner, error);
            }
        }
    }

    /// Asks the backend to bring the completion of the live streams that freed here up to
    /// date ([`poll_completed`](crate::hal::StreamHal::poll_completed)) before memory is
    /// released: a backend that caches completion would otherwise keep memory whose frees the
    /// device has finished.
    fn poll_freeing_streams(&self, device: &DeviceShared) {
        if self.native.is_some() {
            return;
        }
        for (_, live) in self.freeing_live_streams(device) {
            live.hal.poll_completed();
        }
    }

    /// The live streams that freed into this core (read under the lock, returned without it).
    fn freeing_live_streams(
        &self,
        device: &DeviceShared,
    ) -> smallvec::SmallVec<[(StreamSlot, LiveStream); 8]> {
        let slots: smallvec::SmallVec<[StreamSlot; 8]> =
            self.lock().engine.freeing_streams().collect();
        slots.into_iter().filter_map(|s| device.live_stream(s).map(|live| (s, live))).collect()
    }

    /// What this core keeps (the `keep` of [`Engine::release`]) so that the pool holds
    /// `target` bytes: `target` itself when the pool is one core; a shard keeps its
    /// `reserved` minus the pool's excess over `target`.
    fn keep_for(&self, reserved: u64, target: u64) -> u64 {
        match &self.budget {
            Some(b) => reserved.saturating_sub(b.reserved().saturating_sub(target)),
            None => target,
        }
    }

    pub(crate) fn set_sticky(&self, error: Error) {
        let mut inner = self.lock();
        self.put_sticky(&mut inner, error);
    }

    /// Allocates `bytes` for `stream` (rounded to the pool's alignment), waiting for other
    /// streams' pending frees and retrying once before reporting out of memory.
    ///
    /// `peers` are the other shards of a sharded pool (empty otherwise): their cached memory
    /// is tried before this shard grows, and their idle memory released when it runs out.
    #[inline(always)]
    pub(crate) fn allocate(
        &self,
        device: &DeviceShared,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
        peers: &[&PoolCore],
    ) -> Result<Granted> {
        if let Some(native) = &self.native {
            return match self.allocate_native(&**native, bytes, stream) {
                Err(Error::OutOfMemory(oom)) => {
                    self.retry_native_after_oom(&**native, bytes, stream, on_oom, oom)
                }
                other => other,
            };
        }
        match self.try_allocate(device, bytes, stream, location, peers) {
            Err(Error::OutOfMemory(oom)) => {
                self.retry_after_oom(device, bytes, stream, location, on_oom, peers, oom)
            }
            other => other,
        }
    }

    /// Out of memory after waiting for pending frees: both the per-call hook and the pool's
    /// hook may free memory, so either may ask for one retry.
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn retry_after_oom(
        &self,
        device: &DeviceShared,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
        peers: &[&PoolCore],
        oom: Box<OutOfMemory>,
    ) -> Result<Granted> {
        if self.hooks_ask_retry(on_oom, &oom) {
            return self.try_allocate(device, bytes, stream, location, peers);
        }
        Err(Error::OutOfMemory(oom))
    }

    /// Calls the per-call hook and the pool's hook with the report (both, always: either may
    /// free memory); whether one of them asks for a retry.
    fn hooks_ask_retry(
        &self,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
        oom: &OutOfMemory,
    ) -> bool {
        let local = on_oom(oom);
        let global = self.on_oom.as_ref().map_or(OomAction::Fail, |hook| hook(oom));
        local == OomAction::Retry || global == OomAction::Retry
    }

    /// [`PoolCore::allocate`] from the driver's own pool (a pool created on the native path).
    /// Errors as the engine's: a size above the pool's max size is
    /// [`Error::InvalidSize`], a full pool [`Error::OutOfMemory`] with the numbers the driver's
    /// pool gives.
    #[inline(never)]
    fn allocate_native(
        &self,
        native: &dyn crate::hal::NativePoolHal,
        bytes: u64,
        stream: &Stream<'_>,
    ) -> Result<Granted> {
        if let Some(e) = self.take_sticky(&mut self.lock()) {
            return Err(e);
        }
        let size = self.block_size(bytes).filter(|&s| s <= self.max_size).ok_or_else(|| {
            Error::InvalidSize(format!(
                "size {bytes} (rounded to a multiple of {}) exceeds the pool's max size {}",
                self.alignment, self.max_size
            ))
        })?;
        match native.malloc_async(bytes, &**stream.hal()) {
            Ok(ptr) => Ok(Granted { block: None, ptr, size, shard: 0 }),
            Err(e @ crate::hal::DriverError::OutOfMemory { .. }) => {
                Err(Error::OutOfMemory(Box::new(self.native_oom(native, bytes, size, stream, e))))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The report of a native pool that is full: its own counters, the device's memory.
    #[cold]
    fn native_oom(
        &self,
        native: &dyn crate::hal::NativePoolHal,
        bytes: u64,
        rounded: u64,
        stream: &Stream<'_>,
        cause: crate::hal::DriverError,
    ) -> OutOfMemory {
        let attr = |id| native.get_attr(id).unwrap_or(0);
        let (device_free, device_total) = self.hal.mem_info().map_or((0, 0), |m| (m.free, m.total));
        OutOfMemory {
            requested: bytes,
            rounded,
            stream: stream.id(),
            used: attr(attr::UsedMemCurrent::ID),
            reserved: attr(attr::ReservedMemCurrent::ID),
            max: self.max_size,
            largest_free_block: 0,
            pending_bytes: 0,
            pending: Vec::new(),
            reuse: self.reuse_policy(),
            device_free,
            device_total,
            retried: false,
            cause: Some(format!("the driver's pool answered: {cause}")),
        }
    }

    /// [`PoolCore::retry_after_oom`] for a native pool: the hooks may free memory and ask
    /// for one more attempt.
    #[cold]
    #[inline(never)]
    fn retry_native_after_oom(
        &self,
        native: &dyn crate::hal::NativePoolHal,
        bytes: u64,
        stream: &Stream<'_>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
        oom: Box<OutOfMemory>,
    ) -> Result<Granted> {
        if self.hooks_ask_retry(on_oom, &oom) {
            return self.allocate_native(native, bytes, stream);
        }
        Err(Error::OutOfMemory(oom))
    }

    #[inline(always)]
    fn try_allocate(
        &self,
        device: &DeviceShared,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        peers: &[&PoolCore],
    ) -> Result<Granted> {
        let reuse = self.settings.reuse.load(Ordering::Relaxed);
        let order = Order { device, requester: Some(stream), reuse };
        if !peers.is_empty() {
            if let Some(g) = self.reuse_in_shards(device, bytes, stream, location, &order, peers)? {
                return Ok(g);
            }
        }
        let first = {
            let mut inner = self.lock();
            self.drain_passthrough(device, &mut inner);
            if let Some(e) = self.take_sticky(&mut inner) {
                return Err(e);
            }
            self.alloc_locked(&mut inner, bytes, stream, &order)
        };
        let allocation = match first {
            // The common case reads the engine's answer where it landed: no moves of it.
            Ok(a) if a.dependency.is_none() && !self.annotate && !self.history_on => {
                return Ok(self.granted(&a));
            }
            Ok(a) => a,
            Err(e) => match self.alloc_failed(device, bytes, stream, location, &order, e, peers)? {
                Ok(a) => a,
                // Served by another shard after the wait for pending frees.
                Err(granted) => return Ok(granted),
            },
        };
        let a = self.finish_allocate(device, bytes, stream, location, allocation)?;
        Ok(self.granted(&a))
    }

    /// One engine allocation in this core, growth included (the retries after the first).
    #[allow(clippy::result_large_err, reason = "as Engine::alloc, whose error this is")]
    fn alloc_here(
        &self,
        bytes: u64,
        stream: &Stream<'_>,
        order: &Order<'_>,
    ) -> std::result::Result<Allocation, AllocError> {
        self.alloc_locked(&mut self.lock(), bytes, stream, order)
    }

    /// One engine allocation under the lock `inner`. Out of line: inlined into the public
    /// entry points with the rest of the path it costs more than the call.
    #[inline(never)]
    #[allow(clippy::result_large_err, reason = "as Engine::alloc, whose error this is")]
    fn alloc_locked(
        &self,
        inner: &mut PoolInner,
        bytes: u64,
        stream: &Stream<'_>,
        order: &Order<'_>,
    ) -> std::result::Result<Allocation, AllocError> {
        let (engine, mut backing) = inner.parts(self);
        engine.alloc(bytes, self.alignment, stream.slot(), order, &mut backing)
    }

    fn granted(&self, a: &Allocation) -> Granted {
        Granted {
            block: Some(a.block),
            ptr: self.ptr_at(a.offset),
            size: a.size,
            shard: self.shard,
        }
    }

    /// A sharded pool, before this shard (the requesting stream's) maps: cached memory of any
    /// shard, this one first — first under the rules that need no new dependency, then (when
    /// internal dependencies are allowed) with rule 4 — so that the pool reuses before it
    /// grows, as one engine does. `None` when no shard has a fitting block; bad requests are
    /// left to the engine's full path to report.
    fn reuse_in_shards(
        &self,
        device: &DeviceShared,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        order: &Order<'_>,
        peers: &[&PoolCore],
    ) -> Result<Option<Granted>> {
        for with_dependency in [false, true] {
            if with_dependency && !order.internal_dependencies() {
                break;
            }
            for &core in std::iter::once(&self).chain(peers) {
                let got = {
                    let mut inner = core.lock();
                    if std::ptr::eq(core, self) {
                        if let Some(e) = self.take_sticky(&mut inner) {
                            return Err(e);
                        }
                    }
                    inner.engine.alloc_cached(
                        bytes,
                        core.alignment,
                        stream.slot(),
                        order,
                        with_dependency,
                    )
                };
                match got {
                    Ok(Some(a)) => {
                        let a = core.finish_allocate(device, bytes, stream, location, a)?;
                        return Ok(Some(core.granted(&a)));
                    }
                    Ok(None) => {}
                    Err(_) => return Ok(None),
                }
            }
        }
        Ok(None)
    }

    /// Releases the idle memory of the other shards (`peers`): fully free segments whose
    /// frees have completed, as `trim_to(0)` does. Returns the bytes released.
    fn release_peers(&self, device: &DeviceShared, peers: &[&PoolCore]) -> u64 {
        let order = Order { device, requester: None, reuse: 0 };
        let mut released = 0;
        for &core in peers {
            let mut inner = core.lock();
            let (engine, mut backing) = inner.parts(core);
            match engine.release(0, &order, &mut backing) {
                Ok(n) => released += n,
                Err(e) => core.put_sticky(
                    &mut inner,
                    Error::Driver(crate::hal::DriverError::Native {
                        code: -1,
                        message: format!("releasing a shard's memory failed: {e:?}"),
                    }),
                ),
            }
        }
        released
    }

    /// The rest of a failed first attempt of [`PoolCore::try_allocate`] (cold): out of memory
    /// in a sharded pool first releases the other shards' idle memory and retries; out of
    /// memory with frees pending on other streams waits for them and retries once; otherwise
    /// the error is reported and recorded. `Ok(Err(granted))`: served by another shard.
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn alloc_failed(
        &self,
        device: &DeviceShared,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        order: &Order<'_>,
        first: AllocError,
        peers: &[&PoolCore],
    ) -> Result<std::result::Result<Allocation, Granted>> {
        let first = match first {
            AllocError::OutOfMemory(_)
                if !peers.is_empty() && self.release_peers(device, peers) > 0 =>
            {
                match self.alloc_here(bytes, stream, order) {
                    Ok(a) => return Ok(Ok(a)),
                    Err(e) => e,
                }
            }
            other => other,
        };
        // What was pending on other streams before the wait, for the report.
        let mut first_pending = smallvec::SmallVec::new();
        let result = match first {
            AllocError::OutOfMemory(mut info) => {
                for &peer in peers {
                    let more = peer.lock().engine.pending_frees(stream.slot(), order);
                    info.pending.extend(more);
                }
                // With nothing pending but enough free bytes in the pool, the frees are
                // eligible but may be cut into per-stream blocks that only settling merges (a
                // reuse switch on must not fail what the same program with it off serves):
                // what the device has completed of the streams that freed here becomes
                // host-observed without waiting — no stream is synchronised, so neither the
                // requesting stream nor one that took a dropped stream's slot can block this.
                let settle_completed = info.pending.is_empty()
                    && info.reserved.saturating_sub(info.used) >= info.rounded;
                if info.pending.is_empty() && !settle_completed {
                    Err((AllocError::OutOfMemory(info), false))
                } else {
                    first_pending.clone_from(&info.pending);
                    if settle_completed {
                        for &core in std::iter::once(&self).chain(peers) {
                            for (slot, live) in core.freeing_live_streams(device) {
                                live.hal.poll_completed();
                                device.observe(slot, live.completed() + 1);
                            }
                        }
                    }
                    // Wait (without the pool lock) for the streams holding pending frees, then
                    // retry once: their blocks become host-observed and reusable here.
                    for pending in &info.pending {
                        if let Some(live) = device.live_stream(pending.stream) {
                            let enqueued = live.enqueued();
                            let _ = live.hal.synchronize();
                            device.observe(pending.stream, enqueued + 1);
                        }
                    }
                    // Host-observed now, those frees settle: merged with their free
                    // neighbours of any stream, they may serve a request none fits alone.
                    for &core in std::iter::once(&self).chain(peers) {
                        settle(device, &mut core.lock().engine);
                    }
                    self.lock().oom_retries += 1;
                    if !peers.is_empty() {
                        if let Some(g) =
                            self.reuse_in_shards(device, bytes, stream, location, order, peers)?
                        {
                            return Ok(Err(g));
                        }
                        self.release_peers(device, peers);
                    }
                    self.alloc_here(bytes, stream, order).map_err(|e| (e, true))
                }
            }
            other => Err((other, false)),
        };
        match result {
            Ok(a) => Ok(Ok(a)),
            Err((e, retried)) => {
                let oom = matches!(e, AllocError::OutOfMemory(_));
                let error = self.alloc_error(e, bytes, stream, retried, &first_pending);
                let mut inner = self.lock();
                if oom {
                    inner.ooms += 1;
                }
                let kind = if oom { RecordKind::Oom } else { RecordKind::AllocFailed };
                if oom {
                    crate::observe::trace_oom(&error);
                }
                inner.record_full(self, kind, stream.id(), 0, 0, bytes, None, location);
                Err(error)
            }
        }
    }

    /// The success path of [`PoolCore::try_allocate`]: the dependency an internal-dependency
    /// reuse needs, annotations and history.
    #[inline(always)]
    fn finish_allocate(
        &self,
        device: &DeviceShared,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        allocation: Allocation,
    ) -> Result<Allocation> {
        if allocation.dependency.is_none() && !self.annotate && !self.history_on {
            return Ok(allocation);
        }
        self.finish_allocate_slow(device, bytes, stream, location, allocation)
    }

    /// [`PoolCore::finish_allocate`] with a dependency to insert, an annotation or a history
    /// record to make.
    #[inline(never)]
    fn finish_allocate_slow(
        &self,
        device: &DeviceShared,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        allocation: Allocation,
    ) -> Result<Allocation> {
        if let Some(tag) = allocation.dependency {
            if let Err(e) = self.insert_dependency(device, tag, stream) {
                // Give the block back where it came from: its original tag keeps it safe.
                let _ = self.lock().engine.free(allocation.block, tag);
                return Err(e);
            }
        }
        if self.annotate {
            self.hal.annotate(crate::hal::PoolAnnotation::Alloc {
                pool: self.id,
                ptr: self.ptr_at(allocation.offset),
                size: bytes,
                stream: stream.id(),
                position: stream.hal().enqueued(),
            });
        }
        if self.history_on {
            let mut inner = self.lock();
            inner.record_full(
                self,
                RecordKind::Alloc,
                stream.id(),
                allocation.offset,
                allocation.size,
                bytes,
                allocation.reuse,
                location,
            );
        }
        Ok(allocation)
    }

    /// Rule 4: make `stream` wait on an event recorded on `tag.stream` after the free.
    fn insert_dependency(
        &self,
        device: &DeviceShared,
        tag: FreeTag,
        stream: &Stream<'_>,
    ) -> Result<()> {
        // An event recorded on the freeing stream now (after the free), waited on by
        // `stream`: exactly what ordering after a recorded use does. A dropped stream has
        // drained, so its free is complete and nothing is inserted.
        self.wait_for_uses(device, stream, &[(tag.stream, tag.pos)])
    }

    /// The error for a failed allocation; out of memory carries the pool's numbers, the
    /// frees that were pending on other streams (`first_pending`, before the pool's wait, or
    /// those of the final attempt) by stream id, and the reuse policy.
    fn alloc_error(
        &self,
        e: AllocError,
        bytes: u64,
        stream: &Stream<'_>,
        retried: bool,
        first_pending: &[crate::engine::PendingFrees],
    ) -> Error {
        match e {
            AllocError::InvalidSize(msg) => Error::InvalidSize(msg),
            AllocError::InvalidAlignment(msg) => Error::InvalidArgument(msg),
            AllocError::Backing(msg) => Error::Driver(crate::hal::DriverError::Native {
                code: -1,
                message: format!("mapping failed: {msg}"),
            }),
            AllocError::OutOfMemory(info) => {
                let mem = self.hal.mem_info().ok();
                let source =
                    if first_pending.is_empty() { &info.pending[..] } else { first_pending };
                let device = &stream.device().shared;
                let mut pending: Vec<crate::observe::PendingFree> = source
                    .iter()
                    .map(|p| crate::observe::PendingFree {
                        stream: device.live_stream(p.stream).map_or(0, |l| l.hal.id()),
                        bytes: p.bytes,
                    })
                    .collect();
                pending.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.stream.cmp(&b.stream)));
                Error::OutOfMemory(Box::new(OutOfMemory {
                    requested: bytes,
                    rounded: info.rounded,
                    stream: stream.id(),
                    // A sharded pool reports the pool's figures, not the shard's.
                    used: self.budget.as_ref().map_or(info.used, |b| b.counters().used),
                    reserved: self.budget.as_ref().map_or(info.reserved, |b| b.reserved()),
                    max: info.max,
                    largest_free_block: info.largest_free_block,
                    pending_bytes: pending.iter().map(|p| p.bytes).sum(),
                    pending,
                    reuse: self.reuse_policy(),
                    device_free: mem.map_or(0, |m| m.free),
                    device_total: mem.map_or(0, |m| m.total),
                    retried,
                    cause: None,
                }))
            }
        }
    }

    /// Frees `block` onto `stream`, first making `stream` wait for every other stream that
    /// used the block, so that stream order alone covers all uses.
    /// Makes `stream` wait on an event recorded on each other stream in `uses` (now), so
    /// that `stream`'s later work is ordered after every recorded use.
    #[inline]
    pub(crate) fn wait_for_uses(
        &self,
        device: &DeviceShared,
        stream: &Stream<'_>,
        uses: &[StreamUse],
    ) -> Result<()> {
        if uses.is_empty() {
            return Ok(());
        }
        self.wait_for_each_use(device, stream, uses)
    }

    /// [`PoolCore::wait_for_uses`] for a block used on other streams.
    #[inline(never)]
    fn wait_for_each_use(
        &self,
        device: &DeviceShared,
        stream: &Stream<'_>,
        uses: &[StreamUse],
    ) -> Result<()> {
        for &(user, at) in uses {
            if user == stream.slot() {
                continue;
            }
            // A stream that held the slot before the live one was dropped, which drained it:
            // nothing to wait for (and the live stream never touched this block).
            if let Some(live) = device.live_stream(user).filter(|l| l.base <= at) {
                // A record on a capturing stream would be captured, and the wait on it would
                // make the freeing stream join that capture.
                crate::graph::refuse_capturing(&*live.hal, "ordering a pool free after a use")?;
                let event = self.hal.create_event()?;
                let pos = live.hal.record(&*event)?;
                stream.wait_raw(&*event)?;
                stream.clock().raise(user, live.base + pos);
            }
        }
        Ok(())
    }

    pub(crate) fn free_block(
        &self,
        device: &DeviceShared,
        granted: (Option<BlockId>, DevicePtr),
        stream: &Stream<'_>,
        other_uses: &[StreamUse],
        location: Option<&'static Location<'static>>,
    ) -> Result<()> {
        self.wait_for_uses(device, stream, other_uses)?;
        let (block, ptr) = granted;
        let Some(block) = block else {
            let native = self.native.as_ref().ok_or_else(|| {
                Error::InvalidArgument(format!("{ptr} has no block in this pool"))
            })?;
            return Ok(native.free_async(ptr, &**stream.hal())?);
        };
        // One read of the position serves the tag and the sanitizer's annotation: another
        // thread enqueueing on the stream in between must not move one without the other.
        let (local, global) = stream.positions();
        let tag = FreeTag { stream: stream.slot(), pos: global };
        let mut inner = self.lock();
        let info = if self.history_on || self.annotate { inner.engine.block(block) } else { None };
        if self.annotate {
            if let Some(info) = info.filter(|i| i.state == crate::engine::BlockState::Live) {
                self.hal.annotate(crate::hal::PoolAnnotation::Free {
                    pool: self.id,
                    ptr: self.ptr_at(info.offset),
                    stream: stream.id(),
                    position: local,
                });
            }
        }
        match &self.passthrough {
            Some(p) if info.is_none_or(|i| i.state == crate::engine::BlockState::Live) => {
                p.defer(block, tag, &**stream.hal()).map_err(|()| {
                    Error::InvalidArgument(format!("free of block {block:?}: double free"))
                })?;
            }
            _ => inner.engine.free(block, tag).map_err(|e| free_failed(block, &e))?,
        }
        if let Some(info) = info.filter(|_| inner.history.is_some()) {
            let (offset, size) = (info.offset, info.size);
            inner.record_full(self, RecordKind::Free, stream.id(), offset, size, 0, None, location);
        }
        Ok(())
    }
}

/// Settles `engine`'s host-observed frees ([`Engine::settle`]), unless nothing was freed or
/// the only stream that ever freed there is alive and alone on the device: its frees merge
/// among themselves already, and settling would cost a pass over them at every
/// synchronisation. (A dropped stream's frees settle: the next stream may come after it.)
fn settle(device: &DeviceShared, engine: &mut Engine) {
    let mut freeing = engine.freeing_streams();
    let nothing_to_merge = match (freeing.next(), freeing.next()) {
        (None, _) => true,
        (Some(s), None) => device.live_streams() <= 1 && device.is_live(s),
        (Some(_), Some(_)) => false,
    };
    drop(freeing);
    if !nothing_to_merge {
        engine.settle(&Order { device, requester: None, reuse: 0 });
    }
}

/// The error of an engine free that failed (an unknown or already free block).
fn free_failed(block: BlockId, e: &crate::engine::FreeError) -> Error {
    Error::InvalidArgument(format!("free of block {block:?} failed: {e:?} (double free?)"))
}

/// A stream-ordered memory pool on one device.
///
/// Allocations are served from a virtual range reserved at creation, backed by physical
/// memory mapped on demand. A free returns the block to the pool at once, tagged with its
/// stream's position: the same stream may reuse it immediately (stream order makes that
/// safe), other streams when a reuse rule proves it safe ([`ReusePolicy`]).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let npu = soma_sim::Npu::builder().build()?;
/// # let dev = soma_core::Device::new(npu.device(0)?);
/// use soma_core::{attr, MemPool};
/// let s = dev.create_stream()?;
/// let pool = MemPool::builder().max_size(1 << 30).build(&dev)?;
/// let mut x = pool.alloc_async::<f32>(1 << 20, &s)?;
/// s.copy_from_host(&mut x, &vec![1.0; 1 << 20])?;
/// drop(x); // freed onto `s`, in stream order: no synchronisation
/// assert_eq!(pool.get::<attr::UsedMemCurrent>()?, 0);
/// assert!(pool.get::<attr::ReservedMemCurrent>()? >= 4 << 20);
/// # Ok(()) }
/// ```
pub struct MemPool<'d> {
    device: &'d Device,
    /// Shard 0: the whole pool unless it is sharded.
    core: Arc<PoolCore>,
    shards: Option<Box<shards::Shards>>,
}

impl<'d> MemPool<'d> {
    /// A builder with the Rust defaults (see [`MemPoolBuilder`]).
    pub fn builder() -> MemPoolBuilder {
        MemPoolBuilder::default()
    }

    /// The device of the pool.
    #[inline]
    pub fn device(&self) -> &'d Device {
        self.device
    }

    /// Maximum physical memory the pool may hold (rounded to the granularity).
    pub fn max_size(&self) -> u64 {
        self.core.max_size
    }

    /// Block alignment.
    pub fn alignment(&self) -> u64 {
        self.core.alignment
    }

    /// The current reuse rules.
    pub fn reuse_policy(&self) -> ReusePolicy {
        self.core.reuse_policy()
    }

    /// Replaces the reuse rules (affects later allocations). A native pool forwards them to
    /// the driver's pool; a failure there is reported at the pool's next fallible call.
    pub fn set_reuse_policy(&self, policy: ReusePolicy) {
        if self.core.native.is_some() {
            // Switch by switch, as the attributes set them (the driver's pool, then the stored
            // policy), so that `reuse_policy()` agrees with the driver's pool even when a later
            // switch fails.
            use attr::Settable as _;
            let set =
                attr::ReuseFollowEventDependencies::set(self, policy.follow_event_dependencies)
                    .and_then(|()| attr::ReuseAllowOpportunistic::set(self, policy.opportunistic))
                    .and_then(|()| {
                        attr::ReuseAllowInternalDependencies::set(
                            self,
                            policy.internal_dependencies,
                        )
                    });
            if let Err(e) = set {
                self.core.set_sticky(e);
            }
            return;
        }
        self.core.settings.reuse.store(policy.bits(), Ordering::Relaxed);
    }

    /// Allocates `len` elements of `T` for use on `stream`.
    ///
    /// The memory is usable by work enqueued on `stream` after this call. Its content is
    /// undefined (a reused block keeps the bytes of its previous owner).
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for 0 or overflowing sizes, [`Error::WrongDevice`] for a stream
    /// of another device, [`Error::OutOfMemory`] when the pool cannot grow (after waiting for
    /// pending frees and retrying once), a sticky error from an earlier failed `Drop`.
    #[track_caller]
    pub fn alloc_async<'s, T: bytemuck::Pod + Send + Sync>(
        &'s self,
        len: usize,
        stream: &'s Stream<'d>,
    ) -> Result<PoolAlloc<'s, T>> {
        stream.refuse_in_capture("a pool allocation")?;
        stream.check_device(self.device, "the pool")?;
        let bytes = bytes_for::<T>(len)?;
        let home = self.home(stream);
        if let Some(g) = home.reuse_ringed(bytes, stream) {
            return Ok(PoolAlloc::new(self, stream, g, len));
        }
        let location = Location::caller();
        let g = self.allocate(home, bytes, stream, Some(location), &mut |_| OomAction::Fail)?;
        Ok(PoolAlloc::new(self, stream, g, len))
    }

    /// As [`alloc_async`](Self::alloc_async), but when the pool is out of memory `on_oom` is
    /// called with the report; it may free memory (drop allocations it can borrow, e.g. a
    /// cache) and return [`OomAction::Retry`] for one more attempt.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{MemPool, OomAction};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().max_size(4 << 20).build(&dev)?;
    /// let mut cache = vec![pool.alloc_async::<u8>(3 << 20, &s)?];
    /// let x = pool.alloc_async_or::<u8>(2 << 20, &s, |_oom| {
    ///     cache.clear(); // evict, then ask for a retry
    ///     OomAction::Retry
    /// })?;
    /// # drop(x); Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`alloc_async`](Self::alloc_async).
    #[track_caller]
    pub fn alloc_async_or<'s, T: bytemuck::Pod + Send + Sync>(
        &'s self,
        len: usize,
        stream: &'s Stream<'d>,
        mut on_oom: impl FnMut(&OutOfMemory) -> OomAction,
    ) -> Result<PoolAlloc<'s, T>> {
        stream.refuse_in_capture("a pool allocation")?;
        stream.check_device(self.device, "the pool")?;
        let location = Location::caller();
        let bytes = bytes_for::<T>(len)?;
        let home = self.home(stream);
        if let Some(g) = home.reuse_ringed(bytes, stream) {
            return Ok(PoolAlloc::new(self, stream, g, len));
        }
        let g = self.allocate(home, bytes, stream, Some(location), &mut on_oom)?;
        Ok(PoolAlloc::new(self, stream, g, len))
    }

    /// Allocates `bytes` for `stream` without a typed handle: the C API path. The block must be
    /// freed with [`free_raw`](Self::free_raw) (or it is released when the pool is dropped).
    ///
    /// # Errors
    /// As [`alloc_async`](Self::alloc_async).
    pub fn alloc_raw(&self, bytes: u64, stream: &Stream<'_>) -> Result<(DevicePtr, u64)> {
        stream.refuse_in_capture("a pool allocation")?;
        stream.check_device(self.device, "the pool")?;
        if bytes == 0 {
            return Err(Error::InvalidSize("size 0".into()));
        }
        let home = self.home(stream);
        let a = self.allocate(home, bytes, stream, None, &mut |_| OomAction::Fail)?;
        if let Some(block) = a.block {
            self.core_at(a.shard).lock().raw_blocks.insert(block);
        }
        Ok((a.ptr, a.size))
    }

    /// Frees a block from [`alloc_raw`](Self::alloc_raw) onto `stream`, in stream order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a pointer that is not the start of a live raw block of
    /// this pool (including a double free); requires [`MemPoolBuilder::raw_pointers`].
    pub fn free_raw(&self, ptr: DevicePtr, stream: &Stream<'_>) -> Result<()> {
        stream.refuse_in_capture("a pool free")?;
        stream.check_device(self.device, "the pool")?;
        if self.core.native.is_some() {
            return self.core.free_block(&self.device.shared, (None, ptr), stream, &[], None);
        }
        let found = self.lookup(ptr).filter(|(core, b, _)| core.lock().raw_blocks.remove(b));
        let Some((core, block, _)) = found else {
            return Err(Error::InvalidArgument(format!(
                "{ptr} is not the start of a live raw allocation of this pool"
            )));
        };
        core.free_block(&self.device.shared, (Some(block), ptr), stream, &[], None)
    }

    /// Whether `ptr` is the start of a live block of this pool, and its rounded size.
    ///
    /// O(1) in a pool built with [`MemPoolBuilder::raw_pointers`] (its address index), else a
    /// walk over the blocks below `ptr`: a diagnostic, not for a hot path.
    pub fn owns(&self, ptr: DevicePtr) -> Option<u64> {
        let (core, offset) = self.core_of(ptr)?;
        core.lock().engine.live_size_at(offset)
    }

    /// The shard, block and rounded size of the live block that starts at `ptr`.
    fn lookup(&self, ptr: DevicePtr) -> Option<(&PoolCore, BlockId, u64)> {
        let (core, offset) = self.core_of(ptr)?;
        let (block, size) = core.lock().engine.lookup(offset)?;
        Some((core, block, size))
    }

    /// The core (shard) whose address range holds `ptr`, and its offset there (the shards'
    /// ranges are separate reservations: at most one holds it).
    fn core_of(&self, ptr: DevicePtr) -> Option<(&PoolCore, u64)> {
        self.cores().find_map(|core| {
            ptr.offset_from(core.base).filter(|&o| o < core.max_size).map(|o| (core, o))
        })
    }

    /// Reads an attribute.
    ///
    /// # Errors
    /// A sticky error from an earlier failed `Drop` is reported first.
    pub fn get<A: attr::Attribute>(&self) -> Result<A::Value> {
        self.take_sticky()?;
        A::get(self)
    }

    /// Sets an attribute; read-only attributes do not implement [`attr::Settable`].
    ///
    /// # Errors
    /// A value outside the attribute's domain (e.g. a threshold above the max size).
    pub fn set<A: attr::Settable>(&self, value: A::Value) -> Result<()> {
        self.take_sticky()?;
        A::set(self, value)
    }

    /// Resets a high-water mark to 0 (it then follows the current value again).
    ///
    /// # Errors
    /// A sticky error from an earlier failed `Drop`.
    pub fn reset<A: attr::Resettable>(&self) -> Result<()> {
        self.take_sticky()?;
        A::reset(self)
    }

    fn take_sticky(&self) -> Result<()> {
        for core in self.cores() {
            if let Some(e) = core.take_sticky(&mut core.lock()) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Releases free memory now, down to `max(bytes, used)`, keeping at least `bytes`
    /// (rounded up to the device granularity, as CUDA's and CANN's `minBytesToKeep`); memory
    /// in use, and memory whose free has not completed on the device, is never released.
    /// Returns the bytes released.
    ///
    /// # Errors
    /// `bytes` above the pool's max size; backend failures (accounting stays exact).
    pub fn trim_to(&self, bytes: u64) -> Result<u64> {
        self.take_sticky()?;
        if bytes > self.core.max_size {
            return Err(Error::InvalidArgument(format!(
                "trim_to({bytes}) exceeds the pool's max size {}",
                self.core.max_size
            )));
        }
        if let Some(native) = &self.core.native {
            let before = native.get_attr(attr::ReservedMemCurrent::ID)?;
            native.trim_to(bytes)?;
            let after = native.get_attr(attr::ReservedMemCurrent::ID)?;
            return Ok(before.saturating_sub(after));
        }
        let order = Order { device: &self.device.shared, requester: None, reuse: 0 };
        let mut total = 0;
        // A sharded pool trims its shards in turn until the pool as a whole is at `bytes`.
        for core in self.cores() {
            core.poll_freeing_streams(&self.device.shared);
            let mut inner = core.lock();
            core.drain_passthrough(&self.device.shared, &mut inner);
            // At least `bytes` stay (CUDA's and CANN's `minBytesToKeep`): the engine keeps
            // its target rounded down to a granule, so round it up here. `max_size` is a
            // multiple of the granularity, so the rounded target stays within it.
            let at_least = bytes.next_multiple_of(inner.engine.config().granularity);
            let keep = core.keep_for(inner.engine.reserved(), at_least);
            let (engine, mut backing) = inner.parts(core);
            let released = engine.release(keep, &order, &mut backing).map_err(|e| {
                Error::Driver(crate::hal::DriverError::Native {
                    code: -1,
                    message: format!("unmap failed: {e:?}"),
                })
            })?;
            inner.record(core, RecordKind::Trim, 0, 0, released, 0);
            crate::observe::trace_trim("trim_to", released, inner.engine.reserved());
            total += released;
        }
        Ok(total)
    }

    /// A consistent snapshot of the pool's counters; O(1).
    pub fn stats(&self) -> PoolStats {
        if let Some(native) = &self.core.native {
            let get = |id| native.get_attr(id).unwrap_or(0);
            return PoolStats {
                used: get(attr::UsedMemCurrent::ID),
                used_high: get(attr::UsedMemHigh::ID),
                reserved: get(attr::ReservedMemCurrent::ID),
                reserved_high: get(attr::ReservedMemHigh::ID),
                max_size: self.core.max_size,
                ..PoolStats::default()
            };
        }
        let Some(set) = &self.shards else {
            let inner = self.core.lock();
            return PoolStats::from_engine(
                &inner.engine.stats(),
                inner.oom_retries,
                inner.ooms,
                self.core.max_size,
            );
        };
        // The shards' counters add up; the pool's sizes and high-water marks are its own.
        let (mut sum, mut oom_retries, mut ooms) = (EngineStats::default(), 0, 0);
        for core in self.cores() {
            let inner = core.lock();
            let e = inner.engine.stats();
            sum.allocs += e.allocs;
            sum.frees += e.frees;
            sum.fresh_allocs += e.fresh_allocs;
            for (total, n) in sum.reuses.iter_mut().zip(e.reuses) {
                *total += n;
            }
            sum.map_calls += e.map_calls;
            sum.unmap_calls += e.unmap_calls;
            sum.mapped_segments += e.mapped_segments;
            sum.bytes_mapped_total += e.bytes_mapped_total;
            sum.bytes_unmapped_total += e.bytes_unmapped_total;
            sum.recycling_pauses += e.recycling_pauses;
            sum.pending_bytes += e.pending_bytes;
            sum.free_bytes += e.free_bytes;
            sum.largest_free_block = sum.largest_free_block.max(e.largest_free_block);
            sum.ooms += e.ooms;
            oom_retries += inner.oom_retries;
            ooms += inner.ooms;
        }
        let c = set.budget.counters();
        sum.used = c.used;
        sum.used_high = c.used_high;
        sum.reserved = c.reserved;
        sum.reserved_high = c.reserved_high;
        sum.live_blocks = c.live;
        sum.live_blocks_high = c.live_high;
        PoolStats::from_engine(&sum, oom_retries, ooms, self.core.max_size)
    }

    /// Moves the given allocations of `stream` to the lowest free addresses below them, with
    /// stream-ordered device-to-device copies, so that the free space they leave coalesces.
    /// Returns the number of allocations moved. Their [`PoolAlloc::device_ptr`] changes.
    ///
    /// # Errors
    /// An allocation of another pool or stream, backend failures (allocations already moved
    /// stay moved and valid).
    pub fn compact<T: bytemuck::Pod + Send + Sync>(
        &self,
        stream: &Stream<'_>,
        allocations: &mut [&mut PoolAlloc<'_, T>],
    ) -> Result<usize> {
        self.take_sticky()?;
        if self.core.native.is_some() {
            return Err(Error::Driver(crate::hal::DriverError::Unsupported(
                "compact: a native (CANN) pool does not expose its blocks".into(),
            )));
        }
        for a in allocations.iter() {
            if !self.cores().any(|c| std::ptr::eq(a.pool_core(), c)) {
                return Err(Error::WrongDevice("compact: an allocation of another pool".into()));
            }
            if a.stream_slot() != stream.slot() || !a.stream().device().same_as(stream.device()) {
                return Err(Error::InvalidArgument(
                    "compact: every allocation must belong to the stream".into(),
                ));
            }
        }
        let mut order_idx: Vec<usize> = (0..allocations.len()).collect();
        order_idx.sort_by_key(|&i| allocations[i].device_ptr());
        let mut moved = 0;
        for i in order_idx {
            let a = &mut *allocations[i];
            let core = self.core_at(a.shard());
            let order = Order {
                device: &self.device.shared,
                requester: Some(stream),
                reuse: core.settings.reuse.load(Ordering::Relaxed),
            };
            let Some(block) = a.block() else { continue };
            let target = core.lock().engine.relocate_lower(block, stream.slot(), &order);
            let Some(target) = target else { continue };
            if let Some(tag) = target.dependency {
                if let Err(e) = core.insert_dependency(&self.device.shared, tag, stream) {
                    let _ = core.lock().engine.free(target.block, tag);
                    return Err(e);
                }
            }
            // The copy reads the old block: order it after every other stream's recorded use
            // (a write enqueued there before the compaction must land first).
            let uses = a.uses_snapshot();
            if let Err(e) = core.wait_for_uses(&self.device.shared, stream, &uses) {
                let tag = FreeTag { stream: stream.slot(), pos: stream.position() };
                let _ = core.lock().engine.free(target.block, tag);
                return Err(e);
            }
            let new_ptr = core.ptr_at(target.offset);
            if core.annotate {
                // The moved allocation is a new allocation of the block for the sanitizer.
                core.hal.annotate(crate::hal::PoolAnnotation::Alloc {
                    pool: core.id,
                    ptr: new_ptr,
                    size: a.byte_len_internal(),
                    stream: stream.id(),
                    position: stream.hal().enqueued(),
                });
            }
            if let Err(e) = stream.hal().copy_d2d(new_ptr, a.device_ptr(), a.byte_len_internal()) {
                if core.annotate {
                    core.hal.annotate(crate::hal::PoolAnnotation::Free {
                        pool: core.id,
                        ptr: new_ptr,
                        stream: stream.id(),
                        position: stream.hal().enqueued(),
                    });
                }
                let tag = FreeTag { stream: stream.slot(), pos: stream.position() };
                let _ = core.lock().engine.free(target.block, tag);
                return Err(e.into());
            }
            let (old_block, old_ptr, uses) = a.relocate(target.block, new_ptr);
            core.free_block(&self.device.shared, (old_block, old_ptr), stream, &uses, None)?;
            moved += 1;
        }
        Ok(moved)
    }

    /// The event history, oldest first (empty unless built with
    /// [`MemPoolBuilder::history`]), and how many older records were dropped.
    pub fn history(&self) -> (Vec<Record>, u64) {
        let inner = self.core.lock();
        match &inner.history {
            Some(h) => (h.records().copied().collect(), h.dropped()),
            None => (Vec::new(), 0),
        }
    }

    /// Free-ring tickets produced and consumed so far (`None`: the pool has no ring), for
    /// tests that check which path frees and allocations took.
    #[doc(hidden)]
    pub fn free_ring_tickets(&self) -> Option<(u64, u64)> {
        // A sharded pool has no ring (see `create_core`): shard 0's is the only one.
        self.core.free_ring.as_ref().map(|r| (r.produced(), r.consumed()))
    }

    /// Shard 0: the whole pool unless it is sharded.
    pub(crate) fn core(&self) -> &PoolCore {
        &self.core
    }

    /// The pool-wide counters of a sharded pool (`None`: one shard, the engine keeps them).
    pub(crate) fn budget(&self) -> Option<&shards::Budget> {
        self.shards.as_ref().map(|s| &*s.budget)
    }

    /// The shards created so far, shard 0 first.
    pub(crate) fn cores(&self) -> impl Iterator<Item = &PoolCore> {
        let more = self.shards.iter().flat_map(|s| s.more.iter());
        std::iter::once(&*self.core).chain(more.filter_map(|c| c.get().and_then(Option::as_deref)))
    }

    /// Shard `shard` (shard 0 for an index that names no created shard).
    #[inline]
    pub(crate) fn core_at(&self, shard: u8) -> &PoolCore {
        let more =
            self.shards.as_ref().and_then(|s| s.more.get(usize::from(shard).checked_sub(1)?));
        more.and_then(|c| c.get()).and_then(Option::as_deref).unwrap_or(&self.core)
    }

    /// The shard `stream` allocates in: its slot modulo the shard count, created (its range
    /// reserved) on first use; shard 0 when that fails.
    // Inline, as `core_at` and the stream's accessors: `alloc_async` and `PoolAlloc`'s drop
    // are generic, instantiated in the caller's crate, where only `#[inline]` bodies inline.
    #[inline]
    fn home(&self, stream: &Stream<'_>) -> &PoolCore {
        let Some(set) = &self.shards else { return &self.core };
        let i = stream.slot() as usize % set.count();
        let Some(cell) = i.checked_sub(1).and_then(|j| set.more.get(j)) else {
            return &self.core;
        };
        let created = cell.get_or_init(|| {
            set.builder.create_core(self.device, &set.spec, i as u8, Some(&set.budget)).ok()
        });
        created.as_deref().unwrap_or(&self.core)
    }

    /// Allocates for `stream` in its shard `home`; a sharded pool offers the other shards'
    /// cached memory first (see `shards.rs`).
    // The unsharded path inlines down to the engine call (`PoolCore::allocate` and
    // `try_allocate` are `inline(always)`): call frames and moves of the result cost ~30
    // instructions of a random allocation's ~600 through the public API.
    #[inline]
    fn allocate(
        &self,
        home: &PoolCore,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
    ) -> Result<Granted> {
        if self.shards.is_none() {
            return home.allocate(&self.device.shared, bytes, stream, location, on_oom, &[]);
        }
        self.allocate_sharded(home, bytes, stream, location, on_oom)
    }

    /// [`MemPool::allocate`] in a sharded pool: the other shards are `home`'s peers.
    #[inline(never)]
    fn allocate_sharded(
        &self,
        home: &PoolCore,
        bytes: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
    ) -> Result<Granted> {
        // Inline for every possible shard count: no heap allocation per allocation.
        let peers: smallvec::SmallVec<[&PoolCore; MAX_STREAM_SHARDS]> =
            self.cores().filter(|c| !std::ptr::eq(*c, home)).collect();
        home.allocate(&self.device.shared, bytes, stream, location, on_oom, &peers)
    }
}

impl Drop for MemPool<'_> {
    fn drop(&mut self) {
        let device = &self.device.shared;
        for core in self.cores().skip(1) {
            core.shut_down(device);
        }
        self.core.shut_down(device);
    }
}

impl PoolCore {
    /// The end of a pool (or of one of its shards): no allocation is alive (they borrow the
    /// pool), but frees may still be in flight on their streams — waits for those, then
    /// unmaps everything and gives the address range back.
    fn shut_down(&self, device: &DeviceShared) {
        if let Some(p) = &self.passthrough {
            // Deferred frees: let their host functions run, then hand them to the engine.
            if p.outstanding() {
                let _ = self.hal.synchronize();
            }
            self.drain_passthrough(device, &mut self.lock());
        }
        let pending: Vec<(StreamSlot, u64)> = {
            let inner = self.lock();
            let mut v: Vec<(StreamSlot, u64)> = Vec::new();
            for b in inner.engine.blocks() {
                if let crate::engine::BlockState::Free(Some(tag)) = b.state {
                    match v.iter_mut().find(|(s, _)| *s == tag.stream) {
                        Some(e) => e.1 = e.1.max(tag.pos),
                        None => v.push((tag.stream, tag.pos)),
                    }
                }
            }
            v
        };
        let order = Order { device, requester: None, reuse: 0 };
        for (slot, pos) in pending {
            if !order.is_complete(FreeTag { stream: slot, pos }) {
                if let Some(live) = device.live_stream(slot) {
                    let _ = live.hal.synchronize();
                }
            }
        }
        self.torn_down.store(true, Ordering::Release);
        if self.native.is_some() {
            // Dropping the native pool destroys it (errors are kept by the backend).
            return;
        }
        let mut inner = self.lock();
        if !inner.raw_blocks.is_empty() {
            // Raw blocks never given to `free_raw` go with the pool (`alloc_raw`'s contract),
            // once the device's work is done: any stream may still use them.
            drop(inner);
            let _ = self.hal.synchronize();
            inner = self.lock();
            let raw: Vec<BlockId> = inner.raw_blocks.drain().collect();
            for block in raw {
                // Complete (the device synchronised): any tag will do.
                let _ = inner.engine.free(block, FreeTag { stream: 0, pos: 0 });
            }
        }
        // Nothing to report to from a destructor; the device's counters show any leak.
        let (engine, mut backing) = inner.parts(self);
        let _ = engine.teardown(&mut backing);
        drop(inner);
        let _ =
            if self.preallocated { self.hal.free(self.base) } else { self.hal.release(self.base) };
    }
}

impl std::fmt::Debug for MemPool<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemPool")
            .field("id", &self.core.id)
            .field("max_size", &self.core.max_size)
            .field("alignment", &self.core.alignment)
            .field("reuse", &self.core.reuse_policy())
            .field("release_threshold", &self.core.release_threshold())
            .finish()
    }
}
