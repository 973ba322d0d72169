//! In-flight accesses: the ranges a running task or a synchronous call holds, and the
//! slices and copies made through them.

use std::cell::Cell;

use smallvec::SmallVec;
use soma_core::hal::{AccessMode, DriverError, DriverResult, KernelBuffers, KernelError};

use super::staging::{PrivateCopy, Staging};
use super::{atomic, DeviceMemory, Range};

pub(super) fn mode_verb(m: AccessMode) -> &'static str {
    match m {
        AccessMode::Read => "reads",
        AccessMode::Write => "writes",
    }
}

pub(super) fn invalid(r: &Range) -> DriverError {
    DriverError::InvalidAddress {
        addr: r.addr,
        len: r.len,
        reason: "range is not inside mapped device memory".into(),
    }
}

/// Rejects a request whose write ranges overlap any other of its ranges.
pub(crate) fn check_no_self_overlap(ranges: &[Range]) -> DriverResult<()> {
    for (i, a) in ranges.iter().enumerate() {
        if a.mode != AccessMode::Write {
            continue;
        }
        for (j, b) in ranges.iter().enumerate() {
            if i != j && a.overlaps(b.addr, b.end()) && b.len > 0 {
                return Err(DriverError::InvalidValue(format!(
                    "buffer {i} ({:#x} +{} bytes, written) overlaps buffer {j} ({:#x} +{} bytes)",
                    a.addr, a.len, b.addr, b.len
                )));
            }
        }
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Borrow {
    None,
    Shared,
    Mutable,
}

/// A set of device ranges registered in flight. While it lives the ranges stay mapped and no
/// conflicting access can be registered; dropping it removes the registration.
///
/// Ranges in memory shared with another process are never handed out as slices nor accessed
/// with plain reads and writes: kernels get private copies ([`Staging`]), written back when the
/// access ends, and copies and fills go through [`atomic`].
pub(crate) struct Access<'m> {
    pub(super) mem: &'m DeviceMemory,
    pub(super) id: u64,
    pub(super) ranges: SmallVec<[Range; 4]>,
    pub(super) flags: SmallVec<[Cell<Borrow>; 4]>,
    /// `None` when no range touches memory shared across processes.
    pub(super) staging: Option<Box<Staging>>,
}

impl Drop for Access<'_> {
    fn drop(&mut self) {
        // Written back while the ranges are still registered in flight.
        self.settle();
        let id = self.id;
        self.mem.state.lock().inflight.retain(|h| h.id != id);
    }
}

/// Host memory given to a copy by a caller of an `unsafe` copy function.
pub(crate) struct HostSpan {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a HostSpan is created only through `HostSpan::new`, whose caller promises the memory
// stays valid and unaliased until the copy task using it has completed, on whatever thread.
unsafe impl Send for HostSpan {}

impl HostSpan {
    /// Wraps host memory for a copy.
    ///
    /// # Safety
    /// `ptr` must be valid for reads (as a source) or writes (as a destination) of `len` bytes,
    /// and not be accessed by anyone else in a conflicting way, until the span is dropped.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        Self { ptr, len }
    }
}

/// One end of a copy as executed.
pub(crate) enum End {
    /// A device address; must lie in a range of the [`Access`] (a write range for a
    /// destination).
    Device(u64),
    /// Host memory.
    Host(HostSpan),
}

