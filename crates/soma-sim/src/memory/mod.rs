//! Device memory: the one place in the crate that touches raw memory.
//!
//! Every `unsafe` block of soma-sim that dereferences, maps or unmaps memory lives here. The
//! module owns four things whose invariants together make the slices it hands out sound:
//!
//! 1. **The arena**: one `mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)` region
//!    per device, alive as long as the [`DeviceMemory`] value. Device addresses are the real
//!    host addresses inside it.
//! 2. **The mapped set**: the ranges currently `mprotect`ed `READ | WRITE`. Only these are ever
//!    turned into slices or copied to / from by tasks and host copies.
//! 3. **The in-flight table**: every range a running task (or a synchronous copy) accesses,
//!    with its mode. An [`Access`] is only created after its ranges were checked (under the same
//!    lock) to be mapped and not to conflict with any other in-flight range (write / any or
//!    any / write, overlapping); it removes them when dropped. [`DeviceMemory::unmap`] refuses
//!    ranges that are in flight. Hence while an `Access` lives its ranges stay mapped, and no
//!    other thread holds a conflicting reference to their bytes.
//! 4. **The shared ranges**: mapped ranges backed by a physical allocation's memory file
//!    ([`SharedPages`], `MAP_SHARED` over the arena) instead of the arena's own anonymous
//!    pages. Unmapping one puts a fresh `PROT_NONE` anonymous reservation back in its place;
//!    the file keeps the bytes.
//! 5. **The cross-process ranges**: shared ranges whose file another process may map too
//!    (exported or imported physical memory). What the two processes do to those bytes is
//!    ordered by them, as on a device, and never by the in-flight table, which is per process:
//!    the other process may write them at any time. So this process never makes a slice of
//!    them nor reads or writes them non-atomically: an [`Access`] gives kernels private copies
//!    and writes them back when it ends, and copies and fills use relaxed atomic loads and
//!    stores ([`atomic`]). An unordered race between the processes gives unspecified bytes,
//!    not undefined behaviour. Every other range keeps the direct, zero-copy path.
//!
//! A request whose ranges lie in several devices' memories (peer access) holds one `Access`
//! per memory ([`SpanningAccess`]); the arenas of two devices never overlap.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use parking_lot::Mutex;

use soma_core::hal::{AccessMode, DriverError, DriverResult};

/// Who holds an in-flight range: a task on a stream, or a synchronous call from the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Task `task` of stream `stream`.
    Task {
        /// Stream id.
        stream: u64,
        /// Position of the task.
        task: u64,
    },
    /// A synchronous `copy_sync` / `memset_sync` from the host.
    Host(&'static str),
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Task { stream, task } => write!(f, "stream {stream} task {task}"),
            Owner::Host(what) => write!(f, "host {what}"),
        }
    }
}

/// One device range an [`Access`] asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Range {
    /// First byte (a device = host address).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Read or write.
    pub mode: AccessMode,
}

impl Range {
    fn end(&self) -> u64 {
        self.addr.saturating_add(self.len)
    }
    fn overlaps(&self, addr: u64, end: u64) -> bool {
        self.len > 0 && addr < end && self.addr < end && addr < self.end()
    }
}

/// Why [`DeviceMemory::acquire`] refused.
#[derive(Debug)]
pub(crate) enum AcquireError {
    /// A range is not mapped, or arguments are invalid.
    Invalid(DriverError),
    /// A range conflicts with one another owner holds.
    Conflict(String),
}

impl AcquireError {
    /// A human-readable message.
    pub fn message(&self) -> String {
        match self {
            AcquireError::Invalid(e) => e.to_string(),
            AcquireError::Conflict(m) => m.clone(),
        }
    }
}

struct Held {
    id: u64,
    owner: Owner,
    range: Range,
}

#[derive(Default)]
struct MemState {
    /// Mapped ranges: start → end. Disjoint; adjacent entries are not merged (one per map).
    mapped: BTreeMap<u64, u64>,
    /// The mapped ranges shared across processes: start → end, each an entry of `mapped`.
    cross_process: BTreeMap<u64, u64>,
    /// In-flight ranges.
    inflight: Vec<Held>,
    next_id: u64,
    /// Ranges of the arena the OS took back without a reservation in their place (an
    /// `mmap` over them failed half-way): never mapped again, since another mapping of the
    /// process may live there now.
    lost: BTreeMap<u64, u64>,
}

