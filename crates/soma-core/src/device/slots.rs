//! Stream slots: what the device knows of the stream in each slot, and the protocol that
//! publishes the host's knowledge of completed work.
//!
//! A stream holds one slot while it lives. Positions in a slot are global across the streams
//! that hold it in turn: each new stream (an *incarnation*) starts at a `base` one past the
//! last position of the stream before it, so a free's `(slot, position)` tag never names
//! another stream's work.
//!
//! Two facts tell that a free at position `p` of slot `s` has completed on the device:
//!
//! * the **host-observed bound**: the host saw every task of `s` below it complete (a
//!   stream, event or device synchronisation, a successful query, or the stream was dropped
//!   after draining). It is published with `fetch_max(AcqRel)`, so it only grows whatever
//!   the order of concurrent observers, and read with `Acquire`: the device's writes before
//!   the free happen-before what the reader then does with the block;
//! * the live stream's **completed** counter (the backend's, offset by the incarnation's
//!   base), which the opportunistic reuse rule reads.
//!
//! Detaching a drained stream clears the live stream first and then raises the bound past
//! its last position; the next stream attached to the slot counts from there, so a free of
//! the new incarnation never looks complete because of the old one.
//!
//! The atomics and locks come from `crate::sync`, and the live stream's counter is a type
//! parameter ([`Progress`]), so that the loom model (`tests/loom.rs`) runs this code.

use crate::engine::StreamSlot;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::Mutex;

/// What the slot protocol reads of a live stream.
pub trait Progress: Clone {
    /// How many of the stream's tasks the device has completed (counted from 0 for each
    /// stream, not from the slot's base).
    fn completed(&self) -> u64;

    /// The host observed the stream's tasks up to `position` (counted as `completed`)
    /// complete: for a backend that caches completion.
    fn note_completed(&self, position: u64);
}

/// A live stream as the device sees it.
#[derive(Clone, Debug)]
pub struct LiveStream<H> {
    /// The stream's backend (its progress).
    pub hal: H,
    /// Global position of the slot = `base + backend position`; monotonic across
    /// incarnations.
    pub base: u64,
}

impl<H: Progress> LiveStream<H> {
    /// The global position the stream's completed work reaches (`base` plus the backend's
    /// completed count): a free at a position up to it has completed.
    #[inline]
    pub fn completed(&self) -> u64 {
        self.base + self.hal.completed()
    }
}

/// What one slot knows about its current (or last) stream.
struct SlotState<H> {
    /// Frees on this slot with a global position below this bound were observed complete by
    /// the host.
    observed: AtomicU64,
    /// The live stream in this slot, if any.
    live: Mutex<Option<LiveStream<H>>>,
}

/// Which slots are free, and where each slot's next incarnation starts.
struct Allocator {
    free: Vec<StreamSlot>,
    next_unused: StreamSlot,
    /// Base of the next incarnation of each slot that has been used.
    next_base: Vec<u64>,
}

/// The stream slots of one device.
pub struct Slots<H> {
    slots: Box<[SlotState<H>]>,
    allocator: Mutex<Allocator>,
    /// The loom model's planted bug: the bound published and read with `Relaxed`.
    #[cfg(loom)]
    relaxed: bool,
}

impl<H: Progress> Slots<H> {
    /// `count` slots, none taken, every bound 0.
    pub fn new(count: usize) -> Slots<H> {
        let slots = (0..count)
            .map(|_| SlotState { observed: AtomicU64::new(0), live: Mutex::new(None) })
            .collect();
        Slots {
            slots,
            allocator: Mutex::new(Allocator {
                free: Vec::new(),
                next_unused: 0,
                next_base: Vec::new(),
            }),
            #[cfg(loom)]
            relaxed: false,
        }
    }

    /// [`Slots::new`] with the host-observed bound published and read with `Relaxed`: the
    /// loom model checks that it catches the race this opens.
    #[cfg(loom)]
    pub fn with_relaxed_publication(count: usize) -> Slots<H> {
        Slots { relaxed: true, ..Slots::new(count) }
    }

    #[cfg(loom)]
    fn publish_order(&self) -> Ordering {
        if self.relaxed {
            Ordering::Relaxed
        } else {
            Ordering::AcqRel
        }
    }

