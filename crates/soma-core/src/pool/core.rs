//! The core of an engine-backed pool (or of one of its shards): the engine behind its lock,
//! the address range it maps into, the modes fixed at build, and the errors kept for the
//! next fallible call.

use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Instant;

use super::backing::HalBacking;
use super::free_ring::FreeRing;
use super::graph_region::{GraphRegions, FIRST_GRAPH_SLOT};
use super::handle::Origin;
use super::ipc::ExportState;
use super::passthrough::Passthrough;
use super::policy::{OomHook, Settings};
use super::shards::Budget;
use crate::device::DeviceShared;
use crate::engine::{BlockId, Engine, EngineConfig, ReuseKind};
use crate::error::{Error, Result};
use crate::hal::{DeviceHal, DevicePtr};
use crate::observe::{History, Record, RecordKind};

/// What creating a core takes, fixed when the pool is built; a sharded pool keeps it to
/// create its other shards on first use.
pub(super) struct CoreSpec {
    pub(super) max_size: u64,
    pub(super) granularity: u64,
    pub(super) alignment: u64,
    pub(super) index_by_offset: bool,
    /// 0: the engine's default.
    pub(super) segments_per_growth: u64,
    pub(super) recycle_on_growth: bool,
    /// History capacity (0: none).
    pub(super) history: usize,
    pub(super) passthrough: bool,
    pub(super) on_oom: Option<OomHook>,
    pub(super) settings: Arc<Settings>,
    pub(super) created: Instant,
    pub(super) id: u64,
    /// Built with `HandleType::Posix`: the pool can be shared with other processes.
    pub(super) shareable: bool,
}

/// The shared part of an engine-backed pool, or of one of its shards (reachable from the
/// device too, as a listener for synchronisations and dropped streams).
pub(crate) struct PoolCore {
    pub(super) device: Arc<DeviceShared>,
    pub(super) base: DevicePtr,
    pub(super) max_size: u64,
    pub(super) alignment: u64,
    pub(super) id: u64,
    /// This core's index among the pool's shards (0 when the pool is not sharded).
    pub(super) shard: u8,
    /// The origin of a block the free ring hands back: this shard, a same-stream reuse.
    pub(super) ringed_origin: Origin,
    pub(super) settings: Arc<Settings>,
    /// The pool-wide limit and counters of a sharded pool (`None`: one shard, whose engine
    /// keeps them), shared with the other shards: every map claims its size from it first.
    pub(super) budget: Option<Arc<Budget>>,
    /// Set when the pool is torn down: a listener call that comes after finds nothing to
    /// do.
    pub(super) torn_down: AtomicBool,
    inner: Mutex<PoolInner>,
    pub(super) created: Instant,
    pub(super) on_oom: Option<OomHook>,
    /// Whether the device's sanitizer wants to hear about allocations and frees.
    pub(super) annotate: bool,
    /// The range is one `malloc` segment (a device without VMM): the engine's maps and unmaps
    /// only account, the memory stays allocated until the pool is dropped.
    pub(super) preallocated: bool,
    /// Deferred frees of a pass-through pool.
    pub(super) passthrough: Option<Passthrough>,
    /// Whether the pool keeps a history (fixed at creation: the hot path checks this flag,
    /// not the locked state).
    pub(super) history_on: bool,
    /// Typed frees waiting for the engine (see `free_ring.rs`); `None` when every free must
    /// reach the engine at once (annotations, history, pass-through, shards).
    pub(super) free_ring: Option<FreeRing>,
    /// Set whenever a sticky error is stored (cleared when it is taken): the lock-free
    /// allocation path leaves it to the locked one to report.
    sticky_hint: AtomicBool,
    /// Live blocks of live graph regions (written under the lock): while there are none, a
    /// free on a stream that once captured needs no look at the regions.
    pub(super) graph_blocks: AtomicU64,
    /// The sharing state of a pool built with `HandleType::Posix` (see `ipc/`).
    pub(super) ipc: Option<ExportState>,
}

/// The state of a core that its lock guards.
pub(super) struct PoolInner {
    pub(super) engine: Engine,
    /// An error from a `Drop` that could not be reported; returned by the next fallible call.
    sticky: Option<Error>,
    pub(super) oom_retries: u64,
    /// Allocations that failed with out of memory (after the retry, if any).
    pub(super) ooms: u64,
    pub(super) history: Option<History>,
    /// Blocks handed out by `alloc_raw` (by block id): only these may be freed by pointer,
    /// never the block of a live typed `PoolAlloc`.
    pub(super) raw_blocks: std::collections::HashSet<BlockId>,
    /// Free-ring tickets accounted in the engine (drained, or counted as handed out again).
    ring_accounted: u64,
    /// A sharded pool's shard: its `(used, live blocks)` when it was last locked, for
    /// [`Locked`]'s drop. Kept here, under the lock, rather than in the guard: a smaller
    /// guard is moved for less on every lock.
    budget_base: (u64, u64),
    /// The memory kept for captured graphs (see `graph_region.rs`).
    pub(super) graph: GraphRegions,
}