impl Access<'_> {
    pub(super) fn covered(&self, addr: u64, len: u64, write: bool) -> bool {
        self.covering(addr, len, write).is_some()
    }

    /// The range that covers `[addr, addr + len)` (a write range for `write`).
    fn covering(&self, addr: u64, len: u64, write: bool) -> Option<usize> {
        let end = addr.checked_add(len)?;
        self.ranges.iter().position(|r| {
            r.addr <= addr && end <= r.end() && (!write || r.mode == AccessMode::Write)
        })
    }

    /// Whether device bytes `[addr, addr + len)`, inside range `i`, are shared across processes.
    fn crosses(&self, i: usize) -> bool {
        self.staging.as_ref().is_some_and(|s| s.is_cross(i))
    }

    /// Writes the private copies of the kernel's write buffers back to the shared memory and
    /// drops every private copy: the device bytes are current again.
    fn settle(&mut self) {
        let Some(staging) = self.staging.as_mut() else { return };
        for (i, r) in self.ranges.iter().enumerate() {
            let Some(copy) = staging.take(i) else { continue };
            if self.flags[i].get() == Borrow::Mutable {
                // SAFETY: range `i` is registered in flight for this Access and mapped
                // read-write; it is shared across processes, so this process accesses it only
                // atomically; `copy` is private and holds `r.len` bytes.
                unsafe { atomic::store(self.mem.ptr(r.addr), copy.as_ptr(), copy.len()) };
            }
        }
    }

    /// A private copy of range `r`, shared across processes.
    fn load_private(&self, r: &Range) -> PrivateCopy {
        let copy = PrivateCopy::new(r.addr, r.len as usize);
        // SAFETY: `r` is a range of this Access (registered in flight, mapped read-write) and
        // shared across processes, so this process accesses it only atomically; `copy` is a
        // fresh private buffer of `r.len` bytes.
        unsafe { atomic::load(copy.as_ptr(), self.mem.ptr(r.addr), copy.len()) };
        copy
    }

    /// Copies `len` bytes (memmove semantics: the ends may overlap).
    pub fn copy(&mut self, dst: &End, src: &End, len: u64) -> DriverResult<()> {
        if len == 0 {
            return Ok(());
        }
        let n = usize::try_from(len).map_err(|_| DriverError::InvalidValue("length".into()))?;
        let end = |this: &Self, e: &End, write: bool| match e {
            End::Device(a) => match this.covering(*a, len, write) {
                Some(i) => Ok((this.mem.ptr(*a), this.crosses(i))),
                None => Err(not_held(*a, len)),
            },
            End::Host(h) if h.len >= n => Ok((h.ptr, false)),
            End::Host(_) => Err(DriverError::InvalidValue("host span too short".into())),
        };
        let (d, mut d_cross) = end(self, dst, true)?;
        let (s, mut s_cross) = end(self, src, false)?;
        // A range is marked as a whole: a device end in a shared range may still be private
        // bytes, which the other device end may overlap. Both then move atomically.
        if (d_cross || s_cross) && matches!((dst, src), (End::Device(_), End::Device(_))) {
            (d_cross, s_cross) = (true, true);
        }
        self.settle();
        let s = s.cast_const();
        // SAFETY: device ends are inside ranges of this Access (mapped READ|WRITE, the
        // destination registered for writing, so no other thread of this process touches it);
        // host ends are valid per the contract of `HostSpan::new`. `&mut self` means no slice
        // handed out by this Access is alive, and `settle` wrote back and dropped the private
        // copies. Ends shared across processes are accessed only atomically; an end shared
        // across processes and a private one are distinct memory, so they do not overlap.
        unsafe { atomic::copy(d, d_cross, s, s_cross, n) };
        Ok(())
    }

    /// Copies `len` bytes from device address `src`, in a range of `from`, to device address
    /// `dst`, in a write range of `self`: a copy between two memories (peer access).
    pub fn copy_from(
        &mut self,
        dst: u64,
        from: &mut Access<'_>,
        src: u64,
        len: u64,
    ) -> DriverResult<()> {
        if len == 0 {
            return Ok(());
        }
        if std::ptr::eq(self.mem, from.mem) {
            return Err(DriverError::InvalidValue("a copy between two memories: same one".into()));
        }
        let d_cross = match self.covering(dst, len, true) {
            Some(i) => self.crosses(i),
            None => return Err(not_held(dst, len)),
        };
        let s_cross = match from.covering(src, len, false) {
            Some(i) => from.crosses(i),
            None => return Err(not_held(src, len)),
        };
        let n = usize::try_from(len).map_err(|_| DriverError::InvalidValue("length".into()))?;
        self.settle();
        from.settle();
        let (d, s) = (self.mem.ptr(dst), from.mem.ptr(src).cast_const());
        // SAFETY: `dst` is inside a write range of this Access and `src` inside a range of
        // `from` (both mapped READ|WRITE and registered in flight, so no other thread of this
        // process writes either or reads the destination); `&mut` on both means no slice
        // handed out by either is alive, and `settle` wrote back and dropped their private
        // copies. The two Accesses are of two memories, two distinct arenas: the ranges cannot
        // overlap. Ends shared across processes are accessed only atomically.
        unsafe { atomic::copy(d, d_cross, s, s_cross, n) };
        Ok(())
    }

    /// Sets `len` bytes at device address `addr` to `value`.
    pub fn fill(&mut self, addr: u64, value: u8, len: u64) -> DriverResult<()> {
        if len == 0 {
            return Ok(());
        }
        let Some(i) = self.covering(addr, len, true) else {
            return Err(not_held(addr, len));
        };
        self.settle();
        let (d, n) = (self.mem.ptr(addr), len as usize);
        if self.crosses(i) {
            // SAFETY: the range is inside a write range of this Access (mapped read-write,
            // registered in flight) shared across processes, which this process accesses only
            // atomically.
            unsafe { atomic::fill(d, value, n) };
        } else {
            // SAFETY: the range is inside a write range of this Access: mapped, and no other
            // thread may access it; `&mut self` means no slice of this Access is alive.
            unsafe { std::ptr::write_bytes(d, value, n) };
        }
        Ok(())
    }
}

