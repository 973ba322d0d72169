//! What an allocation handle holds, whichever way it holds its pool and stream: the block,
//! its length, and the uses on other streams; and the operations both handle types share
//! (freeing, recording a use, moving to another stream).
//!
//! [`PoolAlloc`](super::PoolAlloc) borrows its pool and stream; [`OwnedAlloc`](super::OwnedAlloc)
//! holds counted references. Both are a [`Handle`] with the matching holders, so the hot
//! paths are the same code.

use std::marker::PhantomData;

use once_cell::race::OnceBox;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::allocate::Granted;
use super::api::MemPool;
use super::free::TypedFree;
use crate::engine::{BlockId, ReuseKind, StreamSlot};
use crate::error::Result;
use crate::hal::DevicePtr;
use crate::stream::{Stream, GRAPH_BLOCKS, GRAPH_PATH};

/// A use of an allocation on another stream than its own.
#[derive(Clone)]
pub(crate) enum StreamUse {
    /// A stream of the allocation's device: its slot and its global position when the use
    /// was recorded. The position tells the stream apart from a later one in the same slot
    /// (positions of a slot never repeat): a stream that was dropped has drained, and the
    /// free must not wait on whatever stream holds its slot now.
    Local(StreamSlot, u64),
    /// A stream of a peer device (peer access). Slots and positions are per device, so the
    /// stream itself is named: held weakly, since a stream that was dropped has drained.
    Peer(PeerUse),
}

/// A stream of a peer device that used an allocation, and that device (whose backend makes
/// the event the free waits on).
#[derive(Clone)]
pub(crate) struct PeerUse {
    pub(crate) device: crate::device::Device,
    pub(crate) stream: std::sync::Weak<dyn crate::hal::StreamHal>,
}

impl StreamUse {
    /// The slot of a use on a stream of the allocation's device.
    fn local_slot(&self) -> Option<StreamSlot> {
        match self {
            StreamUse::Local(slot, _) => Some(*slot),
            StreamUse::Peer(_) => None,
        }
    }
}

/// How a handle holds its pool: a borrow (`PoolAlloc`) or a counted reference (`OwnedAlloc`).
pub(crate) trait PoolHolder {
    fn pool(&self) -> &MemPool<'_>;
}

/// How a handle holds its stream: a borrow or a counted reference.
pub(crate) trait StreamHolder {
    fn stream(&self) -> &Stream<'_>;
}

impl<'s> PoolHolder for &'s MemPool<'s> {
    #[inline]
    fn pool(&self) -> &MemPool<'_> {
        self
    }
}

impl<'s> StreamHolder for &'s Stream<'s> {
    #[inline]
    fn stream(&self) -> &Stream<'_> {
        self
    }
}

/// An allocation's state. It has no `Drop`: the handle types free it in theirs.
pub(crate) struct Handle<P, S, T> {
    pub(crate) pool: P,
    pub(crate) stream: S,
    /// The engine's block; `None` for a native (CANN) pool, which frees by pointer.
    pub(crate) block: Option<BlockId>,
    pub(crate) ptr: DevicePtr,
    /// The length in elements and, in the top bits, the pool's shard that holds the block
    /// and the rule that served the allocation (see [`LenAndShard`]).
    pub(crate) len_shard: LenAndShard,
    /// Other streams that used the block since it was allocated.
    pub(crate) uses: OtherUses,
    pub(crate) _elem: PhantomData<fn() -> T>,
}

/// Bits of [`LenAndShard`] that hold the shard (the top ones: reading it is one shift): at
/// most [`MAX_STREAM_SHARDS`](super::MAX_STREAM_SHARDS) shards.
const SHARD_BITS: u32 = 6;
/// Bits of [`LenAndShard`] below the shard that hold the reuse rule: 0 for none, 1 + the
/// kind's index, 7 for [`LenAndShard::RELEASED`].
const REUSE_BITS: u32 = 3;
/// Bits of [`LenAndShard`] that hold the length.
const LEN_BITS: u32 = u64::BITS - SHARD_BITS - REUSE_BITS;
/// Where the shard starts.
const SHARD_SHIFT: u32 = LEN_BITS + REUSE_BITS;

const _: () = assert!(super::shards::MAX_STREAM_SHARDS <= 1 << SHARD_BITS);
const _: () = assert!(ReuseKind::ALL.len() < (1 << REUSE_BITS) - 1, "7 marks RELEASED");

/// A pool's largest `max_size` (32 PiB, excluded): every allocation's length, in elements
/// of at least one byte, then fits in [`LenAndShard`]'s [`LEN_BITS`] bits.
pub(crate) const MAX_POOL_BYTES: u64 = 1 << LEN_BITS;