/// What a history record tells of one event; the time and the pool's counters are added
/// when it is stored.
pub(super) struct HistoryEntry {
    pub(super) kind: RecordKind,
    pub(super) stream: u64,
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) requested: u64,
    pub(super) reuse: Option<ReuseKind>,
    pub(super) location: Option<&'static Location<'static>>,
}

impl HistoryEntry {
    /// An event of `kind` with every other field empty.
    pub(super) fn of(kind: RecordKind) -> HistoryEntry {
        HistoryEntry {
            kind,
            stream: 0,
            offset: 0,
            size: 0,
            requested: 0,
            reuse: None,
            location: None,
        }
    }

    /// The record, at `t_ns` with the pool at `used` and `reserved` bytes.
    pub(super) fn stamped(self, t_ns: u64, used: u64, reserved: u64) -> Record {
        Record {
            t_ns,
            kind: self.kind,
            stream: self.stream,
            offset: self.offset,
            size: self.size,
            requested: self.requested,
            used,
            reserved,
            reuse: self.reuse,
            location: self.location,
        }
    }
}

impl PoolInner {
    /// Splits the engine from a backing that maps through `core` and records into the history.
    pub(super) fn parts<'a>(&'a mut self, core: &'a PoolCore) -> (&'a mut Engine, HalBacking<'a>) {
        let (used, reserved) = (self.engine.used(), self.engine.reserved());
        let backing = HalBacking::new(core, self.history.as_mut(), used, reserved);
        (&mut self.engine, backing)
    }

    /// Adds `entry` to the history, if the pool keeps one.
    pub(super) fn record(&mut self, core: &PoolCore, entry: HistoryEntry) {
        if let Some(history) = self.history.as_mut() {
            let t_ns = core.created.elapsed().as_nanos() as u64;
            history.push(entry.stamped(t_ns, self.engine.used(), self.engine.reserved()));
        }
    }
}

/// The locked state of one core. In a sharded pool, unlocking applies what the critical
/// section changed in the shard's used bytes and live blocks to the pool-wide counters.
pub(super) struct Locked<'a> {
    guard: MutexGuard<'a, PoolInner>,
    /// The pool's counters (the shard's own at locking are in `PoolInner::budget_base`).
    budget: Option<&'a Budget>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = PoolInner;

    fn deref(&self) -> &PoolInner {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut PoolInner {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some(budget) = self.budget {
            let (used, live) = self.guard.budget_base;
            let engine = &self.guard.engine;
            // Both are below 2^63 (bounded by the range and the slab).
            let d_used = engine.used() as i64 - used as i64;
            let d_live = engine.live_blocks() as i64 - live as i64;
            budget.add_used(d_used, d_live);
        }
    }
}

impl PoolCore {
    /// Creates shard `shard` of a pool (the whole pool when it is not sharded, `budget`
    /// `None`): its engine, its address range, its state; registered with the device as a
    /// listener of its synchronisations and dropped streams.
    pub(super) fn create(
        device: &Arc<DeviceShared>,
        spec: &CoreSpec,
        shard: u8,
        budget: Option<&Arc<Budget>>,
    ) -> Result<Arc<PoolCore>> {
        let mut engine = Engine::new(EngineConfig {
            range_size: spec.max_size,
            granularity: spec.granularity,
            alignment: spec.alignment,
            index_by_offset: spec.index_by_offset,
        })
        .map_err(Error::InvalidConfig)?;
        // Every enabled rule, internal dependencies included, is tried before fresh memory
        // is mapped.
        engine.set_dependency_before_growth(true);
        if spec.segments_per_growth > 0 {
            engine.set_segments_per_growth(spec.segments_per_growth);
        }
        engine.set_recycle_on_growth(spec.recycle_on_growth);
        // Graph memory stays what the graphs allocated: see `graph_region.rs`.
        engine.set_private_slots(FIRST_GRAPH_SLOT);
        // Memory of pools dropped earlier whose work has completed goes back first.
        device.deferred.release_complete(device);
        let hal = &device.hal;
        let preallocated = !hal.info().supports_vmm;
        // Without VMM: one malloc segment of the whole range, held for the pool's life.
        let base =
            if preallocated { hal.malloc(spec.max_size)? } else { hal.reserve(spec.max_size)? };
        let annotate = hal.wants_annotations();
        let core = Arc::new(PoolCore {
            device: Arc::clone(device),
            base,
            max_size: spec.max_size,
            alignment: spec.alignment,
            id: spec.id,
            shard,
            ringed_origin: Origin::new(shard, Some(ReuseKind::SameStream)),
            settings: Arc::clone(&spec.settings),
            budget: budget.cloned(),
            torn_down: AtomicBool::new(false),
            inner: Mutex::new(PoolInner {
                engine,
                sticky: None,
                oom_retries: 0,
                ooms: 0,
                history: (spec.history > 0).then(|| History::new(spec.history)),
                raw_blocks: std::collections::HashSet::new(),
                ring_accounted: 0,
                budget_base: (0, 0),
                graph: GraphRegions::default(),
            }),
            created: spec.created,
            on_oom: spec.on_oom.clone(),
            annotate,
            preallocated,
            passthrough: spec.passthrough.then(Passthrough::default),
            history_on: spec.history > 0,
            // Every free must reach the engine at once for the sanitizer's annotations, the
            // history, pass-through mode and a shareable pool (whose frees may wait for
            // importers). In a sharded pool a ring would be drained only
            // when its own shard is locked, so the pool-wide `used` (and its high-water mark)
            // would count frees waiting there: frees lock instead.
            free_ring: (!spec.passthrough
                && spec.history == 0
                && !annotate
                && budget.is_none()
                && !spec.shareable)
                .then(FreeRing::new),
            sticky_hint: AtomicBool::new(false),
            graph_blocks: AtomicU64::new(0),
            ipc: spec.shareable.then(ExportState::default),
        });
        let weak: Weak<PoolCore> = Arc::downgrade(&core);
        device.register_listener(weak);
        Ok(core)
    }

