//! Typed device buffers: what the copy and kernel APIs of [`Stream`] accept.

use std::marker::PhantomData;
use std::ops::RangeBounds;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::hal::DevicePtr;
use crate::stream::Stream;
use crate::view::{self, SplitMut, View, ViewMut};

mod sealed {
    pub trait Sealed {}
}

/// The object-safe part of a device buffer: which device it lives on and how a use on a
/// stream is recorded. Implemented only by this crate's buffer types.
pub trait BufferOwner: sealed::Sealed + Sync {
    /// The device the memory belongs to.
    fn device(&self) -> &Device;

    /// Records that work on `stream` uses the buffer, so that its free is ordered after that
    /// work. soma's own copies, memsets and kernels record their uses; call this before
    /// work that soma does not see uses the buffer on a stream other than its own (a kernel
    /// enqueued on the raw stream, see `docs/semantics.md`, "Work soma does not see").
    ///
    /// The first use on a stream makes that stream wait for the allocation point (an event
    /// on the allocation's stream); later uses on the same stream cost nothing. The stream
    /// may belong to a peer device with access to the buffer's device
    /// ([`Device::enable_peer_access`]): the free then waits for that stream too.
    ///
    /// # Errors
    /// [`Error::PeerAccess`](crate::Error::PeerAccess) for a stream of a device without access
    /// to the buffer's, or backend failures while recording the event.
    fn record_use(&self, stream: &Stream<'_>) -> Result<()>;
}

/// A typed range of device memory: allocations ([`PoolAlloc`](crate::PoolAlloc),
/// [`OwnedAlloc`](crate::OwnedAlloc), [`DriverAlloc`]) and views of them ([`View`],
/// [`ViewMut`]). Copies, memsets and kernels take any of them.
pub trait DeviceBuffer: BufferOwner {
    /// Element type.
    type Elem: bytemuck::Pod + Send + Sync;
    /// First byte on the device.
    fn device_ptr(&self) -> DevicePtr;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether the buffer has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Size in bytes.
    fn byte_len(&self) -> u64 {
        (self.len() * std::mem::size_of::<Self::Elem>()) as u64
    }

    /// A read-only view of the elements in `range`, as `&v[range]` is of a slice.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{DeviceBuffer, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let logits = pool.alloc_async::<f32>(1000, &s)?;
    /// let last = logits.slice(900..)?;               // the last 100 elements
    /// assert_eq!(last.len(), 100);
    /// assert!(logits.slice(900..1001).is_err());      // out of range: an error, no panic
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `range` is not within `0..len()` or starts after it
    /// ends.
    fn slice(&self, range: impl RangeBounds<usize>) -> Result<View<'_, Self::Elem>>
    where
        Self: Sized,
    {
        view::slice(self, range)
    }

    /// The whole buffer seen as elements of `U` (e.g. `u8` bytes as `f32`s).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{DeviceBuffer, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let bytes = pool.alloc_async::<u8>(64, &s)?;
    /// assert_eq!(bytes.cast::<f32>()?.len(), 16);
    /// assert!(bytes.slice(0..6)?.cast::<f32>().is_err()); // 6 bytes are no whole f32s
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the bytes are not a whole number of `U` or the first
    /// byte is not aligned for `U`.
    fn cast<U: bytemuck::Pod + Send + Sync>(&self) -> Result<View<'_, U>>
    where
        Self: Sized,
    {
        view::cast(self)
    }
}

/// A device buffer that may be written: allocations and [`ViewMut`], not [`View`]. Copies
/// into it, memsets and kernel arguments made with [`KernelArg::write`](crate::KernelArg::write)
/// require it.
pub trait DeviceBufferMut: DeviceBuffer {
    /// A writable view of the elements in `range`, as `&mut v[range]` is of a slice; a write
    /// through it touches only those bytes.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{DeviceBuffer, DeviceBufferMut, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let mut kv = pool.alloc_async::<f32>(16, &s)?;
    /// s.memset(&mut kv, 0)?;
    /// s.copy_from_host(&mut kv.slice_mut(4..6)?, &[1.0, 2.0])?; // append two values
    /// let mut host = [0.0f32; 16];
    /// s.copy_to_host(&kv, &mut host)?;
    /// assert_eq!(&host[3..7], &[0.0, 1.0, 2.0, 0.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::slice`].
    fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<ViewMut<'_, Self::Elem>>
    where
        Self: Sized,
    {
        view::slice_mut(self, range)
    }

