//! Typed pool attributes: the eight ids of the C API (`aclrtMemPoolAttr`), checked at compile
//! time.
//!
//! | id | attribute | value | access |
//! |---|---|---|---|
//! | 0x1 | [`ReuseFollowEventDependencies`] | `bool` | get / set |
//! | 0x2 | [`ReuseAllowOpportunistic`] | `bool` | get / set |
//! | 0x3 | [`ReuseAllowInternalDependencies`] | `bool` | get / set |
//! | 0x4 | [`ReleaseThreshold`] | `u64` bytes | get / set (≤ max size) |
//! | 0x5 | [`ReservedMemCurrent`] | `u64` | get |
//! | 0x6 | [`ReservedMemHigh`] | `u64` | get / reset |
//! | 0x7 | [`UsedMemCurrent`] | `u64` | get |
//! | 0x8 | [`UsedMemHigh`] | `u64` | get / reset |
//!
//! Setting a read-only attribute does not compile:
//!
//! ```compile_fail
//! # fn f(pool: &soma_core::MemPool<'_>) {
//! use soma_core::attr;
//! pool.set::<attr::UsedMemCurrent>(0);
//! # }
//! ```

use super::api::{Backend, MemPool};
use super::policy::{FOLLOW_EVENT_DEPENDENCIES, INTERNAL_DEPENDENCIES, OPPORTUNISTIC};
use super::stats::PoolStats;
use crate::error::Result;

mod sealed {
    pub trait Sealed {}
}

/// A pool attribute with its C API id and value type.
pub trait Attribute: sealed::Sealed {
    /// The `aclrtMemPoolAttr` value.
    const ID: u32;
    /// The value type.
    type Value: Copy;
    #[doc(hidden)]
    fn get(pool: &MemPool<'_>) -> Result<Self::Value>;
}

/// An attribute that can be set.
pub trait Settable: Attribute {
    #[doc(hidden)]
    fn set(pool: &MemPool<'_>, value: Self::Value) -> Result<()>;
}

/// A high-water mark that can be reset (to 0, then it follows the current value again).
pub trait Resettable: Attribute {
    #[doc(hidden)]
    fn reset(pool: &MemPool<'_>) -> Result<()>;
}

macro_rules! reuse_switch {
    ($(#[$doc:meta])* $name:ident, $id:expr, $bit:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl Attribute for $name {
            const ID: u32 = $id;
            type Value = bool;
            fn get(pool: &MemPool<'_>) -> Result<bool> {
                pool.reuse_switch($id, $bit)
            }
        }
        impl Settable for $name {
            fn set(pool: &MemPool<'_>, value: bool) -> Result<()> {
                pool.set_reuse_switch($id, $bit, value)
            }
        }
    };
}

reuse_switch!(
    /// Rule 2: reuse blocks freed on another stream when this stream waited on an event
    /// recorded after the free (directly or through a chain of streams).
    ReuseFollowEventDependencies,
    0x1,
    FOLLOW_EVENT_DEPENDENCIES
);
reuse_switch!(
    /// Rule 3: reuse blocks whose free has already completed on the device.
    ReuseAllowOpportunistic,
    0x2,
    OPPORTUNISTIC
);
reuse_switch!(
    /// Rule 4: reuse another stream's block by making this stream wait on an event the pool
    /// records after the free.
    ReuseAllowInternalDependencies,
    0x3,
    INTERNAL_DEPENDENCIES
);

/// Bytes of reserved memory the pool keeps at a synchronisation; above it, free memory is
/// released to the device. At most the pool's max size.
#[derive(Clone, Copy, Debug)]
pub struct ReleaseThreshold;
impl sealed::Sealed for ReleaseThreshold {}
impl Attribute for ReleaseThreshold {
    const ID: u32 = 0x4;
    type Value = u64;
    fn get(pool: &MemPool<'_>) -> Result<u64> {
        match pool.backend() {
            Backend::Engine(cores) => Ok(cores.first().settings.release_threshold()),
            Backend::Native(native) => native.attr(Self::ID),
        }
    }
}
impl Settable for ReleaseThreshold {
    fn set(pool: &MemPool<'_>, value: u64) -> Result<()> {
        match pool.backend() {
            Backend::Engine(cores) => {
                let core = cores.first();
                core.settings.set_release_threshold(value, core.max_size)
            }
            Backend::Native(native) => native.set_release_threshold(value),
        }
    }
}

macro_rules! counter {
    ($(#[$doc:meta])* $name:ident, $id:expr, |$p:ident| $get:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl Attribute for $name {
            const ID: u32 = $id;
            type Value = u64;
            fn get(pool: &MemPool<'_>) -> Result<u64> {
                pool.counter($id, |$p| $get)
            }
        }
    };
}

counter!(
    /// Physical bytes the pool holds (used + cached). Read-only.
    ReservedMemCurrent,
    0x5,
    |p| p.reserved
);
counter!(
    /// High-water mark of [`ReservedMemCurrent`]; resettable.
    ReservedMemHigh,
    0x6,
    |p| p.reserved_high
);
counter!(
    /// Bytes handed out and not yet freed (rounded sizes). Read-only.
    UsedMemCurrent,
    0x7,
    |p| p.used
);
counter!(
    /// High-water mark of [`UsedMemCurrent`]; resettable.
    UsedMemHigh,
    0x8,
    |p| p.used_high
);

impl Resettable for ReservedMemHigh {
    fn reset(pool: &MemPool<'_>) -> Result<()> {
        pool.reset_high(Self::ID, false, true)
    }
}

impl Resettable for UsedMemHigh {
    fn reset(pool: &MemPool<'_>) -> Result<()> {
        pool.reset_high(Self::ID, true, false)
    }
}

/// Each attribute asks the engine-backed pool or the driver's.
impl MemPool<'_> {
    fn reuse_switch(&self, id: u32, bit: u32) -> Result<bool> {
        match self.backend() {
            Backend::Engine(cores) => Ok(cores.first().settings.reuse_flag(bit)),
            Backend::Native(native) => Ok(native.attr(id)? != 0),
        }
    }

    fn set_reuse_switch(&self, id: u32, bit: u32, on: bool) -> Result<()> {
        match self.backend() {
            Backend::Engine(cores) => {
                cores.first().settings.set_reuse_flag(bit, on);
                Ok(())
            }
            Backend::Native(native) => native.set_reuse_switch(id, bit, on),
        }
    }

    fn counter(&self, id: u32, pick: impl Fn(PoolStats) -> u64) -> Result<u64> {
        match self.backend() {
            Backend::Engine(cores) => Ok(pick(cores.stats())),
            Backend::Native(native) => native.attr(id),
        }
    }

    /// Resets the high-water mark `id` (`used`'s or `reserved`'s, as the flags say).
    fn reset_high(&self, id: u32, used: bool, reserved: bool) -> Result<()> {
        match self.backend() {
            Backend::Engine(cores) => {
                cores.reset_high_marks(used, reserved);
                Ok(())
            }
            Backend::Native(native) => native.set_attr(id, 0),
        }
    }
}
