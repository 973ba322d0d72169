//! Physical memory kept while unmapped: its pages in place or in a mapping of their own.

use std::ptr::NonNull;

use soma_core::hal::DriverResult;

use super::{os_error, page_size};

/// Where the bytes of unmapped physical memory are.
#[derive(PartialEq, Eq)]
pub(super) enum ParkedPages {
    /// Still at the range of the arena it was unmapped from, inaccessible.
    InPlace { addr: u64, len: u64 },
    /// Copied aside because another mapping was made over that range.
    Aside(Region),
}

impl ParkedPages {
    pub(super) fn len(&self) -> u64 {
        match self {
            ParkedPages::InPlace { len, .. } => *len,
            ParkedPages::Aside(r) => r.len as u64,
        }
    }
}

/// A private anonymous mapping outside the arena that only this value refers to, unmapped
/// when it is dropped.
#[derive(PartialEq, Eq)]
pub(super) struct Region {
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
}

// SAFETY: the pointer is the base of a mapping owned by this value alone, whose bytes are
// only touched under the device memory's lock, so moving the value between threads is sound.
unsafe impl Send for Region {}
// SAFETY: `&Region` gives no access to the bytes.
unsafe impl Sync for Region {}

impl Region {
    /// A fresh, zeroed, readable and writable region of `len` bytes.
    pub(super) fn new(len: usize) -> DriverResult<Region> {
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
pub(super) unsafe fn copy_resident(src: *const u8, dst: *mut u8, len: usize) {
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
