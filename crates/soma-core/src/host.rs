//! Page-locked host memory and the asynchronous copies that use it without staging.
//!
//! A [`HostBuffer`] is host memory the device copies to and from directly
//! (`aclrtMallocHost` on Ascend, a locked host mapping on the software NPU). An
//! asynchronous copy takes the buffer by value and lends it to the stream; the
//! [`HostTransfer`] it returns gives the buffer back once the copy has completed, so Rust code
//! cannot read a download early or change an upload under the device.

use std::future::Future;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;
use std::task::{Context, Poll};

use parking_lot::Mutex;

use crate::completion::Signal;
use crate::device::Device;
use crate::engine::StreamSlot;
use crate::error::{Error, Result};
use crate::hal::StreamHal;

/// Page-locked host memory holding `len` elements of `T`; derefs to `[T]`.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let npu = soma_sim::Npu::builder().build()?;
/// # let dev = soma_core::Device::new(npu.device(0)?);
/// use soma_core::HostBuffer;
/// let mut host = HostBuffer::<f32>::new(&dev, 1024)?;  // zeroed
/// host[..4].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
/// assert_eq!(host.len(), 1024);
/// # Ok(()) }
/// ```
pub struct HostBuffer<T> {
    device: Device,
    ptr: NonNull<T>,
    len: usize,
    _elem: PhantomData<T>,
}

// SAFETY: the buffer owns its memory exclusively (like a `Box<[T]>`); sending it sends the
// elements.
unsafe impl<T: Send> Send for HostBuffer<T> {}
// SAFETY: `&HostBuffer` gives only `&[T]`.
unsafe impl<T: Sync> Sync for HostBuffer<T> {}

impl<T: bytemuck::Pod> HostBuffer<T> {
    /// Allocates `len` zeroed elements of page-locked host memory of `device`.
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for 0 or overflowing sizes; the backend's errors (out of host
    /// memory, `Unsupported` on a backend without page-locked memory).
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        let bytes = crate::buffer::bytes_for::<T>(len)?;
        let raw = device.hal().malloc_host(bytes)?;
        if raw.as_ptr().align_offset(std::mem::align_of::<T>()) != 0 {
            // SAFETY: just allocated by this device and never shared.
            let _ = unsafe { device.hal().free_host(raw) };
            return Err(Error::InvalidArgument(format!(
                "the backend's page-locked memory at {raw:p} is not aligned for {}",
                std::any::type_name::<T>()
            )));
        }
        // SAFETY: `raw` is valid for writes of `bytes` bytes and owned by nobody else yet.
        unsafe { raw.as_ptr().write_bytes(0, bytes as usize) };
        Ok(HostBuffer { device: device.clone(), ptr: raw.cast(), len, _elem: PhantomData })
    }

    /// Page-locked host memory holding a copy of `data`.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_slice(device: &Device, data: &[T]) -> Result<Self> {
        let mut buffer = Self::new(device, data.len())?;
        buffer.copy_from_slice(data);
        Ok(buffer)
    }
}

impl<T> HostBuffer<T> {
    /// The device whose page-locked memory this is.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The first byte, for backends' copies.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    /// The first byte, for backends' copies (read-only).
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr().cast()
    }

    /// Size in bytes.
    pub(crate) fn byte_len(&self) -> u64 {
        (self.len * std::mem::size_of::<T>()) as u64
    }
}

