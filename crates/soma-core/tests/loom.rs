//! loom models of soma-core's lock-free protocol: the per-slot **host-observed bound**.
//!
//! `DeviceShared::observe` publishes "the host saw every task of slot `s` below global
//! position `b` complete" with `observed.fetch_max(b, AcqRel)` (after `Stream::synchronize`,
//! `Event::synchronize`, `Device::synchronize`, a successful query, or when a dropped stream
//! drains and its slot is detached). The pool consumes it with `observed.load(Acquire)` in
//! `Order::eligibility` / `Order::is_complete` and then hands the block to another stream,
//! or unmaps it. The opportunistic rule instead reads the stream's `completed()` counter,
//! which the software NPU's worker stores after running a task.
//!
//! What must hold, and what these models check on every interleaving loom explores:
//!
//! 1. when the consumer sees a bound above a free's position, every write the device made to
//!    the block before the free happens-before the new owner's writes (no data race on the
//!    block, modelled as a `loom::cell::UnsafeCell`);
//! 2. the bound only grows, whatever the order of concurrent observers;
//! 3. detaching a drained stream and attaching a new stream to the same slot never makes a
//!    free of the *new* incarnation look complete, and a stale tag of the old incarnation is
//!    complete only with the old writes visible.
//!
//! The models mirror the code in `src/device.rs` and `src/pool/mod.rs` (`Order`) with loom's
//! types; soma-core itself does not switch to loom types, so a change to the protocol there
//! must be mirrored here. `relaxed_publication_is_caught` shows the model is sensitive: with
//! `Relaxed` instead of `AcqRel`/`Acquire`, loom reports the race.
//!
//! Run (own target dir: `--cfg loom` rebuilds every dependency):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test -p soma-core --release --test loom
//! ```
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

/// A stream slot as the protocol sees it: the worker's completed counter, the host-observed
/// bound, the live incarnation (its base) and one block of device memory.
struct Slot {
    /// `StreamHal::completed()` of the first incarnation (stored by the device's worker).
    completed: Arc<AtomicU64>,
    /// `SlotState::observed`.
    observed: AtomicU64,
    /// `SlotState::live`: the live incarnation's base and completed counter, if any.
    live: Mutex<Option<(u64, Arc<AtomicU64>)>>,
    /// The block freed at position 1 of the first incarnation.
    block: UnsafeCell<u64>,
}

impl Slot {
    fn new() -> Arc<Slot> {
        let completed = Arc::new(AtomicU64::new(0));
        Arc::new(Slot {
            completed: Arc::clone(&completed),
            observed: AtomicU64::new(0),
            live: Mutex::new(Some((0, completed))),
            block: UnsafeCell::new(0),
        })
    }

    /// The device's worker runs task 1 (the last use of the block), then counts it complete.
    fn run_task_1(&self, order: Ordering) {
        // SAFETY: a valid, exclusive pointer unless loom finds a concurrent access (the test).
        self.block.with_mut(|p| unsafe { *p = 1 });
        self.completed.store(1, order);
    }

    /// `Stream::synchronize`: read the enqueued position, wait for the device, publish.
    fn synchronize(&self, enqueued: u64, publish: Ordering) {
        while self.completed.load(Ordering::Acquire) < enqueued {
            thread::yield_now();
        }
        self.observed.fetch_max(enqueued + 1, publish);
    }

    /// `Order::is_complete` for a free at global position `pos`.
    fn is_complete(&self, pos: u64, load: Ordering) -> bool {
        if pos < self.observed.load(load) {
            return true;
        }
        let live = self.live.lock().unwrap().clone();
        live.is_some_and(|(base, completed)| pos <= base + completed.load(Ordering::Acquire))
    }

    /// The new owner of the block writes it (on another stream, ordered after the check).
    fn reuse(&self) {
        // SAFETY: as in `run_task_1`: loom checks the exclusivity this relies on.
        self.block.with_mut(|p| unsafe { *p = 2 });
    }
}

