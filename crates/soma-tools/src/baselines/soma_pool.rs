//! soma itself: the engine alone over a counting fake backing, and the public API.

use soma::{MemPool, OwnedAlloc, OwnedPool, OwnedStream, PoolAlloc, Stream};
use soma_core::engine::{BlockId, Engine, EngineConfig, EngineStats, FreeTag};
use soma_engine::testing::{FakeBacking, TestOrder};

use super::Allocator;
use crate::driver_cost::DriverCalls;
use crate::GRANULE;

/// soma's engine alone (no device, no lock): stream 0, frees tagged with increasing
/// positions, every free complete (what the public API sees on the software NPU when no
/// kernel is pending), over the engine's counting fake backing.
#[derive(Debug)]
pub struct SomaEngine {
    engine: Engine,
    backing: FakeBacking,
    order: TestOrder,
    pos: u64,
    name: &'static str,
}

impl SomaEngine {
    /// An engine over a `range` of bytes (a multiple of 2 MiB) with 2 MiB granules and
    /// alignment `alignment`, with the engine's default settings (no recycling on growth);
    /// named `soma-engine`.
    ///
    /// # Panics
    /// An invalid configuration.
    pub fn new(range: u64, alignment: u64) -> SomaEngine {
        SomaEngine::configured(range, alignment, None)
    }

    /// As [`SomaEngine::new`], with `Engine::set_recycle_on_growth(recycle)`: `false` (growth
    /// only maps, never unmaps free segments elsewhere; the default) is named
    /// `soma-engine-retain`, `true` `soma-engine-recycle`.
    ///
    /// # Panics
    /// An invalid configuration.
    pub fn with_recycling(range: u64, alignment: u64, recycle: bool) -> SomaEngine {
        SomaEngine::configured(range, alignment, Some(recycle))
    }

    /// The engine of [`SomaEngine::new`], recycling on growth as `recycle` says if given.
    fn configured(range: u64, alignment: u64, recycle: Option<bool>) -> SomaEngine {
        let mut engine = Engine::new(EngineConfig {
            range_size: range,
            granularity: GRANULE,
            alignment,
            index_by_offset: false,
        })
        .expect("engine configuration");
        let name = match recycle {
            None => "soma-engine",
            Some(false) => "soma-engine-retain",
            Some(true) => "soma-engine-recycle",
        };
        if let Some(recycle) = recycle {
            engine.set_recycle_on_growth(recycle);
        }
        SomaEngine {
            engine,
            backing: FakeBacking::counting(),
            order: TestOrder::complete(),
            pos: 0,
            name,
        }
    }

    /// The engine's counters.
    pub fn stats(&self) -> EngineStats {
        self.engine.stats()
    }

    /// The fake backing, for its counters.
    pub fn backing(&self) -> &FakeBacking {
        &self.backing
    }
}

impl Allocator for SomaEngine {
    type Handle = BlockId;
    fn name(&self) -> &'static str {
        self.name
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<BlockId> {
        let align = self.engine.config().alignment;
        self.engine.alloc(bytes, align, 0, &self.order, &mut self.backing).ok().map(|a| a.block)
    }
    #[inline]
    fn free(&mut self, handle: BlockId) {
        self.pos += 1;
        self.engine.free(handle, FreeTag { stream: 0, pos: self.pos }).expect("engine free");
    }
    fn reserved_high(&self) -> u64 {
        self.engine.stats().reserved_high
    }
    fn driver_calls(&self) -> DriverCalls {
        let st = self.engine.stats();
        DriverCalls::segments(st.map_calls, st.unmap_calls)
    }
}

// ---------------------------------------------------------------------------------------
// soma: public API

/// soma's public API on one stream: `pool.alloc_async::<u8>(bytes, stream)`, freed by
/// dropping the `PoolAlloc`.
#[derive(Debug)]
pub struct SomaApi<'s, 'd> {
    pool: &'s MemPool<'d>,
    stream: &'s Stream<'d>,
    name: &'static str,
}

impl<'s, 'd> SomaApi<'s, 'd> {
    /// Drives `pool` with allocations for `stream`; named `soma` (meant for a pool with the
    /// default settings).
    pub fn new(pool: &'s MemPool<'d>, stream: &'s Stream<'d>) -> Self {
        SomaApi::named(pool, stream, "soma")
    }