pub(super) fn not_held(addr: u64, len: u64) -> DriverError {
    DriverError::InvalidAddress {
        addr,
        len,
        reason: "range is not part of the task's registered accesses".into(),
    }
}

impl KernelBuffers for Access<'_> {
    fn len(&self) -> usize {
        self.ranges.len()
    }

    fn bytes(&self, index: usize) -> Result<&[u8], KernelError> {
        let (r, f) = self.slot(index)?;
        if f.get() == Borrow::Mutable {
            return Err(KernelError(format!("buffer {index} is already borrowed mutably")));
        }
        f.set(Borrow::Shared);
        if r.len == 0 {
            return Ok(&[]);
        }
        if let Some(staging) = self.staging.as_deref().filter(|s| s.is_cross(index)) {
            let copy = staging.copy_of(index, || self.load_private(&r));
            // SAFETY: the private copy holds `len` initialised bytes and lives until `settle`
            // or the drop of `self`, both of which need `&mut self`; the flag allows only
            // shared borrows of it.
            return Ok(unsafe { std::slice::from_raw_parts(copy.as_ptr(), copy.len()) });
        }
        // SAFETY: the range is mapped READ|WRITE and registered in flight for this Access, so
        // it stays mapped while `self` is borrowed; no other thread writes it (a write range
        // of another owner would have been a conflict), and within this Access the only
        // mutable borrow of an overlapping range would be a write buffer, which `acquire`
        // (exclusive_writes) guarantees overlaps no other buffer, and which is never handed
        // out mutably once shared (flags).
        Ok(unsafe { std::slice::from_raw_parts(self.mem.ptr(r.addr), r.len as usize) })
    }

    fn bytes_mut(&self, index: usize) -> Result<&mut [u8], KernelError> {
        let (r, f) = self.slot(index)?;
        if r.mode != AccessMode::Write {
            return Err(KernelError(format!("buffer {index} is not declared for writing")));
        }
        if f.get() != Borrow::None {
            return Err(KernelError(format!("buffer {index} is already borrowed")));
        }
        f.set(Borrow::Mutable);
        if r.len == 0 {
            return Ok(&mut []);
        }
        if let Some(staging) = self.staging.as_deref().filter(|s| s.is_cross(index)) {
            let copy = staging.copy_of(index, || self.load_private(&r));
            // SAFETY: the private copy holds `len` initialised bytes and lives until `settle`
            // or the drop of `self`, both of which need `&mut self`; the flag makes this the
            // only borrow of it.
            return Ok(unsafe { std::slice::from_raw_parts_mut(copy.as_ptr(), copy.len()) });
        }
        // SAFETY: as in `bytes`; in addition the flag makes this the only borrow of the
        // buffer for the life of `self`, the write range overlaps no other buffer of this
        // Access, and no other owner may hold any overlapping range.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.mem.ptr(r.addr), r.len as usize) })
    }
}

impl Access<'_> {
    fn slot(&self, index: usize) -> Result<(Range, &Cell<Borrow>), KernelError> {
        match (self.ranges.get(index), self.flags.get(index)) {
            (Some(r), Some(f)) => Ok((*r, f)),
            _ => Err(KernelError(format!(
                "buffer index {index} out of range ({} buffers)",
                self.ranges.len()
            ))),
        }
    }
}
