//! Typed device buffers: what the copy and kernel APIs of [`Stream`] accept.

use std::marker::PhantomData;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::hal::DevicePtr;
use crate::stream::Stream;

mod sealed {
    pub trait Sealed {}
}

/// The object-safe part of a device buffer: which device it lives on and how a use on a
/// stream is recorded. Implemented only by this crate's buffer types.
pub trait BufferOwner: sealed::Sealed + Sync {
    /// The device the memory belongs to.
    fn device(&self) -> &Device;
    /// Records that work on `stream` uses the buffer, so that its free is ordered after it.
    ///
    /// # Errors
    /// Failures the pool could not absorb.
    #[doc(hidden)]
    fn record_use(&self, stream: &Stream<'_>) -> Result<()>;
}

/// A typed range of device memory: [`PoolAlloc`](crate::PoolAlloc) and [`DriverAlloc`].
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
/// before freeing — the cost a stream-ordered pool exists to remove.
pub struct DriverAlloc<'d, T> {
    device: &'d Device,
    ptr: DevicePtr,
    len: usize,
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
        Ok(DriverAlloc { device, ptr, len, _elem: PhantomData })
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
        let sync = self.device.synchronize();
        self.device.hal().free(self.ptr)?;
        sync
    }
}

impl<T> Drop for DriverAlloc<'_, T> {
    fn drop(&mut self) {
        // Nothing to report to: the free itself is what matters and it happens regardless.
        let _ = self.device.synchronize();
        let _ = self.device.hal().free(self.ptr);
    }
}

impl<T> sealed::Sealed for DriverAlloc<'_, T> {}

impl<T> BufferOwner for DriverAlloc<'_, T> {
    fn device(&self) -> &Device {
        self.device
    }
    fn record_use(&self, _stream: &Stream<'_>) -> Result<()> {
        // Freeing synchronises the device: every use is covered.
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

pub(crate) use sealed::Sealed;
