//! `PoolAlloc`: an RAII allocation freed onto its stream.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;

use once_cell::race::OnceBox;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::allocate::Granted;
use super::api::MemPool;
use super::free::TypedFree;
use crate::buffer::{BufferOwner, DeviceBuffer, DeviceBufferMut, Sealed};
use crate::device::Device;
use crate::engine::{BlockId, StreamSlot};
use crate::error::Result;
use crate::hal::DevicePtr;
use crate::stream::Stream;

/// A use of an allocation on another stream: the stream's slot and its global position when
/// the use was recorded. The position tells the stream apart from a later one in the same slot
/// (positions of a slot never repeat): a stream that was dropped has drained, and the free
/// must not wait on whatever stream holds its slot now.
pub(crate) type StreamUse = (StreamSlot, u64);

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
/// [`hand_off`](Self::hand_off) moves it to another stream for good.
pub struct PoolAlloc<'s, T> {
    pool: &'s MemPool<'s>,
    stream: &'s Stream<'s>,
    /// The engine's block; `None` for a native (CANN) pool, which frees by pointer.
    block: Option<BlockId>,
    ptr: DevicePtr,
    /// The length in elements, and in the top [`SHARD_BITS`] bits the pool's shard that
    /// holds the block (see [`LenAndShard`]).
    len_shard: LenAndShard,
    /// Other streams that used the block since it was allocated.
    uses: OtherUses,
    _elem: PhantomData<fn() -> T>,
}

/// Bits of [`LenAndShard`] that hold the shard.
const SHARD_BITS: u32 = 8;
/// Bits of [`LenAndShard`] that hold the length.
const LEN_BITS: u32 = u64::BITS - SHARD_BITS;

/// A pool's largest `max_size` (64 PiB): every allocation's length, in elements of at least
/// one byte, then fits in [`LenAndShard`]'s [`LEN_BITS`] bits.
pub(crate) const MAX_POOL_BYTES: u64 = 1 << LEN_BITS;

/// An allocation's length and its shard in one word. Callers keep arrays of handles and touch
/// one at random on every free: at 48 bytes a handle spans 1.5 cache lines on average, at
/// the 56 bytes of separate fields 1.75.
#[derive(Clone, Copy)]
struct LenAndShard(u64);

impl LenAndShard {
    #[inline]
    fn new(len: usize, shard: u8) -> LenAndShard {
        // A block is at most `max_size <= MAX_POOL_BYTES` bytes long (`MemPool::build`).
        debug_assert!((len as u64) < MAX_POOL_BYTES);
        LenAndShard(len as u64 | u64::from(shard) << LEN_BITS)
    }

    #[inline]
    fn len(self) -> usize {
        (self.0 & (MAX_POOL_BYTES - 1)) as usize
    }

    #[inline]
    fn shard(self) -> u8 {
        (self.0 >> LEN_BITS) as u8
    }
}

impl<'s, T: bytemuck::Pod + Send + Sync> PoolAlloc<'s, T> {
    pub(crate) fn new(
        pool: &'s MemPool<'s>,
        stream: &'s Stream<'s>,
        granted: Granted,
        len: usize,
    ) -> Self {
        PoolAlloc {
            pool,
            stream,
            block: granted.block,
            ptr: granted.ptr,
            len_shard: LenAndShard::new(len, granted.shard),
            uses: OtherUses::default(),
            _elem: PhantomData,
        }
    }

    /// The stream the allocation is freed onto.
    pub fn stream(&self) -> &'s Stream<'s> {
        self.stream
    }

    /// The pool it came from.
    pub fn pool(&self) -> &'s MemPool<'s> {
        self.pool
    }