impl<T> std::ops::Deref for HostBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` is valid, aligned and initialised for `len` elements (zeroed or
        // written at creation, then only written through `&mut self` or by a copy that has
        // completed before the buffer came back from its transfer), and owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: the memory came from this device's `malloc_host` and is freed once, here;
        // no reference outlives `self`, and a transfer holds the buffer until its copy has
        // completed. A failure cannot be reported from `Drop`; it would mean the backend lost
        // track of its own allocation.
        let _ = unsafe { self.device.hal().free_host(self.ptr.cast()) };
    }
}

impl<T> std::fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}

/// What the host function behind a transfer shares with its [`HostTransfer`].
struct Lent<T> {
    signal: Signal,
    /// The buffer while the device may use it; the ticket takes it back when done.
    buffer: Mutex<Option<HostBuffer<T>>>,
}

/// An asynchronous copy between device memory and a [`HostBuffer`], from
/// [`Stream::copy_to_host_async`](crate::Stream::copy_to_host_async) or
/// [`Stream::copy_from_host_async`](crate::Stream::copy_from_host_async).
///
/// The buffer is lent to the stream until the copy completes. [`wait`](Self::wait) blocks
/// for it; `.await` waits without blocking a thread (any async runtime). Either gives the
/// buffer back and counts as a host observation of the stream up to the copy, as a stream
/// synchronisation does. Dropping an unfinished transfer blocks until the copy is done (the
/// memory cannot be freed under the device).
#[must_use = "the host buffer comes back through `wait` or `.await`"]
pub struct HostTransfer<T> {
    lent: Arc<Lent<T>>,
    stream: Arc<dyn StreamHal>,
    device: Device,
    slot: StreamSlot,
    /// Global position of the copy on its stream.
    position: u64,
    finished: bool,
}

/// Sets the transfer's signal when dropped: after its host function ran, or when the stream
/// dropped it unrun after a failure.
struct Release<T>(Arc<Lent<T>>);

impl<T> Drop for Release<T> {
    fn drop(&mut self) {
        self.0.signal.set();
    }
}

impl<T: Send + 'static> HostTransfer<T> {
    /// Lends `buffer` to `stream` behind a copy already enqueued at global `position`.
    pub(crate) fn lend(
        stream: &crate::stream::Stream<'_>,
        position: u64,
        buffer: HostBuffer<T>,
    ) -> Result<Self> {
        let lent = Arc::new(Lent { signal: Signal::default(), buffer: Mutex::new(Some(buffer)) });
        let release = Release(Arc::clone(&lent));
        let transfer = HostTransfer {
            lent,
            stream: Arc::clone(stream.hal()),
            device: stream.device().clone(),
            slot: stream.slot(),
            position,
            finished: false,
        };
        if let Err(e) = stream.hal().host_fn(Box::new(move || drop(release))) {
            // The copy is enqueued but nothing will signal it: wait for it the blocking way
            // before the buffer can go.
            let _ = transfer.stream.synchronize();
            transfer.lent.signal.set();
            return Err(e.into());
        }
        Ok(transfer)
    }
}

impl<T> HostTransfer<T> {
    /// Whether the copy has completed; never blocks, observes nothing.
    pub fn is_complete(&self) -> bool {
        self.lent.signal.is_done()
    }

    /// Blocks until the copy has completed and returns the buffer.
    ///
    /// # Errors
    /// The stream's failure, if a task up to the copy failed (the buffer's content is then
    /// undefined and it is dropped).
    pub fn wait(mut self) -> Result<HostBuffer<T>> {
        self.lent.signal.wait();
        self.finish()
    }

    /// Takes the buffer back after the signal: publishes the host observation and reports
    /// the stream's failure.
    fn finish(&mut self) -> Result<HostBuffer<T>> {
        self.finished = true;
        let failed = self.stream.query().err();
        self.device.shared.observe(self.slot, self.position + 1);
        self.device.shared.after_host_sync();
        let buffer = self.lent.buffer.lock().take();
        match (failed, buffer) {
            (None, Some(buffer)) => Ok(buffer),
            (Some(e), _) => Err(e.into()),
            (None, None) => Err(Error::InvalidArgument("the transfer was already taken".into())),
        }
    }
}

impl<T> Future for HostTransfer<T> {
    type Output = Result<HostBuffer<T>>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.finished {
            return Poll::Ready(Err(Error::InvalidArgument(
                "the transfer was already awaited".into(),
            )));
        }
        if !self.lent.signal.poll_done(cx) {
            return Poll::Pending;
        }
        Poll::Ready(self.finish())
    }
}

impl<T> Drop for HostTransfer<T> {
    fn drop(&mut self) {
        if !self.finished {
            // The buffer must not be freed while the device may still copy into or out of it,
            // and is freed here, not by the stream's host function (backends forbid freeing
            // inside a stream callback).
            self.lent.signal.wait();
            drop(self.lent.buffer.lock().take());
        }
    }
}

impl<T> std::fmt::Debug for HostTransfer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTransfer")
            .field("stream", &self.stream.id())
            .field("complete", &self.is_complete())
            .finish()
    }
}

impl crate::stream::Stream<'_> {
    /// Enqueues a copy of the start of `src` into `dst`, a page-locked host buffer lent to
    /// the stream until the copy completes: no synchronisation, no staging copy. The
    /// returned transfer gives the buffer back, filled, when waited or awaited.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{HostBuffer, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let logits = pool.upload(&[0.5f32, 1.5, 2.5], &s)?;
    /// let transfer = s.copy_to_host_async(&logits, HostBuffer::new(&dev, 3)?)?;
    /// // ... enqueue more work, serve other requests ...
    /// let host = transfer.wait()?;          // or `transfer.await` in async code
    /// assert_eq!(&host[..], &[0.5, 1.5, 2.5]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `dst` longer than `src`, a buffer of another device (the host buffer is then dropped),
    /// backend failures.
    pub fn copy_to_host_async<B>(
        &self,
        src: &B,
        mut dst: HostBuffer<B::Elem>,
    ) -> Result<HostTransfer<B::Elem>>
    where
        B: crate::DeviceBuffer,
    {
        self.check_device(dst.device(), "the host buffer")?;
        if dst.len() > src.len() {
            return Err(Error::InvalidArgument(format!(
                "copy_to_host_async: {} elements out of a buffer of {}",
                dst.len(),
                src.len()
            )));
        }
        self.note_use(src)?;
        let len = dst.byte_len();
        if len > 0 {
            let host = crate::hal::MemRef::Host(dst.as_mut_ptr());
            let device = crate::hal::MemRef::Device(src.device_ptr());
            // SAFETY: `dst` moves into the transfer below, which keeps it alive and unread by
            // Rust code until the host function enqueued after this copy has run or been
            // dropped, i.e. until the copy has completed or was skipped.
            unsafe { self.hal().copy_async(host, device, len)? };
        }
        let position = self.position();
        HostTransfer::lend(self, position, dst)
    }

    /// Enqueues a copy of `src`, a page-locked host buffer lent to the stream until the copy
    /// completes, into the start of `dst`: no synchronisation, no staging copy. The returned
    /// transfer gives the buffer back for reuse.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{HostBuffer, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let mut tokens = pool.alloc_async::<u32>(4, &s)?;
    /// let staging = HostBuffer::from_slice(&dev, &[1u32, 2, 3, 4])?;
    /// let staging = s.copy_from_host_async(&mut tokens, staging)?.wait()?; // reusable again
    /// assert_eq!(s.download(&tokens)?, vec![1, 2, 3, 4]);
    /// # drop(staging); Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `src` longer than `dst`, a buffer of another device, backend failures.
    pub fn copy_from_host_async<B>(
        &self,
        dst: &mut B,
        src: HostBuffer<B::Elem>,
    ) -> Result<HostTransfer<B::Elem>>
    where
        B: crate::DeviceBufferMut,
    {
        self.check_device(src.device(), "the host buffer")?;
        if src.len() > dst.len() {
            return Err(Error::InvalidArgument(format!(
                "copy_from_host_async: {} elements into a buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        self.note_use(dst)?;
        let len = src.byte_len();
        if len > 0 {
            let host = crate::hal::MemRef::Host(src.as_ptr().cast_mut());
            let device = crate::hal::MemRef::Device(dst.device_ptr());
            // SAFETY: `src` moves into the transfer below, which keeps it alive and unwritten
            // by Rust code until the copy has completed or was skipped (as above).
            unsafe { self.hal().copy_async(device, host, len)? };
        }
        let position = self.position();
        HostTransfer::lend(self, position, src)
    }
}