    /// As [`SomaApi::new`], reported as `name` in benchmark ids and tables: a pool built with
    /// other settings than the default is a different allocator under test (the benches name
    /// a pool built with `recycle_on_growth(true)` `soma-recycle`). The name is the caller's
    /// word; nothing checks it against the pool's settings.
    pub fn named(pool: &'s MemPool<'d>, stream: &'s Stream<'d>, name: &'static str) -> Self {
        SomaApi { pool, stream, name }
    }
}

impl<'s, 'd: 's> Allocator for SomaApi<'s, 'd> {
    type Handle = PoolAlloc<'s, u8>;
    fn name(&self) -> &'static str {
        self.name
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<PoolAlloc<'s, u8>> {
        self.pool.alloc_async::<u8>(bytes as usize, self.stream).ok()
    }
    #[inline]
    fn free(&mut self, handle: PoolAlloc<'s, u8>) {
        drop(handle);
    }
    fn reserved_high(&self) -> u64 {
        self.pool.stats().reserved_high
    }
    fn driver_calls(&self) -> DriverCalls {
        let st = self.pool.stats();
        DriverCalls::segments(st.map_calls, st.unmap_calls)
    }
}

/// soma's public API on several streams in turn, as `soma-replay --streams N` drives it:
/// op `k` of a sequence (allocation or free) runs on stream `k mod N`; a free on another
/// stream than the allocation's hands the allocation off to that stream first (an event
/// recorded on the allocation's stream, waited on by the freeing one), so blocks move
/// between streams only through events.
#[derive(Debug)]
pub struct SomaStreams<'s, 'd> {
    pool: &'s MemPool<'d>,
    streams: &'s [Stream<'d>],
    op: usize,
    name: &'static str,
}

impl<'s, 'd> SomaStreams<'s, 'd> {
    /// Drives `pool` with ops on `streams` in turn (at least one), reported as `name`.
    ///
    /// # Panics
    /// `streams` is empty.
    pub fn new(pool: &'s MemPool<'d>, streams: &'s [Stream<'d>], name: &'static str) -> Self {
        assert!(!streams.is_empty(), "at least one stream");
        SomaStreams { pool, streams, op: 0, name }
    }

    /// The stream of the next op.
    fn next_stream(&mut self) -> &'s Stream<'d> {
        let s = &self.streams[self.op % self.streams.len()];
        self.op += 1;
        s
    }
}

impl<'s, 'd: 's> Allocator for SomaStreams<'s, 'd> {
    type Handle = PoolAlloc<'s, u8>;
    fn name(&self) -> &'static str {
        self.name
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<PoolAlloc<'s, u8>> {
        let s = self.next_stream();
        self.pool.alloc_async::<u8>(bytes as usize, s).ok()
    }
    #[inline]
    fn free(&mut self, handle: PoolAlloc<'s, u8>) {
        let s = self.next_stream();
        if handle.stream().id() == s.id() {
            drop(handle);
        } else {
            drop(handle.hand_off(s).expect("hand-off to the freeing stream"));
        }
    }
    fn reserved_high(&self) -> u64 {
        self.pool.stats().reserved_high
    }
    fn driver_calls(&self) -> DriverCalls {
        let st = self.pool.stats();
        DriverCalls::segments(st.map_calls, st.unmap_calls)
    }
}

// ---------------------------------------------------------------------------------------
// soma: owned handles

/// soma's owned API on one stream: `pool.alloc_async::<u8>(bytes, &stream)` of an
/// [`OwnedPool`] on an [`OwnedStream`], freed by dropping the [`OwnedAlloc`] — what a
/// long-lived engine does.
#[derive(Debug)]
pub struct SomaOwned {
    pool: OwnedPool,
    stream: OwnedStream,
}

impl SomaOwned {
    /// Drives `pool` with allocations for `stream`.
    pub fn new(pool: OwnedPool, stream: OwnedStream) -> Self {
        SomaOwned { pool, stream }
    }
}

impl Allocator for SomaOwned {
    type Handle = OwnedAlloc<u8>;
    fn name(&self) -> &'static str {
        "soma-owned"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<OwnedAlloc<u8>> {
        self.pool.alloc_async::<u8>(bytes as usize, &self.stream).ok()
    }
    #[inline]
    fn free(&mut self, handle: OwnedAlloc<u8>) {
        drop(handle);
    }
    fn reserved_high(&self) -> u64 {
        self.pool.stats().reserved_high
    }
    fn driver_calls(&self) -> DriverCalls {
        let st = self.pool.stats();
        DriverCalls::segments(st.map_calls, st.unmap_calls)
    }
}
