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
//! The free ring (`src/pool/free_ring.rs`) is modelled with its own code at the end of this
//! file (`mod free_ring`).
//!
//! Two more models cover the vector-clock side: a stream's clock against its task queue when
//! one thread records an event on the stream while another makes it wait
//! (`a_record_never_claims_a_later_wait`), and `Event::synchronize` against a concurrent
//! re-record (`event_synchronize_publishes_only_what_it_waited_for`). Both found real races
//! (fixed in 5065b6b); the models of the code before the fix are kept as `should_panic` tests.
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

/// The stream's vector clock against its task queue, as `Stream::record_raw`,
/// `Stream::wait_event`, `Event::record_on` and `Event::wait_on` use them.
mod stream_clock {
    use super::*;

    /// A task of the modelled stream `s1`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Task {
        /// Record of event `E`.
        RecordE,
        /// Wait on event `F` (recorded on stream X after a free there).
        WaitF,
    }

    /// Stream `s1`: its queue (the backend) and its clock (entries: stream X's position).
    pub struct S1 {
        pub queue: Mutex<Vec<Task>>,
        pub clock: Mutex<u64>,
    }

    /// `E.recorded` and `F.recorded` (F was recorded on X at position 7).
    pub struct Events {
        pub e: Mutex<Option<u64>>,
        pub f: Mutex<Option<u64>>,
    }

    pub fn setup() -> (Arc<S1>, Arc<Events>) {
        (
            Arc::new(S1 { queue: Mutex::new(Vec::new()), clock: Mutex::new(0) }),
            Arc::new(Events { e: Mutex::new(None), f: Mutex::new(Some(7)) }),
        )
    }

    /// `s1.record(&E)` before 5065b6b: `Event::record_on` locks `E.recorded`, then
    /// `Stream::record_raw` enqueues the record and only then reads the stream's clock.
    pub fn record_before_fix(s1: &S1, ev: &Events) {
        let mut recorded = ev.e.lock().unwrap();
        s1.queue.lock().unwrap().push(Task::RecordE); // hal.record
        let clock = *s1.clock.lock().unwrap(); // self.clock.lock().clone()
        *recorded = Some(clock);
    }

    /// `s1.wait_event(&F)` (unchanged by 5065b6b): `Event::wait_on` enqueues the wait under
    /// `F.recorded`, then the stream joins the clock under its own lock, separately. The
    /// pool's inserted waits (`free_block`, `insert_dependency`) have the same shape.
    pub fn wait_current(s1: &S1, ev: &Events) {
        let clock = {
            let recorded = ev.f.lock().unwrap();
            s1.queue.lock().unwrap().push(Task::WaitF); // hal.wait
            *recorded
        };
        if let Some(c) = clock {
            let mut mine = s1.clock.lock().unwrap();
            *mine = (*mine).max(c);
        }
    }

    /// `s1.record(&E)` since 5065b6b: `record_on` locks `E.recorded`, then `record_raw`
    /// holds the stream's clock lock across the enqueue and the snapshot.
    pub fn record_current(s1: &S1, ev: &Events) {
        let mut recorded = ev.e.lock().unwrap();
        let clock = s1.clock.lock().unwrap();
        s1.queue.lock().unwrap().push(Task::RecordE);
        let snapshot = *clock;
        drop(clock);
        *recorded = Some(snapshot);
    }

    /// The alternative proposed with the first model: the stream's clock lock held across
    /// "enqueue + clock update" in both, taken before the event's lock.
    pub fn record_fixed(s1: &S1, ev: &Events) {
        let clock = s1.clock.lock().unwrap();
        let mut recorded = ev.e.lock().unwrap();
        s1.queue.lock().unwrap().push(Task::RecordE);
        *recorded = Some(*clock);
    }

    pub fn wait_fixed(s1: &S1, ev: &Events) {
        let mut mine = s1.clock.lock().unwrap();
        let recorded = ev.f.lock().unwrap();
        s1.queue.lock().unwrap().push(Task::WaitF);
        if let Some(c) = *recorded {
            *mine = (*mine).max(c);
        }
    }

    /// What a stream that waits on `E` may believe: E's clock claims "ordered after X's
    /// position 7" only if the record of E comes after the wait on F in s1's queue.
    pub fn check(s1: &S1, ev: &Events) {
        let queue = s1.queue.lock().unwrap().clone();
        let claims_x = ev.e.lock().unwrap().is_some_and(|c| c >= 7);
        let record_after_wait = queue == [Task::WaitF, Task::RecordE];
        assert!(
            !claims_x || record_after_wait,
            "E's clock claims X:7 but s1's queue is {queue:?}: a stream waiting on E would \
             reuse X's pending frees while not ordered after them"
        );
    }

    pub fn run(record: fn(&S1, &Events), wait: fn(&S1, &Events)) {
        loom::model(move || {
            let (s1, ev) = setup();
            let a = {
                let (s1, ev) = (Arc::clone(&s1), Arc::clone(&ev));
                thread::spawn(move || record(&s1, &ev))
            };
            wait(&s1, &ev);
            a.join().unwrap();
            check(&s1, &ev);
        });
    }
}

