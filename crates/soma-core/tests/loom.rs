//! loom models of soma-core's lock-free protocols.
//!
//! **The host-observed bound** (`src/device/slots.rs`). The device publishes "the host saw
//! every task of slot `s` below global position `b` complete" with
//! `observed.fetch_max(b, AcqRel)` (after a stream, event or device synchronisation, a
//! successful query, or when a dropped stream drains and its slot is detached); the pool
//! reads it with `observed.load(Acquire)` when it asks whether a free is complete, and then
//! hands the block to another stream or unmaps it. The opportunistic rule instead reads the
//! live stream's `completed()` counter, which the backend's worker stores after running a
//! task. These models run the device's own slot code: `soma_core::slots` (re-exported under
//! `--cfg loom`) takes its atomics and locks from `crate::sync`, loom's here, and the live
//! stream's counter is a type parameter, which the models fill with a [`Worker`].
//!
//! What must hold, on every interleaving loom explores:
//!
//! 1. when the reader sees a bound above a free's position, every write the device made to
//!    the block before the free happens-before the new owner's writes (no data race on the
//!    block, a `loom::cell::UnsafeCell`);
//! 2. the bound only grows, whatever the order of concurrent observers;
//! 3. detaching a drained stream and attaching a new stream to the same slot never makes a
//!    free of the *new* incarnation look complete, and a free of the old incarnation is
//!    complete only with the old writes visible.
//!
//! `relaxed_publication_is_caught` shows that the models are sensitive: the same slot code
//! with the bound published and read with `Relaxed` (a variant built only under loom) lets
//! the reader's write race with the device's, and loom reports it.
//!
//! **The free ring** (`src/pool/free_ring.rs`) is modelled with its own code too, at the end
//! of this file (`mod free_ring`), with the same kind of planted bug.
//!
//! **The vector clocks** of streams and events are modelled by hand: the models copy the
//! locking of `Stream::record_raw`, `Stream::wait_event`, `Event::record_on`, `Event::wait_on`
//! and `Event::synchronize` onto loom's mutexes, so a change to that locking must be copied
//! here. Each comes with the racy variant it rules out, as a `should_panic` model: a record
//! that reads the stream's clock after enqueueing
//! (`a_record_reading_the_clock_late_claims_a_later_wait`), and an event synchronisation
//! that publishes the clock it read without checking the record's generation
//! (`an_unchecked_event_synchronize_publishes_an_older_record`).
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
use soma_core::slots::{Progress, Slots};

/// A stream's backend as the slot protocol sees it: the completed counter its worker stores.
#[derive(Clone)]
struct Worker(Arc<AtomicU64>);

impl Worker {
    fn new() -> Worker {
        Worker(Arc::new(AtomicU64::new(0)))
    }

    /// The worker runs a task: its last write to the block, then the count (a `Release`
    /// store, as a backend must publish completion).
    fn run_task(&self, block: &UnsafeCell<u64>, task: u64) {
        // SAFETY: a valid, exclusive pointer unless loom finds a concurrent access (the test).
        block.with_mut(|p| unsafe { *p = task });
        self.0.store(task, Ordering::Release);
    }

    /// The host waits for the worker to complete `task` (the backend's synchronize).
    fn wait_for(&self, task: u64) {
        while self.0.load(Ordering::Acquire) < task {
            thread::yield_now();
        }
    }
}

impl Progress for Worker {
    fn completed(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// The modelled backend reads its counter every time: nothing to note.
    fn note_completed(&self, _position: u64) {}
}

/// A device of one slot, whose first stream's task 1 is the last use of a block freed at
/// position 1.
struct Device {
    slots: Slots<Worker>,
    worker: Worker,
    block: UnsafeCell<u64>,
}

impl Device {
    fn new(slots: Slots<Worker>) -> Arc<Device> {
        let worker = Worker::new();
        assert_eq!(slots.attach(worker.clone()), Some((0, 0)), "slot 0, base 0");
        Arc::new(Device { slots, worker, block: UnsafeCell::new(0) })
    }

