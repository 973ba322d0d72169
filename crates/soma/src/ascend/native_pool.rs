//! [`NativePool`]: a thin safe wrapper over CANN's own stream-ordered pool (`aclrtMemPool*`).
//!
//! The typed `MemPool::builder().native()` is built on top of this; here each method is one
//! runtime call plus the checks that make it safe: attribute value widths are checked before
//! the runtime writes through a pointer, pointers are registered with the device so copies and
//! memsets on pool memory validate, and only pointers this pool returned are freed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ascend_sys::aclrtMemPoolAttr;
use soma_core::hal::{DevicePtr, DriverError, DriverResult};

use super::conv::{dev_ptr, is_unsupported, map_alloc_err, map_call_err, to_dev_ptr, to_usize};
use super::device::{bad_addr, lock, pool_props, AscendDevice, DeviceInner};
use super::raw;
use super::stream::{AscendStream, Handle};

static NEXT_POOL_KEY: AtomicU64 = AtomicU64::new(1);

/// The C value type of a pool attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttrWidth {
    /// `uint32_t` (the reuse switches, 0x1–0x3).
    U32,
    /// `uint64_t` (threshold and memory counters, 0x4–0x8).
    U64,
}

/// The value type of `attr`, `None` for an attribute outside the subset (its width is unknown,
/// so it cannot be passed safely).
pub fn attr_width(attr: aclrtMemPoolAttr) -> Option<AttrWidth> {
    match attr.0 {
        0x1..=0x3 => Some(AttrWidth::U32),
        0x4..=0x8 => Some(AttrWidth::U64),
        _ => None,
    }
}

fn check_width(attr: aclrtMemPoolAttr, want: AttrWidth) -> DriverResult<()> {
    match attr_width(attr) {
        Some(w) if w == want => Ok(()),
        Some(w) => Err(DriverError::InvalidValue(format!(
            "pool attribute {:#x} holds a {w:?}, not a {want:?}",
            attr.0
        ))),
        None => Err(DriverError::InvalidValue(format!("unknown pool attribute {:#x}", attr.0))),
    }
}

/// A CANN stream-ordered memory pool on one device.
///
/// `Drop` destroys the pool (`aclrtMemPoolDestroy`); errors there (for instance allocations
/// still live, which the runtime refuses) are kept by the device and returned by its next
/// fallible call. [`destroy`](Self::destroy) reports them instead.
pub struct NativePool {
    dev: Arc<DeviceInner>,
    raw: Handle,
    key: u64,
    max_size: u64,
    destroyed: bool,
}

impl std::fmt::Debug for NativePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativePool")
            .field("device", &self.dev.id)
            .field("max_size", &self.max_size)
            .finish_non_exhaustive()
    }
}

impl NativePool {
    /// Creates a pool of up to `max_size` bytes (`0`: the device's total memory) on `device`:
    /// pinned device memory, no export handle (`aclrtMemPoolCreate`). The runtime rounds
    /// `max_size` up to the granularity.
    ///
    /// # Errors
    /// [`DriverError::Unsupported`] when the device's product does not support CANN's pool API
    /// (`ACL_ERROR_RT_FEATURE_NOT_SUPPORT`, e.g. off Atlas A2) or the library lacks it; other
    /// runtime errors mapped (`ACL_ERROR_INVALID_PARAM` for a size above device memory →
    /// [`DriverError::InvalidValue`]).
    pub fn create(device: &AscendDevice, max_size: u64) -> DriverResult<Self> {
        let dev = &device.inner;
        dev.check_err()?;
        dev.enter()?;
        let props = pool_props(dev.info.ordinal, to_usize(max_size)?);
        let raw = raw::pool::create(&dev.acl, &props).map_err(|e| {
            if is_unsupported(&e) {
                DriverError::Unsupported(format!(
                    "device {} ({}) does not support CANN's stream-ordered pool API \
                     (aclrtMemPool*): {e}",
                    dev.info.ordinal, dev.info.product
                ))
            } else {
                map_call_err(e)
            }
        })?;
        Ok(Self {
            dev: dev.clone(),
            raw: Handle(raw),
            key: NEXT_POOL_KEY.fetch_add(1, Ordering::Relaxed),
            max_size,
            destroyed: false,
        })
    }

    /// The `max_size` the pool was created with (before the runtime's rounding).
    pub fn max_size(&self) -> u64 {
        self.max_size
    }

    /// The runtime handle, valid while `self` lives.
    pub fn as_raw(&self) -> ascend_sys::aclrtMemPool {
        self.raw.0
    }

    fn prologue(&self) -> DriverResult<()> {
        self.dev.check_err()?;
        self.dev.enter()
    }