/// Where a block came from: the pool's shard that holds it and the reuse rule that served
/// it, kept as the top bits of a handle's [`LenAndShard`] so that a handle is made with one
/// `or` (a core keeps the word of its own same-stream reuses ready for the free ring's path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Origin(u64);

impl Origin {
    /// Shard `shard`, served by rule `reuse` (`None`: fresh memory, or a native pool).
    #[inline]
    pub(crate) const fn new(shard: u8, reuse: Option<ReuseKind>) -> Origin {
        let code = match reuse {
            None => 0,
            Some(kind) => kind.index() as u64 + 1,
        };
        Origin((shard as u64) << SHARD_SHIFT | code << LEN_BITS)
    }

    /// The shard that holds the block.
    #[inline]
    pub(crate) fn shard(self) -> u8 {
        (self.0 >> SHARD_SHIFT) as u8
    }

    /// The rule that served the block.
    fn reuse(self) -> Option<ReuseKind> {
        let code = ((self.0 >> LEN_BITS) & ((1 << REUSE_BITS) - 1)) as usize;
        code.checked_sub(1).and_then(|i| ReuseKind::ALL.get(i).copied())
    }
}

/// An allocation's length and its [`Origin`] in one word. Callers keep arrays of handles and
/// touch one at random on every free: at 48 bytes a handle spans 1.5 cache lines on
/// average, at the 56 bytes of separate fields 1.75.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct LenAndShard(u64);

impl LenAndShard {
    /// Marks a handle whose block was already freed or moved (its `Drop` then does nothing):
    /// reuse code 7, which names no rule.
    pub(crate) const RELEASED: LenAndShard = LenAndShard(u64::MAX);

    #[inline]
    fn new(len: usize, origin: Origin) -> LenAndShard {
        // A block is at most `max_size < MAX_POOL_BYTES` bytes long (`MemPool::build`).
        debug_assert!((len as u64) < MAX_POOL_BYTES);
        LenAndShard(len as u64 | origin.0)
    }

    #[inline]
    fn len(self) -> usize {
        (self.0 & (MAX_POOL_BYTES - 1)) as usize
    }

    #[inline]
    fn shard(self) -> u8 {
        Origin(self.0).shard()
    }

    fn reuse(self) -> Option<ReuseKind> {
        Origin(self.0).reuse()
    }
}

impl<P: PoolHolder, S: StreamHolder, T> Handle<P, S, T> {
    #[inline]
    pub(crate) fn new(pool: P, stream: S, granted: Granted, len: usize) -> Self {
        Handle {
            pool,
            stream,
            block: granted.block,
            ptr: granted.ptr,
            len_shard: LenAndShard::new(len, granted.origin),
            uses: OtherUses::default(),
            _elem: PhantomData,
        }
    }

    /// Frees the block onto its stream after `uses` (the caller's drained use list), for a
    /// handle's `Drop` or `free`.
    #[inline]
    pub(crate) fn release(
        &self,
        uses: &[StreamUse],
        location: Option<&'static std::panic::Location<'static>>,
    ) -> Result<()> {
        self.pool.pool().free_typed(&TypedFree {
            block: self.block,
            ptr: self.ptr,
            bytes: self.byte_len(),
            shard: self.shard(),
            stream: self.stream.stream(),
            uses,
            location,
        })
    }

    /// What a handle's `Drop` does: frees the block, keeping a failure for the pool's next
    /// fallible call (a `Drop` never panics and never prints).
    #[inline]
    pub(crate) fn release_on_drop(&self) {
        let uses = self.uses.drain();
        if let Err(e) = self.release(uses.as_deref().unwrap_or_default(), None) {
            self.pool.pool().set_sticky(self.shard(), e);
        }
    }

    /// Makes `to` wait for everything enqueued on the allocation's stream so far: `to` may
    /// then use the allocation and free it.
    pub(crate) fn order_before(&self, to: &Stream<'_>) -> Result<()> {
        let from = self.stream.stream();
        to.check_device(self.pool.pool().device(), "hand_off: the target stream")?;
        let event = from.record_event()?;
        to.wait_event(&event)?;
        if from.flags() & GRAPH_PATH != 0 {
            // The block may be a graph's: its free on `to` must look (see `graph_region.rs`).
            to.set_flag(GRAPH_BLOCKS);
        }
        Ok(())
    }

    /// The use list without the uses of the stream in `slot` (of the allocation's device),
    /// which takes the allocation over (its own work is ordered by stream order).
    pub(crate) fn uses_without(&self, slot: StreamSlot) -> OtherUses {
        let mut uses = self.uses.take();
        uses.retain(|u| u.local_slot() != Some(slot));
        OtherUses::from_list(uses)
    }

