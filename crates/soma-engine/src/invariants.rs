//! The exhaustive consistency check behind [`Engine::check_invariants`].

use crate::block::{Kind, BORDER, NIL};
use crate::coalesce::index_slot;
use crate::tlsf::{class_index, FL, SL};
use crate::Engine;

macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err(format!($($arg)*));
        }
    };
}

pub(super) fn check(e: &Engine) -> Result<(), String> {
    let blocks = &e.slab.blocks;
    let unit = e.cfg.alignment;
    let g = e.cfg.granularity;

    // Address-order list: covers [0, range) without gaps, links consistent.
    ensure!(e.first != NIL, "no first block");
    ensure!(
        blocks[e.first as usize].prev == NIL && blocks[e.first as usize].offset == 0,
        "first block does not start the range"
    );
    let (mut cur, mut prev, mut expect_off) = (e.first, NIL, 0u64);
    let (mut used, mut live, mut free_bytes, mut pending, mut mapped) = (0u64, 0u64, 0, 0, 0);
    let mut n_blocks = 0u64;
    let (mut border, mut border_tagged, mut n_border) = (0u64, 0u64, 0u64);
    let mut mapped_runs: Vec<(u64, u64)> = Vec::new();
    while cur != NIL {
        let b = &blocks[cur as usize];
        n_blocks += 1;
        ensure!(n_blocks <= blocks.len() as u64, "address list has a cycle");
        ensure!(b.prev == prev, "block {cur}: prev link {} != {prev}", b.prev);
        ensure!(
            b.offset == expect_off,
            "block {cur}: offset {} != expected {expect_off}",
            b.offset
        );
        ensure!(b.size > 0, "block {cur}: size 0");
        ensure!(b.offset % unit == 0 && b.size % unit == 0, "block {cur}: not aligned to {unit}");
        match b.kind {
            Kind::Vacant => return Err(format!("vacant record {cur} in the address list")),
            Kind::Live => {
                used += b.size;
                live += 1;
                ensure!(
                    b.offset % (1u64 << b.align_log2) == 0,
                    "live block {cur} misaligned for its request"
                );
                if let Some(map) = &e.live_index {
                    ensure!(
                        map.get(&b.offset) == Some(&cur),
                        "live block {cur} missing from the offset index"
                    );
                }
            }
            Kind::Free => {
                free_bytes += b.size;
                if b.tagged {
                    pending += b.size;
                }
                // From the block list, not `Engine::border_end`, which this checks.
                let below_unmapped = !e.recycle_on_growth
                    && b.next != NIL
                    && blocks[b.next as usize].kind == Kind::Unmapped
                    && blocks[b.next as usize].next == NIL;
                ensure!(
                    below_unmapped == e.below_the_top_hole(b),
                    "free block {cur}: the recorded border end {} is stale",
                    e.border_end
                );
                ensure!(
                    below_unmapped == (b.cls == BORDER),
                    "free block {cur}: border mark {} but the top hole after it {below_unmapped}",
                    b.cls == BORDER
                );
                if below_unmapped {
                    n_border += 1;
                    ensure!(e.border == cur, "border block {cur} is not the one recorded");
                    border += b.size;
                    if b.tagged {
                        border_tagged += b.size;
                    }
                    ensure!(
                        b.prev_free == NIL && b.next_free == NIL,
                        "border block {cur} is linked into a free list"
                    );
                    ensure!(
                        e.indexes.get(index_slot(b.tagged, b.stream)).is_some_and(Option::is_some),
                        "border block {cur}: its stream has no index"
                    );
                }
            }
            Kind::Unmapped => {
                ensure!(
                    b.offset % g == 0 && b.size % g == 0,
                    "unmapped block {cur} not granule aligned"
                );
                ensure!(
                    e.holes.get(&b.offset) == Some(&cur),
                    "unmapped block {cur} missing from the hole map"
                );
            }
        }
        if b.kind != Kind::Unmapped {
            mapped += b.size;
            match mapped_runs.last_mut() {
                Some(r) if r.1 == b.offset => r.1 = b.end(),
                _ => mapped_runs.push((b.offset, b.end())),
            }
        }
        ensure!(
            !b.settled || (b.kind == Kind::Free && !b.tagged),
            "block {cur} is settled but not an untagged free block"
        );
        if prev != NIL {
            let p = &blocks[prev as usize];
            ensure!(
                !(p.kind == Kind::Unmapped && b.kind == Kind::Unmapped),
                "adjacent unmapped blocks {prev} and {cur}"
            );
            ensure!(!e.mergeable(prev, cur), "adjacent mergeable free blocks {prev} and {cur}");
        }
        expect_off = b.end();
        prev = cur;
        cur = b.next;
    }
    ensure!(expect_off == e.cfg.range_size, "blocks end at {expect_off}, not at the range size");
    let s = &e.stats();
    ensure!(used == s.used, "used {} != live sum {used}", s.used);
    ensure!(live == s.live_blocks, "live_blocks {} != {live}", s.live_blocks);
    ensure!(free_bytes == s.free_bytes, "free_bytes {} != {free_bytes}", s.free_bytes);
    ensure!(pending == s.pending_bytes, "pending_bytes {} != {pending}", s.pending_bytes);
    ensure!(mapped == s.reserved, "reserved {} != mapped {mapped}", s.reserved);
    ensure!(s.reserved == s.used + s.free_bytes, "reserved != used + free");
    ensure!(s.used_high >= s.used, "used_high below used");
    ensure!(s.reserved_high >= s.reserved, "reserved_high below reserved");
    ensure!(s.live_blocks_high >= s.live_blocks, "live_blocks_high below live_blocks");
    ensure!(
        s.bytes_mapped_total - s.bytes_unmapped_total == s.reserved,
        "mapped - unmapped totals != reserved"
    );
    ensure!(
        n_blocks + u64::from(e.slab.vacant_count()) == blocks.len() as u64,
        "slab: {n_blocks} blocks + {} vacant != {} records",
        e.slab.vacant_count(),
        blocks.len()
    );
    let mut v = e.slab.vacant_head();
    let mut n_vacant = 0;
    while v != NIL {
        ensure!(
            blocks[v as usize].kind == Kind::Vacant,
            "non-vacant record {v} on the vacant chain"
        );
        n_vacant += 1;
        ensure!(n_vacant <= e.slab.vacant_count(), "vacant chain too long");
        v = blocks[v as usize].next_free;
    }
    ensure!(n_vacant == e.slab.vacant_count(), "vacant chain too short");
    ensure!(
        e.holes.len() == blocks.iter().filter(|b| b.kind == Kind::Unmapped).count(),
        "hole map has stale entries"
    );
    if let Some(map) = &e.live_index {
        ensure!(map.len() as u64 == live, "offset index has stale entries");
    }

    // Segments: disjoint, granule aligned, and together exactly the mapped runs.
    let mut seg_runs: Vec<(u64, u64)> = Vec::new();
    let mut seg_bytes = 0;
    for (&off, seg) in &e.segments {
        ensure!(
            off % g == 0 && seg.size % g == 0 && seg.size > 0,
            "segment at {off} not granule aligned"
        );
        seg_bytes += seg.size;
        match seg_runs.last_mut() {
            Some(r) if r.1 == off => r.1 = off + seg.size,
            Some(r) if r.1 > off => return Err(format!("segment at {off} overlaps")),
            _ => seg_runs.push((off, off + seg.size)),
        }
    }
    ensure!(seg_bytes == s.reserved, "segments {seg_bytes} != reserved");
    let mut edges: Vec<u64> =
        e.segments.iter().flat_map(|(&off, seg)| [off / g, (off + seg.size) / g]).collect();
    edges.dedup();
    ensure!(e.bounds.all() == edges, "segment boundaries do not match the segments");
    ensure!(seg_runs == mapped_runs, "segments do not match the mapped blocks");

    // Free indices: every free block is in the index of its tag, in its class's list.
    let mut indexed = 0u64;
    for (slot, ix) in e.indexes.iter().enumerate() {
        let Some(ix) = ix else { continue };
        ix.check_bitmaps()?;
        let (mut count, mut bytes, mut max_pos) = (0u64, 0u64, 0u64);
        for fl in 0..FL {
            for sl in 0..SL {
                let mut cur = ix.head(fl, sl);
                let mut p = NIL;
                ensure!(
                    (cur != NIL) == ix.class_bit(fl, sl),
                    "index {slot}: class ({fl},{sl}) bit disagrees"
                );
                while cur != NIL {
                    let b = &blocks[cur as usize];
                    ensure!(b.kind == Kind::Free, "index {slot}: non-free block {cur}");
                    ensure!(
                        index_slot(b.tagged, b.stream) == slot,
                        "block {cur} in the wrong index {slot}"
                    );
                    let own = class_index(b.size >> e.unit_shift);
                    let list = fl * SL + sl;
                    ensure!(
                        usize::from(b.cls) == list && (own == list || own == list + 1),
                        "block {cur} in the wrong class (own {own}, list {list}, cls {})",
                        b.cls
                    );
                    ensure!(b.prev_free == p, "block {cur}: prev_free link");
                    count += 1;
                    ensure!(count <= n_blocks, "index {slot}: free list cycle");
                    bytes += b.size;
                    if b.tagged {
                        max_pos = max_pos.max(b.pos);
                    }
                    p = cur;
                    cur = b.next_free;
                }
            }
        }
        ensure!(
            (count == 0) == ix.is_empty(),
            "index {slot}: bitmaps disagree with {count} blocks"
        );
        ensure!(bytes == ix.bytes, "index {slot}: bytes {} != {bytes}", ix.bytes);
        ensure!(ix.max_pos >= max_pos, "index {slot}: max_pos below a block's pos");
        indexed += count;
    }
    let n_free = blocks.iter().filter(|b| b.kind == Kind::Free).count() as u64;
    ensure!(
        indexed + n_border == n_free,
        "{indexed} indexed free blocks and {n_border} border blocks != {n_free} free blocks"
    );
    ensure!((n_border == 0) == (e.border == NIL), "the recorded border block is stale");
    ensure!(
        e.border_bytes == (border, border_tagged),
        "border bytes {:?} != ({border}, {border_tagged})",
        e.border_bytes
    );
    Ok(())
}

impl Engine {
    /// Exhaustive consistency check (for tests; O(n + segments + free-list lengths)).
    ///
    /// # Errors
    ///
    /// A description of the first violated invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        check(self)
    }
}
