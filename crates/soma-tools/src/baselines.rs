//! Every allocator under test behind one trait, [`Allocator`].
//!
//! | type | what | unit / rounding | `reserved_high` is |
//! |---|---|---|---|
//! | [`SomaApi`] | soma's public API: `alloc_async::<u8>` → `PoolAlloc` dropped to free, on the software NPU | pool alignment (512 B default) | the pool's `reserved_high` (physical memory mapped, high-water) |
//! | [`SomaApi`] named `soma-retain` ([`SomaApi::named`]) | the same over a pool built with `MemPool::builder().recycle_on_growth(false)`: growth never unmaps free segments | pool alignment (512 B default) | the pool's `reserved_high` |
//! | [`SomaEngine`] | soma's engine alone, over a counting fake backing, one stream whose frees count as complete | 512 B | the engine's `reserved_high` (bytes the fake backing had mapped, high-water) |
//! | [`SomaEngine`] named `soma-engine-retain` ([`SomaEngine::with_recycling`]`(…, false)`) | the engine alone with `Engine::set_recycle_on_growth(false)`: growth only maps | 512 B | the engine's `reserved_high` |
//! | [`OffsetAlloc`] | the `offset-allocator` crate (Sebastian Aaltonen's O(1) offset allocator) | 512 B units (its sizes are `u32`) | high-water end offset, rounded up to 2 MiB |
//! | [`Tlsf`] | a TLSF (rlsf's algorithm: 2-level bitmaps, good fit, immediate coalescing) over an offset space, with out-of-band block records | 512 B | high-water end offset, rounded up to 2 MiB |
//! | [`SomaReplica`] | CANN SOMA's algorithm: every request rounded up to 2 MiB, best fit over a `BTreeSet` of `(size, address)` free segments, neighbour merge | 2 MiB | high-water end offset (already 2 MiB multiples) |
//! | [`SeedFirstFit`] | the seed's pool: first fit over a free list sorted by offset, a merge pass over the whole list on every free | 512 B | high-water end offset, rounded up to 2 MiB |
//! | [`DriverPath`] | the plain driver: `DeviceHal::malloc` / `free` per allocation (soma-sim) | 2 MiB (the simulator rounds to its granularity) | high-water of Σ live granule-rounded sizes |
//!
//! Why not `rlsf` itself: rlsf manages *real* memory — it writes its block headers into the
//! pool it is given and hands out pointers — so it cannot serve an offset space (a device
//! range the host cannot touch) without backing that range with host memory. [`Tlsf`] is
//! the same algorithm with the headers kept in a side table, which is what a device pool
//! needs.
//!
//! The pure offset allocators (offset-allocator, TLSF, SOMA replica, seed) carve a
//! conceptually unbounded range from address 0 upwards, as a pool that maps on demand at
//! the top of its used space would; "reserved" for them is the highest end offset ever
//! handed out, in granules. They never give memory back, so that is also what they would
//! have mapped.

use std::collections::{BTreeMap, BTreeSet};

use soma::hal::{DeviceHal, DevicePtr};
use soma::{MemPool, PoolAlloc, Stream};
use soma_core::engine::{BlockId, Engine, EngineConfig, EngineStats, FreeTag};
use soma_engine::testing::{FakeBacking, TestOrder};

use crate::{round_up, GRANULE};

/// Block size unit of every baseline that does not round to 2 MiB (soma's default alignment).
pub const UNIT: u64 = 512;

/// One allocator under test: allocate `bytes`, free by handle, report peak reserved memory.
///
/// Every benchmark and the replay tool drive allocators only through this trait, with static
/// dispatch, so each figure is the same loop for every allocator.
pub trait Allocator {
    /// What `alloc` returns and `free` takes back.
    type Handle;
    /// Short name used in benchmark ids and tables.
    fn name(&self) -> &'static str;
    /// Allocates `bytes` (> 0); `None` when out of memory.
    fn alloc(&mut self, bytes: u64) -> Option<Self::Handle>;
    /// Frees an allocation of this allocator.
    fn free(&mut self, handle: Self::Handle);
    /// Peak reserved bytes so far, per the definition in the [module docs](self).
    fn reserved_high(&self) -> u64;
    /// Driver map and unmap calls so far, `(maps, unmaps)`, for the allocators that map
    /// memory on demand (soma's public API and engine); `None` for the others (the pure
    /// offset allocators never map, the driver path allocates instead).
    fn driver_calls(&self) -> Option<(u64, u64)> {
        None
    }
}

