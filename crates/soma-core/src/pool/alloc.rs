//! `PoolAlloc`: an RAII allocation that borrows its pool and stream, freed onto its stream.

use std::mem::ManuallyDrop;

use super::allocate::Granted;
use super::api::MemPool;
use super::handle::{Handle, Relocatable, StreamUse};
use crate::buffer::{BufferOwner, DeviceBuffer, DeviceBufferMut, Sealed};
use crate::device::Device;
use crate::engine::{BlockId, ReuseKind};
use crate::error::Result;
use crate::hal::DevicePtr;
use crate::stream::Stream;

use smallvec::SmallVec;

/// An allocation from a [`MemPool`], usable on its stream and freed onto it when dropped.
///
/// It borrows both the pool and the stream, so it cannot outlive either: freeing onto a
/// stream that no longer exists does not compile.
///
/// ```compile_fail
/// # fn f(dev: &soma_core::Device, pool: &soma_core::MemPool<'_>) -> soma_core::Result<()> {
/// let x = {
///     let s = dev.create_stream()?;
///     pool.alloc_async::<f32>(16, &s)?
/// }; // error: `s` dropped here while still borrowed
/// # drop(x); Ok(()) }
/// ```
///
/// Using it on another stream through [`Stream`]'s copy and kernel APIs records that use
/// (like PyTorch's `record_stream`, but automatic): the free then waits for those streams.
/// [`hand_off`](Self::hand_off) moves it to another stream for good. A long-lived engine that
/// cannot borrow its pool and streams uses [`OwnedAlloc`](crate::OwnedAlloc), the same
/// allocation holding counted references.
pub struct PoolAlloc<'s, T>(Handle<&'s MemPool<'s>, &'s Stream<'s>, T>);

impl<'s, T: bytemuck::Pod + Send + Sync> PoolAlloc<'s, T> {
    #[inline]
    pub(crate) fn new(
        pool: &'s MemPool<'s>,
        stream: &'s Stream<'s>,
        granted: Granted,
        len: usize,
    ) -> Self {
        PoolAlloc(Handle::new(pool, stream, granted, len))
    }

    /// The stream the allocation is freed onto.
    pub fn stream(&self) -> &'s Stream<'s> {
        self.0.stream
    }

    /// The pool it came from.
    pub fn pool(&self) -> &'s MemPool<'s> {
        self.0.pool
    }

    /// Frees the allocation onto its stream now, reporting failures (`Drop` cannot).
    ///
    /// # Errors
    /// Backend failures while ordering the free after other streams' uses.
    #[track_caller]
    pub fn free(self) -> Result<()> {
        let (this, uses) = self.disarm();
        this.0.release(&uses, Some(std::panic::Location::caller()))
    }

    /// Moves the allocation to stream `to`: records an event on its current stream and makes
    /// `to` wait on it, so that `to` may use it and will free it.
    ///
    /// # Errors
    /// Backend failures (the allocation is then freed onto its original stream) or a stream
    /// of another device.
    pub fn hand_off<'o>(self, to: &'o Stream<'o>) -> Result<PoolAlloc<'o, T>>
    where
        's: 'o,
    {
        self.0.order_before(to)?;
        let uses = self.0.uses_without(to.slot());
        let (this, _) = self.disarm();
        Ok(PoolAlloc(Handle {
            pool: this.0.pool,
            stream: to,
            block: this.0.block,
            ptr: this.0.ptr,
            len_shard: this.0.len_shard,
            uses,
            _elem: std::marker::PhantomData,
        }))
    }

    /// As [`hand_off`](Self::hand_off), in place: the handle stays where it is (a field of a
    /// struct, an element of a table) and is freed onto `to` from now on.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let (prefill, decode) = (dev.create_stream()?, dev.create_stream()?);
    /// let pool = MemPool::builder().build(&dev)?;
    /// let mut kv = pool.alloc_zeros::<f32>(1024, &prefill)?;
    /// kv.hand_off_in_place(&decode)?;
    /// assert_eq!(kv.stream().id(), decode.id());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A stream of another device, backend failures (the allocation then stays on its
    /// stream).
    pub fn hand_off_in_place(&mut self, to: &'s Stream<'s>) -> Result<()> {
        self.0.hand_off_in_place(to)
    }

