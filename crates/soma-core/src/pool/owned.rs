//! Owned pool handles: [`OwnedPool`] and [`OwnedAlloc`], `'static` and `Send + Sync`, for
//! engines that keep their memory in structs, threads and async tasks.
//!
//! An `OwnedAlloc` is a [`PoolAlloc`](super::PoolAlloc) that holds counted references to its
//! pool and stream instead of borrows: the same block, the same free ring and rules, freed
//! onto its stream when dropped. The pool and the stream live as long as any allocation
//! that needs them.

use std::ops::Deref;
use std::panic::Location;
use std::sync::Arc;

use smallvec::SmallVec;

use super::api::MemPool;
use super::handle::{Handle, LenAndShard, PoolHolder, Relocatable, StreamHolder, StreamUse};
use super::policy::OomAction;
use crate::buffer::{bytes_for, BufferOwner, DeviceBuffer, DeviceBufferMut, Sealed};
use crate::device::Device;
use crate::engine::{BlockId, ReuseKind};
use crate::error::{OutOfMemory, Result};
use crate::hal::DevicePtr;
use crate::owned::OwnedStream;
use crate::stream::Stream;

/// A pool that owns its handle to the device: `'static`, `Send + Sync`, cheap to clone
/// (every clone is the same pool; it is torn down with the last clone and the last
/// allocation from it). Built with [`MemPoolBuilder::build_owned`](super::MemPoolBuilder::build_owned).
///
/// Every [`MemPool`] method is available through `Deref` (attributes, statistics, trimming,
/// snapshots…). Its own `alloc_*` methods take an [`OwnedStream`] and return
/// [`OwnedAlloc`]s; `(*pool).alloc_async(len, &stream)` still gives a borrowing
/// [`PoolAlloc`](super::PoolAlloc) on any stream of the device.
#[derive(Clone)]
pub struct OwnedPool(Arc<MemPool<'static>>);

/// An allocation from an [`OwnedPool`] on an [`OwnedStream`]: `'static`, `Send + Sync`, freed
/// onto its stream when dropped, exactly as a [`PoolAlloc`](super::PoolAlloc) is (same
/// rules, same free ring, no extra synchronisation). It keeps its pool and its stream alive.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let npu = soma_sim::Npu::builder().build()?;
/// # let dev = soma_core::Device::new(npu.device(0)?);
/// use soma_core::{MemPool, OwnedAlloc, OwnedPool, OwnedStream};
/// struct Tensor {
///     buf: OwnedAlloc<f32>, // no lifetime: the tensor can live anywhere
/// }
/// let pool: OwnedPool = MemPool::builder().build_owned(&dev)?;
/// let stream: OwnedStream = dev.create_owned_stream()?;
/// let t = Tensor { buf: pool.alloc_zeros(1024, &stream)? };
/// let worker = std::thread::spawn(move || t.buf.len());
/// assert_eq!(worker.join().unwrap(), 1024);
/// # Ok(()) }
/// ```
pub struct OwnedAlloc<T>(Handle<OwnedPool, OwnedStream, T>);

impl PoolHolder for OwnedPool {
    #[inline]
    fn pool(&self) -> &MemPool<'_> {
        &self.0
    }
}

impl StreamHolder for OwnedStream {
    #[inline]
    fn stream(&self) -> &Stream<'_> {
        self
    }
}

impl OwnedPool {
    pub(super) fn new(pool: MemPool<'static>) -> Self {
        OwnedPool(Arc::new(pool))
    }

    /// Allocates `len` elements of `T` for use on `stream` (see [`MemPool::alloc_async`]).
    ///
    /// # Errors
    /// As [`MemPool::alloc_async`].
    #[track_caller]
    pub fn alloc_async<T: bytemuck::Pod + Send + Sync>(
        &self,
        len: usize,
        stream: &OwnedStream,
    ) -> Result<OwnedAlloc<T>> {
        self.alloc_async_or(len, stream, |_| OomAction::Fail)
    }

    /// As [`alloc_async`](Self::alloc_async), calling `on_oom` when the pool is out of memory
    /// (see [`MemPool::alloc_async_or`]).
    ///
    /// # Errors
    /// As [`MemPool::alloc_async`].
    #[track_caller]
    pub fn alloc_async_or<T: bytemuck::Pod + Send + Sync>(
        &self,
        len: usize,
        stream: &OwnedStream,
        mut on_oom: impl FnMut(&OutOfMemory) -> OomAction,
    ) -> Result<OwnedAlloc<T>> {
        stream.check_device(self.device(), "the pool")?;
        let bytes = bytes_for::<T>(len)?;
        let handle = |g| OwnedAlloc(Handle::new(self.clone(), stream.clone(), g, len));
        self.0.allocate_typed(bytes, stream, Location::caller(), &mut on_oom, handle)
    }

