//! What a task touches and runs: kernels (their buffers and bodies), copy ends, host
//! functions.

use std::fmt;

use super::DevicePtr;

/// How a kernel accesses one of its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccessMode {
    /// Read only.
    Read,
    /// Written (and possibly read).
    Write,
}

/// One byte range a task touches: the seam for the stream-order sanitizer and for the
/// backend's bounds checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferAccess {
    /// First byte.
    pub ptr: DevicePtr,
    /// Length in bytes.
    pub len: u64,
    /// Read or write.
    pub mode: AccessMode,
}

/// One end of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemRef {
    /// Device memory.
    Device(DevicePtr),
    /// Host memory (a raw host address; see the `# Safety` of the copy functions).
    Host(*mut u8),
}

// SAFETY: `MemRef::Host` is an address, never dereferenced by the holder; the unsafe copy
// functions that take it put the obligation (validity until completion) on their caller.
unsafe impl Send for MemRef {}
// SAFETY: as above; a `&MemRef` gives no access to the pointee.
unsafe impl Sync for MemRef {}

/// The error a kernel body returns to fail its stream.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KernelError(pub String);

impl KernelError {
    /// A kernel error with a message.
    pub fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

/// The device buffers a kernel body sees, in the order of [`KernelLaunch::buffers`].
///
/// A buffer can be borrowed any number of times read-only (`read::<T>(i)`, `&[T]`)
/// or once mutably (`write::<T>(i)`, `&mut [T]`, only buffers declared
/// [`AccessMode::Write`]), not both. The backend rejects launches whose write buffers overlap
/// any other buffer, so the slices handed out never alias. Physical memory keeps its contents
/// while unmapped, as on a device: mapped again, at any address, it shows them.
pub trait KernelBuffers {
    /// Number of buffers.
    fn len(&self) -> usize;
    /// Whether there are no buffers.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Buffer `index` as bytes, read-only.
    ///
    /// # Errors
    /// Index out of range, or the buffer is already borrowed mutably.
    fn bytes(&self, index: usize) -> Result<&[u8], KernelError>;
    /// Buffer `index` as bytes, writable. At most once per buffer and launch.
    ///
    /// # Errors
    /// Index out of range, buffer not declared for writing, or already borrowed.
    #[allow(clippy::mut_from_ref)]
    fn bytes_mut(&self, index: usize) -> Result<&mut [u8], KernelError>;
}

impl dyn KernelBuffers + '_ {
    /// Buffer `index` as `&[T]`.
    ///
    /// # Errors
    /// As [`KernelBuffers::bytes`], or the bytes are not a whole, aligned `[T]`.
    pub fn read<T: bytemuck::Pod>(&self, index: usize) -> Result<&[T], KernelError> {
        bytemuck::try_cast_slice(self.bytes(index)?).map_err(|e| {
            KernelError(format!("buffer {index} is not a [{}]: {e}", std::any::type_name::<T>()))
        })
    }

    /// Buffer `index` as `&mut [T]`.
    ///
    /// # Errors
    /// As [`KernelBuffers::bytes_mut`], or the bytes are not a whole, aligned `[T]`.
    #[allow(clippy::mut_from_ref)]
    pub fn write<T: bytemuck::Pod>(&self, index: usize) -> Result<&mut [T], KernelError> {
        bytemuck::try_cast_slice_mut(self.bytes_mut(index)?).map_err(|e| {
            KernelError(format!("buffer {index} is not a [{}]: {e}", std::any::type_name::<T>()))
        })
    }
}

/// The body of a kernel written as a Rust closure (software NPU).
pub type KernelBody = Box<dyn FnOnce(&dyn KernelBuffers) -> Result<(), KernelError> + Send>;

/// A kernel launch: a name for reports, the buffers it touches, and its body.
pub struct KernelLaunch {
    /// Name used in error and sanitizer reports.
    pub name: &'static str,
    /// Every device range the kernel reads or writes.
    pub buffers: Vec<BufferAccess>,
    /// The work.
    pub body: KernelBody,
}

impl fmt::Debug for KernelLaunch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelLaunch")
            .field("name", &self.name)
            .field("buffers", &self.buffers)
            .finish()
    }
}

/// A host function enqueued on a stream.
pub type HostFn = Box<dyn FnOnce() + Send>;
