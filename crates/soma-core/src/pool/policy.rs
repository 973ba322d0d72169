//! What a pool lets callers choose after it is built: the cross-stream reuse rules, the
//! release threshold (both stored in [`Settings`]), and the out-of-memory hook.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, OutOfMemory, Result};

pub(crate) const FOLLOW_EVENT_DEPENDENCIES: u32 = 1 << 0;
pub(crate) const OPPORTUNISTIC: u32 = 1 << 1;
pub(crate) const INTERNAL_DEPENDENCIES: u32 = 1 << 2;

/// What an out-of-memory hook asks the pool to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomAction {
    /// Report the error.
    Fail,
    /// The hook freed memory: try the allocation once more.
    Retry,
}

/// A hook called when an allocation is about to fail with out of memory.
pub type OomHook = Arc<dyn Fn(&OutOfMemory) -> OomAction + Send + Sync>;

/// Which cross-stream reuse rules a pool applies (same-stream reuse is always on).
///
/// See `docs/semantics.md` for the rules; the switches are the C API's attributes 0x1–0x3.
/// Name the switches you set, starting from [`NONE`](Self::NONE), [`ALL`](Self::ALL) or the
/// [default](Self::default) (the setters are `const`):
///
/// ```
/// use soma_core::ReusePolicy;
/// const EVENTS_ONLY: ReusePolicy = ReusePolicy::NONE.follow_event_dependencies(true);
/// assert!(EVENTS_ONLY.follow_event_dependencies && !EVENTS_ONLY.opportunistic);
/// let cautious = ReusePolicy::default().opportunistic(false);
/// assert_eq!(cautious, EVENTS_ONLY);
/// ```
///
/// With the `serde` feature it serializes (in [`OutOfMemory`](crate::OutOfMemory) reports)
/// as an object keyed by the field names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ReusePolicy {
    /// Rule 2: reuse a block freed on stream S on stream T when T waited on an event recorded
    /// on S after the free (directly or through a chain of streams).
    pub follow_event_dependencies: bool,
    /// Rule 3: reuse a block whose free has already completed on the device.
    pub opportunistic: bool,
    /// Rule 4: reuse another stream's block by inserting an event dependency.
    pub internal_dependencies: bool,
}

impl ReusePolicy {
    /// All cross-stream rules off: what CANN's C API starts with.
    pub const NONE: ReusePolicy = ReusePolicy {
        follow_event_dependencies: false,
        opportunistic: false,
        internal_dependencies: false,
    };

    /// All cross-stream rules on.
    pub const ALL: ReusePolicy = ReusePolicy {
        follow_event_dependencies: true,
        opportunistic: true,
        internal_dependencies: true,
    };

    /// A policy from the three switches, in the order of the fields (the named setters
    /// below cannot be swapped by mistake).
    pub const fn new(
        follow_event_dependencies: bool,
        opportunistic: bool,
        internal_dependencies: bool,
    ) -> Self {
        ReusePolicy { follow_event_dependencies, opportunistic, internal_dependencies }
    }

    /// This policy with rule 2, following event dependencies, switched `on` or off.
    #[must_use]
    pub const fn follow_event_dependencies(self, on: bool) -> Self {
        ReusePolicy { follow_event_dependencies: on, ..self }
    }

    /// This policy with rule 3, opportunistic reuse, switched `on` or off.
    #[must_use]
    pub const fn opportunistic(self, on: bool) -> Self {
        ReusePolicy { opportunistic: on, ..self }
    }

    /// This policy with rule 4, internal dependencies, switched `on` or off.
    #[must_use]
    pub const fn internal_dependencies(self, on: bool) -> Self {
        ReusePolicy { internal_dependencies: on, ..self }
    }

    fn bits(self) -> u32 {
        let bit = |on: bool, bit: u32| if on { bit } else { 0 };
        bit(self.follow_event_dependencies, FOLLOW_EVENT_DEPENDENCIES)
            | bit(self.opportunistic, OPPORTUNISTIC)
            | bit(self.internal_dependencies, INTERNAL_DEPENDENCIES)
    }

    fn from_bits(bits: u32) -> Self {
        ReusePolicy {
            follow_event_dependencies: bits & FOLLOW_EVENT_DEPENDENCIES != 0,
            opportunistic: bits & OPPORTUNISTIC != 0,
            internal_dependencies: bits & INTERNAL_DEPENDENCIES != 0,
        }
    }
}

impl Default for ReusePolicy {
    /// The Rust default: follow event dependencies and opportunistic reuse on (both free of
    /// hidden synchronisation), internal dependencies off (they add waits the program did not
    /// ask for).
    fn default() -> Self {
        ReusePolicy {
            follow_event_dependencies: true,
            opportunistic: true,
            internal_dependencies: false,
        }
    }
}

/// The reuse switches and the release threshold of a pool, which every shard reads (and
/// which may be set through any of them).
pub(crate) struct Settings {
    reuse: AtomicU32,
    release_threshold: AtomicU64,
}

impl Settings {
    pub(crate) fn new(reuse: ReusePolicy, release_threshold: u64) -> Settings {
        Settings {
            reuse: AtomicU32::new(reuse.bits()),
            release_threshold: AtomicU64::new(release_threshold),
        }
    }

    /// The reuse switches as the bits the stream order reads.
    #[inline]
    pub(crate) fn reuse_bits(&self) -> u32 {
        self.reuse.load(Ordering::Relaxed)
    }

    pub(crate) fn reuse_policy(&self) -> ReusePolicy {
        ReusePolicy::from_bits(self.reuse_bits())
    }

    pub(crate) fn set_reuse_policy(&self, policy: ReusePolicy) {
        self.reuse.store(policy.bits(), Ordering::Relaxed);
    }

    pub(crate) fn reuse_flag(&self, bit: u32) -> bool {
        self.reuse_bits() & bit != 0
    }

    pub(crate) fn set_reuse_flag(&self, bit: u32, on: bool) {
        if on {
            self.reuse.fetch_or(bit, Ordering::Relaxed);
        } else {
            self.reuse.fetch_and(!bit, Ordering::Relaxed);
        }
    }

    pub(crate) fn release_threshold(&self) -> u64 {
        self.release_threshold.load(Ordering::Relaxed)
    }

    /// Sets the threshold, which may not exceed the pool's `max_size`.
    pub(crate) fn set_release_threshold(&self, bytes: u64, max_size: u64) -> Result<()> {
        if bytes > max_size {
            return Err(Error::InvalidArgument(format!(
                "release threshold {bytes} exceeds the pool's max size {max_size}"
            )));
        }
        self.release_threshold.store(bytes, Ordering::Relaxed);
        Ok(())
    }
}