/// Two host threads use one stream: one records an event on it, the other makes it wait on
/// an event of stream X. If the record is enqueued first but reads the stream's clock after
/// the wait joined X's clock, the event claims an ordering the device does not have, and a
/// stream waiting on it may be handed X's memory while X still uses it (rule 2).
///
/// This was a bug until 5065b6b; the model of the code before it must fail (`should_panic`),
/// the model of the current code must pass.
#[test]
#[should_panic(expected = "E's clock claims X:7")]
fn a_record_claimed_a_later_wait_before_the_fix() {
    stream_clock::run(stream_clock::record_before_fix, stream_clock::wait_current);
}

/// The current `record_raw` (clock lock spanning the enqueue) with the current `wait_event`.
#[test]
fn a_record_never_claims_a_later_wait() {
    stream_clock::run(stream_clock::record_current, stream_clock::wait_current);
}

/// The proposed fix (stream clock lock held across enqueue and clock update, taken before the
/// event's lock) is sound and deadlock-free in the model.
#[test]
fn fixed_record_and_wait_keep_clock_and_queue_in_step() {
    stream_clock::run(stream_clock::record_fixed, stream_clock::wait_fixed);
}

/// `Event::synchronize` (and `Event::query`) read the event's clock, release its lock, then
/// ask the backend to wait for the event's *latest* record. If another thread re-records the
/// event on a second stream in between, the host waits for the new record; publishing the
/// old record's clock as host-observed would make the first stream's pending frees reusable
/// by every stream while it still runs. Since 5065b6b records carry a generation and the
/// clock is published only if the generation is unchanged after the wait.
///
/// Model: `E` is recorded on `s1`, whose work never completes here; a thread re-records it on
/// `s2` (complete) while another synchronizes it. Returns what the synchronizing thread
/// published (`None`: nothing, or it would still be waiting for s1).
fn event_sync_model(check_generation: bool) {
    loom::model(move || {
        // (generation, clock's stream) of the latest record, and the backend's latest record.
        let recorded = Arc::new(Mutex::new((1u64, 1u8)));
        let hal_latest = Arc::new(Mutex::new(1u8));
        let rerecord = {
            let (recorded, hal_latest) = (Arc::clone(&recorded), Arc::clone(&hal_latest));
            thread::spawn(move || {
                // Event::record_on(s2): lock `recorded`, enqueue the record, store the clock.
                let mut r = recorded.lock().unwrap();
                *hal_latest.lock().unwrap() = 2;
                *r = (r.0 + 1, 2);
            })
        };
        let before = *recorded.lock().unwrap();
        let waited_for = *hal_latest.lock().unwrap();
        if waited_for == 2 {
            // s2's record is complete: the call returns and publishes (maybe) `before`.
            let publish = !check_generation || recorded.lock().unwrap().0 == before.0;
            if publish {
                assert_eq!(before.1, 2, "published s1's clock after waiting for s2's record");
            }
        } // else: waiting for s1 would block for ever in this model (s1 never completes).
        rerecord.join().unwrap();
    });
}

/// The code before 5065b6b published the clock it had read, whatever it waited for.
#[test]
#[should_panic(expected = "published s1's clock")]
fn event_synchronize_published_an_older_record_before_the_fix() {
    event_sync_model(false);
}

/// The current code publishes only if the record's generation is unchanged after the wait.
#[test]
fn event_synchronize_publishes_only_what_it_waited_for() {
    event_sync_model(true);
}

// ---------------------------------------------------------------------------------------
// The pool's free ring (`src/pool/free_ring.rs`): typed frees pushed without the pool's lock,
// taken by the lock's drain or by an allocation of the same stream and size. This model runs
// the ring's own code (re-exported under `--cfg loom`), with two slots.
//
// What must hold: every pushed free is taken exactly once; whoever takes it sees the previous
// owner's last writes to the block (the push happens-before the pop); a drain takes every push
// that returned before it started.

