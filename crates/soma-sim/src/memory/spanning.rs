//! Accesses that span devices (peer access): one [`Access`] per device memory a task
//! touches, seen by a kernel as one list of buffers, and copies from one memory to another.
//!
//! Each part is an ordinary [`Access`] of its own memory, registered in that memory's
//! in-flight table, so every invariant of the module holds per memory. Two memories are two
//! `mmap` arenas: their bytes never overlap.

use smallvec::SmallVec;
use soma_core::hal::{DriverError, DriverResult, KernelBuffers, KernelError};

use super::access::{check_no_self_overlap, not_held};
use super::{Access, AcquireError, DeviceMemory, End, Owner, Range};

/// The in-flight registration of a request whose ranges lie in one or more memories.
pub(crate) struct SpanningAccess<'m> {
    parts: SmallVec<[Access<'m>; 1]>,
    /// For each range of the request, in order: its part and its index in the part.
    index: SmallVec<[(usize, usize); 4]>,
}

impl<'m> SpanningAccess<'m> {
    /// Registers `ranges` in flight for `owner`, range `i` in `memories[of[i]]` (as
    /// [`DeviceMemory::acquire`] does for one memory). On an error nothing stays registered.
    pub fn acquire(
        memories: &[&'m DeviceMemory],
        of: &[usize],
        owner: Owner,
        ranges: &[Range],
        exclusive_writes: bool,
    ) -> Result<Self, AcquireError> {
        if let [memory] = memories {
            let part = memory.acquire(owner, ranges, exclusive_writes)?;
            let index = (0..ranges.len()).map(|i| (0, i)).collect();
            let mut parts = SmallVec::new();
            parts.push(part);
            return Ok(SpanningAccess { parts, index });
        }
        if exclusive_writes {
            check_no_self_overlap(ranges).map_err(AcquireError::Invalid)?;
        }
        let mut parts: SmallVec<[Access<'m>; 1]> = SmallVec::new();
        let mut index: SmallVec<[(usize, usize); 4]> = SmallVec::from_elem((0, 0), ranges.len());
        for (m, memory) in memories.iter().enumerate() {
            let mut mine: SmallVec<[Range; 4]> = SmallVec::new();
            for (i, r) in ranges.iter().enumerate().filter(|(i, _)| of.get(*i) == Some(&m)) {
                index[i] = (parts.len(), mine.len());
                mine.push(*r);
            }
            if !mine.is_empty() {
                // An error drops the parts registered so far, which unregisters them.
                parts.push(memory.acquire(owner, &mine, exclusive_writes)?);
            }
        }
        Ok(SpanningAccess { parts, index })
    }

    /// The part whose ranges cover `[addr, addr + len)` (a write range for `write`).
    fn part_of(&self, addr: u64, len: u64, write: bool) -> Option<usize> {
        self.parts.iter().position(|p| p.covered(addr, len, write))
    }

    /// Copies `len` bytes (memmove semantics when both ends are in one memory).
    pub fn copy(&mut self, dst: &End, src: &End, len: u64) -> DriverResult<()> {
        let part = |this: &Self, end: &End, write: bool| match end {
            End::Device(a) => {
                this.part_of(*a, len, write).ok_or_else(|| not_held(*a, len)).map(Some)
            }
            End::Host(_) => Ok(None),
        };
        let (d, s) = (part(self, dst, true)?, part(self, src, false)?);
        match (d, s) {
            (Some(d), Some(s)) if d != s => {
                let (to, from) = two_mut(&mut self.parts, d, s);
                match (dst, src) {
                    (End::Device(dst), End::Device(src)) => to.copy_from(*dst, from, *src, len),
                    _ => Err(DriverError::InvalidValue("a copy between two memories".into())),
                }
            }
            (Some(p), _) | (None, Some(p)) => self.parts[p].copy(dst, src, len),
            // Host to host: any part copies it (a request always has one, maybe empty).
            (None, None) => match self.parts.first_mut() {
                Some(part) => part.copy(dst, src, len),
                None => Err(DriverError::InvalidValue("a copy with no registration".into())),
            },
        }
    }

    /// Sets `len` bytes at device address `addr` to `value`.
    pub fn fill(&mut self, addr: u64, value: u8, len: u64) -> DriverResult<()> {
        let p = self.part_of(addr, len, true).ok_or_else(|| not_held(addr, len))?;
        self.parts[p].fill(addr, value, len)
    }
}

/// `parts[a]` mutably and `parts[b]` mutably, for `a != b`.
fn two_mut<T>(parts: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    if a < b {
        let (low, high) = parts.split_at_mut(b);
        (&mut low[a], &mut high[0])
    } else {
        let (low, high) = parts.split_at_mut(a);
        (&mut high[0], &mut low[b])
    }
}

impl KernelBuffers for SpanningAccess<'_> {
    fn len(&self) -> usize {
        self.index.len()
    }

    fn bytes(&self, index: usize) -> Result<&[u8], KernelError> {
        let (part, at) = self.locate(index)?;
        self.parts[part].bytes(at)
    }

    fn bytes_mut(&self, index: usize) -> Result<&mut [u8], KernelError> {
        let (part, at) = self.locate(index)?;
        self.parts[part].bytes_mut(at)
    }
}

impl SpanningAccess<'_> {
    fn locate(&self, index: usize) -> Result<(usize, usize), KernelError> {
        self.index.get(index).copied().ok_or_else(|| {
            KernelError(format!("buffer index {index} out of range ({} buffers)", self.index.len()))
        })
    }
}