    /// The device's backend.
    #[inline]
    pub(super) fn hal(&self) -> &dyn DeviceHal {
        &*self.device.hal
    }

    /// Locks the pool's state, first handing the frees waiting in the free ring to the
    /// engine: whatever runs under the lock sees every free that returned before it.
    #[inline]
    pub(super) fn lock(&self) -> Locked<'_> {
        // std's mutex: under oversubscription (more allocating threads than cores) it beat
        // parking_lot's by ~10-25 % on the multi-stream bench. Poisoning is ignored: the
        // engine does not panic on any input (the bad-input and fuzz tests check it), and a
        // pool that refused every later call would be worse.
        let mut guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let budget = self.budget.as_deref();
        if budget.is_some() {
            guard.budget_base = (guard.engine.used(), guard.engine.live_blocks());
        }
        let mut inner = Locked { guard, budget };
        if let Some(ring) = &self.free_ring {
            if ring.produced() != inner.ring_accounted {
                self.drain_ring(ring, &mut inner);
            }
        }
        inner
    }

    #[cold]
    #[inline(never)]
    fn drain_ring(&self, ring: &FreeRing, inner: &mut PoolInner) {
        let mut failed = None;
        let engine = &mut inner.engine;
        let drained = ring.drain(|f| {
            if let Err(e) = engine.free(f.block, f.tag) {
                failed.get_or_insert((f.block, e));
            }
        });
        // Tickets taken by allocations of the same stream and size: a free and an
        // allocation the engine never saw.
        let consumed = ring.consumed();
        engine.count_repeated_pairs(consumed - inner.ring_accounted - drained);
        inner.ring_accounted = consumed;
        if let Some((block, e)) = failed {
            self.put_sticky(
                inner,
                Error::InvalidArgument(format!("free of block {block:?} failed: {e:?}")),
            );
        }
    }

    /// Stores `error` for the next fallible call (the first one stays).
    pub(super) fn put_sticky(&self, inner: &mut PoolInner, error: Error) {
        inner.sticky.get_or_insert(error);
        self.sticky_hint.store(true, Ordering::Relaxed);
    }

    /// Stores `error` for the next fallible call, taking the lock.
    pub(super) fn set_sticky(&self, error: Error) {
        let mut inner = self.lock();
        self.put_sticky(&mut inner, error);
    }

    /// Whether an error may be stored (exact under the lock; a hint without it).
    #[inline]
    pub(super) fn sticky_pending(&self) -> bool {
        self.sticky_hint.load(Ordering::Relaxed)
    }

    /// Takes the stored error, if any.
    ///
    /// The hint is read first: it is written under the lock with the error, which the caller
    /// holds, so it is exact here, and the common case (no error) does not move an `Error`.
    #[inline]
    pub(super) fn take_sticky(&self, inner: &mut PoolInner) -> Option<Error> {
        if !self.sticky_pending() {
            return None;
        }
        self.take_stored_sticky(inner)
    }

    #[cold]
    #[inline(never)]
    fn take_stored_sticky(&self, inner: &mut PoolInner) -> Option<Error> {
        let e = inner.sticky.take();
        if e.is_some() {
            self.sticky_hint.store(false, Ordering::Relaxed);
        }
        e
    }

    /// The size of the block a request of `bytes` gets (the engine's rounding to the pool's
    /// alignment); `None` when rounding overflows.
    #[inline]
    pub(super) fn block_size(&self, bytes: u64) -> Option<u64> {
        crate::engine::checked_align_up(bytes, self.alignment)
    }

    pub(super) fn ptr_at(&self, offset: u64) -> DevicePtr {
        // The engine hands out offsets inside the reserved range, which does not wrap.
        self.base.checked_add(offset).unwrap_or(self.base)
    }

    /// The offset of `ptr` in this core's range, if the range holds it.
    pub(super) fn offset_of(&self, ptr: DevicePtr) -> Option<u64> {
        ptr.offset_from(self.base).filter(|&o| o < self.max_size)
    }
}