impl MemState {
    /// Whether `[addr, addr + len)` lies entirely in mapped memory (possibly spanning several
    /// adjacent mappings).
    fn is_mapped(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else { return false };
        let mut cur = addr;
        while cur < end {
            match self.mapped.range(..=cur).next_back() {
                Some((_, &e)) if e > cur => cur = e,
                _ => return false,
            }
        }
        true
    }

    /// Whether `r` touches a range shared across processes.
    fn crosses(&self, r: &Range) -> bool {
        r.len > 0
            && self.cross_process.range(..r.end()).next_back().is_some_and(|(_, &e)| e > r.addr)
    }

    fn conflict(&self, r: &Range) -> Option<&Held> {
        self.inflight.iter().find(|h| {
            h.range.overlaps(r.addr, r.end())
                && (h.range.mode == AccessMode::Write || r.mode == AccessMode::Write)
        })
    }
}

/// A device's memory: the arena, the mapped set and the in-flight table.
pub(crate) struct DeviceMemory {
    /// Start of the whole `mmap` (for `munmap`).
    map_base: NonNull<u8>,
    /// Length of the whole `mmap`.
    map_len: usize,
    /// First usable, granule-aligned address.
    start: u64,
    /// Usable bytes from `start`.
    len: u64,
    state: Mutex<MemState>,
}

// SAFETY: the raw pointer is only the base of an mmap region owned by this value; all access
// to the bytes goes through the mapped set / in-flight table protocol above, guarded by the
// mutex, so sharing the value between threads is sound.
unsafe impl Send for DeviceMemory {}
// SAFETY: as above: `&DeviceMemory` only allows mutex-guarded state changes and `Access`es,
// which never alias conflicting ranges.
unsafe impl Sync for DeviceMemory {}

fn os_error(what: &str) -> DriverError {
    DriverError::Native {
        code: -1,
        message: format!("{what}: {}", std::io::Error::last_os_error()),
    }
}

