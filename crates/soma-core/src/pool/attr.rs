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

use super::MemPool;
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
                match &pool.core().native {
                    Some(n) => Ok(n.get_attr($id)? != 0),
                    None => Ok(pool.core().reuse_flag($bit)),
                }
            }
        }
        impl Settable for $name {
            fn set(pool: &MemPool<'_>, value: bool) -> Result<()> {
                if let Some(n) = &pool.core().native {
                    n.set_attr($id, value.into())?;
                }
                pool.core().set_reuse_flag($bit, value);
                Ok(())
            }
        }
    };
}

reuse_switch!(
    /// Rule 2: reuse blocks freed on another stream when this stream waited on an event
    /// recorded after the free (directly or through a chain of streams).
    ReuseFollowEventDependencies,
    0x1,
    super::FOLLOW_EVENT_DEPENDENCIES
);
reuse_switch!(
    /// Rule 3: reuse blocks whose free has already completed on the device.
    ReuseAllowOpportunistic,
    0x2,
    super::OPPORTUNISTIC
);
reuse_switch!(
    /// Rule 4: reuse another stream's block by making this stream wait on an event the pool
    /// records after the free.
    ReuseAllowInternalDependencies,
    0x3,
    super::INTERNAL_DEPENDENCIES
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
        match &pool.core().native {
            Some(n) => Ok(n.get_attr(Self::ID)?),
            None => Ok(pool.core().release_threshold()),
        }
    }
}
impl Settable for ReleaseThreshold {
    fn set(pool: &MemPool<'_>, value: u64) -> Result<()> {
        pool.core().set_release_threshold(value)?;
        if let Some(n) = &pool.core().native {
            n.set_attr(Self::ID, value)?;
        }
        Ok(())
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
                if let Some(n) = &pool.core().native {
                    return Ok(n.get_attr($id)?);
                }
                let $p = pool.stats();
                Ok($get)
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
        if let Some(n) = &pool.core().native {
            return Ok(n.set_attr(Self::ID, 0)?);
        }
        pool.reset_high_marks(false, true);
        Ok(())
    }
}

impl Resettable for UsedMemHigh {
    fn reset(pool: &MemPool<'_>) -> Result<()> {
        if let Some(n) = &pool.core().native {
            return Ok(n.set_attr(Self::ID, 0)?);
        }
        pool.reset_high_marks(true, false);
        Ok(())
    }
}