    /// Allocates `len` elements of `T` for use on `stream` at alignment `align` (see
    /// [`MemPool::alloc_aligned_async`]).
    ///
    /// # Errors
    /// As [`MemPool::alloc_aligned_async`].
    #[track_caller]
    pub fn alloc_aligned_async<T: bytemuck::Pod + Send + Sync>(
        &self,
        len: usize,
        align: u64,
        stream: &OwnedStream,
    ) -> Result<OwnedAlloc<T>> {
        stream.check_device(self.device(), "the pool")?;
        let bytes = bytes_for::<T>(len)?;
        let handle = |g| OwnedAlloc(Handle::new(self.clone(), stream.clone(), g, len));
        self.0.allocate_aligned(bytes, align, stream, Location::caller(), handle)
    }

    /// Allocates `len` zeroed elements of `T` for use on `stream` (see
    /// [`MemPool::alloc_zeros`]).
    ///
    /// # Errors
    /// As [`MemPool::alloc_zeros`].
    #[track_caller]
    pub fn alloc_zeros<T: bytemuck::Pod + Send + Sync>(
        &self,
        len: usize,
        stream: &OwnedStream,
    ) -> Result<OwnedAlloc<T>> {
        let mut alloc = self.alloc_async::<T>(len, stream)?;
        stream.memset(&mut alloc, 0)?;
        Ok(alloc)
    }

    /// Allocates a copy of `data` for use on `stream` (see [`MemPool::upload`]).
    ///
    /// # Errors
    /// As [`MemPool::upload`].
    #[track_caller]
    pub fn upload<T: bytemuck::Pod + Send + Sync>(
        &self,
        data: &[T],
        stream: &OwnedStream,
    ) -> Result<OwnedAlloc<T>> {
        let mut alloc = self.alloc_async::<T>(data.len(), stream)?;
        stream.copy_from_host(&mut alloc, data)?;
        Ok(alloc)
    }

    /// Compacts owned allocations of `stream` (see [`MemPool::compact`]).
    ///
    /// # Errors
    /// As [`MemPool::compact`].
    pub fn compact<T: bytemuck::Pod + Send + Sync>(
        &self,
        stream: &OwnedStream,
        allocations: &mut [&mut OwnedAlloc<T>],
    ) -> Result<usize> {
        self.0.compact_handles(stream, allocations)
    }

    /// Whether `self` and `other` are clones of the same pool.
    pub fn same_pool(&self, other: &OwnedPool) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Deref for OwnedPool {
    type Target = MemPool<'static>;

    fn deref(&self) -> &MemPool<'static> {
        &self.0
    }
}

impl std::fmt::Debug for OwnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedPool").field(&*self.0).finish()
    }
}

impl<T: bytemuck::Pod + Send + Sync> OwnedAlloc<T> {
    /// The stream the allocation is freed onto.
    pub fn stream(&self) -> &OwnedStream {
        &self.0.stream
    }

    /// The pool it came from.
    pub fn pool(&self) -> &OwnedPool {
        &self.0.pool
    }

    /// Names the allocation for another process, as [`PoolAlloc::export_pointer`](crate::PoolAlloc::export_pointer).
    ///
    /// # Errors
    /// As [`PoolAlloc::export_pointer`](crate::PoolAlloc::export_pointer).
    pub fn export_pointer(&self) -> Result<crate::ExportedPointer> {
        self.0.export_pointer()
    }

    /// Frees the allocation onto its stream now, reporting failures (`Drop` cannot).
    ///
    /// # Errors
    /// Backend failures while ordering the free after other streams' uses.
    #[track_caller]
    pub fn free(mut self) -> Result<()> {
        let uses = self.0.uses.take();
        let result = self.0.release(&uses, Some(Location::caller()));
        // Freed: the handle's `Drop` only lets go of the pool and the stream.
        self.0.len_shard = LenAndShard::RELEASED;
        result
    }

    /// Moves the allocation to stream `to`, in place: records an event on its current stream
    /// and makes `to` wait on it, so that `to` may use it and will free it.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let pool = MemPool::builder().build_owned(&dev)?;
    /// let (prefill, decode) = (dev.create_owned_stream()?, dev.create_owned_stream()?);
    /// let mut kv = pool.alloc_zeros::<f32>(4096, &prefill)?;
    /// kv.hand_off(&decode)?;
    /// assert!(kv.stream().same_stream(&decode));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A stream of another device, backend failures (the allocation then stays on its
    /// stream).
    pub fn hand_off(&mut self, to: &OwnedStream) -> Result<()> {
        self.0.hand_off_in_place(to.clone())
    }