    /// The device's worker runs task 1.
    fn run_task_1(&self) {
        self.worker.run_task(&self.block, 1);
    }

    /// `Stream::synchronize`: read the enqueued position, wait for the device, publish.
    fn synchronize(&self, enqueued: u64) {
        self.worker.wait_for(enqueued);
        self.slots.observe(0, enqueued + 1);
    }

    /// The new owner of the block writes it (on another stream, ordered after the check).
    fn reuse(&self) {
        // SAFETY: as in `Worker::run_task`: loom checks the exclusivity this relies on.
        self.block.with_mut(|p| unsafe { *p = 2 });
    }
}

/// Property 1 through the host-observed bound: the device's worker runs the block's last
/// task, a host thread synchronises the stream, and an allocating thread reuses the block
/// once the bound says that its free (at position 1) is complete. `slots` makes the device's
/// slots: the real ones, or the planted bug.
fn reuse_after_host_synchronize(slots: fn(usize) -> Slots<Worker>) {
    loom::model(move || {
        let device = Device::new(slots(1));
        let worker = {
            let device = Arc::clone(&device);
            thread::spawn(move || device.run_task_1())
        };
        let host_sync = {
            let device = Arc::clone(&device);
            thread::spawn(move || device.synchronize(1))
        };
        // The allocating thread: host-observed eligibility only (no opportunistic read).
        if 1 < device.slots.host_observed(0) {
            device.reuse();
        }
        worker.join().unwrap();
        host_sync.join().unwrap();
        assert_eq!(device.slots.host_observed(0), 2);
    });
}

#[test]
fn host_observed_bound_publishes_the_device_writes() {
    reuse_after_host_synchronize(Slots::new);
}

/// The models are sensitive: the slots with the bound published and read with `Relaxed`
/// lose the happens-before edge from the device's writes to the new owner's, and loom
/// reports the race.
#[test]
#[should_panic(expected = "Causality violation")]
fn relaxed_publication_is_caught() {
    reuse_after_host_synchronize(Slots::with_relaxed_publication);
}

/// Property 1 through the opportunistic rule: the allocating thread asks whether the free
/// is complete, which reads the live stream's counter.
#[test]
fn completed_counter_publishes_the_device_writes() {
    loom::model(|| {
        let device = Device::new(Slots::new(1));
        let worker = {
            let device = Arc::clone(&device);
            thread::spawn(move || device.run_task_1())
        };
        if device.slots.is_complete(0, 1) {
            device.reuse();
        }
        worker.join().unwrap();
    });
}

/// Property 2: concurrent observers (two synchronisations, an event synchronize) leave the
/// maximum, and a reader never sees the bound go down.
#[test]
fn the_bound_only_grows() {
    loom::model(|| {
        let device = Device::new(Slots::new(1));
        let observers: Vec<_> = [5, 3]
            .into_iter()
            .map(|bound| {
                let device = Arc::clone(&device);
                thread::spawn(move || device.slots.observe(0, bound))
            })
            .collect();
        let first = device.slots.host_observed(0);
        let second = device.slots.host_observed(0);
        assert!(second >= first, "the bound went down: {first} -> {second}");
        for o in observers {
            o.join().unwrap();
        }
        assert_eq!(device.slots.host_observed(0), 5);
    });
}

/// Property 3: the stream is dropped (it drains up to its final position 1, its slot is
/// detached) and a new stream takes the slot, while another thread checks frees of both
/// incarnations.
#[test]
fn slot_recycling_keeps_incarnations_apart() {
    loom::model(|| {
        let device = Device::new(Slots::new(1));
        let worker = {
            let device = Arc::clone(&device);
            thread::spawn(move || device.run_task_1())
        };
        let recycle = {
            let device = Arc::clone(&device);
            thread::spawn(move || {
                // Drop of the stream: drain, detach; then a new stream takes the slot, its
                // worker having completed nothing yet.
                device.worker.wait_for(1);
                device.slots.detach(0, 1);
                let next = device.slots.attach(Worker::new());
                assert_eq!(next, Some((0, 2)), "the new incarnation starts after the old one");
            })
        };
        // A free of the old incarnation at position 1 ...
        if device.slots.is_complete(0, 1) {
            device.reuse();
        }
        // ... and one of the new incarnation after its first task (global 2 + 1 = 3), which
        // never completes in this model.
        assert!(
            !device.slots.is_complete(0, 3),
            "a pending free of the new stream looked complete"
        );
        worker.join().unwrap();
        recycle.join().unwrap();
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

    /// The racy variant of `s1.record(&E)`: `Event::record_on` locks `E.recorded`, then the
    /// record is enqueued and only then is the stream's clock read (without its lock held
    /// across the enqueue).
    pub fn record_reading_the_clock_late(s1: &S1, ev: &Events) {
        let mut recorded = ev.e.lock().unwrap();
        s1.queue.lock().unwrap().push(Task::RecordE); // hal.record
        let clock = *s1.clock.lock().unwrap(); // self.clock.lock().clone()
        *recorded = Some(clock);
    }

    /// `s1.wait_event(&F)`: `Event::wait_on` enqueues the wait under `F.recorded`, then the
    /// stream joins the clock under its own lock, separately. The pool's inserted waits
    /// (frees after uses on other streams, internal dependencies) have the same shape.
    pub fn wait(s1: &S1, ev: &Events) {
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

    /// `s1.record(&E)`: `record_on` locks `E.recorded`, then `record_raw` holds the stream's
    /// clock lock across the enqueue and the snapshot.
    pub fn record(s1: &S1, ev: &Events) {
        let mut recorded = ev.e.lock().unwrap();
        let clock = s1.clock.lock().unwrap();
        s1.queue.lock().unwrap().push(Task::RecordE);
        let snapshot = *clock;
        drop(clock);
        *recorded = Some(snapshot);
    }

    /// Another sound locking: the stream's clock lock held across "enqueue + clock update"
    /// in both record and wait, taken before the event's lock.
    pub fn record_clock_first(s1: &S1, ev: &Events) {
        let clock = s1.clock.lock().unwrap();
        let mut recorded = ev.e.lock().unwrap();
        s1.queue.lock().unwrap().push(Task::RecordE);
        *recorded = Some(*clock);
    }

    pub fn wait_clock_first(s1: &S1, ev: &Events) {
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
/// The racy variant, a record that reads the stream's clock after enqueueing, must fail
/// (`should_panic`); the model of `record_raw` must pass.
#[test]
#[should_panic(expected = "E's clock claims X:7")]
fn a_record_reading_the_clock_late_claims_a_later_wait() {
    stream_clock::run(stream_clock::record_reading_the_clock_late, stream_clock::wait);
}

/// `record_raw` (clock lock spanning the enqueue) with `wait_event`.
#[test]
fn a_record_never_claims_a_later_wait() {
    stream_clock::run(stream_clock::record, stream_clock::wait);
}

/// The other locking (stream clock lock held across enqueue and clock update, taken before
/// the event's lock) is sound and deadlock-free in the model too.
#[test]
fn clock_first_record_and_wait_keep_clock_and_queue_in_step() {
    stream_clock::run(stream_clock::record_clock_first, stream_clock::wait_clock_first);
}

/// `Event::synchronize` (and `Event::query`) read the event's clock, release its lock, then
/// ask the backend to wait for the event's *latest* record. If another thread re-records the
/// event on a second stream in between, the host waits for the new record; publishing the
/// old record's clock as host-observed would make the first stream's pending frees reusable
/// by every stream while it still runs. So records carry a generation, and the clock is
/// published only if the generation is unchanged after the wait.
///
/// Model: `E` is recorded on `s1`, whose work never completes here; a thread re-records it on
/// `s2` (complete) while another synchronizes it, and checks the clock it publishes (when
/// its wait returns: a wait for s1 would never return here).
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

/// The racy variant publishes the clock it had read, whatever it waited for: it must fail.
#[test]
#[should_panic(expected = "published s1's clock")]
fn an_unchecked_event_synchronize_publishes_an_older_record() {
    event_sync_model(false);
}

/// `Event::synchronize` publishes only if the record's generation is unchanged after the
/// wait.
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
