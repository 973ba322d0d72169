//! The free ring: typed frees handed to the pool without taking its lock.
//!
//! Dropping a `PoolAlloc` pushes `(block, offset, size, stream, position)` here — one
//! compare-and-swap — instead of locking the pool. Two consumers take entries out:
//!
//! * **the pool's lock**: whoever locks the pool's state first hands every entry pushed so
//!   far to the engine, in push order ([`FreeRing::drain`]), so anything that observes or
//!   changes the engine — an allocation that searches it, stats, trim, the release threshold,
//!   a snapshot — sees those frees done, exactly as if they had been made under the lock;
//! * **an allocation of the same stream and size** ([`FreeRing::pop_only_if`]): when the
//!   ring holds exactly one free and it matches, it is handed out again directly — what the
//!   engine's search would do (it serves the most recent exact fit on the requesting stream
//!   first), without the lock. With more frees waiting the allocation takes the lock, so
//!   that placement stays the engine's. Such a pair never reaches the engine; the drain
//!   reports how many there were so the pool's counters stay exact.
//!
//! A bounded multi-producer multi-consumer queue (Dmitry Vyukov's design): slot `i` carries
//! a sequence number; `seq == ticket` means free for the producer of `ticket`, `seq ==
//! ticket + 1` full for its consumer, who then sets `seq = ticket + capacity`. Producers and
//! consumers claim tickets with one compare-and-swap each; the entry's fields are atomics
//! written and read between the two sequence updates (release / acquire), so the ring needs
//! no `unsafe`. loom models it (`tests/loom.rs`).

use crate::engine::{BlockId, FreeTag, StreamSlot};
use crate::sync::atomic::{AtomicU64, Ordering};

/// Entries a pool's ring holds; a free that finds it full takes the pool's lock instead.
pub const CAPACITY: u64 = 64;

/// One free waiting in the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingedFree {
    /// The engine's (still live) block.
    pub block: BlockId,
    /// Its offset in the pool's range.
    pub offset: u64,
    /// Its size (the rounded size the engine holds).
    pub size: u64,
    /// Stream slot and position of the free.
    pub tag: FreeTag,
}

/// One slot: a sequence number and the entry's fields.
#[derive(Debug)]
struct Slot {
    seq: AtomicU64,
    block: AtomicU64,
    offset: AtomicU64,
    size: AtomicU64,
    stream: AtomicU64,
    pos: AtomicU64,
}

impl Slot {
    /// The entry's fields (the caller has seen its publication through `seq`).
    #[inline]
    fn read(&self) -> RingedFree {
        RingedFree {
            block: BlockId::from_raw(self.block.load(Ordering::Relaxed)),
            offset: self.offset.load(Ordering::Relaxed),
            size: self.size.load(Ordering::Relaxed),
            tag: FreeTag {
                stream: self.stream.load(Ordering::Relaxed) as StreamSlot,
                pos: self.pos.load(Ordering::Relaxed),
            },
        }
    }
}

/// The ring (see the module docs).
#[derive(Debug)]
pub struct FreeRing {
    slots: Box<[Slot]>,
    /// `slots.len() - 1` (a power of two minus one).
    mask: u64,
    /// Next ticket to consume.
    head: AtomicU64,
    /// Next ticket to produce.
    tail: AtomicU64,
    /// The ordering that publishes an entry (`Release`; the loom model plants `Relaxed` to
    /// show that it catches the race).
    #[cfg(loom)]
    publish: Ordering,
}

impl Default for FreeRing {
    fn default() -> Self {
        FreeRing::new()
    }
}

impl FreeRing {
    /// An empty ring of [`CAPACITY`] slots.
    pub fn new() -> FreeRing {
        FreeRing::with_capacity(CAPACITY)
    }

    /// An empty ring of `capacity` slots (a power of two ≥ 2; the loom model uses 2).
    ///
    /// # Panics
    /// A capacity that is not a power of two ≥ 2.
    pub fn with_capacity(capacity: u64) -> FreeRing {
        assert!(capacity >= 2 && capacity.is_power_of_two(), "ring capacity {capacity}");
        let slots = (0..capacity)
            .map(|i| Slot {
                seq: AtomicU64::new(i),
                block: AtomicU64::new(0),
                offset: AtomicU64::new(0),
                size: AtomicU64::new(0),
                stream: AtomicU64::new(0),
                pos: AtomicU64::new(0),
            })
            .collect();
        FreeRing {
            slots,
            mask: capacity - 1,
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            #[cfg(loom)]
            publish: Ordering::Release,
        }
    }

    /// The loom model's planted bug: entries published with `Relaxed`.
    #[cfg(loom)]
    pub fn with_relaxed_publication(capacity: u64) -> FreeRing {
        FreeRing { publish: Ordering::Relaxed, ..FreeRing::with_capacity(capacity) }
    }

