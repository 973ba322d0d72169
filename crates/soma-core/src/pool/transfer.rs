//! Allocations that start with known contents: zeros, or a copy of host data.

use super::{MemPool, PoolAlloc};
use crate::error::Result;
use crate::stream::Stream;

impl<'d> MemPool<'d> {
    /// Allocates `len` elements of `T` for use on `stream`, set to zero in stream order.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let counts = pool.alloc_zeros::<u32>(8, &s)?;
    /// assert_eq!(s.download(&counts)?, vec![0; 8]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`alloc_async`](Self::alloc_async), and backend failures of the memset.
    #[track_caller]
    pub fn alloc_zeros<'s, T: bytemuck::Pod + Send + Sync>(
        &'s self,
        len: usize,
        stream: &'s Stream<'d>,
    ) -> Result<PoolAlloc<'s, T>> {
        let mut alloc = self.alloc_async::<T>(len, stream)?;
        stream.memset(&mut alloc, 0)?;
        Ok(alloc)
    }

    /// Allocates a copy of `data` for use on `stream` (the host slice is staged at once,
    /// as [`Stream::copy_from_host`] does, and is free to change when this returns).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let weights = pool.upload(&[1.0f32, 2.0, 3.0], &s)?;
    /// assert_eq!(s.download(&weights)?, vec![1.0, 2.0, 3.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`alloc_async`](Self::alloc_async) (an empty `data` is size 0), and backend
    /// failures of the copy.
    #[track_caller]
    pub fn upload<'s, T: bytemuck::Pod + Send + Sync>(
        &'s self,
        data: &[T],
        stream: &'s Stream<'d>,
    ) -> Result<PoolAlloc<'s, T>> {
        let mut alloc = self.alloc_async::<T>(data.len(), stream)?;
        stream.copy_from_host(&mut alloc, data)?;
        Ok(alloc)
    }
}
