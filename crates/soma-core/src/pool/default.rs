//! The default pool of a device: what `Stream::alloc_async` allocates from, as CUDA's
//! `cudaMallocAsync` allocates from the device's current pool.
//!
//! It is made on first use from the builder given to `Device::set_default_pool` (the Rust
//! defaults otherwise), and lives as long as the device: the device holds it, and the pool
//! holds a handle to the device that does not keep the default pool alive, so the two do not
//! keep each other alive. Explicit pools remain the way to separate lifetime classes
//! (weights, KV caches, activations) and to give each its own limits.

use super::alloc::PoolAlloc;
use super::builder::MemPoolBuilder;
use super::owned::{OwnedAlloc, OwnedPool};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::owned::OwnedStream;
use crate::stream::Stream;

/// A device's default pool: the builder it will be made from, then the pool.
#[derive(Default)]
pub(crate) struct DefaultPool {
    builder: Option<MemPoolBuilder>,
    pub(crate) pool: Option<OwnedPool>,
}

impl Device {
    /// The device's default pool, made on first use (with the builder given to
    /// [`set_default_pool`](Self::set_default_pool), else [`MemPool::builder`]'s defaults).
    /// Every call returns a handle to the same pool while the device lives.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// let s = dev.create_stream()?;
    /// let x = s.alloc_async::<f32>(1024)?;               // from the default pool
    /// assert_eq!(dev.default_pool()?.stats().used, 4096);
    /// # drop(x); Ok(()) }
    /// ```
    ///
    /// [`MemPool::builder`]: crate::MemPool::builder
    ///
    /// # Errors
    /// Building the pool failed (the configuration given to `set_default_pool` does not fit
    /// the device, or the backend refused the address space); the next call tries again.
    pub fn default_pool(&self) -> Result<OwnedPool> {
        let mut slot = self.shared.default_pool.lock();
        if let Some(pool) = &slot.pool {
            return Ok(pool.clone());
        }
        let builder = slot.builder.clone().unwrap_or_default();
        let pool = builder.build_owned(&self.without_owner())?;
        slot.pool = Some(pool.clone());
        Ok(pool)
    }

    /// Configures the device's default pool before its first use.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// dev.set_default_pool(MemPool::builder().max_size(1 << 30).release_threshold(0))?;
    /// assert_eq!(dev.default_pool()?.max_size(), 1 << 30);
    /// assert!(dev.set_default_pool(MemPool::builder()).is_err()); // made already
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] once the default pool has been made (its configuration can
    /// no longer change; the pool itself still takes attributes such as the release
    /// threshold), or for a configuration `build` would refuse on this device (checked now).
    pub fn set_default_pool(&self, builder: MemPoolBuilder) -> Result<()> {
        let mut slot = self.shared.default_pool.lock();
        if slot.pool.is_some() {
            return Err(Error::InvalidConfig(
                "the device's default pool is already in use; set it before its first use".into(),
            ));
        }
        builder.check(self)?;
        slot.builder = Some(builder);
        Ok(())
    }
}

impl<'d> Stream<'d> {
    /// Allocates `len` elements of `T` for use on this stream from its device's default pool
    /// (see [`Device::default_pool`]), as `cudaMallocAsync` does; the allocation borrows the
    /// stream and is freed onto it when dropped.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// let s = dev.create_stream()?;
    /// let mut x = s.alloc_async::<u32>(8)?;
    /// s.fill(&mut x, 7)?;
    /// assert_eq!(s.download(&x)?, vec![7; 8]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`MemPool::alloc_async`](crate::MemPool::alloc_async), and as
    /// [`Device::default_pool`] on first use.
    #[track_caller]
    pub fn alloc_async<T: bytemuck::Pod + Send + Sync>(
        &self,
        len: usize,
    ) -> Result<PoolAlloc<'_, T>> {
        let pool = match self.default_pool.get() {
            Some(pool) => pool,
            None => {
                let pool = self.device().default_pool()?;
                self.default_pool.get_or_init(|| pool)
            }
        };
        let pool: &crate::MemPool<'_> = pool;
        pool.alloc_async(len, self)
    }
}

impl OwnedStream {
    /// Allocates `len` elements of `T` for use on this stream from its device's default pool,
    /// as an [`OwnedAlloc`] (see [`Stream::alloc_async`] for the borrowing form, reachable as
    /// `(*stream).alloc_async(len)`).
    ///
    /// # Errors
    /// As [`Stream::alloc_async`].
    #[track_caller]
    pub fn alloc_async<T: bytemuck::Pod + Send + Sync>(&self, len: usize) -> Result<OwnedAlloc<T>> {
        self.device().default_pool()?.alloc_async(len, self)
    }
}