    /// Frees the allocation onto its stream now, reporting failures (`Drop` cannot).
    ///
    /// # Errors
    /// Backend failures while ordering the free after other streams' uses.
    #[track_caller]
    pub fn free(self) -> Result<()> {
        let (this, uses) = self.disarm();
        let location = std::panic::Location::caller();
        this.pool.free_typed(&this.typed_free(&uses, Some(location)))
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
        to.check_device(self.pool.device(), "hand_off: the target stream")?;
        let event = self.stream.record_event()?;
        to.wait_event(&event)?;
        let (this, mut uses) = self.disarm();
        uses.retain(|u| u.0 != to.slot());
        Ok(PoolAlloc {
            pool: this.pool,
            stream: to,
            block: this.block,
            ptr: this.ptr,
            len_shard: this.len_shard,
            uses: OtherUses::from_list(uses),
            _elem: PhantomData,
        })
    }
}

impl<T> PoolAlloc<'_, T> {
    /// Takes the handle apart without freeing the block, for the caller to free it or move it
    /// to another handle: the handle, which will not be dropped, and its use list, moved out
    /// (nothing else in the handle owns heap memory, so nothing leaks).
    fn disarm(self) -> (ManuallyDrop<Self>, SmallVec<[StreamUse; 2]>) {
        let mut this = ManuallyDrop::new(self);
        let uses = std::mem::take(&mut this.uses).take();
        (this, uses)
    }

    /// First byte on the device (changes only through [`MemPool::compact`]).
    pub fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len_shard.len()
    }

    /// Whether the allocation has no elements (never: size 0 is rejected).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes as requested (the block is rounded up to the pool's alignment).
    pub fn byte_len(&self) -> u64 {
        self.byte_len_internal()
    }

    /// The free of this allocation's block onto its stream, after `uses` on other streams.
    #[inline]
    fn typed_free<'a>(
        &'a self,
        uses: &'a [StreamUse],
        location: Option<&'static std::panic::Location<'static>>,
    ) -> TypedFree<'a> {
        TypedFree {
            block: self.block,
            ptr: self.ptr,
            bytes: self.byte_len_internal(),
            shard: self.shard(),
            stream: self.stream,
            uses,
            location,
        }
    }

    pub(crate) fn shard(&self) -> u8 {
        self.len_shard.shard()
    }

    pub(crate) fn stream_slot(&self) -> StreamSlot {
        self.stream.slot()
    }

    pub(crate) fn block(&self) -> Option<BlockId> {
        self.block
    }

    pub(crate) fn byte_len_internal(&self) -> u64 {
        (self.len() * std::mem::size_of::<T>()) as u64
    }

    /// The other streams that used the allocation so far.
    pub(crate) fn uses_snapshot(&self) -> SmallVec<[StreamUse; 2]> {
        self.uses.snapshot()
    }

    /// Points the allocation at a new block; returns the uses recorded on the old one.
    pub(crate) fn relocate(&mut self, block: BlockId, ptr: DevicePtr) -> SmallVec<[StreamUse; 2]> {
        self.block = Some(block);
        self.ptr = ptr;
        self.uses.take()
    }
}

impl<T> Drop for PoolAlloc<'_, T> {
    fn drop(&mut self) {
        let uses = self.uses.drain();
        let result =
            self.pool.free_typed(&self.typed_free(uses.as_deref().unwrap_or_default(), None));
        if let Err(e) = result {
            // Never panic, never print: the pool reports it at its next fallible call.
            self.pool.set_sticky(self.shard(), e);
        }
    }
}

/// The other streams that used an allocation. Most allocations are only ever used on their
/// own stream, so the handle holds one null word until the first use elsewhere boxes a list
/// (a `Mutex<SmallVec>` inline would make `PoolAlloc` 32 bytes larger, and the caller's
/// arrays of handles are what a workload touches on every free).
#[derive(Default)]
struct OtherUses(OnceBox<Mutex<SmallVec<[StreamUse; 2]>>>);

impl OtherUses {
    fn from_list(list: SmallVec<[StreamUse; 2]>) -> Self {
        let uses = OtherUses::default();
        if !list.is_empty() {
            // A fresh cell is empty, so `set` cannot fail.
            let _ = uses.0.set(Box::new(Mutex::new(list)));
        }
        uses
    }

