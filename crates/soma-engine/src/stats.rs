//! The engine's counters.

use crate::{Engine, StreamSlot};

/// Counters of an engine; [`Engine::stats`] is O(1) in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Bytes in live blocks (rounded sizes).
    pub used: u64,
    /// High-water mark of `used` since creation or [`Engine::reset_used_high`].
    pub used_high: u64,
    /// Mapped bytes.
    pub reserved: u64,
    /// High-water mark of `reserved` since creation or [`Engine::reset_reserved_high`].
    pub reserved_high: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// High-water mark of `live_blocks`.
    pub live_blocks_high: u64,
    /// Successful allocations (including [`Engine::relocate_lower`]).
    pub allocs: u64,
    /// Successful frees.
    pub frees: u64,
    /// Allocations served with fresh memory (`reuse == None`).
    pub fresh_allocs: u64,
    /// Allocations per reuse rule, indexed by [`ReuseKind::index`](crate::ReuseKind::index).
    pub reuses: [u64; 5],
    /// Successful [`Backing::map`](crate::Backing::map) calls.
    pub map_calls: u64,
    /// Successful [`Backing::unmap`](crate::Backing::unmap) calls.
    pub unmap_calls: u64,
    /// Segments currently mapped.
    pub mapped_segments: u64,
    /// Bytes ever mapped.
    pub bytes_mapped_total: u64,
    /// Bytes ever unmapped.
    pub bytes_unmapped_total: u64,
    /// Times recycling on growth paused because it had become chronic (more than one
    /// allocation in 8 recycling, see the crate docs).
    pub recycling_pauses: u64,
    /// Free mapped bytes tagged with a stream.
    pub pending_bytes: u64,
    /// All free mapped bytes (`reserved - used`).
    pub free_bytes: u64,
    /// Largest free mapped block (exact).
    pub largest_free_block: u64,
    /// [`AllocError::OutOfMemory`](crate::AllocError::OutOfMemory) returns.
    pub ooms: u64,
}

impl Engine {
    /// Current counters. `largest_free_block` is exact.
    ///
    /// # Time Complexity
    ///
    /// O(1) in blocks: O(streams) plus the length of each stream's highest non-empty size
    /// class list (usually one block).
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        s.mapped_segments = self.segments.len() as u64;
        s.largest_free_block = self.largest_free_block();
        // Derived from the free indices (index 0 holds the untagged blocks) and the border
        // blocks, which are in none.
        s.free_bytes =
            self.indexes.iter().flatten().map(|ix| ix.bytes).sum::<u64>() + self.border_bytes.0;
        s.pending_bytes = self.indexes.iter().skip(1).flatten().map(|ix| ix.bytes).sum::<u64>()
            + self.border_bytes.1;
        s
    }

    /// Restarts the `used` high-water mark from the current `used` (what setting the
    /// attribute to 0 means in CUDA and CANN: the mark can never be below the current value).
    pub fn reset_used_high(&mut self) {
        self.stats.used_high = self.stats.used;
    }

    /// Restarts the `reserved` high-water mark from the current `reserved`.
    pub fn reset_reserved_high(&mut self) {
        self.stats.reserved_high = self.stats.reserved;
    }

    /// Bytes in live blocks.
    pub fn used(&self) -> u64 {
        self.stats.used
    }

    /// Live blocks.
    pub fn live_blocks(&self) -> u64 {
        self.stats.live_blocks
    }

    /// Bytes mapped.
    pub fn reserved(&self) -> u64 {
        self.stats.reserved
    }

    /// Free bytes cached on stream slot `slot` (tagged with it), the border block's included;
    /// O(1).
    pub fn cached_bytes(&self, slot: StreamSlot) -> u64 {
        let ix = self.indexes.get(slot as usize + 1).and_then(|ix| ix.as_deref());
        let border = self.border_block().map(|p| &self.slab.blocks[p as usize]);
        let in_border = border.filter(|b| b.tagged && b.stream == slot).map_or(0, |b| b.size);
        ix.map_or(0, |ix| ix.bytes) + in_border
    }

    /// The stream slots that have freed memory here (ever), in slot order.
    pub fn freeing_streams(&self) -> impl Iterator<Item = StreamSlot> + '_ {
        let slots = self.indexes.iter().enumerate().skip(1);
        slots.filter(|(_, ix)| ix.is_some()).map(|(slot, _)| (slot - 1) as StreamSlot)
    }
}