/// Property 1 through the host-observed bound (`Stream::synchronize` on one thread, an
/// allocation on another).
#[test]
fn host_observed_bound_publishes_the_device_writes() {
    loom::model(|| {
        let slot = Slot::new();
        let worker = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || slot.run_task_1(Ordering::SeqCst))
        };
        let host_sync = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || slot.synchronize(1, Ordering::AcqRel))
        };
        // The allocating thread: host-observed eligibility only (no opportunistic read).
        if 1 < slot.observed.load(Ordering::Acquire) {
            slot.reuse();
        }
        worker.join().unwrap();
        host_sync.join().unwrap();
        assert_eq!(slot.observed.load(Ordering::Relaxed), 2);
    });
}

/// Property 1 through the opportunistic rule: the allocating thread reads `completed`.
#[test]
fn completed_counter_publishes_the_device_writes() {
    loom::model(|| {
        let slot = Slot::new();
        let worker = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || slot.run_task_1(Ordering::SeqCst))
        };
        if slot.is_complete(1, Ordering::Acquire) {
            slot.reuse();
        }
        worker.join().unwrap();
    });
}

/// Property 2: concurrent observers (two synchronisations, an event synchronize) leave the
/// maximum, and a reader never sees the bound go down.
#[test]
fn the_bound_only_grows() {
    loom::model(|| {
        let observed = Arc::new(AtomicU64::new(0));
        let a = {
            let o = Arc::clone(&observed);
            thread::spawn(move || o.fetch_max(5, Ordering::AcqRel))
        };
        let b = {
            let o = Arc::clone(&observed);
            thread::spawn(move || o.fetch_max(3, Ordering::AcqRel))
        };
        let first = observed.load(Ordering::Acquire);
        let second = observed.load(Ordering::Acquire);
        assert!(second >= first, "the bound went down: {first} -> {second}");
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(observed.load(Ordering::Acquire), 5);
    });
}

/// Property 3: a drained stream is detached (`live = None`, then the bound is raised past its
/// last position) and a new stream attached to the slot with `base = final + 1`, while
/// another thread checks tags of both incarnations.
#[test]
fn slot_recycling_keeps_incarnations_apart() {
    loom::model(|| {
        let slot = Slot::new();
        let worker = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || slot.run_task_1(Ordering::SeqCst))
        };
        let recycle = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || {
                // Drop of the stream: drain (final position 1), detach, then a new stream
                // takes the slot. Its worker has completed nothing yet.
                let final_global = 1;
                while slot.completed.load(Ordering::Acquire) < final_global {
                    thread::yield_now();
                }
                *slot.live.lock().unwrap() = None;
                slot.observed.fetch_max(final_global + 1, Ordering::AcqRel);
                // The new incarnation has its own hal, counting from 0.
                *slot.live.lock().unwrap() = Some((final_global + 1, Arc::new(AtomicU64::new(0))));
            })
        };
        // A free of the old incarnation at position 1 ...
        if slot.is_complete(1, Ordering::Acquire) {
            slot.reuse();
        }
        // ... and one of the new incarnation after its first task (global 2 + 1 = 3), which
        // never completes in this model.
        assert!(
            !slot.is_complete(3, Ordering::Acquire),
            "a pending free of the new stream looked complete"
        );
        worker.join().unwrap();
        recycle.join().unwrap();
    });
}

/// The model is sensitive: publishing and consuming the bound with `Relaxed` loses the
/// happens-before edge from the device's writes to the new owner's, and loom reports it.
#[test]
#[should_panic]
fn relaxed_publication_is_caught() {
    loom::model(|| {
        let slot = Slot::new();
        let worker = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || slot.run_task_1(Ordering::Relaxed))
        };
        let host_sync = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || {
                while slot.completed.load(Ordering::Relaxed) < 1 {
                    thread::yield_now();
                }
                slot.observed.fetch_max(2, Ordering::Relaxed);
            })
        };
        if 1 < slot.observed.load(Ordering::Relaxed) {
            slot.reuse();
        }
        worker.join().unwrap();
        host_sync.join().unwrap();
    });
}