    /// Sets a `uint32_t` attribute (the reuse switches 0x1–0x3).
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for an attribute that is not `uint32_t`; runtime errors.
    pub fn set_attr_u32(&self, attr: aclrtMemPoolAttr, value: u32) -> DriverResult<()> {
        check_width(attr, AttrWidth::U32)?;
        self.prologue()?;
        let mut v = value;
        // SAFETY: the pool is live; `v` is a readable `uint32_t`, the attribute's type.
        unsafe { raw::pool::set_attr(&self.dev.acl, self.raw.0, attr, (&raw mut v).cast()) }
            .map_err(map_call_err)
    }

    /// Sets a `uint64_t` attribute (0x4–0x8; `*_CURRENT` are read-only, `*_HIGH` accept 0).
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for an attribute that is not `uint64_t`; runtime errors.
    pub fn set_attr_u64(&self, attr: aclrtMemPoolAttr, value: u64) -> DriverResult<()> {
        check_width(attr, AttrWidth::U64)?;
        self.prologue()?;
        let mut v = value;
        // SAFETY: the pool is live; `v` is a readable `uint64_t`, the attribute's type.
        unsafe { raw::pool::set_attr(&self.dev.acl, self.raw.0, attr, (&raw mut v).cast()) }
            .map_err(map_call_err)
    }

    /// Reads a `uint32_t` attribute.
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for an attribute that is not `uint32_t`; runtime errors.
    pub fn get_attr_u32(&self, attr: aclrtMemPoolAttr) -> DriverResult<u32> {
        check_width(attr, AttrWidth::U32)?;
        self.prologue()?;
        let mut v = 0u32;
        // SAFETY: the pool is live; `v` is writable storage of the attribute's type.
        unsafe { raw::pool::get_attr(&self.dev.acl, self.raw.0, attr, (&raw mut v).cast()) }
            .map_err(map_call_err)?;
        Ok(v)
    }

    /// Reads a `uint64_t` attribute.
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for an attribute that is not `uint64_t`; runtime errors.
    pub fn get_attr_u64(&self, attr: aclrtMemPoolAttr) -> DriverResult<u64> {
        check_width(attr, AttrWidth::U64)?;
        self.prologue()?;
        let mut v = 0u64;
        // SAFETY: the pool is live; `v` is writable storage of the attribute's type.
        unsafe { raw::pool::get_attr(&self.dev.acl, self.raw.0, attr, (&raw mut v).cast()) }
            .map_err(map_call_err)?;
        Ok(v)
    }

    fn check_stream(&self, stream: &AscendStream) -> DriverResult<()> {
        if stream.same_device(&self.dev) {
            Ok(())
        } else {
            Err(DriverError::InvalidHandle("the stream belongs to another device".into()))
        }
    }

