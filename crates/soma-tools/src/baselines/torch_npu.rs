//! A replica of torch_npu's caching allocator (`NPUCachingAllocator`, PyTorch's
//! `CUDACachingAllocator` ported to Ascend), on one stream.

use std::collections::BTreeSet;

use super::Allocator;
use crate::driver_cost::DriverCalls;
use crate::{round_up, MIB};

/// Every request is padded by this many bytes before rounding (torch_npu's `round_size`).
const PAD: u64 = 32;
/// Sizes are rounded up to multiples of this (and are at least this).
const MIN_BLOCK: u64 = 512;
/// The largest request served from the small pool.
const SMALL_SIZE: u64 = MIB;
/// The segment the small pool allocates when it has no fitting block.
const SMALL_SEGMENT: u64 = 2 * MIB;
/// Requests of the large pool below this share a [`LARGE_SEGMENT`].
const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// The segment the large pool allocates for requests below [`MIN_LARGE_ALLOC`].
const LARGE_SEGMENT: u64 = 20 * MIB;
/// Larger requests get a segment of their own size, rounded up to this.
const ROUND_LARGE: u64 = 2 * MIB;

/// No block (the end of a segment's chain).
const NIL: u32 = u32::MAX;

/// One block: a whole segment or a piece of one, linked to its neighbours in the segment.
#[derive(Clone, Copy, Debug)]
struct Block {
    addr: u64,
    size: u64,
    prev: u32,
    next: u32,
    small: bool,
    allocated: bool,
}

/// torch_npu's caching allocator as it runs by default (no `expandable_segments`, no
/// `max_split_size_mb`, no garbage-collection threshold), on one stream:
///
/// * a request of `n` bytes becomes `n + 32` rounded up to a multiple of 512 B;
/// * up to 1 MiB it is served from the small pool, above from the large pool;
/// * the pool's best fit: the free block of the smallest size, then lowest address, that
///   holds the request;
/// * without one, a new segment (one `aclrtMalloc`): 2 MiB for the small pool, 20 MiB for
///   large requests under 10 MiB, else the request rounded up to 2 MiB;
/// * the block found is split when what remains is at least 512 B (small pool) or more than
///   1 MiB (large pool), the remainder staying free in the pool;
/// * a free merges with the free neighbours of its segment; segments are never merged and
///   stay cached until [`TorchNpu::empty_cache`], which frees (one `aclrtFree` each) the
///   segments that are wholly free; the allocator does that itself, then retries, when a new
///   segment would exceed the device's capacity.
///
/// Simplified: one stream (torch_npu keys free blocks by stream too, and defers the reuse
/// of a block used on other streams through events), no statistics, no out-of-memory
/// observers. Addresses are offsets in a conceptually unbounded space where every segment
/// starts at a fresh 2 MiB-aligned offset. As in torch_npu, a block is linked to its
/// neighbours in the segment and free blocks sit in an ordered set per pool.
///
/// Reserved memory is the sum of the segments held; driver calls are the segments' mallocs
/// and frees.
#[derive(Debug)]
pub struct TorchNpu {
    /// Every block, live or free, by index (vacant slots in `vacant`).
    blocks: Vec<Block>,
    vacant: Vec<u32>,
    /// Free blocks by `(size, address, index)`.
    small_free: BTreeSet<(u64, u64, u32)>,
    large_free: BTreeSet<(u64, u64, u32)>,
    next_segment: u64,
    capacity: u64,
    reserved: u64,
    reserved_high: u64,
    calls: DriverCalls,
}

/// torch_npu's `round_size`: the pad, then 512 B multiples.
fn rounded(bytes: u64) -> u64 {
    round_up(bytes + PAD, MIN_BLOCK)
}

/// torch_npu's `get_allocation_size`: the segment a request of `size` (rounded) bytes makes.
fn segment_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_SEGMENT
    } else if size < MIN_LARGE_ALLOC {
        LARGE_SEGMENT
    } else {
        round_up(size, ROUND_LARGE)
    }
}

impl TorchNpu {
    /// An allocator on a device of `capacity` bytes.
    pub fn new(capacity: u64) -> TorchNpu {
        TorchNpu {
            blocks: Vec::new(),
            vacant: Vec::new(),
            small_free: BTreeSet::new(),
            large_free: BTreeSet::new(),
            next_segment: 0,
            capacity,
            reserved: 0,
            reserved_high: 0,
            calls: DriverCalls::default(),
        }
    }

