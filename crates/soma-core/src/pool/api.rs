//! [`MemPool`]: the public face of a pool, which hands each operation to the engine-backed
//! pool or to the driver's native pool.

use std::marker::PhantomData;
use std::panic::Location;
use std::sync::Arc;

use super::alloc::PoolAlloc;
use super::allocate::Granted;
use super::allocate::Request;
use super::attr;
use super::builder::MemPoolBuilder;
use super::core::PoolCore;
use super::free::TypedFree;
use super::graph_region::{capture_error, capture_memory};
use super::handle::Relocatable;
use super::native::NativePool;
use super::policy::{OomAction, ReusePolicy, Settings};
use super::shards::{Cores, Shards};
use super::stats::PoolStats;
use crate::buffer::bytes_for;
use crate::device::Device;
use crate::engine::BlockId;
use crate::error::{Error, OutOfMemory, Result};
use crate::hal::{CaptureErrorKind, DevicePtr, DriverError};
use crate::observe::Record;
use crate::stream::{Stream, CAPTURED};

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
///
/// Dropping a pool never blocks: memory that work enqueued before the drop may still use
/// (frees in flight, raw blocks) is released by the device once that work has completed, at
/// its next synchronisation, stream drop or pool creation or drop (see the `Drop` impl).
pub struct MemPool<'d> {
    /// A handle to the device (reference-counted); `'d` is the borrow the API promises.
    device: Device,
    _device: PhantomData<&'d Device>,
    kind: PoolKind,
}

/// What serves a pool's requests. The allocation and free paths tell the three apart; every
/// other operation asks [`MemPool::backend`]. (The unsharded engine pool is a variant of its
/// own so that the hot paths reach its core with one check.)
enum PoolKind {
    /// soma's engine over the device's virtual memory: one core.
    Engine(Arc<PoolCore>),
    /// soma's engine, one core per group of streams ([`MemPoolBuilder::stream_shards`]).
    Sharded(Box<Shards>),
    /// The driver's own pool ([`MemPoolBuilder::native`]).
    Native(Box<NativePool>),
}