    #[cfg(loom)]
    fn publish_order(&self) -> Ordering {
        self.publish
    }

    #[cfg(not(loom))]
    #[inline]
    fn publish_order(&self) -> Ordering {
        Ordering::Release
    }

    #[inline]
    fn slot(&self, ticket: u64) -> &Slot {
        &self.slots[(ticket & self.mask) as usize]
    }

    /// Pushes `e`; gives it back when the ring is full.
    ///
    /// # Errors
    /// The entry itself, when every slot is taken.
    #[inline]
    pub fn push(&self, e: RingedFree) -> Result<(), RingedFree> {
        let mut t = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = self.slot(t);
            let seq = slot.seq.load(Ordering::Acquire);
            if seq == t {
                match self.tail.compare_exchange_weak(
                    t,
                    t + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        slot.block.store(e.block.to_raw(), Ordering::Relaxed);
                        slot.offset.store(e.offset, Ordering::Relaxed);
                        slot.size.store(e.size, Ordering::Relaxed);
                        slot.stream.store(u64::from(e.tag.stream), Ordering::Relaxed);
                        slot.pos.store(e.tag.pos, Ordering::Relaxed);
                        slot.seq.store(t + 1, self.publish_order());
                        return Ok(());
                    }
                    Err(current) => t = current,
                }
            } else if seq < t {
                // The slot still holds the entry of ticket `t - capacity`: full.
                return Err(e);
            } else {
                t = self.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// Takes the oldest entry if it is published and `accept` says yes. `None` when the ring
    /// is empty, its oldest entry is still being written, or `accept` refused it.
    #[inline]
    pub fn pop_if(&self, accept: impl Fn(&RingedFree) -> bool) -> Option<RingedFree> {
        let mut h = self.head.load(Ordering::Relaxed);
        loop {
            let slot = self.slot(h);
            let seq = slot.seq.load(Ordering::Acquire);
            if seq == h + 1 {
                // Published. The fields belong to ticket `h` unless another consumer takes
                // `h` first, in which case the compare-and-swap below fails.
                let e = slot.read();
                if !accept(&e) {
                    // Torn by a concurrent consumer at worst: the caller takes its slow path.
                    return None;
                }
                match self.head.compare_exchange_weak(
                    h,
                    h + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        slot.seq.store(h + self.mask + 1, Ordering::Release);
                        return Some(e);
                    }
                    Err(current) => h = current,
                }
            } else if seq < h + 1 {
                // Not published: empty, or its producer is between claim and publication.
                return None;
            } else {
                h = self.head.load(Ordering::Relaxed);
            }
        }
    }

    /// Takes the ring's only entry if `accept` says yes: `None` unless exactly one entry is
    /// published and none is being written. The entry is then both the oldest and the newest
    /// free, the one the engine's last-in-first-out search would return for an exact fit.
    #[inline]
    pub fn pop_only_if(&self, accept: impl Fn(&RingedFree) -> bool) -> Option<RingedFree> {
        let tail = self.tail.load(Ordering::Acquire);
        let head = self.head.load(Ordering::Relaxed);
        if tail != head + 1 {
            return None;
        }
        // A pop between the loads and the claim makes the claim fail (`pop_ticket_if` claims
        // `head` only); a push in between merely makes the entry not the only one any more.
        self.pop_ticket_if(head, accept)
    }

    /// [`pop_if`](Self::pop_if) of ticket `h` only.
    #[inline]
    fn pop_ticket_if(&self, h: u64, accept: impl Fn(&RingedFree) -> bool) -> Option<RingedFree> {
        let slot = self.slot(h);
        if slot.seq.load(Ordering::Acquire) != h + 1 {
            return None;
        }
        let e = slot.read();
        if !accept(&e) {
            return None;
        }
        self.head.compare_exchange(h, h + 1, Ordering::Relaxed, Ordering::Relaxed).ok()?;
        slot.seq.store(h + self.mask + 1, Ordering::Release);
        Some(e)
    }