    /// Moves every allocation of `allocations` to stream `to` with one event per stream they
    /// are on (a KV block table moved from prefill to decode costs one event, not one per
    /// block). All are ordered before any moves: on an error none has moved.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{MemPool, PoolAlloc};
    /// let (prefill, decode) = (dev.create_stream()?, dev.create_stream()?);
    /// let pool = MemPool::builder().build(&dev)?;
    /// let mut blocks = (0..16)
    ///     .map(|_| pool.alloc_zeros::<f32>(256, &prefill))
    ///     .collect::<Result<Vec<_>, _>>()?;
    /// PoolAlloc::hand_off_all(&mut blocks, &decode)?;
    /// assert!(blocks.iter().all(|b| b.stream().id() == decode.id()));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A stream of another device, backend failures.
    pub fn hand_off_all<'a>(
        allocations: impl IntoIterator<Item = &'a mut PoolAlloc<'s, T>>,
        to: &'s Stream<'s>,
    ) -> Result<()>
    where
        's: 'a,
        T: 'a,
    {
        Handle::hand_off_all(allocations.into_iter().map(|a| &mut a.0), &to)
    }
}

impl<T> PoolAlloc<'_, T> {
    /// Takes the handle apart without freeing the block: the handle, which will not be
    /// dropped, and its use list, moved out (nothing else in the handle owns heap memory, and
    /// its pool and stream are borrows, so nothing leaks).
    fn disarm(self) -> (ManuallyDrop<Self>, SmallVec<[StreamUse; 2]>) {
        let mut this = ManuallyDrop::new(self);
        // Moved out, so that the list's box is dropped here (the handle's fields are not).
        let uses = std::mem::take(&mut this.0.uses).take();
        (this, uses)
    }

    /// First byte on the device (changes only through [`MemPool::compact`]).
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
    /// let (s1, s2) = (dev.create_stream()?, dev.create_stream()?);
    /// let pool = MemPool::builder().build(&dev)?;
    /// let a = pool.alloc_async::<u8>(4096, &s1)?;
    /// assert_eq!(a.reuse_kind(), None);
    /// drop(a);
    /// let b = pool.alloc_async::<u8>(4096, &s1)?;
    /// assert_eq!(b.reuse_kind(), Some(ReuseKind::SameStream));
    /// drop(b);
    /// s2.wait_event(&s1.record_event()?)?;
    /// assert_eq!(pool.alloc_async::<u8>(4096, &s2)?.reuse_kind(), Some(ReuseKind::EventDependency));
    /// # Ok(()) }
    /// ```
    pub fn reuse_kind(&self) -> Option<ReuseKind> {
        self.0.reuse_kind()
    }

    /// Size in bytes as requested (the block is rounded up to the pool's alignment).
    pub fn byte_len(&self) -> u64 {
        self.0.byte_len()
    }

    /// Names the allocation for another process that imported its pool
    /// ([`ImportedPool::open`](crate::ImportedPool::open)). From now on its free waits for
    /// every importer that opened it to release it, and it cannot be compacted. See
    /// [`MemPool::export`].
    ///
    /// # Errors
    /// [`IpcErrorKind::NotExportable`](crate::IpcErrorKind::NotExportable) for a pool not
    /// built with [`HandleType::Posix`](crate::HandleType::Posix).
    pub fn export_pointer(&self) -> Result<crate::ExportedPointer> {
        self.0.export_pointer()
    }
}

impl<T> Drop for PoolAlloc<'_, T> {
    fn drop(&mut self) {
        self.0.release_on_drop();
    }
}

impl<T> Sealed for PoolAlloc<'_, T> {}

impl<T> BufferOwner for PoolAlloc<'_, T> {
    fn device(&self) -> &Device {
        self.0.pool.device()
    }

    fn record_use(&self, stream: &Stream<'_>) -> Result<()> {
        self.0.record_use(stream)
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBuffer for PoolAlloc<'_, T> {
    type Elem = T;
    fn device_ptr(&self) -> DevicePtr {
        self.0.ptr
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBufferMut for PoolAlloc<'_, T> {}

impl<T> Relocatable for PoolAlloc<'_, T> {
    fn pool(&self) -> &MemPool<'_> {
        self.0.pool
    }
    fn stream(&self) -> &Stream<'_> {
        self.0.stream
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

impl<T> std::fmt::Debug for PoolAlloc<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt_as("PoolAlloc", f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_is_six_words_and_its_option_costs_nothing() {
        assert_eq!(std::mem::size_of::<PoolAlloc<'static, u8>>(), 48);
        assert_eq!(std::mem::size_of::<Option<PoolAlloc<'static, u8>>>(), 48);
    }
}