/// What serves a pool, for the operations that are not on the hot paths.
#[derive(Clone, Copy)]
pub(super) enum Backend<'a> {
    /// soma's engine: the pool's cores.
    Engine(Cores<'a>),
    /// The driver's own pool.
    Native(&'a NativePool),
}

impl<'d> MemPool<'d> {
    /// A builder with the Rust defaults (see [`MemPoolBuilder`]).
    pub fn builder() -> MemPoolBuilder {
        MemPoolBuilder::default()
    }

    /// An engine pool of one core.
    pub(super) fn single(device: &Device, core: Arc<PoolCore>) -> MemPool<'d> {
        MemPool::of(device, PoolKind::Engine(core))
    }

    /// An engine pool of several shards.
    pub(super) fn sharded(device: &Device, shards: Shards) -> MemPool<'d> {
        MemPool::of(device, PoolKind::Sharded(Box::new(shards)))
    }

    /// A pool delegated to the driver's pool.
    pub(super) fn native(device: &Device, native: NativePool) -> MemPool<'d> {
        MemPool::of(device, PoolKind::Native(Box::new(native)))
    }

    fn of(device: &Device, kind: PoolKind) -> MemPool<'d> {
        MemPool { device: device.clone(), _device: PhantomData, kind }
    }

    /// What serves the pool.
    pub(super) fn backend(&self) -> Backend<'_> {
        match &self.kind {
            PoolKind::Engine(core) => Backend::Engine(Cores::single(core)),
            PoolKind::Sharded(shards) => Backend::Engine(shards.cores()),
            PoolKind::Native(native) => Backend::Native(native),
        }
    }

    /// The core of an engine pool of one core (`None`: sharded or native).
    pub(super) fn single_core(&self) -> Option<&Arc<PoolCore>> {
        match &self.kind {
            PoolKind::Engine(core) => Some(core),
            PoolKind::Sharded(_) | PoolKind::Native(_) => None,
        }
    }

    /// The pool's number among the pools of the process (in traces and annotations).
    pub(super) fn id(&self) -> u64 {
        match self.backend() {
            Backend::Engine(cores) => cores.first().id,
            Backend::Native(native) => native.id,
        }
    }

    /// The device of the pool.
    #[inline]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Maximum physical memory the pool may hold (rounded to the granularity).
    pub fn max_size(&self) -> u64 {
        match self.backend() {
            Backend::Engine(cores) => cores.first().max_size,
            Backend::Native(native) => native.max_size,
        }
    }

    /// Block alignment.
    pub fn alignment(&self) -> u64 {
        match self.backend() {
            Backend::Engine(cores) => cores.first().alignment,
            Backend::Native(native) => native.alignment,
        }
    }

    /// The reuse switches and the release threshold.
    pub(super) fn settings(&self) -> &Settings {
        match self.backend() {
            Backend::Engine(cores) => &cores.first().settings,
            Backend::Native(native) => &native.settings,
        }
    }

    /// The current reuse rules.
    pub fn reuse_policy(&self) -> ReusePolicy {
        self.settings().reuse_policy()
    }

    /// Replaces the reuse rules (affects later allocations). A native pool forwards them to
    /// the driver's pool; a failure there is reported at the pool's next fallible call.
    pub fn set_reuse_policy(&self, policy: ReusePolicy) {
        match self.backend() {
            Backend::Engine(cores) => cores.first().settings.set_reuse_policy(policy),
            Backend::Native(native) => native.set_reuse_policy(policy),
        }
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
        stream.check_device(&self.device, "the pool")?;
        let bytes = bytes_for::<T>(len)?;
        let location = Location::caller();
        let handle = |g| PoolAlloc::new(self, stream, g, len);
        self.allocate_typed(bytes, stream, location, &mut |_| OomAction::Fail, handle)
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
        stream.check_device(&self.device, "the pool")?;
        let location = Location::caller();
        let bytes = bytes_for::<T>(len)?;
        let handle = |g| PoolAlloc::new(self, stream, g, len);
        self.allocate_typed(bytes, stream, location, &mut on_oom, handle)
    }

    /// Allocates `len` elements of `T` for use on `stream` in a block whose first byte and
    /// length are multiples of `align`: a power of two from the pool's
    /// [`alignment`](Self::alignment) up to the device granularity (2 MiB on Ascend, what
    /// HCCL wants of the memory it registers). The rest of the block beyond `len` elements
    /// (up to the next multiple of `align`) belongs to the allocation; no other allocation is
    /// carved from it. Requests that do not ask for more than the pool's alignment are
    /// served exactly as by [`alloc_async`](Self::alloc_async).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let _small = pool.alloc_async::<u8>(1000, &s)?;
    /// let comm = pool.alloc_aligned_async::<f32>(1000, 2 << 20, &s)?;
    /// assert_eq!(comm.device_ptr().addr() % (2 << 20), 0);
    /// assert!(pool.alloc_aligned_async::<u8>(1, 3000, &s).is_err()); // not a power of two
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`alloc_async`](Self::alloc_async); [`Error::InvalidArgument`] for an alignment
    /// that is not a power of two between the pool's alignment and the granularity, or on a
    /// native pool (CANN's pool takes no alignment).
    #[track_caller]
    pub fn alloc_aligned_async<'s, T: bytemuck::Pod + Send + Sync>(
        &'s self,
        len: usize,
        align: u64,
        stream: &'s Stream<'d>,
    ) -> Result<PoolAlloc<'s, T>> {
        stream.check_device(&self.device, "the pool")?;
        let bytes = bytes_for::<T>(len)?;
        let handle = |g| PoolAlloc::new(self, stream, g, len);
        self.allocate_aligned(bytes, align, stream, Location::caller(), handle)
    }

    /// Allocates with alignment `align` (checked) for a typed handle made by `handle`: never
    /// from the free ring, whose blocks are sized for the pool's alignment.
    pub(super) fn allocate_aligned<H>(
        &self,
        bytes: u64,
        align: u64,
        stream: &Stream<'_>,
        location: &'static Location<'static>,
        handle: impl Fn(Granted) -> H,
    ) -> Result<H> {
        let granularity = self.device.info().granularity;
        if !align.is_power_of_two() || align < self.alignment() || align > granularity {
            return Err(Error::InvalidArgument(format!(
                "alignment {align} is not a power of two from the pool's alignment {} to the \
                 granularity {granularity}",
                self.alignment()
            )));
        }
        if stream.flags() & CAPTURED != 0 {
            if let Some(g) = self.allocate_in_capture(bytes, align, stream, Some(location))? {
                return Ok(handle(g));
            }
        }
        let fail = &mut |_: &OutOfMemory| OomAction::Fail;
        let location = Some(location);
        let granted = match &self.kind {
            PoolKind::Engine(core) => {
                core.allocate(&Request { bytes, align, stream, location, peers: &[] }, fail)?
            }
            PoolKind::Sharded(shards) => shards.allocate(bytes, align, stream, location, fail)?,
            PoolKind::Native(native) if align == native.alignment => {
                native.allocate(bytes, stream, fail)?
            }
            PoolKind::Native(_) => {
                return Err(Error::InvalidArgument(
                    "a native (CANN) pool takes no alignment beyond its own".into(),
                ))
            }
        };
        Ok(handle(granted))
    }

    /// Allocates for a typed handle, which `handle` makes of the block: the free ring's only
    /// free when it fits (see `free_ring.rs`), else from the engine (the stream's shard of a
    /// sharded pool) or the driver's pool.
    // Inline: `alloc_async` is generic, instantiated in the caller's crate, where only
    // `#[inline]` bodies inline; the unsharded path inlines down to the engine call. Each
    // path makes its handle where it got the block: merging the paths' blocks first costs
    // moves on the ring's path.
    #[inline]
    pub(super) fn allocate_typed<H>(
        &self,
        bytes: u64,
        stream: &Stream<'_>,
        location: &'static Location<'static>,
        on_oom: &mut dyn FnMut(&OutOfMemory) -> OomAction,
        handle: impl Fn(Granted) -> H,
    ) -> Result<H> {
        // One load tells whether the stream ever captured.
        if stream.flags() & CAPTURED != 0 {
            if let Some(g) = self.allocate_in_capture(bytes, 0, stream, Some(location))? {
                return Ok(handle(g));
            }
        }
        let location = Some(location);
        let granted = match &self.kind {
            PoolKind::Engine(core) => {
                if let Some(g) = core.reuse_ringed(bytes, stream) {
                    return Ok(handle(g));
                }
                core.allocate(&Request { bytes, align: 0, stream, location, peers: &[] }, on_oom)?
            }
            PoolKind::Sharded(shards) => shards.allocate(bytes, 0, stream, location, on_oom)?,
            PoolKind::Native(native) => native.allocate(bytes, stream, on_oom)?,
        };
        Ok(handle(granted))
    }

    /// The request of a stream that captured at some point: `Ok(None)` when it is not
    /// capturing now (the ordinary path serves it), else served from graph memory (see
    /// `graph_region.rs`) — by the stream's shard in a sharded pool, never by a native pool.
    #[cold]
    #[inline(never)]
    fn allocate_in_capture(
        &self,
        bytes: u64,
        align: u64,
        stream: &Stream<'_>,
        location: Option<&'static Location<'static>>,
    ) -> Result<Option<Granted>> {
        let Some(memory) = capture_memory(stream, "a pool allocation")? else { return Ok(None) };
        let request = Request { bytes, align, stream, location, peers: &[] };
        match &self.kind {
            PoolKind::Engine(core) => core.allocate_captured(&request, &memory).map(Some),
            PoolKind::Sharded(shards) => {
                shards.home(stream).allocate_captured(&request, &memory).map(Some)
            }
            PoolKind::Native(_) => Err(capture_error(
                CaptureErrorKind::NotCapturable,
                format!(
                    "a pool allocation on stream {}, which is capturing: a native (CANN) pool \
                     keeps no graph memory",
                    stream.id()
                ),
            )),
        }
    }

    /// Allocates `bytes` for `stream` without a typed handle: the C API path. The block must be
    /// freed with [`free_raw`](Self::free_raw) (or it is released when the pool is dropped).
    ///
    /// Returns the block's first byte and its size: `bytes` rounded up to the pool's
    /// [`alignment`](Self::alignment), the bytes the block holds and what
    /// [`PoolStats::used`] counts for it (the C API reports no size).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().raw_pointers(true).build(&dev)?;
    /// let (ptr, size) = pool.alloc_raw(1000, &s)?;
    /// assert_eq!(size, 1024); // rounded to the 512-byte alignment
    /// assert_eq!(pool.stats().used, size);
    /// pool.free_raw(ptr, &s)?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`alloc_async`](Self::alloc_async).
    pub fn alloc_raw(&self, bytes: u64, stream: &Stream<'_>) -> Result<(DevicePtr, u64)> {
        stream.check_device(&self.device, "the pool")?;
        if bytes == 0 {
            return Err(Error::InvalidSize("size 0".into()));
        }
        let captured = match stream.flags() & CAPTURED {
            0 => None,
            _ => self.allocate_in_capture(bytes, 0, stream, None)?,
        };
        let fail = &mut |_: &OutOfMemory| OomAction::Fail;
        let request = Request { bytes, align: 0, stream, location: None, peers: &[] };
        let g = match (captured, &self.kind) {
            (Some(g), _) => g,
            (None, PoolKind::Engine(core)) => core.allocate(&request, fail)?,
            (None, PoolKind::Sharded(shards)) => shards.allocate(bytes, 0, stream, None, fail)?,
            (None, PoolKind::Native(native)) => native.allocate(bytes, stream, fail)?,
        };
        if let (Some(block), Backend::Engine(cores)) = (g.block, self.backend()) {
            cores.core_at(g.origin.shard()).lock().raw_blocks.insert(block);
        }
        Ok((g.ptr, g.size))
    }

    /// Frees a block from [`alloc_raw`](Self::alloc_raw) onto `stream`, in stream order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a pointer that is not the start of a live raw block of
    /// this pool (including a double free); requires [`MemPoolBuilder::raw_pointers`].
    pub fn free_raw(&self, ptr: DevicePtr, stream: &Stream<'_>) -> Result<()> {
        stream.check_device(&self.device, "the pool")?;
        let cores = match self.backend() {
            Backend::Engine(cores) => cores,
            Backend::Native(native) => {
                stream.refuse_in_capture("a pool free")?;
                return native.free(ptr, stream, &[]);
            }
        };
        let found = cores.lookup(ptr).filter(|(core, b)| core.lock().raw_blocks.remove(b));
        let Some((core, block)) = found else {
            return Err(Error::InvalidArgument(format!(
                "{ptr} is not the start of a live raw allocation of this pool"
            )));
        };
        // A raw block may be freed on any stream: a graph's block is looked for whatever the
        // stream's flags.
        match core.free_graph_aware(block, stream, &[], None) {
            Ok(true) => Ok(()),
            Ok(false) => core.free_block(block, stream, &[], None),
            Err(e) => {
                // Refused: the block stays allocated, and freeable later.
                core.lock().raw_blocks.insert(block);
                Err(e)
            }
        }
    }

    /// Frees a typed allocation's block (its `PoolAlloc` is going away).
    // Inline: `PoolAlloc`'s drop is generic, instantiated in the caller's crate.
    #[inline]
    pub(super) fn free_typed(&self, f: &TypedFree<'_>) -> Result<()> {
        match &self.kind {
            PoolKind::Engine(core) => core.free_typed(f),
            PoolKind::Sharded(shards) => shards.core_at(f.shard).free_typed(f),
            PoolKind::Native(native) => native.free(f.ptr, f.stream, f.uses),
        }
    }

    /// Keeps `error`, from a `Drop` of an allocation of shard `shard`, for the pool's next
    /// fallible call.
    #[cold]
    pub(super) fn set_sticky(&self, shard: u8, error: Error) {
        match self.backend() {
            Backend::Engine(cores) => cores.core_at(shard).set_sticky(error),
            Backend::Native(native) => native.set_sticky(error),
        }
    }

    /// Whether `ptr` is the start of a live block of this pool, and its rounded size.
    ///
    /// O(1) in a pool built with [`MemPoolBuilder::raw_pointers`] (its address index), else a
    /// walk over the blocks below `ptr`: a diagnostic, not for a hot path.
    pub fn owns(&self, ptr: DevicePtr) -> Option<u64> {
        let Backend::Engine(cores) = self.backend() else { return None };
        let (core, offset) = cores.core_of(ptr)?;
        core.lock().engine.live_size_at(offset)
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

    /// The error kept from an earlier failed `Drop`, taken.
    pub(super) fn take_sticky(&self) -> Result<()> {
        match self.backend() {
            Backend::Engine(cores) => cores.take_sticky(),
            Backend::Native(native) => native.take_sticky(),
        }
    }

    /// Releases free memory now, down to `max(bytes, used)`, keeping at least `bytes`
    /// (rounded up to the device granularity, as CUDA's and CANN's `minBytesToKeep`); memory
    /// in use, and memory whose free has not completed on the device, is never released.
    /// Returns the bytes released.
    ///
    /// # Errors
    /// `bytes` above the pool's max size; backend failures, including a backend that refuses
    /// to unmap memory a use the pool was not told of still runs on (accounting stays exact;
    /// what could not go stays cached). The release threshold applied at a synchronisation
    /// reports no such failure: it keeps the memory for a later release.
    pub fn trim_to(&self, bytes: u64) -> Result<u64> {
        self.take_sticky()?;
        if bytes > self.max_size() {
            return Err(Error::InvalidArgument(format!(
                "trim_to({bytes}) exceeds the pool's max size {}",
                self.max_size()
            )));
        }
        match self.backend() {
            Backend::Engine(cores) => cores.trim_to(bytes),
            Backend::Native(native) => native.trim_to(bytes),
        }
    }

    /// A consistent snapshot of the pool's counters; O(1) in blocks, except for
    /// [`PoolStats::pending_bytes`] while frees are cached on a stream: O(those cached
    /// blocks).
    pub fn stats(&self) -> PoolStats {
        match self.backend() {
            Backend::Engine(cores) => cores.stats(),
            Backend::Native(native) => native.stats(),
        }
    }

    /// Moves the given allocations of `stream` to the lowest free addresses below them, with
    /// stream-ordered device-to-device copies, so that the free space they leave coalesces.
    /// Returns the number of allocations moved. Their [`PoolAlloc::device_ptr`] changes.
    /// Allocations a captured graph holds (made while capturing, see [`GraphPool`]) stay
    /// where they are: the graph's launches use them there.
    ///
    /// [`GraphPool`]: crate::GraphPool
    ///
    /// # Errors
    /// An allocation of another pool or stream, a capturing stream
    /// ([`CaptureErrorKind::NotCapturable`]), backend failures (allocations already moved
    /// stay moved and valid).
    pub fn compact<T: bytemuck::Pod + Send + Sync>(
        &self,
        stream: &Stream<'_>,
        allocations: &mut [&mut PoolAlloc<'_, T>],
    ) -> Result<usize> {
        self.compact_handles(stream, allocations)
    }

    /// [`compact`](Self::compact) for either handle type.
    pub(super) fn compact_handles<A: Relocatable>(
        &self,
        stream: &Stream<'_>,
        allocations: &mut [&mut A],
    ) -> Result<usize> {
        self.take_sticky()?;
        let Backend::Engine(cores) = self.backend() else {
            return Err(Error::Driver(DriverError::Unsupported(
                "compact: a native (CANN) pool does not expose its blocks".into(),
            )));
        };
        // Its copies would be captured, its frees made now.
        stream.refuse_in_capture("compact")?;
        for a in allocations.iter() {
            if !std::ptr::eq(a.pool(), self) {
                return Err(Error::WrongDevice("compact: an allocation of another pool".into()));
            }
            if cores.first().is_exported(a.device_ptr()) {
                return Err(Error::InvalidArgument(
                    "compact: an exported allocation cannot move (another process maps it)".into(),
                ));
            }
            let own = a.stream();
            if own.slot() != stream.slot() || !own.device().same_as(stream.device()) {
                return Err(Error::InvalidArgument(
                    "compact: every allocation must belong to the stream".into(),
                ));
            }
        }
        cores.compact(stream, allocations)
    }

    /// The event history, oldest first (empty unless built with
    /// [`MemPoolBuilder::history`]), and how many older records were dropped.
    pub fn history(&self) -> (Vec<Record>, u64) {
        let Backend::Engine(cores) = self.backend() else { return (Vec::new(), 0) };
        let inner = cores.first().lock();
        match &inner.history {
            Some(h) => (h.records().copied().collect(), h.dropped()),
            None => (Vec::new(), 0),
        }
    }

    /// Free-ring tickets produced and consumed so far (`None`: the pool has no ring), for
    /// tests that check which path frees and allocations took.
    #[doc(hidden)]
    pub fn free_ring_tickets(&self) -> Option<(u64, u64)> {
        let Backend::Engine(cores) = self.backend() else { return None };
        // A sharded pool has no ring (see `PoolCore::create`): shard 0's is the only one.
        cores.first().free_ring.as_ref().map(|r| (r.produced(), r.consumed()))
    }
}

impl<'a> Cores<'a> {
    /// The shard and block of the live block that starts at `ptr`.
    fn lookup(self, ptr: DevicePtr) -> Option<(&'a PoolCore, BlockId)> {
        let (core, offset) = self.core_of(ptr)?;
        let (block, _) = core.lock().engine.lookup(offset)?;
        Some((core, block))
    }

    /// The core (shard) whose address range holds `ptr`, and its offset there (the shards'
    /// ranges are separate reservations: at most one holds it).
    fn core_of(self, ptr: DevicePtr) -> Option<(&'a PoolCore, u64)> {
        self.iter().find_map(|core| core.offset_of(ptr).map(|o| (core, o)))
    }

    /// The error kept from an earlier failed `Drop` in any shard, taken.
    fn take_sticky(self) -> Result<()> {
        for core in self.iter() {
            if let Some(e) = core.take_sticky(&mut core.lock()) {
                return Err(e);
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for MemPool<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemPool")
            .field("id", &self.id())
            .field("max_size", &self.max_size())
            .field("alignment", &self.alignment())
            .field("reuse", &self.reuse_policy())
            .field("release_threshold", &self.settings().release_threshold())
            .finish()
    }
}