    /// Moves the allocation to stream `to` (one event on its stream, waited on by `to`),
    /// keeping the handle where it is.
    pub(crate) fn hand_off_in_place(&mut self, to: S) -> Result<()> {
        self.order_before(to.stream())?;
        self.uses = self.uses_without(to.stream().slot());
        self.stream = to;
        Ok(())
    }

    /// Moves every handle of `allocations` to stream `to` with one event per distinct stream
    /// they are on (usually one). All are ordered before any is rebound, so on an error none
    /// has moved.
    pub(crate) fn hand_off_all<'a>(
        allocations: impl IntoIterator<Item = &'a mut Self>,
        to: &S,
    ) -> Result<()>
    where
        Self: 'a,
        S: Clone,
    {
        let allocations: SmallVec<[&mut Self; 16]> = allocations.into_iter().collect();
        let target = to.stream();
        // Streams already ordered before `target`, by address: a stream is one object.
        let mut ordered: SmallVec<[*const (); 4]> = SmallVec::new();
        for a in &allocations {
            let from = a.stream.stream();
            let key = std::ptr::from_ref(from).cast::<()>();
            if std::ptr::eq(from, target) || ordered.contains(&key) {
                continue;
            }
            a.order_before(target)?;
            ordered.push(key);
        }
        for a in allocations {
            if !std::ptr::eq(a.stream.stream(), target) {
                a.uses = a.uses_without(target.slot());
                a.stream = to.clone();
            }
        }
        Ok(())
    }

    /// Records a use of the allocation by work on `stream` (see
    /// [`BufferOwner::record_use`](crate::BufferOwner::record_use)).
    pub(crate) fn record_use(&self, stream: &Stream<'_>) -> Result<()> {
        let own = self.stream.stream();
        let device = self.pool.pool().device();
        // Before anything is enqueued: a refused call leaves both streams untouched.
        stream.check_access(device, "the allocation")?;
        if stream.slot() == own.slot() && stream.device().same_as(device) {
            return Ok(());
        }
        if let Some(capture) = stream.capture_id() {
            // Captured work runs at launches, not now (see the `graph` module): only a use
            // by another stream of the capture the allocation's stream records into is
            // recorded (with captured events), so that a free inside the capture is ordered
            // after it at every launch.
            if !stream.device().same_as(device) || own.capture_id() != Some(capture) {
                return Ok(());
            }
        }
        if !stream.device().same_as(device) {
            return self.record_peer_use(stream);
        }
        let mut uses = self.uses.list().lock();
        let known = uses.iter().position(|u| u.local_slot() == Some(stream.slot()));
        // Recorded by this stream, or by a dropped one whose slot it took (an older position).
        if let Some(i) = known {
            if matches!(uses[i], StreamUse::Local(_, at) if at >= stream.base()) {
                return Ok(());
            }
        }
        // First use on this stream: order it after the allocation point. The block may have
        // been reused on the allocation's stream while its previous owner's work is still
        // queued there; only stream order makes it this allocation's memory.
        let event = own.record_event()?;
        stream.wait_event(&event)?;
        let now = StreamUse::Local(stream.slot(), stream.position());
        match known {
            Some(i) => uses[i] = now,
            None => uses.push(now),
        }
        Ok(())
    }

    /// [`record_use`](Self::record_use) by a stream of a peer device: the stream waits for the
    /// allocation point (an event of this device), and the free will wait for the stream.
    #[cold]
    fn record_peer_use(&self, stream: &Stream<'_>) -> Result<()> {
        let mut uses = self.uses.list().lock();
        let hal = std::sync::Arc::downgrade(stream.hal());
        if uses.iter().any(|u| matches!(u, StreamUse::Peer(p) if p.stream.ptr_eq(&hal))) {
            return Ok(());
        }
        let event = self.stream.stream().record_event()?;
        stream.wait_event(&event)?;
        uses.push(StreamUse::Peer(PeerUse {
            device: stream.device().without_owner(),
            stream: hal,
        }));
        Ok(())
    }

    /// Number of elements.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len_shard.len()
    }

    /// Size in bytes as requested (the block is this rounded up to the pool's alignment).
    #[inline]
    pub(crate) fn byte_len(&self) -> u64 {
        (self.len() * std::mem::size_of::<T>()) as u64
    }

    /// The shard of the pool that holds the block.
    #[inline]
    pub(crate) fn shard(&self) -> u8 {
        self.len_shard.shard()
    }

    /// The rule that served the allocation; `None` for fresh memory (never used, or newly
    /// mapped) and for a native pool, whose driver does not tell.
    pub(crate) fn reuse_kind(&self) -> Option<ReuseKind> {
        self.len_shard.reuse()
    }

    pub(crate) fn fmt_as(&self, name: &str, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(name)
            .field("ptr", &self.ptr)
            .field("len", &self.len())
            .field("elem", &std::any::type_name::<T>())
            .field("stream", &self.stream.stream().id())
            .finish()
    }
}

