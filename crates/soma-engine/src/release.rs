//! Giving memory back: releasing fully free segments (to a target, or all of them at
//! teardown), unmapping one segment, and packing the mapped memory of an emptied engine.

use smallvec::SmallVec;

use crate::block::{Block, Kind, NIL};
use crate::config::align_down;
use crate::{Backing, BackingError, Engine, FreeTag, StreamOrder};

/// Why [`Engine::teardown`] failed: `E` is the backing's error ([`Backing::Error`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TeardownError<E> {
    /// Blocks are still live: nothing was unmapped.
    LiveBlocks(u64),
    /// An unmap failed with this error; what was unmapped before it is accounted.
    Unmap(E),
}

impl<E: std::fmt::Display> std::fmt::Display for TeardownError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TeardownError::LiveBlocks(n) => write!(f, "teardown with {n} live blocks"),
            TeardownError::Unmap(e) => write!(f, "unmap failed during teardown: {e}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for TeardownError<E> {}

impl Engine {
    /// Unmaps fully free segments whose memory no in-flight work can touch (untagged, or
    /// [`StreamOrder::is_complete`]) — highest address first, so that what stays mapped is
    /// packed low — until `reserved <= max(keep, used)` or nothing more can go. `reserved`
    /// never ends below the target rounded down to the granularity: a segment larger than
    /// what is left to release is skipped while smaller ones can go, and otherwise unmapped
    /// with its lowest granules mapped again (one more map call). Returns the bytes released
    /// (net).
    ///
    /// # Errors
    ///
    /// The first [`Backing::unmap`] error; what was unmapped before it is accounted.
    ///
    /// # Time Complexity
    ///
    /// O(n + segments) plus one driver call per released segment.
    pub fn release<E>(
        &mut self,
        keep: u64,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<u64, E> {
        self.release_where(keep, backing, &|b| {
            !b.tagged || order.is_complete(FreeTag { stream: b.stream, pos: b.pos })
        })
    }

    /// Unmaps every segment (the caller guarantees that all work is complete). Afterwards the
    /// engine is as new, except for its statistics.
    ///
    /// # Errors
    ///
    /// [`TeardownError::LiveBlocks`] without touching anything when live blocks remain;
    /// otherwise [`TeardownError::Unmap`] with the first unmap error (what was unmapped
    /// before it is accounted).
    pub fn teardown<E>(
        &mut self,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<(), TeardownError<E>> {
        if self.stats.live_blocks != 0 {
            return Err(TeardownError::LiveBlocks(self.stats.live_blocks));
        }
        self.release_where(0, backing, &|_| true).map_err(TeardownError::Unmap)?;
        debug_assert!(self.segments.is_empty());
        Ok(())
    }

    /// Unmaps, highest address first, fully free segments whose every block satisfies
    /// `pred` until `reserved <= max(keep, used)`, without going below the target by a
    /// granule or more: a segment larger than what is left to release is skipped while
    /// smaller ones can go, and if the target is still not met, one of the skipped segments
    /// is unmapped and its lowest granules mapped again, so that `reserved` ends at the
    /// target rounded down to the granularity (the release threshold and `trim_to` keep what
    /// they were told to keep; a multi-granule segment unmapped whole would take the cache of
    /// one large allocation away entirely). Returns the bytes released, net of that remap.
    pub(crate) fn release_where<E>(
        &mut self,
        keep: u64,
        backing: &mut dyn Backing<Error = E>,
        pred: &dyn Fn(&Block) -> bool,
    ) -> Result<u64, E> {
        let target = keep.max(self.stats.used);
        if self.stats.reserved <= target {
            return Ok(0);
        }
        let mut cands = std::mem::take(&mut self.scratch);
        self.collect_free_segments(pred, (0, 0), 0, &mut cands);
        let mut released = 0;
        let mut result = Ok(());
        // The highest segment too large to go whole.
        let mut too_large = None;
        for &(off, len, first) in cands.iter().rev() {
            if self.stats.reserved <= target {
                break;
            }
            if self.stats.reserved - len < target {
                too_large = too_large.or(Some(off));
                continue;
            }
            if let Err(e) = self.unmap_segment(off, len, first, backing) {
                result = Err(e);
                break;
            }
            released += len;
        }
        if let (Ok(()), Some(off)) = (&result, too_large) {
            if self.stats.reserved > target {
                // The unmaps above may have split the blocks covering it: find them again.
                self.collect_free_segments(pred, (0, 0), off, &mut cands);
                if let Some(&(o, len, first)) = cands.first().filter(|c| c.0 == off) {
                    result = self.release_part(o, len, first, target, backing).map(|n| {
                        released += n;
                    });
                }
            }
        }
        cands.clear();
        self.scratch = cands;
        result.map(|()| released)
    }

    /// Unmaps free segment `[off, off + len)` (covered from block `first`) and maps its
    /// lowest granules again, so that `reserved` drops to `target` rounded down to the
    /// granularity; `reserved - len < target < reserved`. Returns the bytes released. A
    /// failed remap is not an error: the segment stays unmapped (`reserved` ends lower).
    fn release_part<E>(
        &mut self,
        off: u64,
        len: u64,
        first: u32,
        target: u64,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<u64, E> {
        let rest = self.stats.reserved - len;
        let again = align_down(target - rest, self.cfg.granularity);
        debug_assert!(again < len, "segment at {off} not larger than what is left to release");
        self.unmap_segment(off, len, first, backing)?;
        if again == 0 || self.map_free(off, again, backing).is_err() {
            return Ok(len);
        }
        Ok(len - again)
    }

    /// Unmaps fully free segment `[off, off + len)`, whose free blocks start at `first`, and
    /// turns it into unmapped space.
    pub(crate) fn unmap_segment<E>(
        &mut self,
        off: u64,
        len: u64,
        first: u32,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<(), E> {
        let seg = self.segments[&off];
        debug_assert_eq!(seg.size, len, "boundaries and segments disagree at {off}");
        backing.unmap(off, len, seg.token)?;
        self.unmap_bookkeeping(off, len, first);
        Ok(())
    }

    /// Maps `[off, off + len)` of an unmapped hole as never-used free memory, coalesced and
    /// indexed.
    pub(crate) fn map_free<E>(
        &mut self,
        off: u64,
        len: u64,
        backing: &mut dyn Backing<Error = E>,
    ) -> Result<(), BackingError<E>> {
        let mut tokens: SmallVec<[(u64, u64, u64); 4]> = SmallVec::new();
        self.map_chunks(off, len, backing, &mut tokens)?;
        let fresh = self.map_into_hole(off, len, &tokens);
        self.insert_free_coalesce(fresh);
        Ok(())
    }

    /// Packing, on the first allocation after the engine emptied (nothing live) when
    /// segments were unmapped since the last packing: moves the free segments that lie
    /// entirely above `reserved` bytes from the start of the range into the lowest unmapped
    /// holes below it — unmapped first, then the holes mapped, so `reserved` ends where it
    /// was and its high-water mark does not move. The next workload then starts from one
    /// mapped run at the bottom of the range, as the first one did from nothing: without it,
    /// a workload run again from empty (a model unloaded and loaded again) places its
    /// long-lived blocks between the holes recycling left, and peak reserved memory creeps
    /// up from run to run (the BERT trace: 1.007 -> 1.07 after 20 runs). Only segments no
    /// in-flight work can touch move (untagged, or complete per [`StreamOrder::is_complete`]),
    /// as for [`Engine::release`]; pools that do not recycle on growth never pack. Best
    /// effort: a failed driver call ends it (what moved is accounted, `reserved` may end
    /// lower).
    ///
    /// # Time Complexity
    ///
    /// O(holes + log segments + the blocks and segments above `reserved`) plus one driver
    /// call per moved segment and per mapped segment; runs once per emptying of an engine
    /// that unmapped.
    #[cold]
    #[inline(never)]
    pub(crate) fn pack_idle<E>(
        &mut self,
        order: &dyn StreamOrder,
        backing: &mut dyn Backing<Error = E>,
    ) {
        self.pack_wanted = false;
        if !self.recycle_on_growth || self.holes.len() <= 1 {
            // One hole: the mapped memory is already one run (or nothing is mapped).
            return;
        }
        let top = self.stats.reserved;
        let mut cands = std::mem::take(&mut self.scratch);
        self.collect_free_segments(
            &|b| !b.tagged || order.is_complete(FreeTag { stream: b.stream, pos: b.pos }),
            (0, 0),
            top,
            &mut cands,
        );
        let mut moved = 0;
        for &(off, len, first) in cands.iter().rev() {
            if self.unmap_segment(off, len, first, backing).is_err() {
                break;
            }
            moved += len;
        }
        cands.clear();
        self.scratch = cands;
        // The holes below `top`: exactly the bytes mapped above it, so `moved` fits.
        let holes: SmallVec<[(u64, u64); 8]> = self
            .holes
            .iter()
            .map(|(&h0, &h)| (h0, self.slab.blocks[h as usize].size.min(top.saturating_sub(h0))))
            .take_while(|&(h0, _)| h0 < top)
            .collect();
        for (h0, room) in holes {
            if moved == 0 {
                break;
            }
            let len = room.min(moved);
            if self.map_free(h0, len, backing).is_err() {
                break;
            }
            moved -= len;
        }
        // Its own unmaps set the flag again.
        self.pack_wanted = false;
    }

    /// After `Backing::unmap` of segment `[off, off + len)`: carves it out of the free
    /// blocks covering it (the first being `first`) into an unmapped block, merged with
    /// unmapped neighbours; the free block below it becomes the border block when the
    /// unmapped space reaches the end of the range.
    fn unmap_bookkeeping(&mut self, off: u64, len: u64, first: u32) {
        let end = off + len;
        let mut idx = first;
        self.remove_free(idx);
        if self.slab.blocks[idx as usize].offset < off {
            let n = self.slab.split(idx, off);
            self.insert_free(idx);
            idx = n;
        }
        let start = idx;
        loop {
            debug_assert_eq!(self.slab.blocks[idx as usize].kind, Kind::Free);
            if self.slab.blocks[idx as usize].end() > end {
                let t = self.slab.split(idx, end);
                self.insert_free(t);
            }
            let b = &mut self.slab.blocks[idx as usize];
            b.kind = Kind::Unmapped;
            b.tagged = false;
            b.settled = false;
            b.stream = 0;
            b.pos = 0;
            if b.end() == end {
                break;
            }
            idx = b.next;
            self.remove_free(idx);
        }
        // The segment's edges stay boundaries where mapped memory (another segment) touches
        // them.
        let g = self.cfg.granularity;
        let mapped = |b: u32| b != NIL && self.slab.blocks[b as usize].kind != Kind::Unmapped;
        let (before, after) = (
            mapped(self.slab.blocks[start as usize].prev),
            mapped(self.slab.blocks[idx as usize].next),
        );
        if !before {
            self.bounds.clear(off / g);
        }
        if !after {
            self.bounds.clear(end / g);
        }
        // Merge the run and any unmapped block after it.
        let u = start;
        loop {
            let n = self.slab.blocks[u as usize].next;
            if n == NIL || self.slab.blocks[n as usize].kind != Kind::Unmapped {
                break;
            }
            let n_off = self.slab.blocks[n as usize].offset;
            if n_off >= end {
                self.holes.remove(&n_off);
            }
            self.slab.absorb_next(u, n);
        }
        let p = self.slab.blocks[u as usize].prev;
        let hole = if p != NIL && self.slab.blocks[p as usize].kind == Kind::Unmapped {
            // `p` is already in the hole map under its own offset.
            self.slab.absorb_next(p, u);
            p
        } else {
            self.holes.insert(self.slab.blocks[u as usize].offset, u);
            u
        };
        self.locate_border_end();
        // The free block below the hole becomes the border block if the hole reaches the
        // end of the range now.
        let below = self.slab.blocks[hole as usize].prev;
        if below != NIL && self.slab.blocks[below as usize].kind == Kind::Free {
            self.refile_free(below);
        }
        self.segments.remove(&off);
        self.pack_wanted = true;
        let s = &mut self.stats;
        s.reserved -= len;
        s.unmap_calls += 1;
        s.bytes_unmapped_total += len;
    }
}
