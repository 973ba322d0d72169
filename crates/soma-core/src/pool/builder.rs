//! [`MemPoolBuilder`]: a pool's configuration, its validation, and the pool it builds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::api::MemPool;
use super::core::{CoreSpec, PoolCore};
use super::handle::MAX_POOL_BYTES;
use super::ipc::HandleType;
use super::native::NativePool;
use super::owned::OwnedPool;
use super::policy::{OomAction, OomHook, ReusePolicy, Settings};
use super::shards::{Budget, Shards, MAX_STREAM_SHARDS};
use crate::device::Device;
use crate::error::{Error, OutOfMemory, Result};

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
    handle_type: HandleType,
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
            .field("handle_type", &self.handle_type)
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
            recycle_on_growth: false,
            stream_shards: 1,
            handle_type: HandleType::None,
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
    /// (cached memory is released at every synchronisation), and recycling on growth (a pool
    /// that gives its memory back at every synchronisation maps again on the next run anyway,
    /// so it keeps its peak down between synchronisations too).
    pub fn cann_defaults(mut self) -> Self {
        self.reuse = ReusePolicy::NONE;
        self.release_threshold = Some(0);
        self.recycle_on_growth = true;
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
    /// Setting it fixes the count. A growth of `g` granules makes exactly `min(n, g)` driver
    /// map calls, its segments of equal size in whole granules; 1 makes exactly one call per
    /// growth — the right choice for a pool of long-lived memory such as model weights,
    /// where it cuts loading time on real drivers.
    /// Segments are never smaller than 1/512 of the memory reserved when they are mapped
    /// (so the count only applies while growths are small against the pool: below 1 GiB of
    /// 2 MiB granules, always).
    pub fn segments_per_growth(mut self, n: u64) -> Self {
        self.segments_per_growth = n;
        self
    }

    /// Whether growth keeps peak reserved memory down by *recycling* (default `false`):
    /// before mapping beyond the pool's all-time reserved high, fully free segments elsewhere
    /// whose frees have completed are unmapped, so that reserved memory tracks used memory
    /// even when allocation sizes vary. The price is driver calls in steady state for
    /// workloads whose shapes keep changing (an unmap and a map per recycled segment: on the
    /// PyTorch BERT trace about 700 per run, for a peak of 1.008× the live bytes instead of
    /// 1.084×). A recycling pool also *packs* when it empties: the first allocation after
    /// nothing was live moves the free segments above its reserved size into the holes
    /// recycling left below, so the next workload starts from one mapped run (see
    /// `docs/semantics.md`).
    ///
    /// `false` (the default): growth only maps, and a workload run again on the memory its
    /// first run mapped makes no driver call at all; peak reserved is the address space the
    /// placement of the workload spans (within 1.05× the live bytes on the PyTorch traces
    /// but BERT's, 1.084×). Memory pressure, the release threshold and [`MemPool::trim_to`]
    /// still release free memory.
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

    /// Whether the pool can be shared with other processes (default [`HandleType::None`]).
    /// With [`HandleType::Posix`] the pool can be exported ([`MemPool::export`]) and its
    /// allocations opened by another process; see `docs/semantics.md`, *IPC*. Such a pool
    /// frees under its lock (no free ring) and needs virtual memory management; it cannot be
    /// [`native`](Self::native), [`passthrough`](Self::passthrough) or sharded.
    pub fn handle_type(mut self, handle_type: HandleType) -> Self {
        self.handle_type = handle_type;
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
    pub fn build(self, device: &Device) -> Result<MemPool<'_>> {
        self.build_pool(device)
    }

    /// Builds the pool as an [`OwnedPool`]: `'static`, `Send + Sync`, shared by cloning (an
    /// `Arc` inside), for engines that keep their pools in structs, threads and tasks.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let weights = MemPool::builder().max_size(1 << 30).build_owned(&dev)?;
    /// let s = dev.create_owned_stream()?;
    /// let w = weights.upload(&[0.5f32; 1024], &s)?;   // OwnedAlloc<f32>
    /// std::thread::spawn(move || drop(w)).join().unwrap();
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`build`](Self::build).
    pub fn build_owned(self, device: &Device) -> Result<OwnedPool> {
        Ok(OwnedPool::new(self.build_pool(device)?))
    }

    /// Builds the pool for a caller that chooses the lifetime it claims.
    fn build_pool<'d>(mut self, device: &Device) -> Result<MemPool<'d>> {
        if self.passthrough {
            self.reuse = ReusePolicy::NONE;
            self.release_threshold = Some(0);
        }
        let (max_size, threshold) = self.validate(device)?;
        let spec = CoreSpec {
            max_size,
            granularity: device.info().granularity,
            alignment: self.alignment,
            index_by_offset: self.index_by_offset,
            segments_per_growth: self.segments_per_growth,
            recycle_on_growth: self.recycle_on_growth,
            history: self.history,
            passthrough: self.passthrough,
            on_oom: self.on_oom,
            settings: Arc::new(Settings::new(self.reuse, threshold)),
            created: Instant::now(),
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            shareable: self.handle_type == HandleType::Posix,
        };
        let pool = if self.native {
            MemPool::native(device, NativePool::create(device, &spec)?)
        } else if self.stream_shards > 1 {
            let budget = Arc::new(Budget::new(max_size));
            let core = PoolCore::create(&device.shared, &spec, 0, Some(&budget))?;
            MemPool::sharded(device, Shards::new(core, budget, self.stream_shards, spec))
        } else {
            MemPool::single(device, PoolCore::create(&device.shared, &spec, 0, None)?)
        };
        crate::observe::trace_pool_created(pool.id(), max_size, threshold, self.alignment);
        Ok(pool)
    }

    /// Whether `build` would accept this configuration on `device` (its checks, without
    /// building).
    pub(super) fn check(&self, device: &Device) -> Result<()> {
        self.validate(device).map(|_| ())
    }

    /// Checks the configuration against `device`; returns the max size (rounded to the
    /// device granularity) and the release threshold.
    fn validate(&self, device: &Device) -> Result<(u64, u64)> {
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
        if max_size >= MAX_POOL_BYTES {
            // A handle keeps its length in 55 bits (see `PoolAlloc`): one allocation of the
            // whole pool must fit.
            return Err(Error::InvalidConfig(format!(
                "max_size {max_size} is not below the largest pool size, {MAX_POOL_BYTES} bytes"
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
        if self.handle_type == HandleType::Posix
            && (self.native || self.passthrough || self.stream_shards > 1 || !info.supports_vmm)
        {
            return Err(Error::InvalidConfig(
                "handle_type(Posix) needs virtual memory management and is not available with \
                 a native, pass-through or sharded pool"
                    .into(),
            ));
        }
        if !granularity.is_power_of_two() {
            // The engine's blocks and segments are laid out in granules.
            return Err(Error::InvalidConfig(format!(
                "granularity {granularity} is not a power of two"
            )));
        }
        Ok((max_size, threshold))
    }
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);