    /// Moves every allocation of `allocations` to stream `to` with one event per stream they
    /// are on (see [`PoolAlloc::hand_off_all`](super::PoolAlloc::hand_off_all)). On an error
    /// none has moved.
    ///
    /// # Errors
    /// A stream of another device, backend failures.
    pub fn hand_off_all<'a>(
        allocations: impl IntoIterator<Item = &'a mut OwnedAlloc<T>>,
        to: &OwnedStream,
    ) -> Result<()>
    where
        T: 'a,
    {
        Handle::hand_off_all(allocations.into_iter().map(|a| &mut a.0), to)
    }
}

impl<T> OwnedAlloc<T> {
    /// First byte on the device (changes only through compaction).
    pub fn device_ptr(&self) -> DevicePtr {
        self.0.ptr
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the allocation has no elements (never: size 0 is rejected).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The reuse rule that served this allocation when it was made: `None` for fresh memory
    /// (never used, or newly mapped) and for a native pool, whose driver does not tell.
    /// Moving the allocation (compaction, a hand-off) does not change it. The same answer
    /// as the history's `reuse` field, without a history.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{MemPool, ReuseKind};
    /// let s = dev.create_owned_stream()?;
    /// let pool = MemPool::builder().build_owned(&dev)?;
    /// let a = pool.alloc_async::<u8>(4096, &s)?;
    /// assert_eq!(a.reuse_kind(), None);
    /// drop(a);
    /// assert_eq!(pool.alloc_async::<u8>(4096, &s)?.reuse_kind(), Some(ReuseKind::SameStream));
    /// # Ok(()) }
    /// ```
    pub fn reuse_kind(&self) -> Option<ReuseKind> {
        self.0.reuse_kind()
    }

    /// Size in bytes as requested (the block is rounded up to the pool's alignment).
    pub fn byte_len(&self) -> u64 {
        self.0.byte_len()
    }
}

impl<T> Drop for OwnedAlloc<T> {
    fn drop(&mut self) {
        if self.0.len_shard != LenAndShard::RELEASED {
            self.0.release_on_drop();
        }
    }
}

impl<T> Sealed for OwnedAlloc<T> {}

impl<T> BufferOwner for OwnedAlloc<T> {
    fn device(&self) -> &Device {
        self.0.pool.device()
    }

    fn record_use(&self, stream: &Stream<'_>) -> Result<()> {
        self.0.record_use(stream)
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBuffer for OwnedAlloc<T> {
    type Elem = T;
    fn device_ptr(&self) -> DevicePtr {
        self.0.ptr
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBufferMut for OwnedAlloc<T> {}

impl<T> Relocatable for OwnedAlloc<T> {
    fn pool(&self) -> &MemPool<'_> {
        &self.0.pool
    }
    fn stream(&self) -> &Stream<'_> {
        &self.0.stream
    }
    fn shard(&self) -> u8 {
        self.0.shard()
    }
    fn block(&self) -> Option<BlockId> {
        self.0.block
    }
    fn device_ptr(&self) -> DevicePtr {
        self.0.ptr
    }
    fn byte_len(&self) -> u64 {
        self.0.byte_len()
    }
    fn uses_snapshot(&self) -> SmallVec<[StreamUse; 2]> {
        Relocatable::uses_snapshot(&self.0)
    }
    fn relocate(&mut self, block: BlockId, ptr: DevicePtr) -> SmallVec<[StreamUse; 2]> {
        self.0.relocate(block, ptr)
    }
}

impl<T> std::fmt::Debug for OwnedAlloc<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt_as("OwnedAlloc", f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync_static<X: Send + Sync + 'static>() {}

    #[test]
    fn owned_handles_are_send_sync_static_and_as_small_as_borrowed_ones() {
        send_sync_static::<OwnedPool>();
        send_sync_static::<OwnedStream>();
        send_sync_static::<OwnedAlloc<f32>>();
        send_sync_static::<crate::Event<'static>>();
        send_sync_static::<crate::Device>();
        assert_eq!(std::mem::size_of::<OwnedAlloc<u8>>(), 48);
        assert_eq!(std::mem::size_of::<Option<OwnedAlloc<u8>>>(), 48);
    }
}