// ---------------------------------------------------------------------------------------
// soma: engine alone

/// soma's engine alone (no device, no lock): stream 0, frees tagged with increasing
/// positions, every free complete (what the public API sees on the software NPU when no
/// kernel is pending), over the engine's counting fake backing.
#[derive(Debug)]
pub struct SomaEngine {
    engine: Engine,
    backing: FakeBacking,
    order: TestOrder,
    pos: u64,
    recycle: bool,
}

impl SomaEngine {
    /// An engine over a `range` of bytes (a multiple of 2 MiB) with 2 MiB granules and
    /// alignment `alignment`, recycling on growth (the engine's default); named
    /// `soma-engine`.
    ///
    /// # Panics
    /// An invalid configuration.
    pub fn new(range: u64, alignment: u64) -> SomaEngine {
        SomaEngine::with_recycling(range, alignment, true)
    }

    /// As [`SomaEngine::new`], with `Engine::set_recycle_on_growth(recycle)`. `false` (growth
    /// only maps, never unmaps free segments elsewhere) is named `soma-engine-retain`.
    ///
    /// # Panics
    /// An invalid configuration.
    pub fn with_recycling(range: u64, alignment: u64, recycle: bool) -> SomaEngine {
        let mut engine = Engine::new(EngineConfig {
            range_size: range,
            granularity: GRANULE,
            alignment,
            index_by_offset: false,
        })
        .expect("engine configuration");
        engine.set_recycle_on_growth(recycle);
        SomaEngine {
            engine,
            backing: FakeBacking::counting(),
            order: TestOrder::complete(),
            pos: 0,
            recycle,
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
        if self.recycle {
            "soma-engine"
        } else {
            "soma-engine-retain"
        }
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
    fn driver_calls(&self) -> Option<(u64, u64)> {
        let st = self.engine.stats();
        Some((st.map_calls, st.unmap_calls))
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
    /// a pool built with `recycle_on_growth(false)` `soma-retain`). The name is the caller's
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
    fn driver_calls(&self) -> Option<(u64, u64)> {
        let st = self.pool.stats();
        Some((st.map_calls, st.unmap_calls))
    }
}

// ---------------------------------------------------------------------------------------
// the plain driver path

/// One `DeviceHal::malloc` / `free` per allocation (no pool at all).
pub struct DriverPath<'a> {
    hal: &'a dyn DeviceHal,
    granularity: u64,
    live: u64,
    high: u64,
}

impl<'a> DriverPath<'a> {
    /// Allocates through `hal` (whose device has granularity `granularity`).
    pub fn new(hal: &'a dyn DeviceHal, granularity: u64) -> Self {
        DriverPath { hal, granularity, live: 0, high: 0 }
    }
}

impl std::fmt::Debug for DriverPath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverPath").field("live", &self.live).field("high", &self.high).finish()
    }
}

impl Allocator for DriverPath<'_> {
    type Handle = (DevicePtr, u64);
    fn name(&self) -> &'static str {
        "driver"
    }
    fn alloc(&mut self, bytes: u64) -> Option<(DevicePtr, u64)> {
        let p = self.hal.malloc(bytes).ok()?;
        let size = round_up(bytes, self.granularity);
        self.live += size;
        self.high = self.high.max(self.live);
        Some((p, size))
    }
    fn free(&mut self, (p, size): (DevicePtr, u64)) {
        self.hal.free(p).expect("driver free");
        self.live -= size;
    }
    fn reserved_high(&self) -> u64 {
        self.high
    }
}