impl DeviceMemory {
    /// Reserves `len` bytes of address space aligned to `align` (a power of two).
    pub fn new(len: u64, align: u64) -> DriverResult<Self> {
        let total = len
            .checked_add(align)
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| DriverError::InvalidValue(format!("address space of {len} bytes")))?;
        // SAFETY: an anonymous, private, PROT_NONE mapping at an address the kernel chooses
        // cannot alias any existing Rust object; the arguments are valid by construction.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap of the device address space"));
        }
        let map_base =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| os_error("mmap returned null"))?;
        let base_addr = map_base.as_ptr() as u64;
        let start = base_addr.div_ceil(align) * align;
        Ok(Self { map_base, map_len: total, start, len, state: Mutex::new(MemState::default()) })
    }

    /// First usable address.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Usable bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// A pointer to device address `addr` with the provenance of the mapping.
    fn ptr(&self, addr: u64) -> *mut u8 {
        let off = (addr - self.map_base.as_ptr() as u64) as usize;
        self.map_base.as_ptr().wrapping_add(off)
    }

    fn in_arena(&self, addr: u64, len: u64) -> bool {
        addr >= self.start && addr.checked_add(len).is_some_and(|e| e <= self.start + self.len)
    }

    /// Whether `[addr, addr + len)` lies in this device's address space (mapped or not):
    /// device addresses of different devices never overlap.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        self.in_arena(addr, len)
    }

    /// Makes `[addr, addr + len)` readable and writable. The range must be inside the arena,
    /// page aligned and not overlap a mapped range.
    pub fn map(&self, addr: u64, len: u64) -> DriverResult<()> {
        let mut st = self.state.lock();
        self.check_mappable(&st, addr, len)?;
        self.protect(addr, len, libc::PROT_READ | libc::PROT_WRITE)?;
        st.mapped.insert(addr, addr + len);
        Ok(())
    }

    /// Unmaps the mapped range that starts at `addr` and has length `len`, returning its pages
    /// to the OS. Fails, changing nothing, if the range is in flight.
    pub fn unmap(&self, addr: u64, len: u64) -> DriverResult<()> {
        let mut st = self.state.lock();
        self.check_unmappable(&st, addr, len)?;
        self.protect(addr, len, libc::PROT_NONE)?;
        st.mapped.remove(&addr);
        self.drop_pages(addr, len);
        Ok(())
    }

    /// Maps the memory file `pages` at `[addr, addr + len)`: inside the arena, page aligned,
    /// not overlapping a mapped range, and `len` the file's length. The range shows the
    /// file's bytes, as any other mapping of it does (in this process or another).
    /// `cross_process`: another process may map the file too (it was exported or imported),
    /// so the range is accessed as [`share`](Self::share) describes.
    pub fn map_shared(
        &self,
        addr: u64,
        len: u64,
        pages: &SharedPages,
        cross_process: bool,
    ) -> DriverResult<()> {
        let mut st = self.state.lock();
        self.check_mappable(&st, addr, len)?;
        if pages.len() != len {
            return Err(DriverError::InvalidValue(format!(
                "physical memory of {} bytes mapped over {len} bytes",
                pages.len()
            )));
        }
        // SAFETY: the range is inside our arena and not mapped (checked under the lock), so
        // no slice or `Access` refers to it; MAP_FIXED replaces its PROT_NONE reservation
        // with the file's pages, which are `len` bytes long.
        let p = unsafe {
            libc::mmap(
                self.ptr(addr).cast(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                pages.fd().as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = os_error("mmap of physical memory");
            self.reserve_again(&mut st, addr, len);
            return Err(e);
        }
        st.mapped.insert(addr, addr + len);
        if cross_process {
            st.cross_process.insert(addr, addr + len);
        }
        Ok(())
    }

    /// Marks the mapping `[addr, addr + len)` (made by [`map_shared`](Self::map_shared)) as
    /// shared across processes, before its file is handed to another process: from now on no
    /// slice of it is made and its bytes are read and written atomically only. Returns once
    /// the accesses registered before, which may hold slices of it, have ended (accesses end
    /// when their task or call does, without waiting for anything).
    pub fn share(&self, addr: u64, len: u64) -> DriverResult<()> {
        let whole = Range { addr, len, mode: AccessMode::Write };
        let horizon = {
            let mut st = self.state.lock();
            if st.mapped.get(&addr) != Some(&whole.end()) {
                return Err(DriverError::InvalidAddress {
                    addr,
                    len,
                    reason: "not the start of a mapping of that size".into(),
                });
            }
            st.cross_process.insert(addr, whole.end());
            st.next_id
        };
        let direct_in_flight = |st: &MemState| {
            st.inflight.iter().any(|h| h.id < horizon && h.range.overlaps(addr, whole.end()))
        };
        while direct_in_flight(&self.state.lock()) {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        Ok(())
    }

    /// Unmaps the range `[addr, addr + len)` made by [`map_shared`](Self::map_shared): a
    /// fresh reservation takes its place, the memory file keeps the bytes. Fails, changing
    /// nothing, if the range is in flight.
    pub fn unmap_shared(&self, addr: u64, len: u64) -> DriverResult<()> {
        let mut st = self.state.lock();
        self.check_unmappable(&st, addr, len)?;
        st.mapped.remove(&addr);
        st.cross_process.remove(&addr);
        if !self.reserve_again(&mut st, addr, len) {
            return Err(os_error("mmap of the unmapped range's reservation"));
        }
        Ok(())
    }

    /// Puts a fresh `PROT_NONE` reservation over `[addr, addr + len)`, a range of the arena
    /// that is not mapped; whether it could. When the OS refuses, the range is lost.
    fn reserve_again(&self, st: &mut MemState, addr: u64, len: u64) -> bool {
        // SAFETY: the range is inside our arena and not in the mapped set (the caller holds
        // the lock and checked), so nothing refers to its bytes; MAP_FIXED replaces whatever
        // pages it has with inaccessible, unbacked ones.
        let p = unsafe {
            libc::mmap(
                self.ptr(addr).cast(),
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            st.lost.insert(addr, addr + len);
            return false;
        }
        true
    }

    /// Gives the pages of an inaccessible range of the arena back to the OS (best effort: if
    /// madvise fails they only stay resident).
    fn drop_pages(&self, addr: u64, len: u64) {
        // SAFETY: the caller holds the lock and the range is not mapped, so nothing refers to
        // it; MADV_DONTNEED on a private anonymous mapping only drops its pages (they read as
        // zero when mapped again).
        let _ = unsafe { libc::madvise(self.ptr(addr).cast(), len as usize, libc::MADV_DONTNEED) };
    }

    fn check_mappable(&self, st: &MemState, addr: u64, len: u64) -> DriverResult<()> {
        if len == 0 || !self.in_arena(addr, len) {
            return Err(DriverError::InvalidAddress {
                addr,
                len,
                reason: "outside the device address space".into(),
            });
        }
        let end = addr + len;
        if st.mapped.range(..end).next_back().is_some_and(|(_, &e)| e > addr) {
            return Err(DriverError::InvalidAddress {
                addr,
                len,
                reason: "range is already mapped".into(),
            });
        }
        if st.lost.range(..end).next_back().is_some_and(|(_, &e)| e > addr) {
            return Err(DriverError::InvalidAddress {
                addr,
                len,
                reason: "range was lost to a failed mapping call of the OS".into(),
            });
        }
        Ok(())
    }

    fn check_unmappable(&self, st: &MemState, addr: u64, len: u64) -> DriverResult<()> {
        let end = addr.saturating_add(len);
        if st.mapped.get(&addr) != Some(&end) {
            return Err(DriverError::InvalidAddress {
                addr,
                len,
                reason: "not the start of a mapping of that size".into(),
            });
        }
        let probe = Range { addr, len, mode: AccessMode::Write };
        if let Some(h) = st.conflict(&probe) {
            return Err(DriverError::InvalidValue(format!(
                "cannot unmap {addr:#x} (+{len} bytes): in use by {} ({:#x} +{} bytes in flight)",
                h.owner, h.range.addr, h.range.len
            )));
        }
        Ok(())
    }

    /// Sets the protection of a range of the arena that no slice or [`Access`] refers to (the
    /// caller holds the state lock and checked: a mapping with nothing in flight, or a range
    /// not mapped).
    fn protect(&self, addr: u64, len: u64, prot: libc::c_int) -> DriverResult<()> {
        // SAFETY: per the caller's check, no reference to the range's bytes exists, so
        // changing its protection cannot invalidate one; the range is inside our arena.
        let rc = unsafe { libc::mprotect(self.ptr(addr).cast(), len as usize, prot) };
        if rc != 0 {
            return Err(os_error("mprotect"));
        }
        Ok(())
    }

    /// Checks that every range is mapped (no registration).
    pub fn check_mapped(&self, ranges: &[Range]) -> DriverResult<()> {
        let st = self.state.lock();
        for r in ranges {
            if r.len > 0 && !st.is_mapped(r.addr, r.len) {
                return Err(invalid(r));
            }
        }
        Ok(())
    }

    /// Registers `ranges` as in flight for `owner` after checking they are mapped and free of
    /// conflicts. With `exclusive_writes` (kernels), a write range must not overlap any other
    /// range of the same request either.
    pub fn acquire(
        &self,
        owner: Owner,
        ranges: &[Range],
        exclusive_writes: bool,
    ) -> Result<Access<'_>, AcquireError> {
        if exclusive_writes {
            check_no_self_overlap(ranges).map_err(AcquireError::Invalid)?;
        }
        let mut st = self.state.lock();
        for r in ranges {
            if r.len > 0 && !st.is_mapped(r.addr, r.len) {
                return Err(AcquireError::Invalid(invalid(r)));
            }
            if let Some(h) = st.conflict(r) {
                return Err(AcquireError::Conflict(format!(
                    "concurrent conflicting access (data race): {owner} {} {:#x} (+{} bytes) \
                     while {} {} {:#x} (+{} bytes) is in flight",
                    mode_verb(r.mode),
                    r.addr,
                    r.len,
                    h.owner,
                    mode_verb(h.range.mode),
                    h.range.addr,
                    h.range.len
                )));
            }
        }
        let id = st.next_id;
        st.next_id += 1;
        for r in ranges {
            if r.len > 0 {
                st.inflight.push(Held { id, owner, range: *r });
            }
        }
        let staging = (!st.cross_process.is_empty() && ranges.iter().any(|r| st.crosses(r)))
            .then(|| Box::new(Staging::new(ranges.iter().map(|r| st.crosses(r)).collect())));
        drop(st);
        Ok(Access {
            mem: self,
            id,
            ranges: ranges.iter().copied().collect(),
            flags: ranges.iter().map(|_| Cell::new(Borrow::None)).collect(),
            staging,
        })
    }

    /// Number of in-flight ranges (for tests).
    #[cfg(test)]
    pub fn inflight_len(&self) -> usize {
        self.state.lock().inflight.len()
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: we own the mapping; `&mut self` proves no Access (which borrows `self`)
        // exists, so nothing refers to the region any more.
        unsafe {
            libc::munmap(self.map_base.as_ptr().cast(), self.map_len);
        }
    }
}

mod access;
mod atomic;
mod handoff;
mod host;
mod shared;
mod spanning;
mod staging;
#[cfg(test)]
mod tests;

pub(crate) use access::{check_no_self_overlap, Access, End, HostSpan};
use access::{invalid, mode_verb, Borrow};
pub(crate) use handoff::{peer_pid, recv_with_fd, send_with_fd};
pub(crate) use host::{alloc_host, free_host, page_size};
pub(crate) use shared::SharedPages;
pub(crate) use spanning::SpanningAccess;
use staging::Staging;