mod free_ring {
    use super::*;
    use soma_core::engine::{BlockId, FreeTag};
    use soma_core::free_ring::{FreeRing, RingedFree};

    /// Device memory of the blocks, as loom cells: the previous owner writes before its free,
    /// the next owner after taking it.
    struct Blocks([UnsafeCell<u64>; 3]);

    impl Blocks {
        fn new() -> Arc<Blocks> {
            Arc::new(Blocks([UnsafeCell::new(0), UnsafeCell::new(0), UnsafeCell::new(0)]))
        }

        fn write(&self, block: u64, value: u64) {
            // SAFETY: exclusive unless the ring fails to order the two owners — which is
            // what loom checks.
            self.0[block as usize].with_mut(|p| unsafe { *p = value });
        }
    }

    fn entry(block: u64) -> RingedFree {
        RingedFree {
            block: BlockId::from_raw(block),
            offset: block * 512,
            size: 512,
            tag: FreeTag { stream: block as u32 % 2, pos: block },
        }
    }

    /// Two threads free (write, then push); an allocation of stream 1 takes the ring's only
    /// entry if it matches, without the lock (`pop_only_if`, the pool's path); the "lock"
    /// drains the rest.
    fn two_frees_one_bypass_one_drain(ring: fn() -> FreeRing) {
        loom::model(move || {
            let ring = Arc::new(ring());
            let blocks = Blocks::new();
            let taken = Arc::new(Mutex::new(Vec::new()));
            let producers: Vec<_> = [1u64, 2]
                .into_iter()
                .map(|b| {
                    let (ring, blocks) = (Arc::clone(&ring), Arc::clone(&blocks));
                    thread::spawn(move || {
                        blocks.write(b, 10 + b);
                        ring.push(entry(b)).unwrap();
                    })
                })
                .collect();
            let bypass = {
                let (ring, blocks, taken) =
                    (Arc::clone(&ring), Arc::clone(&blocks), Arc::clone(&taken));
                thread::spawn(move || {
                    if let Some(f) = ring.pop_only_if(|f| f.tag.stream == 1) {
                        blocks.write(f.block.to_raw(), 99);
                        taken.lock().unwrap().push(f.block.to_raw());
                    }
                })
            };
            let drain = |ring: &FreeRing| {
                ring.drain(|f| {
                    blocks.write(f.block.to_raw(), 77);
                    taken.lock().unwrap().push(f.block.to_raw());
                })
            };
            drain(&ring);
            for p in producers {
                p.join().unwrap();
            }
            bypass.join().unwrap();
            drain(&ring);
            let mut all = taken.lock().unwrap().clone();
            all.sort_unstable();
            assert_eq!(all, [1, 2], "each free taken exactly once");
            assert_eq!(ring.consumed(), ring.produced());
        });
    }

    #[test]
    fn each_free_is_taken_once_after_its_owner_wrote() {
        two_frees_one_bypass_one_drain(|| FreeRing::with_capacity(2));
    }

    /// The planted bug: entries published with `Relaxed` instead of `Release` — a consumer
    /// can read the slot before its fields (a wrong block, caught by the "taken exactly once"
    /// check) and its writes then race with the previous owner's.
    #[test]
    #[should_panic]
    fn relaxed_publication_is_caught() {
        two_frees_one_bypass_one_drain(|| FreeRing::with_relaxed_publication(2));
    }

    /// A drain that starts after a push returned takes it (the thread that freed and then
    /// reads the pool's stats sees its free), even with a slower push claimed before it.
    #[test]
    fn a_drain_takes_every_push_that_returned() {
        loom::model(|| {
            let ring = Arc::new(FreeRing::with_capacity(2));
            let returned = Arc::new(AtomicU64::new(0));
            let slow = {
                let ring = Arc::clone(&ring);
                thread::spawn(move || ring.push(entry(1)).unwrap())
            };
            let fast = {
                let (ring, returned) = (Arc::clone(&ring), Arc::clone(&returned));
                thread::spawn(move || {
                    ring.push(entry(2)).unwrap();
                    returned.store(1, Ordering::Release);
                })
            };
            if returned.load(Ordering::Acquire) == 1 {
                let mut seen = Vec::new();
                ring.drain(|f| seen.push(f.block.to_raw()));
                assert!(seen.contains(&2), "a returned push is drained: {seen:?}");
            }
            slow.join().unwrap();
            fast.join().unwrap();
        });
    }
}
