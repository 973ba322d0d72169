//! Stream order as the engine sees it: stream slots, the tag of a free, the bounds under
//! which another stream's frees are eligible, and the reuse rule each bound stands for.

/// Index of a stream slot on a device (small, dense, recycled after the stream is dropped;
/// positions of a slot stay monotonic across its incarnations).
pub type StreamSlot = u32;

/// Which rule justified handing a cached block to a request.
///
/// With the `serde` feature it serializes as its name in snake case: `same_stream`,
/// `event_dependency`, `opportunistic`, `internal_dependency`, `host_synchronized`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
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

impl ReuseKind {
    /// All kinds, in declaration order (the order of
    /// [`EngineStats::reuses`](crate::EngineStats::reuses)).
    pub const ALL: [ReuseKind; 5] = [
        ReuseKind::SameStream,
        ReuseKind::EventDependency,
        ReuseKind::Opportunistic,
        ReuseKind::InternalDependency,
        ReuseKind::HostSynchronized,
    ];

    /// Index of this kind in [`EngineStats::reuses`](crate::EngineStats::reuses).
    pub const fn index(self) -> usize {
        self as usize
    }
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

    /// What every stream knows of stream `s`'s frees: [`Eligibility::host_observed`], and
    /// [`Eligibility::completed`] when rule 3 is on; `event` is 0. Settling asks it, of the
    /// requesting stream too (unlike [`StreamOrder::eligibility`]): below these bounds a
    /// free may serve every stream. The default asks `eligibility`, which suits an order
    /// without a requesting stream.
    fn completion(&self, s: StreamSlot) -> Eligibility {
        Eligibility { event: 0, ..self.eligibility(s) }
    }
}

/// The rule under which a block freed at `pos` is eligible, in the documented order.
#[inline]
pub(crate) fn kind_for(pos: u64, e: &Eligibility) -> Option<ReuseKind> {
    if pos < e.host_observed {
        Some(ReuseKind::HostSynchronized)
    } else if pos < e.event {
        Some(ReuseKind::EventDependency)
    } else if pos < e.completed {
        Some(ReuseKind::Opportunistic)
    } else {
        None
    }
}

/// The largest bound of an eligibility (0: nothing eligible).
#[inline]
pub(crate) fn bound_of(e: &Eligibility) -> u64 {
    e.host_observed.max(e.event).max(e.completed)
}