    /// Tickets consumed so far (by [`pop_if`](Self::pop_if) and [`drain`](Self::drain)).
    #[inline]
    pub fn consumed(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// Tickets produced so far (claimed by [`push`](Self::push)).
    #[inline]
    pub fn produced(&self) -> u64 {
        self.tail.load(Ordering::Acquire)
    }

    /// Takes every entry whose push was claimed before the call, in ticket order, passing
    /// each to `f`; returns how many it took. Entries a concurrent [`pop_if`](Self::pop_if)
    /// takes are skipped. A producer that claimed a ticket but has not published it yet is
    /// waited for (it is a few stores away), so every push that *returned* before the call
    /// is in the result — a thread that dropped an allocation and then asks the pool for its
    /// stats sees its own free.
    pub fn drain(&self, mut f: impl FnMut(RingedFree)) -> u64 {
        let end = self.tail.load(Ordering::Acquire);
        let mut taken = 0;
        let mut spins = 0u32;
        while self.head.load(Ordering::Relaxed) < end {
            match self.pop_if(|_| true) {
                Some(e) => {
                    f(e);
                    taken += 1;
                    spins = 0;
                }
                None => {
                    spins += 1;
                    if spins < 64 {
                        crate::sync::spin_loop();
                    } else {
                        crate::sync::yield_now();
                    }
                }
            }
        }
        taken
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Entry `n`: block word `n + 1` (0 names no block, see `BlockId::from_raw`).
    fn entry(n: u64) -> RingedFree {
        RingedFree {
            block: BlockId::from_raw(n + 1),
            offset: n * 512,
            size: 512,
            tag: FreeTag { stream: (n % 3) as StreamSlot, pos: n + 100 },
        }
    }

    #[test]
    fn fifo_full_and_wrap_around() {
        let r = FreeRing::new();
        for lap in 0..3 {
            for i in 0..CAPACITY {
                r.push(entry(lap * 1000 + i)).unwrap();
            }
            assert_eq!(r.push(entry(9)), Err(entry(9)), "full");
            for i in 0..CAPACITY {
                assert_eq!(r.pop_if(|_| true), Some(entry(lap * 1000 + i)));
            }
            assert_eq!(r.pop_if(|_| true), None, "empty");
        }
        assert_eq!(r.consumed(), 3 * CAPACITY);
        assert_eq!(r.produced(), 3 * CAPACITY);
    }

    #[test]
    fn pop_if_only_takes_an_accepted_head() {
        let r = FreeRing::new();
        r.push(entry(1)).unwrap();
        r.push(entry(2)).unwrap();
        assert_eq!(r.pop_if(|e| e.tag.stream == 2), None, "the head is entry 1");
        assert_eq!(r.pop_if(|e| e.tag.stream == 1), Some(entry(1)));
        let mut seen = Vec::new();
        assert_eq!(r.drain(|e| seen.push(e)), 1);
        assert_eq!(seen, [entry(2)]);
        assert_eq!(r.drain(|_| unreachable!()), 0);
    }

    #[test]
    fn pop_only_if_needs_a_single_entry() {
        let r = FreeRing::new();
        assert_eq!(r.pop_only_if(|_| true), None, "empty");
        r.push(entry(1)).unwrap();
        r.push(entry(2)).unwrap();
        assert_eq!(r.pop_only_if(|_| true), None, "two entries");
        assert_eq!(r.pop_if(|_| true), Some(entry(1)));
        assert_eq!(r.pop_only_if(|e| e.tag.stream == 0), None, "refused");
        assert_eq!(r.pop_only_if(|e| e.tag.stream == 2), Some(entry(2)));
        assert_eq!(r.pop_only_if(|_| true), None);
    }

    /// Producers and consumers on threads: every entry is taken exactly once.
    #[test]
    fn concurrent_producers_and_consumers_take_each_entry_once() {
        use std::sync::Mutex;
        let r = FreeRing::new();
        let taken = Mutex::new(Vec::new());
        let per_thread = 20_000u64;
        std::thread::scope(|s| {
            for p in 0..2u64 {
                let r = &r;
                let taken = &taken;
                s.spawn(move || {
                    for i in 0..per_thread {
                        let mut e = entry(p * per_thread + i);
                        loop {
                            match r.push(e) {
                                Ok(()) => break,
                                Err(back) => {
                                    // full: take something ourselves, as a free would
                                    e = back;
                                    if let Some(x) = r.pop_if(|_| true) {
                                        taken.lock().unwrap().push(x.block.to_raw());
                                    }
                                }
                            }
                        }
                    }
                });
            }
            // a "bypass" consumer and a "drainer"
            let r2 = &r;
            let taken2 = &taken;
            s.spawn(move || {
                for i in 0..per_thread {
                    let x = if i % 2 == 0 {
                        r2.pop_if(|e| e.tag.stream == 1)
                    } else {
                        r2.pop_only_if(|e| e.tag.stream == 1)
                    };
                    if let Some(x) = x {
                        taken2.lock().unwrap().push(x.block.to_raw());
                    }
                }
            });
            let r3 = &r;
            let taken3 = &taken;
            s.spawn(move || {
                for _ in 0..200 {
                    r3.drain(|x| taken3.lock().unwrap().push(x.block.to_raw()));
                }
            });
        });
        r.drain(|x| taken.lock().unwrap().push(x.block.to_raw()));
        let mut all = taken.into_inner().unwrap();
        all.sort_unstable();
        let expect: Vec<u64> = (1..=2 * per_thread).collect();
        assert_eq!(all, expect);
    }
}
