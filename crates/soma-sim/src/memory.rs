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
//! 4. **The parked pages** of unmapped physical memory: in place (a `PROT_NONE` range of the
//!    arena outside the mapped set) or aside (a private mapping of their own). Only this
//!    module's `map_parked` / `evict` copy them, under the lock, while no slice or `Access`
//!    can refer to them (they are not mapped).

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;

use parking_lot::Mutex;
use smallvec::SmallVec;
use soma_core::hal::{AccessMode, DriverError, DriverResult, KernelBuffers, KernelError};

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
    /// In-flight ranges.
    inflight: Vec<Held>,
    next_id: u64,
    /// Bytes of unmapped physical memory, by its key.
    parked: HashMap<u64, ParkedPages>,
    /// The arena ranges holding parked bytes in place: start → (end, key).
    in_place: BTreeMap<u64, (u64, u64)>,
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

    /// Makes `[addr, addr + len)` readable and writable. The range must be inside the arena,
    /// page aligned and not overlap a mapped range.
    pub fn map(&self, addr: u64, len: u64) -> DriverResult<()> {
        let mut st = self.state.lock();
        self.check_mappable(&st, addr, len)?;
        // Fresh memory reads as zero: parked bytes of unmapped physical memory there move aside.
        self.evict_overlapping(&mut st, addr, len)?;
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

    /// Unmaps the mapped range that starts at `addr` and has length `len`, as
    /// [`unmap`](Self::unmap), but keeps its bytes as physical memory `key`'s: this is
    /// physical memory's life on a device, where unmapping removes the address and the memory
    /// keeps its contents until it is freed. The pages stay where they are, inaccessible (no
    /// copy: a pool unmaps to free, and [`discard_parked`](Self::discard_parked) then drops
    /// them as `unmap` would have); they are copied aside only if a mapping is made over them
    /// first. [`map_parked`](Self::map_parked) maps them again, at any address.
    pub fn unmap_keep(&self, addr: u64, len: u64, key: u64) -> DriverResult<()> {
        let mut st = self.state.lock();
        self.check_unmappable(&st, addr, len)?;
        if st.parked.contains_key(&key) {
            return Err(DriverError::InvalidValue(format!("physical memory {key} is parked")));
        }
        self.protect(addr, len, libc::PROT_NONE)?;
        st.mapped.remove(&addr);
        st.in_place.insert(addr, (addr + len, key));
        st.parked.insert(key, ParkedPages::InPlace { addr, len });
        Ok(())
    }

    /// Maps the bytes of physical memory `key` (parked by [`unmap_keep`](Self::unmap_keep)) at
    /// `[addr, addr + len)`: inside the arena, page aligned, not overlapping a mapped range,
    /// and `len` the parked length. On an error the bytes stay parked.
    pub fn map_parked(&self, addr: u64, len: u64, key: u64) -> DriverResult<()> {
        let mut st = self.state.lock();
        self.check_mappable(&st, addr, len)?;
        let same_place = match st.parked.get(&key) {
            Some(p) if p.len() == len => *p == ParkedPages::InPlace { addr, len },
            Some(p) => {
                return Err(DriverError::InvalidValue(format!(
                    "physical memory {key} holds {} bytes, not {len}",
                    p.len()
                )))
            }
            None => {
                return Err(DriverError::InvalidValue(format!(
                    "physical memory {key} is not parked"
                )))
            }
        };
        if same_place {
            // Back where it was: the pages never moved.
            self.protect(addr, len, libc::PROT_READ | libc::PROT_WRITE)?;
            st.in_place.remove(&addr);
        } else {
            // Aside first (its own old place may overlap the target), then clear the target.
            self.evict(&mut st, key)?;
            self.evict_overlapping(&mut st, addr, len)?;
            self.protect(addr, len, libc::PROT_READ | libc::PROT_WRITE)?;
            if let Some(ParkedPages::Aside(region)) = st.parked.get(&key) {
                // SAFETY: the target is `len` bytes of our arena, just made accessible and not
                // mapped before (checked), so nothing refers to it; the region holds `len`
                // bytes outside the arena that only this table refers to.
                unsafe { copy_resident(region.ptr.as_ptr(), self.ptr(addr), region.len) };
            }
        }
        st.parked.remove(&key);
        st.mapped.insert(addr, addr + len);
        Ok(())
    }

    /// Drops the parked bytes of physical memory `key` (it is freed): their pages go back to
    /// the OS. Nothing to do for memory that was never parked.
    pub fn discard_parked(&self, key: u64) {
        let mut st = self.state.lock();
        match st.parked.remove(&key) {
            Some(ParkedPages::InPlace { addr, len }) => {
                st.in_place.remove(&addr);
                self.drop_pages(addr, len);
            }
            Some(ParkedPages::Aside(region)) => {
                // Unmapped outside the lock.
                drop(st);
                drop(region);
            }
            None => {}
        }
    }

    /// Copies the parked bytes of `key`, if they are in place, to a region outside the arena
    /// and drops them from the arena.
    fn evict(&self, st: &mut MemState, key: u64) -> DriverResult<()> {
        let Some(&ParkedPages::InPlace { addr, len }) = st.parked.get(&key) else {
            return Ok(());
        };
        let region = Region::new(len as usize)?;
        self.protect(addr, len, libc::PROT_READ)?;
        // SAFETY: `[addr, addr + len)` is an unmapped range of our arena holding parked pages,
        // just made readable, that nothing refers to; the region is fresh, `len` bytes long
        // and outside the arena.
        unsafe { copy_resident(self.ptr(addr), region.ptr.as_ptr(), len as usize) };
        self.protect(addr, len, libc::PROT_NONE)?;
        self.drop_pages(addr, len);
        st.in_place.remove(&addr);
        st.parked.insert(key, ParkedPages::Aside(region));
        Ok(())
    }

    /// Moves aside the parked bytes of every range that overlaps `[addr, addr + len)`, before
    /// a mapping is made there.
    fn evict_overlapping(&self, st: &mut MemState, addr: u64, len: u64) -> DriverResult<()> {
        let end = addr + len;
        while let Some(key) = st
            .in_place
            .range(..end)
            .next_back()
            .filter(|(_, &(e, _))| e > addr)
            .map(|(_, &(_, key))| key)
        {
            self.evict(st, key)?;
        }
        Ok(())
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
    /// caller holds the state lock and checked: a mapping with nothing in flight, a range not
    /// mapped, or parked pages).
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
        drop(st);
        Ok(Access {
            mem: self,
            id,
            ranges: ranges.iter().copied().collect(),
            flags: ranges.iter().map(|_| Cell::new(Borrow::None)).collect(),
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

/// Where the bytes of unmapped physical memory are.
#[derive(PartialEq, Eq)]
enum ParkedPages {
    /// Still at the range of the arena it was unmapped from, inaccessible.
    InPlace { addr: u64, len: u64 },
    /// Copied aside because another mapping was made over that range.
    Aside(Region),
}

impl ParkedPages {
    fn len(&self) -> u64 {
        match self {
            ParkedPages::InPlace { len, .. } => *len,
            ParkedPages::Aside(r) => r.len as u64,
        }
    }
}

/// A private anonymous mapping outside the arena that only this value refers to, unmapped
/// when it is dropped.
#[derive(PartialEq, Eq)]
struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the pointer is the base of a mapping owned by this value alone, whose bytes are
// only touched under the device memory's lock, so moving the value between threads is sound.
unsafe impl Send for Region {}
// SAFETY: `&Region` gives no access to the bytes.
unsafe impl Sync for Region {}

impl Region {
    /// A fresh, zeroed, readable and writable region of `len` bytes.
    fn new(len: usize) -> DriverResult<Region> {
        // SAFETY: an anonymous private mapping at an address the kernel chooses aliases no
        // existing Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap of parked physical memory"));
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| os_error("mmap returned null"))?;
        Ok(Region { ptr, len })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: we own the mapping and nothing refers to its bytes.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Copies the pages of `[src, src + len)` that are resident to the same offsets of `dst`,
/// whose other pages must read as zero already: pages never touched stay unbacked in `dst`
/// too, so moving unmapped physical memory aside costs what was written, not its size. Copies
/// everything when `mincore` cannot tell.
///
/// # Safety
/// `src` is page aligned and readable for `len` bytes, `dst` writable for `len` bytes and
/// zero where `src` has no resident page; the ranges do not overlap and nothing else refers
/// to them during the call.
unsafe fn copy_resident(src: *const u8, dst: *mut u8, len: usize) {
    let page = page_size() as usize;
    let pages = len.div_ceil(page);
    let mut resident = vec![0u8; pages];
    // SAFETY: `src` is page aligned and mapped for `len` bytes (the caller's contract);
    // `resident` has one byte per page of the range.
    let rc = unsafe { libc::mincore(src.cast_mut().cast(), len, resident.as_mut_ptr()) };
    if rc != 0 {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let mut i = 0;
    while i < pages {
        if resident[i] & 1 == 0 {
            i += 1;
            continue;
        }
        let start = i;
        while i < pages && resident[i] & 1 != 0 {
            i += 1;
        }
        let (from, to) = (start * page, (i * page).min(len));
        // SAFETY: `from..to` lies within both ranges (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.add(from), dst.add(from), to - from) };
    }
}

/// The host page size.
/// Page-locked host memory for `malloc_host`: `len` bytes (a whole number of pages) of a
/// fresh private mapping, locked in RAM where the process may lock memory (`mlock` failing,
/// e.g. over `RLIMIT_MEMLOCK`, leaves it pageable: the copies behave the same).
pub(crate) fn alloc_host(len: u64) -> DriverResult<NonNull<u8>> {
    let len = usize::try_from(len)
        .map_err(|_| DriverError::InvalidValue(format!("host allocation of {len} bytes")))?;
    // SAFETY: an anonymous, private mapping at an address the kernel chooses cannot alias
    // any existing Rust object; the arguments are valid by construction.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(DriverError::OutOfMemory { requested: len as u64, free: 0 });
    }
    // SAFETY: `[p, p + len)` is the mapping just made; locking it changes no contents.
    let _ = unsafe { libc::mlock(p, len) };
    NonNull::new(p.cast::<u8>()).ok_or_else(|| os_error("mmap returned null"))
}

/// Unmaps memory from [`alloc_host`].
///
/// # Safety
/// `ptr` and `len` are exactly an allocation of [`alloc_host`] not freed yet, and nothing
/// refers to its memory any more.
pub(crate) unsafe fn free_host(ptr: NonNull<u8>, len: u64) {
    // SAFETY: by the caller's contract the range is one whole mapping nobody uses; munmap
    // also drops the lock.
    unsafe { libc::munmap(ptr.as_ptr().cast(), len as usize) };
}

pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

fn mode_verb(m: AccessMode) -> &'static str {
    match m {
        AccessMode::Read => "reads",
        AccessMode::Write => "writes",
    }
}

fn invalid(r: &Range) -> DriverError {
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
enum Borrow {
    None,
    Shared,
    Mutable,
}

/// A set of device ranges registered in flight. While it lives the ranges stay mapped and no
/// conflicting access can be registered; dropping it removes the registration.
pub(crate) struct Access<'m> {
    mem: &'m DeviceMemory,
    id: u64,
    ranges: SmallVec<[Range; 4]>,
    flags: SmallVec<[Cell<Borrow>; 4]>,
}

impl Drop for Access<'_> {
    fn drop(&mut self) {
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
    fn covered(&self, addr: u64, len: u64, write: bool) -> bool {
        let Some(end) = addr.checked_add(len) else { return false };
        self.ranges
            .iter()
            .any(|r| r.addr <= addr && end <= r.end() && (!write || r.mode == AccessMode::Write))
    }

    /// Copies `len` bytes (memmove semantics: the ends may overlap).
    pub fn copy(&mut self, dst: &End, src: &End, len: u64) -> DriverResult<()> {
        if len == 0 {
            return Ok(());
        }
        let n = usize::try_from(len).map_err(|_| DriverError::InvalidValue("length".into()))?;
        let d = match dst {
            End::Device(a) if self.covered(*a, len, true) => self.mem.ptr(*a),
            End::Host(h) if h.len >= n => h.ptr,
            End::Device(a) => return Err(not_held(*a, len)),
            End::Host(_) => return Err(DriverError::InvalidValue("host span too short".into())),
        };
        let s = match src {
            End::Device(a) if self.covered(*a, len, false) => self.mem.ptr(*a).cast_const(),
            End::Host(h) if h.len >= n => h.ptr.cast_const(),
            End::Device(a) => return Err(not_held(*a, len)),
            End::Host(_) => return Err(DriverError::InvalidValue("host span too short".into())),
        };
        // SAFETY: device ends are inside ranges of this Access (mapped READ|WRITE, the
        // destination registered for writing, so no other thread touches it); host ends are
        // valid per the contract of `HostSpan::new`. `&mut self` means no slice handed out by
        // this Access is alive. `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(s, d, n) };
        Ok(())
    }

    /// Sets `len` bytes at device address `addr` to `value`.
    pub fn fill(&mut self, addr: u64, value: u8, len: u64) -> DriverResult<()> {
        if len == 0 {
            return Ok(());
        }
        if !self.covered(addr, len, true) {
            return Err(not_held(addr, len));
        }
        // SAFETY: the range is inside a write range of this Access: mapped, and no other
        // thread may access it; `&mut self` means no slice of this Access is alive.
        unsafe { std::ptr::write_bytes(self.mem.ptr(addr), value, len as usize) };
        Ok(())
    }
}

fn not_held(addr: u64, len: u64) -> DriverError {
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

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    fn r(addr: u64, len: u64, mode: AccessMode) -> Range {
        Range { addr, len, mode }
    }

    #[test]
    fn map_access_unmap() {
        let m = DeviceMemory::new(8 * G, G).unwrap();
        let a = m.start();
        assert_eq!(a % G, 0);
        assert!(m.check_mapped(&[r(a, 1, AccessMode::Read)]).is_err());
        m.map(a, G).unwrap();
        m.map(a + G, G).unwrap();
        assert!(m.map(a, G).is_err());
        // A range spanning two adjacent mappings is valid.
        m.check_mapped(&[r(a + G - 1, 2, AccessMode::Read)]).unwrap();
        assert!(m.check_mapped(&[r(a + G, G + 1, AccessMode::Read)]).is_err());
        {
            let mut acc =
                m.acquire(Owner::Host("t"), &[r(a, 16, AccessMode::Write)], true).unwrap();
            acc.fill(a, 7, 16).unwrap();
            assert!(acc.fill(a, 7, 17).is_err());
            assert!(m.unmap(a, G).is_err(), "in-flight range must not be unmapped");
            let bytes = KernelBuffers::bytes(&acc, 0).unwrap();
            assert_eq!(bytes, &[7u8; 16]);
            assert!(acc.bytes_mut(0).is_err());
        }
        assert_eq!(m.inflight_len(), 0);
        m.unmap(a, G).unwrap();
        assert!(m.unmap(a, G).is_err());
        m.map(a, G).unwrap();
        let acc = m.acquire(Owner::Host("t"), &[r(a, 16, AccessMode::Read)], true).unwrap();
        assert_eq!(KernelBuffers::bytes(&acc, 0).unwrap(), &[0u8; 16], "fresh pages are zero");
    }

    /// Unmapping with `unmap_keep` keeps the bytes, wherever they are mapped again, also after
    /// another mapping was made over their old place; discarding them frees them; a refused
    /// unmap or map changes nothing.
    #[test]
    fn parked_pages_keep_their_bytes() {
        let m = DeviceMemory::new(8 * G, G).unwrap();
        let a = m.start();
        let fill = |at: u64, v: u8| {
            let mut acc =
                m.acquire(Owner::Host("t"), &[r(at, G, AccessMode::Write)], true).unwrap();
            acc.fill(at, v, G).unwrap();
        };
        let read = |at: u64| {
            let acc = m.acquire(Owner::Host("t"), &[r(at, G, AccessMode::Read)], true).unwrap();
            let b = KernelBuffers::bytes(&acc, 0).unwrap();
            (b[0], b[G as usize - 1], b.iter().all(|&x| x == b[0]))
        };
        m.map(a, G).unwrap();
        fill(a, 0xAB);
        {
            let _busy = m.acquire(Owner::Host("t"), &[r(a, 1, AccessMode::Read)], true).unwrap();
            assert!(m.unmap_keep(a, G, 1).is_err(), "in-flight range must not be unmapped");
        }
        assert!(m.unmap_keep(a, 2 * G, 1).is_err(), "not a mapping of that size");
        m.unmap_keep(a, G, 1).unwrap();
        assert!(m.check_mapped(&[r(a, 1, AccessMode::Read)]).is_err(), "unmapped");
        // Back in place: nothing moved.
        assert!(m.map_parked(a, 2 * G, 1).is_err(), "wrong length");
        assert!(m.map_parked(a, G, 2).is_err(), "nothing parked under that key");
        m.map_parked(a, G, 1).unwrap();
        assert_eq!(read(a), (0xAB, 0xAB, true));
        // Elsewhere: copied.
        m.unmap_keep(a, G, 1).unwrap();
        m.map(a + 3 * G, G).unwrap();
        assert!(m.map_parked(a + 3 * G, G, 1).is_err(), "target already mapped");
        m.map_parked(a + 2 * G, G, 1).unwrap();
        assert_eq!(read(a + 2 * G), (0xAB, 0xAB, true));
        // A fresh mapping over parked bytes reads zero, and the parked bytes survive it.
        fill(a + 2 * G, 0x5C);
        m.unmap_keep(a + 2 * G, G, 1).unwrap();
        m.map(a + 2 * G, G).unwrap();
        assert_eq!(read(a + 2 * G), (0, 0, true));
        m.map_parked(a, G, 1).unwrap();
        assert_eq!(read(a), (0x5C, 0x5C, true));
        // Discarded bytes are gone: the range reads zero when mapped again.
        m.unmap_keep(a, G, 1).unwrap();
        m.discard_parked(1);
        assert!(m.map_parked(a, G, 1).is_err(), "discarded");
        m.map(a, G).unwrap();
        assert_eq!(read(a), (0, 0, true));
        // A parked range overlapped by a larger mapping is moved aside too.
        m.unmap(a + 2 * G, G).unwrap();
        fill(a, 0x11);
        m.unmap_keep(a, G, 7).unwrap();
        m.map(a, 3 * G).unwrap();
        assert_eq!(read(a), (0, 0, true));
        m.map_parked(a + 5 * G, G, 7).unwrap();
        assert_eq!(read(a + 5 * G), (0x11, 0x11, true));
    }

    #[test]
    fn conflicts() {
        let m = DeviceMemory::new(4 * G, G).unwrap();
        let a = m.start();
        m.map(a, G).unwrap();
        let own = |t| Owner::Task { stream: 1, task: t };
        let r1 = m.acquire(own(1), &[r(a, 100, AccessMode::Read)], true).unwrap();
        let r2 = m.acquire(own(2), &[r(a + 50, 100, AccessMode::Read)], true).unwrap();
        let e = m.acquire(own(3), &[r(a + 99, 1, AccessMode::Write)], true).err().unwrap();
        assert!(e.message().contains("data race"), "{}", e.message());
        drop((r1, r2));
        let _w = m.acquire(own(4), &[r(a + 99, 1, AccessMode::Write)], true).unwrap();
        assert!(m.acquire(own(5), &[r(a + 100, 1, AccessMode::Write)], true).is_ok());
        // Self overlap of a write.
        assert!(m
            .acquire(
                own(6),
                &[r(a + 200, 10, AccessMode::Write), r(a + 205, 10, AccessMode::Read)],
                true
            )
            .is_err());
    }
}