// ---------------------------------------------------------------------------------------
// offset-allocator

/// The `offset-allocator` crate, in units of [`UNIT`] bytes.
pub struct OffsetAlloc {
    inner: offset_allocator::Allocator<u32>,
    high_end_units: u64,
}

impl OffsetAlloc {
    /// An allocator over `range` bytes (at most `u32::MAX` units of 512 B = 2 TiB) with room
    /// for `max_allocs` simultaneous allocations plus free regions.
    pub fn new(range: u64, max_allocs: u32) -> Self {
        let units = u32::try_from(range / UNIT).unwrap_or(u32::MAX - 1);
        OffsetAlloc {
            inner: offset_allocator::Allocator::with_max_allocs(units, max_allocs),
            high_end_units: 0,
        }
    }
}

impl std::fmt::Debug for OffsetAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffsetAlloc").field("high_end_units", &self.high_end_units).finish()
    }
}

impl Allocator for OffsetAlloc {
    type Handle = offset_allocator::Allocation<u32>;
    fn name(&self) -> &'static str {
        "offset-allocator"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<Self::Handle> {
        let units = u32::try_from(bytes.div_ceil(UNIT)).ok()?;
        let a = self.inner.allocate(units)?;
        self.high_end_units = self.high_end_units.max(u64::from(a.offset) + u64::from(units));
        Some(a)
    }
    #[inline]
    fn free(&mut self, handle: Self::Handle) {
        self.inner.free(handle);
    }
    fn reserved_high(&self) -> u64 {
        round_up(self.high_end_units * UNIT, GRANULE)
    }
}

// ---------------------------------------------------------------------------------------
// TLSF over offsets

const NIL: u32 = u32::MAX;
const TLSF_SL_LOG2: u32 = 4;
const TLSF_SL: usize = 1 << TLSF_SL_LOG2;
const TLSF_FL: usize = 48;

#[derive(Clone, Copy, Debug)]
struct TBlock {
    off: u64,
    size: u64,
    prev_phys: u32,
    next_phys: u32,
    prev_free: u32,
    next_free: u32,
    free: bool,
}

/// A TLSF allocator (rlsf's algorithm: 16 second-level classes, good-fit search from the
/// class above the request, split on allocation, immediate coalescing on free) over an offset
/// space in units of [`UNIT`] bytes. Block headers live in a side table (a slab with a vacant
/// chain), not in the managed memory.
#[derive(Debug)]
pub struct Tlsf {
    blocks: Vec<TBlock>,
    vacant: u32,
    fl_bitmap: u64,
    sl_bitmap: [u16; TLSF_FL],
    heads: Vec<u32>,
    high_end: u64,
}

#[inline]
fn tlsf_mapping(units: u64) -> (usize, usize) {
    if units < TLSF_SL as u64 {
        (0, units as usize)
    } else {
        let msb = 63 - units.leading_zeros();
        ((msb - TLSF_SL_LOG2 + 1) as usize, ((units >> (msb - TLSF_SL_LOG2)) as usize) - TLSF_SL)
    }
}

impl Tlsf {
    /// A TLSF over `range` bytes.
    pub fn new(range: u64) -> Tlsf {
        let mut t = Tlsf {
            blocks: Vec::new(),
            vacant: NIL,
            fl_bitmap: 0,
            sl_bitmap: [0; TLSF_FL],
            heads: vec![NIL; TLSF_FL * TLSF_SL],
            high_end: 0,
        };
        let b = t.take(TBlock {
            off: 0,
            size: range / UNIT,
            prev_phys: NIL,
            next_phys: NIL,
            prev_free: NIL,
            next_free: NIL,
            free: true,
        });
        t.link(b);
        t
    }