    /// Bytes of the segments held now.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Address and size of the live block `handle` (for tests and tools).
    pub fn range_of(&self, handle: u32) -> (u64, u64) {
        let b = &self.blocks[handle as usize];
        (b.addr, b.size)
    }

    /// Frees every segment that is wholly free, i.e. every free block without neighbours
    /// (torch's `empty_cache`).
    pub fn empty_cache(&mut self) {
        let whole: Vec<(bool, (u64, u64, u32))> =
            [(true, &self.small_free), (false, &self.large_free)]
                .into_iter()
                .flat_map(|(small, set)| set.iter().map(move |&key| (small, key)))
                .filter(|&(_, (_, _, i))| {
                    let b = &self.blocks[i as usize];
                    b.prev == NIL && b.next == NIL
                })
                .collect();
        for (small, key) in whole {
            self.free_set(small).remove(&key);
            self.vacant.push(key.2);
            self.reserved -= key.0;
            self.calls.free += 1;
        }
    }

    fn free_set(&mut self, small: bool) -> &mut BTreeSet<(u64, u64, u32)> {
        if small {
            &mut self.small_free
        } else {
            &mut self.large_free
        }
    }

    /// A slot for `b`.
    fn take(&mut self, b: Block) -> u32 {
        if let Some(i) = self.vacant.pop() {
            self.blocks[i as usize] = b;
            i
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    /// A new segment for a request of `size` bytes, as one free block, or `None` when the
    /// device is full even after [`TorchNpu::empty_cache`].
    fn new_segment(&mut self, size: u64, small: bool) -> Option<u32> {
        let bytes = segment_size(size);
        if self.reserved + bytes > self.capacity {
            self.empty_cache();
            if self.reserved + bytes > self.capacity {
                return None;
            }
        }
        let addr = self.next_segment;
        self.next_segment = round_up(addr + bytes, SMALL_SEGMENT);
        self.reserved += bytes;
        self.reserved_high = self.reserved_high.max(self.reserved);
        self.calls.malloc += 1;
        Some(self.take(Block { addr, size: bytes, prev: NIL, next: NIL, small, allocated: false }))
    }

    /// Merges the free block `src` into `dst` (its neighbour), when `src` is a free block.
    fn absorb(&mut self, dst: u32, src: u32) {
        if src == NIL || self.blocks[src as usize].allocated {
            return;
        }
        let s = self.blocks[src as usize];
        self.free_set(s.small).remove(&(s.size, s.addr, src));
        let d = &mut self.blocks[dst as usize];
        if d.prev == src {
            d.addr = s.addr;
            d.prev = s.prev;
            if s.prev != NIL {
                self.blocks[s.prev as usize].next = dst;
            }
        } else {
            d.next = s.next;
            if s.next != NIL {
                self.blocks[s.next as usize].prev = dst;
            }
        }
        self.blocks[dst as usize].size += s.size;
        self.vacant.push(src);
    }
}

impl Allocator for TorchNpu {
    /// The block's index.
    type Handle = u32;
    fn name(&self) -> &'static str {
        "torch-npu"
    }
    fn alloc(&mut self, bytes: u64) -> Option<u32> {
        let size = rounded(bytes);
        let small = size <= SMALL_SIZE;
        let found = self.free_set(small).range((size, 0, 0)..).next().copied();
        let i = match found {
            Some(key) => {
                self.free_set(small).remove(&key);
                key.2
            }
            None => self.new_segment(size, small)?,
        };
        let b = self.blocks[i as usize];
        let remaining = b.size - size;
        let split = if small { remaining >= MIN_BLOCK } else { remaining > SMALL_SIZE };
        if split {
            let rest = Block { addr: b.addr + size, size: remaining, prev: i, ..b };
            let r = self.take(rest);
            if b.next != NIL {
                self.blocks[b.next as usize].prev = r;
            }
            self.blocks[i as usize].next = r;
            self.blocks[i as usize].size = size;
            self.free_set(small).insert((remaining, rest.addr, r));
        }
        self.blocks[i as usize].allocated = true;
        Some(i)
    }
    fn free(&mut self, i: u32) {
        self.blocks[i as usize].allocated = false;
        let b = self.blocks[i as usize];
        self.absorb(i, b.prev);
        self.absorb(i, b.next);
        let b = self.blocks[i as usize];
        self.free_set(b.small).insert((b.size, b.addr, i));
    }
    fn reserved_high(&self) -> u64 {
        self.reserved_high
    }
    fn driver_calls(&self) -> DriverCalls {
        self.calls
    }
}
