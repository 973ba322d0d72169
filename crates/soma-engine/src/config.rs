//! The engine's configuration, its tuning switches, and the rounding of requests.

use crate::block::{Kind, NIL};
use crate::{AllocError, Engine};

/// Largest supported range (2^62 bytes), so that offset arithmetic never overflows.
pub const MAX_RANGE: u64 = 1 << 62;

/// Static configuration of an [`Engine`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Size of the pool's virtual range in bytes; a non-zero multiple of `granularity`, at
    /// most [`MAX_RANGE`].
    pub range_size: u64,
    /// Mapping granularity in bytes (a power of two, e.g. 2 MiB on Ascend).
    pub granularity: u64,
    /// Minimum alignment and size rounding of every block: a power of two, `>= 32` and
    /// `<= granularity` (default 512).
    pub alignment: u64,
    /// Keep an offset → live block index so that [`Engine::lookup`] works (the C API frees by
    /// pointer). Costs one hash-map entry per live block.
    pub index_by_offset: bool,
}

impl EngineConfig {
    /// The default alignment of a pool (512 B).
    pub const DEFAULT_ALIGNMENT: u64 = 512;

    /// A configuration with the default alignment and no offset index.
    pub fn new(range_size: u64, granularity: u64) -> EngineConfig {
        EngineConfig {
            range_size,
            granularity,
            alignment: Self::DEFAULT_ALIGNMENT,
            index_by_offset: false,
        }
    }

    /// Checks the configuration; see [`Engine::new`] for what it requires.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.granularity == 0 || !self.granularity.is_power_of_two() {
            return Err(format!("granularity {} is not a power of two", self.granularity));
        }
        if !self.alignment.is_power_of_two() || self.alignment < 32 {
            return Err(format!("alignment {} is not a power of two >= 32", self.alignment));
        }
        if self.alignment > self.granularity {
            return Err(format!(
                "alignment {} exceeds the granularity {}",
                self.alignment, self.granularity
            ));
        }
        if self.range_size > MAX_RANGE {
            return Err(format!(
                "range size {} exceeds the supported maximum of 2^62 bytes",
                self.range_size
            ));
        }
        if self.range_size == 0 || self.range_size % self.granularity != 0 {
            return Err(format!(
                "range size {} is not a non-zero multiple of the granularity {}",
                self.range_size, self.granularity
            ));
        }
        Ok(())
    }
}

impl Engine {
    /// Bounds the size of one mapping (one segment). By default a growth is cut into as many
    /// segments of equal size in whole granules as [`Engine::set_segments_per_growth`]
    /// says; `bytes` (rounded up to a power of two, at least one granule; 0 restores the
    /// default) raises that count until no segment is larger. Smaller segments let recycling and
    /// [`Engine::release`] return memory more finely — one granule per segment gives the
    /// least fragmentation — at the cost of more driver calls.
    pub fn set_max_segment(&mut self, bytes: u64) {
        self.max_segment = if bytes == 0 {
            0
        } else {
            bytes.max(self.cfg.granularity).checked_next_power_of_two().unwrap_or(0)
        };
    }

    /// Into how many segments (each unmapped whole, one [`Backing::map`](crate::Backing::map) call each) a growth
    /// is mapped, at least 1 (default 4, doubled up to 16 while recycling falls short for
    /// want of finer segments, see `growth::MAX_SPLIT_BOOST`; parts of a large block that
    /// later hold smaller ones can be recycled piecewise; 1: exactly one driver call per
    /// growth, for pools of long-lived memory such as weights). Setting it fixes the count
    /// (no doubling). A growth of fewer granules has one segment per granule, and segments
    /// are never smaller than 1/512 of the reserved memory (see
    /// `growth::MIN_SEGMENT_FRACTION`), so the count applies exactly to pools below 512
    /// granules.
    pub fn set_segments_per_growth(&mut self, n: u64) {
        self.segments_per_growth = n.max(1);
        self.segments_fixed = true;
        self.split_boost = 0;
    }