    /// The list, created by the first use on another stream.
    fn list(&self) -> &Mutex<SmallVec<[StreamUse; 2]>> {
        self.0.get_or_init(|| Box::new(Mutex::new(SmallVec::new())))
    }

    fn snapshot(&self) -> SmallVec<[StreamUse; 2]> {
        self.0.get().map(|l| l.lock().clone()).unwrap_or_default()
    }

    /// Empties the set, returning what it held; `None` (nothing built or moved, the common
    /// case) when no other stream used the allocation.
    // Inline: `PoolAlloc`'s drop is instantiated in the caller's crate.
    #[inline]
    fn drain(&self) -> Option<SmallVec<[StreamUse; 2]>> {
        self.0.get().map(|l| std::mem::take(&mut *l.lock()))
    }

    /// [`OtherUses::drain`], an empty list when there was none.
    #[inline]
    fn take(&self) -> SmallVec<[StreamUse; 2]> {
        self.drain().unwrap_or_default()
    }
}

impl<T> Sealed for PoolAlloc<'_, T> {}

impl<T> BufferOwner for PoolAlloc<'_, T> {
    fn device(&self) -> &Device {
        self.pool.device()
    }

    fn record_use(&self, stream: &Stream<'_>) -> Result<()> {
        // Before anything is enqueued: a refused call leaves both streams untouched.
        stream.check_device(self.pool.device(), "the allocation")?;
        if stream.slot() == self.stream.slot() {
            return Ok(());
        }
        let mut uses = self.uses.list().lock();
        let known = uses.iter().position(|u| u.0 == stream.slot());
        // Recorded by this stream, or by a dropped one whose slot it took (an older position).
        if known.is_some_and(|i| uses[i].1 >= stream.base()) {
            return Ok(());
        }
        // First use on this stream: order it after the allocation point. The block may have
        // been reused on the allocation's stream while its previous owner's work is still
        // queued there; only stream order makes it this allocation's memory.
        let event = self.stream.record_event()?;
        stream.wait_event(&event)?;
        let now = (stream.slot(), stream.position());
        match known {
            Some(i) => uses[i] = now,
            None => uses.push(now),
        }
        Ok(())
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBuffer for PoolAlloc<'_, T> {
    type Elem = T;
    fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len_shard.len()
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBufferMut for PoolAlloc<'_, T> {}

impl<T> std::fmt::Debug for PoolAlloc<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolAlloc")
            .field("ptr", &self.ptr)
            .field("len", &self.len())
            .field("elem", &std::any::type_name::<T>())
            .field("stream", &self.stream.id())
            .finish()
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

    #[test]
    fn length_and_shard_share_a_word_without_mixing() {
        for (len, shard) in [(1, 0), (7, 255), ((MAX_POOL_BYTES - 1) as usize, 3), (1 << 40, 128)] {
            let p = LenAndShard::new(len, shard);
            assert_eq!((p.len(), p.shard()), (len, shard));
        }
    }

    #[test]
    fn other_uses_box_only_when_used_and_take_empties_them() {
        let uses = OtherUses::default();
        assert!(uses.0.get().is_none() && uses.drain().is_none());
        assert!(uses.snapshot().is_empty());
        uses.list().lock().push((3, 7));
        assert_eq!(uses.snapshot().as_slice(), &[(3, 7)]);
        assert_eq!(uses.take().as_slice(), &[(3, 7)]);
        assert!(uses.take().is_empty() && uses.drain().is_some_and(|l| l.is_empty()));
        let moved = OtherUses::from_list(SmallVec::from_slice(&[(1, 0)]));
        assert_eq!(moved.snapshot().as_slice(), &[(1, 0)]);
        assert!(OtherUses::from_list(SmallVec::new()).0.get().is_none());
    }
}