    #[cfg(loom)]
    fn read_order(&self) -> Ordering {
        if self.relaxed {
            Ordering::Relaxed
        } else {
            Ordering::Acquire
        }
    }

    #[cfg(not(loom))]
    #[inline]
    fn publish_order(&self) -> Ordering {
        Ordering::AcqRel
    }

    #[cfg(not(loom))]
    #[inline]
    fn read_order(&self) -> Ordering {
        Ordering::Acquire
    }

    #[inline]
    fn slot(&self, slot: StreamSlot) -> &SlotState<H> {
        &self.slots[slot as usize]
    }

    /// How many slots there are.
    pub fn count(&self) -> usize {
        self.slots.len()
    }

    /// Whether a stream can be attached (a slot is free or was never used).
    pub fn has_room(&self) -> bool {
        let alloc = self.allocator.lock();
        !alloc.free.is_empty() || (alloc.next_unused as usize) < self.slots.len()
    }

    /// How many streams are attached.
    pub fn live_count(&self) -> usize {
        let alloc = self.allocator.lock();
        alloc.next_unused as usize - alloc.free.len()
    }

    /// Attaches a new stream: its slot and base (one past the last position of the slot's
    /// previous stream), or `None` when every slot is taken.
    pub fn attach(&self, hal: H) -> Option<(StreamSlot, u64)> {
        let mut alloc = self.allocator.lock();
        let slot = match alloc.free.pop() {
            Some(s) => s,
            None if (alloc.next_unused as usize) < self.slots.len() => {
                alloc.next_unused += 1;
                alloc.next_base.push(0);
                alloc.next_unused - 1
            }
            None => return None,
        };
        let base = alloc.next_base[slot as usize];
        *self.slot(slot).live.lock() = Some(LiveStream { hal, base });
        Some((slot, base))
    }

    /// Detaches the stream of `slot`, which has drained (everything it enqueued, up to global
    /// position `final_global`, is complete): the slot's bound passes that position and the
    /// slot's next stream starts after it.
    pub fn detach(&self, slot: StreamSlot, final_global: u64) {
        let mut alloc = self.allocator.lock();
        *self.slot(slot).live.lock() = None;
        self.observe(slot, final_global + 1);
        alloc.next_base[slot as usize] = final_global + 1;
        alloc.free.push(slot);
    }

    /// Records that the host observed completion of the slot's work below global `bound`.
    pub fn observe(&self, slot: StreamSlot, bound: u64) {
        let before = self.slot(slot).observed.fetch_max(bound, self.publish_order());
        if bound > before {
            // Tell the backend too: one that caches completion (the ascend backend checks
            // unmaps against it) would otherwise ask the driver, which knows only "not idle".
            if let Some(live) = self.live(slot) {
                if let Some(done) = bound.checked_sub(1).and_then(|d| d.checked_sub(live.base)) {
                    live.hal.note_completed(done);
                }
            }
        }
    }

    /// The host-observed bound of `slot`.
    #[inline]
    pub fn host_observed(&self, slot: StreamSlot) -> u64 {
        self.slot(slot).observed.load(self.read_order())
    }

    /// The live stream in `slot`, if any.
    #[inline]
    pub fn live(&self, slot: StreamSlot) -> Option<LiveStream<H>> {
        self.slot(slot).live.lock().clone()
    }

    /// Whether a stream occupies `slot`.
    pub fn is_live(&self, slot: StreamSlot) -> bool {
        self.slot(slot).live.lock().is_some()
    }

    /// One past the last position of `slot` the device has completed, by the live stream's
    /// counter (0 without a live stream).
    #[inline]
    pub fn completed_bound(&self, slot: StreamSlot) -> u64 {
        self.live(slot).map_or(0, |l| l.completed() + 1)
    }

    /// Whether a free at global position `pos` of `slot` has completed: below the
    /// host-observed bound, or completed by the live stream's counter.
    #[inline]
    pub fn is_complete(&self, slot: StreamSlot, pos: u64) -> bool {
        if pos < self.host_observed(slot) {
            return true;
        }
        self.live(slot).is_some_and(|l| pos <= l.completed())
    }
}