    /// Whether a growth that would raise `reserved` above its all-time high first unmaps
    /// fully free recyclable segments elsewhere (see the crate docs, *Recycling*): `true`
    /// keeps peak reserved memory close to peak used memory at the price of an unmap and a
    /// map per recycled segment for as long as the workload's shapes keep changing. `false`
    /// (the default): growth never unmaps, and a workload run again on the memory its first
    /// run mapped makes no driver calls at all. Memory pressure still releases free
    /// segments ([`AllocError::OutOfMemory`] is the last resort either way), and
    /// [`Engine::release`] is unaffected.
    pub fn set_recycle_on_growth(&mut self, yes: bool) {
        if yes == self.recycle_on_growth {
            return;
        }
        // The free block below the top hole is the border block only without recycling.
        let top_block = self.holes.iter().next_back().map(|(_, &h)| self.slab.blocks[h as usize]);
        self.recycle_on_growth = yes;
        self.locate_border_end();
        if let Some(t) = top_block.filter(|t| t.next == NIL && t.prev != NIL) {
            if self.slab.blocks[t.prev as usize].kind == Kind::Free {
                self.refile_free(t.prev);
            }
        }
    }

    /// When internal dependencies are allowed, take another stream's cached block with a
    /// dependency *before* growing (`true`), instead of only when growth fails (`false`, the
    /// default, CUDA's order — see the crate docs). `true` trades stream concurrency for less
    /// mapping; soma's pool sets it on every engine.
    pub fn set_dependency_before_growth(&mut self, yes: bool) {
        self.dependency_first = yes;
    }

    /// The configuration the engine was created with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The effective alignment of a request (`max(align, cfg.alignment)`), or `None` when
    /// `align` is 0, not a power of two or larger than the granularity.
    #[inline]
    fn effective_align(&self, align: u64) -> Option<u64> {
        (align != 0 && align.is_power_of_two() && align <= self.cfg.granularity)
            .then(|| align.max(self.cfg.alignment))
    }

    /// The size a request of `bytes` with alignment `align` occupies: `bytes` rounded up to a
    /// multiple of `max(align, cfg.alignment)` (so that blocks aligned for a request are never
    /// split below that alignment). `None` for 0 bytes, on overflow, or for an invalid
    /// alignment (0, not a power of two, above the granularity). Alignments below the pool's
    /// are raised to it.
    pub fn round_size(&self, bytes: u64, align: u64) -> Option<u64> {
        let align = self.effective_align(align)?;
        if bytes == 0 {
            return None;
        }
        checked_align_up(bytes, align)
    }

    /// Validates a request: its rounded size and effective alignment.
    #[allow(clippy::result_large_err, reason = "as Engine::alloc, whose errors these are")]
    #[inline(always)]
    pub(crate) fn checked_request<E>(
        &self,
        bytes: u64,
        align: u64,
    ) -> Result<(u64, u64), AllocError<E>> {
        // The pool's own alignment (what a pool always passes) is valid by construction.
        let a = if align == self.cfg.alignment { Some(align) } else { self.effective_align(align) };
        if let Some(a) = a {
            // `round_size` with the alignment already validated and raised.
            if let Some(size) = checked_align_up(bytes, a) {
                if bytes != 0 && size <= self.cfg.range_size {
                    return Ok((size, a));
                }
            }
        }
        Err(self.request_error(bytes, align))
    }

    /// Why [`Engine::checked_request`] refused `bytes` at alignment `align`.
    #[cold]
    #[inline(never)]
    fn request_error<E>(&self, bytes: u64, align: u64) -> AllocError<E> {
        let Some(align) = self.effective_align(align) else {
            return AllocError::InvalidAlignment(format!(
                "alignment {align} is not a power of two in 1..={}",
                self.cfg.granularity
            ));
        };
        if bytes == 0 {
            return AllocError::InvalidSize("size 0".into());
        }
        match checked_align_up(bytes, align) {
            None => {
                AllocError::InvalidSize(format!("size {bytes} overflows when rounded to {align}"))
            }
            Some(size) => AllocError::InvalidSize(format!(
                "size {bytes} (rounded {size}) exceeds the pool's range of {} bytes",
                self.cfg.range_size
            )),
        }
    }
}

/// `x` rounded up to a multiple of the power of two `a` (no overflow for in-range offsets).
#[inline]
pub(crate) fn align_up(x: u64, a: u64) -> u64 {
    (x + a - 1) & !(a - 1)
}

/// `x` rounded up to a multiple of the power of two `a`, for any `x`: `None` when the rounded
/// value overflows. Also the pool's rounding of a request before it reaches the engine.
#[inline(always)]
pub fn checked_align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|b| b & !(a - 1))
}

/// `x` rounded down to a multiple of the power of two `a`.
#[inline]
pub(crate) fn align_down(x: u64, a: u64) -> u64 {
    x & !(a - 1)
}