    fn take(&mut self, b: TBlock) -> u32 {
        if self.vacant != NIL {
            let i = self.vacant;
            self.vacant = self.blocks[i as usize].next_free;
            self.blocks[i as usize] = b;
            i
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    fn give_back(&mut self, i: u32) {
        self.blocks[i as usize].next_free = self.vacant;
        self.vacant = i;
    }

    #[inline]
    fn link(&mut self, i: u32) {
        let (fl, sl) = tlsf_mapping(self.blocks[i as usize].size);
        let slot = fl * TLSF_SL + sl;
        let head = self.heads[slot];
        {
            let b = &mut self.blocks[i as usize];
            b.prev_free = NIL;
            b.next_free = head;
            b.free = true;
        }
        if head != NIL {
            self.blocks[head as usize].prev_free = i;
        }
        self.heads[slot] = i;
        self.sl_bitmap[fl] |= 1 << sl;
        self.fl_bitmap |= 1 << fl;
    }

    #[inline]
    fn unlink(&mut self, i: u32) {
        let b = self.blocks[i as usize];
        let (fl, sl) = tlsf_mapping(b.size);
        if b.prev_free != NIL {
            self.blocks[b.prev_free as usize].next_free = b.next_free;
        } else {
            let slot = fl * TLSF_SL + sl;
            self.heads[slot] = b.next_free;
            if b.next_free == NIL {
                self.sl_bitmap[fl] &= !(1 << sl);
                if self.sl_bitmap[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        if b.next_free != NIL {
            self.blocks[b.next_free as usize].prev_free = b.prev_free;
        }
        self.blocks[i as usize].free = false;
    }

    /// Byte offset and size of the live block `handle` (for tests and tools).
    pub fn range_of(&self, handle: u32) -> (u64, u64) {
        let b = &self.blocks[handle as usize];
        (b.off * UNIT, b.size * UNIT)
    }

    /// The head of the first non-empty class whose every block holds `units`.
    #[inline]
    fn find(&self, units: u64) -> Option<u32> {
        let rounded = if units < TLSF_SL as u64 {
            units
        } else {
            let msb = 63 - units.leading_zeros();
            units.checked_add((1u64 << (msb - TLSF_SL_LOG2)) - 1)?
        };
        let (fl, sl) = tlsf_mapping(rounded);
        if fl >= TLSF_FL {
            return None;
        }
        let sl_bits = u32::from(self.sl_bitmap[fl]) & (u32::MAX << sl);
        let (fl, sl) = if sl_bits != 0 {
            (fl, sl_bits.trailing_zeros() as usize)
        } else {
            let fl_bits = self.fl_bitmap & (u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0));
            if fl_bits == 0 {
                return None;
            }
            let fl = fl_bits.trailing_zeros() as usize;
            (fl, self.sl_bitmap[fl].trailing_zeros() as usize)
        };
        Some(self.heads[fl * TLSF_SL + sl])
    }
}

impl Allocator for Tlsf {
    type Handle = u32;
    fn name(&self) -> &'static str {
        "tlsf"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<u32> {
        let units = bytes.div_ceil(UNIT).max(1);
        let i = self.find(units)?;
        self.unlink(i);
        let b = self.blocks[i as usize];
        if b.size > units {
            let rest = self.take(TBlock {
                off: b.off + units,
                size: b.size - units,
                prev_phys: i,
                next_phys: b.next_phys,
                prev_free: NIL,
                next_free: NIL,
                free: true,
            });
            if b.next_phys != NIL {
                self.blocks[b.next_phys as usize].prev_phys = rest;
            }
            let m = &mut self.blocks[i as usize];
            m.size = units;
            m.next_phys = rest;
            self.link(rest);
        }
        self.high_end = self.high_end.max(b.off + units);
        Some(i)
    }
    #[inline]
    fn free(&mut self, handle: u32) {
        let mut i = handle;
        let p = self.blocks[i as usize].prev_phys;
        if p != NIL && self.blocks[p as usize].free {
            self.unlink(p);
            let b = self.blocks[i as usize];
            let pb = &mut self.blocks[p as usize];
            pb.size += b.size;
            pb.next_phys = b.next_phys;
            if b.next_phys != NIL {
                self.blocks[b.next_phys as usize].prev_phys = p;
            }
            self.give_back(i);
            i = p;
        }
        let n = self.blocks[i as usize].next_phys;
        if n != NIL && self.blocks[n as usize].free {
            self.unlink(n);
            let nb = self.blocks[n as usize];
            let b = &mut self.blocks[i as usize];
            b.size += nb.size;
            b.next_phys = nb.next_phys;
            if nb.next_phys != NIL {
                self.blocks[nb.next_phys as usize].prev_phys = i;
            }
            self.give_back(n);
        }
        self.link(i);
    }
    fn reserved_high(&self) -> u64 {
        round_up(self.high_end * UNIT, GRANULE)
    }
}

// ---------------------------------------------------------------------------------------
// CANN SOMA replica

/// CANN SOMA's algorithm: sizes rounded up to 2 MiB, best fit (smallest size, then lowest
/// address) over a `BTreeSet<(size, address)>` of free segments, merge with free neighbours
/// (found through a `BTreeMap<address, size>`) on free.
#[derive(Debug)]
pub struct SomaReplica {
    by_size: BTreeSet<(u64, u64)>,
    by_addr: BTreeMap<u64, u64>,
    high_end: u64,
}

impl SomaReplica {
    /// A replica managing `range` bytes.
    pub fn new(range: u64) -> SomaReplica {
        let range = range / GRANULE * GRANULE;
        SomaReplica {
            by_size: BTreeSet::from([(range, 0)]),
            by_addr: BTreeMap::from([(0, range)]),
            high_end: 0,
        }
    }
}

impl Allocator for SomaReplica {
    type Handle = (u64, u64);
    fn name(&self) -> &'static str {
        "soma-replica"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<(u64, u64)> {
        let size = round_up(bytes, GRANULE);
        let &(seg, addr) = self.by_size.range((size, 0)..).next()?;
        self.by_size.remove(&(seg, addr));
        self.by_addr.remove(&addr);
        if seg > size {
            self.by_size.insert((seg - size, addr + size));
            self.by_addr.insert(addr + size, seg - size);
        }
        self.high_end = self.high_end.max(addr + size);
        Some((addr, size))
    }
    #[inline]
    fn free(&mut self, (mut addr, mut size): (u64, u64)) {
        if let Some((&pa, &ps)) = self.by_addr.range(..addr).next_back() {
            if pa + ps == addr {
                self.by_addr.remove(&pa);
                self.by_size.remove(&(ps, pa));
                addr = pa;
                size += ps;
            }
        }
        if let Some(ns) = self.by_addr.remove(&(addr + size)) {
            self.by_size.remove(&(ns, addr + size));
            size += ns;
        }
        self.by_addr.insert(addr, size);
        self.by_size.insert((size, addr));
    }
    fn reserved_high(&self) -> u64 {
        self.high_end
    }
}

// ---------------------------------------------------------------------------------------
// the seed's pool

/// The seed's pool: a free list of `(offset, size)` kept sorted by offset, first fit on
/// allocation, and on every free an insertion followed by a merge pass over the whole list.
#[derive(Debug)]
pub struct SeedFirstFit {
    free: Vec<(u64, u64)>,
    high_end: u64,
}

impl SeedFirstFit {
    /// A pool managing `range` bytes.
    pub fn new(range: u64) -> SeedFirstFit {
        SeedFirstFit { free: vec![(0, range)], high_end: 0 }
    }

    /// A pool whose free list is `free` (sorted, non-adjacent ranges), i.e. the state the
    /// API would reach through a sequence of allocations and frees; lets the benches set up
    /// a million-hole state without the quadratic cost of a million merge passes.
    ///
    /// # Panics
    /// `free` is not sorted by offset, overlaps, or holds adjacent ranges.
    pub fn from_free_list(free: Vec<(u64, u64)>, high_end: u64) -> SeedFirstFit {
        for w in free.windows(2) {
            assert!(w[0].0 + w[0].1 < w[1].0, "free list must be sorted and merged");
        }
        SeedFirstFit { free, high_end }
    }

    /// The free list (for tests).
    pub fn free_list(&self) -> &[(u64, u64)] {
        &self.free
    }
}

impl Allocator for SeedFirstFit {
    type Handle = (u64, u64);
    fn name(&self) -> &'static str {
        "seed-first-fit"
    }
    #[inline]
    fn alloc(&mut self, bytes: u64) -> Option<(u64, u64)> {
        let size = round_up(bytes, UNIT);
        let i = self.free.iter().position(|&(_, s)| s >= size)?;
        let (off, s) = self.free[i];
        if s == size {
            self.free.remove(i);
        } else {
            self.free[i] = (off + size, s - size);
        }
        self.high_end = self.high_end.max(off + size);
        Some((off, size))
    }
    #[inline]
    fn free(&mut self, (off, size): (u64, u64)) {
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, size));
        // The merge pass: one sweep over the whole list, merging adjacent ranges.
        let mut w = 0;
        for r in 1..self.free.len() {
            let (o, s) = self.free[r];
            let last = &mut self.free[w];
            if last.0 + last.1 == o {
                last.1 += s;
            } else {
                w += 1;
                self.free[w] = (o, s);
            }
        }
        self.free.truncate(w + 1);
    }
    fn reserved_high(&self) -> u64 {
        round_up(self.high_end, GRANULE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MIB;

    /// Random alloc/free against a shadow list of live ranges: no overlap, sizes honoured,
    /// everything merges back at the end (checked by allocating the whole range again).
    fn exercise<A: Allocator>(
        a: &mut A,
        range: u64,
        offset_of: impl Fn(&A, &A::Handle) -> (u64, u64),
    ) {
        let mut live: Vec<(A::Handle, u64, u64)> = Vec::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for step in 0..4000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 3 != 0 || live.is_empty() {
                let bytes = 1 + (x >> 20) % (3 * MIB);
                let h = a.alloc(bytes).expect("alloc");
                let (off, size) = offset_of(a, &h);
                assert!(size >= bytes, "step {step}: size {size} < {bytes}");
                assert!(off + size <= range);
                for &(_, o, s) in &live {
                    assert!(off + size <= o || o + s <= off, "overlap at step {step}");
                }
                live.push((h, off, size));
            } else {
                let i = (x >> 8) as usize % live.len();
                let (h, _, _) = live.swap_remove(i);
                a.free(h);
            }
        }
        for (h, _, _) in live {
            a.free(h);
        }
        // Fully coalesced: the whole range is one block again.
        let h = a.alloc(range).expect("everything merged back");
        assert_eq!(offset_of(a, &h).0, 0);
        assert!(a.reserved_high() >= GRANULE);
    }

    const RANGE: u64 = 1 << 34;

    #[test]
    fn tlsf_is_a_correct_allocator() {
        let mut t = Tlsf::new(RANGE);
        exercise(&mut t, RANGE, |t, &h| t.range_of(h));
    }

    #[test]
    fn offset_allocator_is_a_correct_allocator() {
        let mut o = OffsetAlloc::new(1 << 40, 1 << 16);
        // offset-allocator's handle carries the offset; sizes are the requested units.
        let mut live = Vec::new();
        for i in 1..100u64 {
            live.push(o.alloc(i * 1000).unwrap());
        }
        for h in live {
            o.free(h);
        }
        assert!(o.reserved_high() >= GRANULE);
        let h = o.alloc(1 << 39).unwrap();
        assert_eq!(h.offset, 0);
    }

    #[test]
    fn soma_replica_is_a_correct_allocator() {
        let mut r = SomaReplica::new(RANGE);
        exercise(&mut r, RANGE, |_, &(o, s)| (o, s));
        let mut r = SomaReplica::new(RANGE);
        let a = r.alloc(1).unwrap();
        let b = r.alloc(3 * MIB).unwrap();
        assert_eq!((a, b), ((0, 2 * MIB), (2 * MIB, 4 * MIB)));
        r.free(a);
        // best fit: the 2 MiB hole at 0, not the tail
        assert_eq!(r.alloc(100).unwrap(), (0, 2 * MIB));
        assert_eq!(r.reserved_high(), 6 * MIB);
    }

    #[test]
    fn seed_is_a_correct_allocator() {
        let mut s = SeedFirstFit::new(RANGE);
        exercise(&mut s, RANGE, |_, &(o, s)| (o, s));
        let mut s = SeedFirstFit::new(RANGE);
        let a = s.alloc(1000).unwrap();
        let b = s.alloc(1000).unwrap();
        let c = s.alloc(1000).unwrap();
        s.free(a);
        s.free(c);
        assert_eq!(s.free_list(), &[(0, 1024), (2048, RANGE - 2048)]);
        s.free(b);
        assert_eq!(s.free_list(), &[(0, RANGE)]);
        let built = SeedFirstFit::from_free_list(vec![(0, 512), (1024, RANGE - 1024)], 1024);
        assert_eq!(built.free_list().len(), 2);
    }

    #[test]
    fn engine_and_api_serve_and_account() {
        let mut e = SomaEngine::new(RANGE, 512);
        let hs: Vec<_> = (1..50u64).map(|i| e.alloc(i * 100_000).unwrap()).collect();
        let used = e.stats().used;
        assert!(used >= (1..50u64).map(|i| i * 100_000).sum::<u64>());
        for h in hs {
            e.free(h);
        }
        assert_eq!(e.stats().used, 0);
        assert_eq!(e.reserved_high(), e.backing().mapped_high);

        let npu = soma::sim::Npu::builder().capacity(4 << 30).build().unwrap();
        let dev = npu.device(0).unwrap();
        let s = dev.create_stream().unwrap();
        let pool = MemPool::builder().build(&dev).unwrap();
        let mut api = SomaApi::new(&pool, &s);
        let h = api.alloc(3 * MIB).unwrap();
        assert_eq!(h.byte_len(), 3 * MIB);
        api.free(h);
        assert_eq!(api.reserved_high(), 4 * MIB);

        let mut d = DriverPath::new(&**dev.hal(), dev.info().granularity);
        let h = d.alloc(1).unwrap();
        let h2 = d.alloc(3 * MIB).unwrap();
        assert_eq!(d.reserved_high(), 6 * MIB);
        d.free(h);
        d.free(h2);
        assert_eq!(d.driver_calls(), None);
    }

    #[test]
    fn retain_variants_are_named_and_never_unmap_on_growth() {
        use crate::workload::{free_all, random_allocations, replay, SEED};
        let w = random_allocations(300, 4, 64, SEED);

        let mut e = SomaEngine::new(RANGE, 512);
        let mut r = SomaEngine::with_recycling(RANGE, 512, false);
        assert_eq!((e.name(), r.name()), ("soma-engine", "soma-engine-retain"));
        for _ in 0..3 {
            let h = replay(&mut r, &w.ops, w.slots);
            free_all(&mut r, h);
            let h = replay(&mut e, &w.ops, w.slots);
            free_all(&mut e, h);
        }
        let (maps, unmaps) = r.driver_calls().unwrap();
        assert!(maps > 0);
        assert_eq!(unmaps, 0, "growth without recycling only maps");
        assert_eq!(e.driver_calls(), Some((e.stats().map_calls, e.stats().unmap_calls)));

        let npu = soma::sim::Npu::builder().capacity(4 << 30).build().unwrap();
        let dev = npu.device(0).unwrap();
        let s = dev.create_stream().unwrap();
        let pool = MemPool::builder().recycle_on_growth(false).build(&dev).unwrap();
        let mut api = SomaApi::named(&pool, &s, "soma-retain");
        assert_eq!(api.name(), "soma-retain");
        for _ in 0..2 {
            let h = replay(&mut api, &w.ops, w.slots);
            free_all(&mut api, h);
        }
        let (maps, unmaps) = api.driver_calls().unwrap();
        assert!(maps > 0);
        assert_eq!(unmaps, 0, "growth without recycling only maps");
        assert_eq!(SomaApi::new(&pool, &s).name(), "soma");
    }
}
