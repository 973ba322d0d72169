//! The pool engine's bookkeeping: pure, safe Rust over an offset space, testable without a
//! device (see DESIGN.md §4).
//!
//! INTERFACE SKETCH — to be implemented. The typed layer (`crate::pool`) owns one `Engine`
//! per pool behind a mutex and talks to the device only through the [`Backing`] it passes in.

use smallvec::SmallVec;

/// Index of a stream slot on a device (small, dense, recycled after the stream is dropped;
/// positions of a slot stay monotonic across its incarnations).
pub type StreamSlot = u32;

/// Which rule justified handing a cached block to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReuseKind {
    /// Rule 1: the block was freed on the requesting stream.
    SameStream,
    /// Rule 2: the requesting stream is ordered after the free through events.
    EventDependency,
    /// Rule 3: the free had already completed on the device.
    Opportunistic,
    /// Rule 4: the pool inserted an event dependency (the caller must make it real).
    InternalDependency,
    /// The host observed completion of the free (a synchronize, or the stream was dropped).
    HostSynchronized,
}

/// Where a freed block stands in stream order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreeTag {
    /// Stream the block was freed on.
    pub stream: StreamSlot,
    /// Tasks enqueued on that stream before the free.
    pub pos: u64,
}

/// Bounds, per other stream, under which that stream's cached blocks are eligible for the
/// requesting stream. A block freed on `s` at position `pos` is eligible when `pos < bound`.
/// A bound of 0 means "none by this rule".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Eligibility {
    /// Host observed completion (synchronize, event synchronize, stream dropped): always on.
    pub host_observed: u64,
    /// Rule 2 (follow event dependencies): the requesting stream's vector-clock entry for `s`
    /// (0 when the switch is off).
    pub event: u64,
    /// Rule 3 (opportunistic): `completed(s) + 1` (0 when the switch is off).
    pub completed: u64,
}

/// What the engine needs to know about stream order for one request or release.
pub trait StreamOrder {
    /// Eligibility bounds for blocks cached on stream `s` (never called for the requesting
    /// stream itself).
    fn eligibility(&self, s: StreamSlot) -> Eligibility;
    /// Rule 4: may the engine take any other stream's block, returning the dependency for the
    /// caller to insert?
    fn internal_dependencies(&self) -> bool;
    /// Whether the free `tag` has completed on the device (used before unmapping: memory that
    /// in-flight work may still touch is never unmapped).
    fn is_complete(&self, tag: FreeTag) -> bool;
}

/// The physical side, implemented by the pool over the driver HAL (and by fakes in tests).
pub trait Backing {
    /// Maps physical memory at `[offset, offset + size)` of the pool's range; both are
    /// multiples of the granularity. Returns a token the engine hands back to `unmap`.
    fn map(&mut self, offset: u64, size: u64) -> Result<u64, BackingError>;
    /// Unmaps exactly a range previously returned by `map` and frees its physical memory.
    fn unmap(&mut self, offset: u64, size: u64, token: u64) -> Result<(), BackingError>;
}

/// Why the backing could not map or unmap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackingError {
    /// The device has no physical memory left.
    OutOfMemory,
    /// Anything else (injected faults, driver errors); carried as text.
    Failed(String),
}