    /// Allocates `size` bytes usable by work enqueued on `stream` after this call
    /// (`aclrtMemPoolMallocAsync`). The allocation is not a task: it takes no stream position.
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] for size 0; [`DriverError::OutOfMemory`] when the pool or
    /// the device is full; [`DriverError::InvalidHandle`] for a stream of another device.
    pub fn malloc_async(&self, size: u64, stream: &AscendStream) -> DriverResult<DevicePtr> {
        if size == 0 {
            return Err(DriverError::InvalidValue("pool allocation of 0 bytes".into()));
        }
        self.check_stream(stream)?;
        self.prologue()?;
        // SAFETY: pool and stream are live handles of this device.
        let p = unsafe {
            raw::pool::malloc_async(&self.dev.acl, to_usize(size)?, self.raw.0, stream.as_raw())
        }
        .map_err(|e| map_alloc_err(e, size, || self.dev.free_bytes()))?;
        let Some(ptr) = to_dev_ptr(p) else {
            return Err(DriverError::Native {
                code: 0,
                message: "aclrtMemPoolMallocAsync returned success and a null pointer".into(),
            });
        };
        lock(&self.dev.mem).pool_insert(ptr.addr(), size, self.key);
        Ok(ptr)
    }

    /// Returns `ptr` (from [`malloc_async`](Self::malloc_async) of this pool) to the pool in
    /// the order of `stream` (`aclrtMemPoolFreeAsync`): work enqueued on `stream` after this
    /// may reuse it. Not a task: it takes no stream position.
    ///
    /// # Errors
    /// [`DriverError::InvalidAddress`] for a pointer this pool did not return or already
    /// freed; [`DriverError::InvalidHandle`] for a stream of another device; runtime errors.
    pub fn free_async(&self, ptr: DevicePtr, stream: &AscendStream) -> DriverResult<()> {
        self.check_stream(stream)?;
        self.prologue()?;
        let mut mem = lock(&self.dev.mem);
        if !mem.pool_owns(ptr.addr(), self.key) {
            return Err(bad_addr(ptr.addr(), 0, "not a live allocation of this pool"));
        }
        // SAFETY: `ptr` is a live allocation of this pool (checked under the lock); the stream
        // is a live handle of this device.
        unsafe { raw::pool::free_async(&self.dev.acl, dev_ptr(ptr), stream.as_raw()) }
            .map_err(map_call_err)?;
        mem.pool_remove(ptr.addr());
        Ok(())
    }

    /// Releases cached memory now, keeping at least `bytes` reserved (`aclrtMemPoolTrimTo`).
    ///
    /// # Errors
    /// Runtime errors (`bytes` above the pool size → [`DriverError::InvalidValue`]).
    pub fn trim_to(&self, bytes: u64) -> DriverResult<()> {
        self.prologue()?;
        // SAFETY: the pool is live.
        unsafe { raw::pool::trim_to(&self.dev.acl, self.raw.0, to_usize(bytes)?) }
            .map_err(map_call_err)
    }

    /// Number of allocations of this pool not yet freed through [`free_async`](Self::free_async).
    pub fn live_allocations(&self) -> usize {
        lock(&self.dev.mem).pool_count(self.key)
    }

    /// Destroys the pool, reporting errors (`Drop` cannot).
    ///
    /// # Errors
    /// [`DriverError::InvalidValue`] while allocations are live: the pool is then not destroyed
    /// but leaked, since its memory is still in use; runtime errors.
    pub fn destroy(mut self) -> DriverResult<()> {
        self.destroy_inner()
    }

    /// The check [`destroy`](Self::destroy) makes first, without destroying (tests).
    #[cfg(test)]
    pub(crate) fn destroy_check(&self) -> DriverResult<()> {
        match self.live_allocations() {
            0 => Ok(()),
            live => Err(DriverError::InvalidValue(format!("{live} live allocation(s)"))),
        }
    }

    fn destroy_inner(&mut self) -> DriverResult<()> {
        if self.destroyed {
            return Ok(());
        }
        self.destroyed = true;
        let live = self.live_allocations();
        if live > 0 {
            return Err(DriverError::InvalidValue(format!(
                "pool destroyed with {live} live allocation(s); it is leaked, not destroyed"
            )));
        }
        self.dev.enter()?;
        // SAFETY: the pool is live, has no live allocations and is not used afterwards.
        unsafe { raw::pool::destroy(&self.dev.acl, self.raw.0) }.map_err(map_call_err)
    }
}

impl Drop for NativePool {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_inner() {
            self.dev.record_err(e);
        }
    }
}

/// Downcasts a HAL stream to this backend's stream.
fn ascend_stream(stream: &dyn soma_core::hal::StreamHal) -> DriverResult<&AscendStream> {
    stream.as_any().downcast_ref::<AscendStream>().ok_or_else(|| {
        DriverError::InvalidHandle("a stream of another backend used with a CANN pool".into())
    })
}

impl soma_core::hal::NativePoolHal for NativePool {
    fn max_size(&self) -> u64 {
        self.max_size
    }

    fn malloc_async(
        &self,
        size: u64,
        stream: &dyn soma_core::hal::StreamHal,
    ) -> DriverResult<DevicePtr> {
        NativePool::malloc_async(self, size, ascend_stream(stream)?)
    }

    fn free_async(
        &self,
        ptr: DevicePtr,
        stream: &dyn soma_core::hal::StreamHal,
    ) -> DriverResult<()> {
        NativePool::free_async(self, ptr, ascend_stream(stream)?)
    }

    fn set_attr(&self, id: u32, value: u64) -> DriverResult<()> {
        let attr = aclrtMemPoolAttr(id as _);
        match attr_width(attr) {
            Some(AttrWidth::U32) => {
                let v = u32::try_from(value).map_err(|_| {
                    DriverError::InvalidValue(format!("{value} does not fit attribute {id:#x}"))
                })?;
                self.set_attr_u32(attr, v)
            }
            Some(AttrWidth::U64) => self.set_attr_u64(attr, value),
            None => Err(DriverError::InvalidValue(format!("unknown pool attribute {id:#x}"))),
        }
    }

    fn get_attr(&self, id: u32) -> DriverResult<u64> {
        let attr = aclrtMemPoolAttr(id as _);
        match attr_width(attr) {
            Some(AttrWidth::U32) => self.get_attr_u32(attr).map(u64::from),
            Some(AttrWidth::U64) => self.get_attr_u64(attr),
            None => Err(DriverError::InvalidValue(format!("unknown pool attribute {id:#x}"))),
        }
    }

    fn trim_to(&self, bytes: u64) -> DriverResult<()> {
        NativePool::trim_to(self, bytes)
    }
}
