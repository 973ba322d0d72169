//! Page-locked host memory for `malloc_host`, and the host page size.

use std::ptr::NonNull;

use soma_core::hal::{DriverError, DriverResult};

use super::os_error;

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

/// The host page size.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}
