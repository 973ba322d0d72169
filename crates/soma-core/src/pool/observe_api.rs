//! The pool's observability methods: snapshot, high-water reset, history exports.

use super::api::{Backend, MemPool};
use super::graph_region::is_stream_slot;
use super::shards::Cores;
use crate::engine::{BlockInfo, BlockState};
use crate::error::Result;
use crate::observe::{History, Snapshot, SvgOptions};

impl MemPool<'_> {
    /// The pool's mapped memory now: segments (runs of mapped address space) and their
    /// blocks — live, cached on a stream (named by the stream's backend id), or free — with
    /// totals. O(blocks), under the pool's lock; see [`Snapshot::to_json`]. Empty for a
    /// [`native`](crate::MemPoolBuilder::native) pool (the driver does not expose its blocks).
    /// A [sharded](crate::MemPoolBuilder::stream_shards) pool's shards appear side by side:
    /// shard *i*'s offsets start at *i* × `max_size`.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{observe::BlockStatus, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let a = pool.alloc_async::<u8>(4096, &s)?;
    /// drop(pool.alloc_async::<u8>(4096, &s)?); // cached on `s`
    /// let snap = pool.snapshot();
    /// assert_eq!(snap.used, 4096);
    /// assert!(snap.blocks().any(|b| matches!(b.status,
    ///     BlockStatus::Cached { stream: Some(id), .. } if id == s.id())));
    /// # drop(a); Ok(()) }
    /// ```
    pub fn snapshot(&self) -> Snapshot {
        let cores = match self.backend() {
            Backend::Engine(cores) => cores,
            Backend::Native(native) => return native.snapshot(),
        };
        let core = cores.first();
        let device = &core.device;
        // A sharded pool's shards side by side: shard i's offsets start at i * max_size
        // (the shards are locked one after another, so the picture is per-shard consistent).
        let guards: Vec<_> = cores.iter().map(|c| (c.shard, c.lock())).collect();
        let blocks = guards.iter().flat_map(|(shard, inner)| {
            let shift = u64::from(*shard) * core.max_size;
            // An empty unmapped block first: each shard is its own reservation, so a mapped
            // run at the end of one shard and one at the start of the next are two segments.
            let boundary = BlockInfo { offset: shift, size: 0, state: BlockState::Unmapped };
            std::iter::once(boundary).chain(inner.engine.blocks().map(move |mut b| {
                b.offset += shift;
                b
            }))
        });
        let shards = guards.iter().map(|(shard, _)| u64::from(*shard) + 1).max().unwrap_or(1);
        Snapshot::from_blocks(
            core.created.elapsed().as_nanos() as u64,
            core.max_size * shards,
            core.alignment,
            blocks,
            |slot| {
                // A graph slot (graph memory) names no stream.
                if !is_stream_slot(slot) {
                    return (None, 0);
                }
                let id = device.live_stream(slot).map(|l| l.hal.id());
                (id, device.slots.host_observed(slot))
            },
        )
    }

    /// Restarts the `used` and `reserved` high-water marks from their current values (as
    /// resetting [`attr::UsedMemHigh`](crate::attr::UsedMemHigh) and
    /// [`attr::ReservedMemHigh`](crate::attr::ReservedMemHigh) does), both under one lock:
    /// e.g. to measure the peak of one phase of a program.
    ///
    /// # Errors
    /// A sticky error from an earlier failed `Drop`; for a [`native`](crate::MemPoolBuilder::native)
    /// pool, the driver's error.
    pub fn reset_highs(&self) -> Result<()> {
        self.take_sticky()?;
        match self.backend() {
            Backend::Engine(cores) => {
                cores.reset_high_marks(true, true);
                Ok(())
            }
            Backend::Native(native) => native.reset_highs(),
        }
    }

    /// A copy of the event history ring (it keeps the **last** `capacity` records and counts
    /// the dropped ones), or `None` when the pool was built without
    /// [`history`](crate::MemPoolBuilder::history) (or [`native`](crate::MemPoolBuilder::native)).
    /// Its methods export it:
    /// [`History::to_json_lines`], [`History::to_chrome_trace`], [`History::to_trace_csv`],
    /// [`History::to_svg`].
    pub fn history_log(&self) -> Option<History> {
        match self.backend() {
            Backend::Engine(cores) => cores.first().lock().history.clone(),
            Backend::Native(_) => None,
        }
    }

    /// The history as JSON lines ([`History::to_json_lines`]); empty without a history.
    pub fn history_json_lines(&self) -> String {
        self.history_log().map(|h| h.to_json_lines()).unwrap_or_default()
    }

    /// The history as a Chrome trace / Perfetto JSON document ([`History::to_chrome_trace`]);
    /// a document without events when the pool keeps no history.
    pub fn history_chrome_trace(&self) -> String {
        self.history_log().unwrap_or_else(|| History::new(1)).to_chrome_trace()
    }

    /// The history's allocations and frees as a replay trace CSV
    /// ([`History::to_trace_csv`]).
    pub fn history_trace_csv(&self) -> String {
        self.history_log().unwrap_or_else(|| History::new(1)).to_trace_csv()
    }

    /// A memory timeline picture of the history ([`History::to_svg`]).
    pub fn history_svg(&self, options: &SvgOptions) -> String {
        self.history_log().unwrap_or_else(|| History::new(1)).to_svg(options)
    }
}

impl Cores<'_> {
    /// Restarts the chosen high-water marks from the current values, in every shard and in
    /// the pool-wide counters of a sharded pool.
    pub(super) fn reset_high_marks(self, used: bool, reserved: bool) {
        for core in self.iter() {
            let mut inner = core.lock();
            if used {
                inner.engine.reset_used_high();
            }
            if reserved {
                inner.engine.reset_reserved_high();
            }
        }
        if let Some(b) = self.budget() {
            if used {
                b.reset_used_high();
            }
            if reserved {
                b.reset_reserved_high();
            }
        }
    }
}