    /// Two writable views, of `[0, mid)` and `[mid, len)`, as `<[T]>::split_at_mut`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `mid > len()`.
    fn split_at_mut(&mut self, mid: usize) -> Result<SplitMut<'_, Self::Elem>>
    where
        Self: Sized,
    {
        view::split_at_mut(self, mid)
    }

    /// The whole buffer seen as writable elements of `U`.
    ///
    /// # Errors
    /// As [`DeviceBuffer::cast`].
    fn cast_mut<U: bytemuck::Pod + Send + Sync>(&mut self) -> Result<ViewMut<'_, U>>
    where
        Self: Sized,
    {
        view::cast_mut(self)
    }
}

/// Bytes for `len` elements of `T`, or an error for 0 and overflow.
pub(crate) fn bytes_for<T>(len: usize) -> Result<u64> {
    let elem = std::mem::size_of::<T>() as u64;
    if elem == 0 {
        return Err(Error::InvalidSize(
            "zero-sized element types have no device representation".into(),
        ));
    }
    match (len as u64).checked_mul(elem) {
        Some(0) => Err(Error::InvalidSize("size 0".into())),
        Some(bytes) => Ok(bytes),
        None => Err(Error::InvalidSize(format!("{len} elements of {elem} bytes overflow u64"))),
    }
}

/// Device memory from the plain driver path (`aclrtMalloc` / `aclrtFree`), outside any pool.
///
/// This is what code without a pool does, kept for comparison (the `llama_decode` demo) and
/// for memory that must outlive every pool. Dropping it **synchronises the whole device**
/// before freeing — the cost a stream-ordered pool exists to remove — and every peer device
/// whose streams used it ([`Device::enable_peer_access`]).
pub struct DriverAlloc<'d, T> {
    device: &'d Device,
    ptr: DevicePtr,
    len: usize,
    /// Peer devices whose streams used the memory: synchronised too before the free.
    peers: parking_lot::Mutex<Vec<Device>>,
    _elem: PhantomData<fn() -> T>,
}

impl<'d, T: bytemuck::Pod + Send + Sync> DriverAlloc<'d, T> {
    /// Allocates `len` elements with the driver's `malloc`.
    ///
    /// # Errors
    /// Size 0 or overflowing, device out of memory.
    pub fn new(device: &'d Device, len: usize) -> Result<Self> {
        let bytes = bytes_for::<T>(len)?;
        let ptr = device.hal().malloc(bytes)?;
        Ok(DriverAlloc {
            device,
            ptr,
            len,
            peers: parking_lot::Mutex::default(),
            _elem: PhantomData,
        })
    }

    /// Synchronises the device, then frees the memory.
    ///
    /// # Errors
    /// A stream error reported by the synchronisation, or the driver's free failing.
    pub fn free(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        this.release()
    }

    fn release(&self) -> Result<()> {
        let sync = self.synchronize_users();
        self.device.hal().free(self.ptr)?;
        sync
    }
}

impl<T> DriverAlloc<'_, T> {
    /// Synchronises the device and the peers that used the memory; the first error.
    fn synchronize_users(&self) -> Result<()> {
        let peers = std::mem::take(&mut *self.peers.lock());
        let own = self.device.synchronize();
        peers.iter().map(Device::synchronize).fold(own, Result::and)
    }
}

impl<T> Drop for DriverAlloc<'_, T> {
    fn drop(&mut self) {
        // Nothing to report to: the free itself is what matters and it happens regardless.
        let _ = self.synchronize_users();
        let _ = self.device.hal().free(self.ptr);
    }
}

impl<T> sealed::Sealed for DriverAlloc<'_, T> {}

impl<T> BufferOwner for DriverAlloc<'_, T> {
    fn device(&self) -> &Device {
        self.device
    }
    fn record_use(&self, stream: &Stream<'_>) -> Result<()> {
        stream.check_access(self.device, "the allocation")?;
        // Freeing synchronises the device, which covers its own streams' uses; a peer's are
        // covered by synchronising the peer too.
        let user = stream.device();
        if !user.same_as(self.device) {
            let mut peers = self.peers.lock();
            if !peers.iter().any(|p| p.same_as(user)) {
                peers.push(user.without_owner());
            }
        }
        Ok(())
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBuffer for DriverAlloc<'_, T> {
    type Elem = T;
    fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBufferMut for DriverAlloc<'_, T> {}

pub(crate) use sealed::Sealed;
