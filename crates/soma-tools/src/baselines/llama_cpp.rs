//! A replica of llama.cpp's CANN priority pool (`ggml_cann_pool_buf_prio` in
//! `ggml/src/ggml-cann/ggml-cann.cpp`).

use std::collections::BTreeSet;
use std::time::Duration;

use super::Allocator;
use crate::driver_cost::DriverCalls;
use crate::{round_up, MIB};

/// Requests are rounded up to multiples of this.
const ALIGNMENT: u64 = 128;
/// A free buffer serves a request only if it is at most this much larger.
const MAX_REUSE_MARGIN: u64 = 4 * MIB;
/// Only free buffers larger than this are ever given back to the driver.
const MIN_FREE_MARGIN: u64 = MIB;
/// Free buffers unused for longer than this are given back.
const CLEAN_AGE: Duration = Duration::from_millis(100);

/// One `aclrtMalloc` buffer.
#[derive(Clone, Copy, Debug)]
struct Buffer {
    addr: u64,
    size: u64,
    /// The clock when it was last freed; `None` while in use.
    freed_at: Option<u64>,
}

/// llama.cpp's CANN priority pool (selected with `GGML_CANN_MEM_POOL=prio`): every buffer is
/// one `aclrtMalloc` of exactly the (128 B-rounded) request; buffers are never split or
/// merged.
///
/// * Allocation looks at the free buffers from the smallest up and takes the first that
///   holds the request, provided it is at most 4 MiB larger; the free buffers it looks at
///   before (all of them when none fits) are freed (`aclrtFree`) when larger than 1 MiB and
///   unused for over 100 ms; without a fitting buffer it calls `aclrtMalloc` for the
///   request's size.
/// * Free returns the buffer to the free set, stamped with the time.
///
/// The replay has no clock, so the replica counts time in its own calls: a call stands for
/// [`LlamaCppPrio::CALL_TIME`], the Ascend-like model's kernel launch — a program calls the
/// allocator about once per kernel it launches, and a launch takes at least that — and
/// "unused for over 100 ms" becomes "unused for over 20 000 calls". Equal sizes are looked
/// at in address order (the pool's heap leaves their order unspecified). The replica finds
/// the buffer through ordered sets, in logarithmic time; the pool itself pops every smaller
/// free buffer off its heap and pushes it back, so its host time grows with the number of
/// free buffers smaller than the request: the replica's host time is a lower bound of it.
///
/// llama.cpp uses the pool for the temporary buffers of its operators; the model's weights
/// and KV cache are allocated outside it. Its default pool on devices with virtual memory
/// management (`ggml_cann_pool_vmm`) is a stack that requires frees in reverse order, which
/// a trace does not follow.
///
/// Reserved memory is the sum of the buffers held; driver calls are their mallocs and frees.
#[derive(Debug)]
pub struct LlamaCppPrio {
    /// Every buffer held, by index (vacant slots in `vacant`).
    buffers: Vec<Buffer>,
    vacant: Vec<u32>,
    /// Free buffers by `(size, address, index)`.
    by_size: BTreeSet<(u64, u64, u32)>,
    /// Free buffers larger than 1 MiB not yet stale, by `(freed at, index)`.
    aging: BTreeSet<(u64, u32)>,
    /// Free buffers larger than 1 MiB that are stale, by `(size, address, index)`.
    stale: BTreeSet<(u64, u64, u32)>,
    next_addr: u64,
    /// Calls so far.
    clock: u64,
    clean_after: u64,
    reserved: u64,
    reserved_high: u64,
    calls: DriverCalls,
}

impl Default for LlamaCppPrio {
    fn default() -> Self {
        LlamaCppPrio::new()
    }
}

impl LlamaCppPrio {
    /// How long one call of the allocator stands for: `LatencyModel::ascend_like().launch`.
    pub const CALL_TIME: Duration = Duration::from_micros(5);

    /// An empty pool.
    pub fn new() -> LlamaCppPrio {
        LlamaCppPrio {
            buffers: Vec::new(),
            vacant: Vec::new(),
            by_size: BTreeSet::new(),
            aging: BTreeSet::new(),
            stale: BTreeSet::new(),
            next_addr: 0,
            clock: 0,
            clean_after: (CLEAN_AGE.as_nanos() / Self::CALL_TIME.as_nanos()) as u64,
            reserved: 0,
            reserved_high: 0,
            calls: DriverCalls::default(),
        }
    }

    /// Bytes of the buffers held now.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Address and size of the live buffer `handle` (for tests and tools).
    pub fn range_of(&self, handle: u32) -> (u64, u64) {
        let b = &self.buffers[handle as usize];
        (b.addr, b.size)
    }

    /// Moves the free buffers that have been unused for over the clean age to `stale`.
    fn age(&mut self) {
        while let Some(&(at, i)) = self.aging.first() {
            if self.clock - at <= self.clean_after {
                break;
            }
            self.aging.pop_first();
            let b = self.buffers[i as usize];
            self.stale.insert((b.size, b.addr, i));
        }
    }

    /// Frees the stale buffers the search looked at: those ordered before `fit`, or all
    /// when nothing fits.
    fn clean(&mut self, fit: Option<(u64, u64, u32)>) {
        let looked_at: Vec<(u64, u64, u32)> = match fit {
            Some(f) => self.stale.range(..f).copied().collect(),
            None => self.stale.iter().copied().collect(),
        };
        for key in looked_at {
            self.stale.remove(&key);
            self.by_size.remove(&key);
            self.vacant.push(key.2);
            self.reserved -= key.0;
            self.calls.free += 1;
        }
    }
}

impl Allocator for LlamaCppPrio {
    /// The buffer's index.
    type Handle = u32;
    fn name(&self) -> &'static str {
        "llama-cpp"
    }
    fn alloc(&mut self, bytes: u64) -> Option<u32> {
        self.clock += 1;
        self.age();
        let size = round_up(bytes.max(1), ALIGNMENT);
        let fit = self
            .by_size
            .range((size, 0, 0)..)
            .next()
            .copied()
            .filter(|&(s, _, _)| s - size <= MAX_REUSE_MARGIN);
        self.clean(fit);
        if let Some(key) = fit {
            self.by_size.remove(&key);
            let b = &mut self.buffers[key.2 as usize];
            let at = b.freed_at.take().expect("a free buffer has a time");
            if !self.aging.remove(&(at, key.2)) {
                self.stale.remove(&key);
            }
            return Some(key.2);
        }
        let addr = self.next_addr;
        self.next_addr = round_up(addr + size, ALIGNMENT);
        let b = Buffer { addr, size, freed_at: None };
        let i = if let Some(i) = self.vacant.pop() {
            self.buffers[i as usize] = b;
            i
        } else {
            self.buffers.push(b);
            (self.buffers.len() - 1) as u32
        };
        self.reserved += size;
        self.reserved_high = self.reserved_high.max(self.reserved);
        self.calls.malloc += 1;
        Some(i)
    }
    fn free(&mut self, i: u32) {
        self.clock += 1;
        let b = &mut self.buffers[i as usize];
        b.freed_at = Some(self.clock);
        let b = *b;
        self.by_size.insert((b.size, b.addr, i));
        if b.size > MIN_FREE_MARGIN {
            self.aging.insert((self.clock, i));
        }
    }
    fn reserved_high(&self) -> u64 {
        self.reserved_high
    }
    fn driver_calls(&self) -> DriverCalls {
        self.calls
    }
}