/// What compaction needs of an allocation handle, whichever way it holds pool and stream.
pub(crate) trait Relocatable {
    /// The pool the allocation came from.
    fn pool(&self) -> &MemPool<'_>;
    /// The stream the allocation is freed onto.
    fn stream(&self) -> &Stream<'_>;
    /// The shard that holds the block.
    fn shard(&self) -> u8;
    /// The engine's block (`None` for a native pool).
    fn block(&self) -> Option<BlockId>;
    /// First byte on the device.
    fn device_ptr(&self) -> DevicePtr;
    /// Bytes as requested.
    fn byte_len(&self) -> u64;
    /// The other streams that used the allocation so far.
    fn uses_snapshot(&self) -> SmallVec<[StreamUse; 2]>;
    /// Points the allocation at a new block; returns the uses recorded on the old one.
    fn relocate(&mut self, block: BlockId, ptr: DevicePtr) -> SmallVec<[StreamUse; 2]>;
}

impl<P: PoolHolder, S: StreamHolder, T> Relocatable for Handle<P, S, T> {
    fn pool(&self) -> &MemPool<'_> {
        self.pool.pool()
    }
    fn stream(&self) -> &Stream<'_> {
        self.stream.stream()
    }
    fn shard(&self) -> u8 {
        self.len_shard.shard()
    }
    fn block(&self) -> Option<BlockId> {
        self.block
    }
    fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn byte_len(&self) -> u64 {
        Handle::byte_len(self)
    }
    fn uses_snapshot(&self) -> SmallVec<[StreamUse; 2]> {
        self.uses.snapshot()
    }
    fn relocate(&mut self, block: BlockId, ptr: DevicePtr) -> SmallVec<[StreamUse; 2]> {
        self.block = Some(block);
        self.ptr = ptr;
        self.uses.take()
    }
}

/// The other streams that used an allocation. Most allocations are only ever used on their
/// own stream, so the handle holds one null word until the first use elsewhere boxes a list
/// (a `Mutex<SmallVec>` inline would make `PoolAlloc` 32 bytes larger, and the caller's
/// arrays of handles are what a workload touches on every free).
#[derive(Default)]
pub(crate) struct OtherUses(OnceBox<Mutex<SmallVec<[StreamUse; 2]>>>);

impl OtherUses {
    pub(crate) fn from_list(list: SmallVec<[StreamUse; 2]>) -> Self {
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
    // Inline: a handle's drop is instantiated in the caller's crate.
    #[inline]
    pub(crate) fn drain(&self) -> Option<SmallVec<[StreamUse; 2]>> {
        self.0.get().map(|l| std::mem::take(&mut *l.lock()))
    }

    /// [`OtherUses::drain`], an empty list when there was none.
    #[inline]
    pub(crate) fn take(&self) -> SmallVec<[StreamUse; 2]> {
        self.drain().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_shard_and_reuse_share_a_word_without_mixing() {
        let kinds = std::iter::once(None).chain(ReuseKind::ALL.map(Some));
        for reuse in kinds {
            for (len, shard) in [(1, 0), (7, 63), ((MAX_POOL_BYTES - 1) as usize, 3), (1 << 40, 17)]
            {
                let p = LenAndShard::new(len, Origin::new(shard, reuse));
                assert_eq!((p.len(), p.shard(), p.reuse()), (len, shard, reuse));
                assert!(p != LenAndShard::RELEASED);
            }
        }
    }

    #[test]
    fn other_uses_box_only_when_used_and_take_empties_them() {
        let uses = OtherUses::default();
        assert!(uses.0.get().is_none() && uses.drain().is_none());
        assert!(uses.snapshot().is_empty());
        let slots =
            |l: SmallVec<[StreamUse; 2]>| -> Vec<_> { l.iter().map(|u| u.local_slot()).collect() };
        uses.list().lock().push(StreamUse::Local(3, 7));
        assert_eq!(slots(uses.snapshot()), [Some(3)]);
        assert_eq!(slots(uses.take()), [Some(3)]);
        assert!(uses.take().is_empty() && uses.drain().is_some_and(|l| l.is_empty()));
        let moved = OtherUses::from_list(SmallVec::from_elem(StreamUse::Local(1, 0), 1));
        assert_eq!(slots(moved.snapshot()), [Some(1)]);
        assert!(OtherUses::from_list(SmallVec::new()).0.get().is_none());
    }
}
