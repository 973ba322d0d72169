//! Physical memory as a file of its own (a `memfd`): mapped into the arena with
//! `MAP_SHARED`, it keeps its bytes while unmapped, shows them wherever it is mapped next, and
//! can be handed to another process, whose mapping of it sees the same bytes.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use soma_core::hal::{DriverError, DriverResult};

/// The bytes of one physical allocation: a memory file of `len` bytes. Its pages live as
/// long as the file is open or mapped anywhere (in this process or another), and go back to
/// the OS after the last of them.
pub(crate) struct SharedPages {
    file: File,
    len: u64,
}

impl SharedPages {
    /// A fresh memory file of `len` bytes, all zero (no page is allocated before it is
    /// written).
    pub(crate) fn create(len: u64) -> DriverResult<SharedPages> {
        let fd = match memfd() {
            Ok(fd) => fd,
            // One file per physical allocation: a process low on descriptors may raise its
            // soft limit up to the hard one, once.
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) && raise_fd_limit() => {
                memfd().map_err(|e| physical_error(len, &e))?
            }
            Err(e) => return Err(physical_error(len, &e)),
        };
        let file = File::from(fd);
        file.set_len(len).map_err(|e| physical_error(len, &e))?;
        Ok(SharedPages { file, len })
    }

    /// The memory file `fd` received from another process; its length is what it says.
    pub(crate) fn adopt(fd: OwnedFd) -> DriverResult<SharedPages> {
        let file = File::from(fd);
        let len = file.metadata().map_err(|e| physical_error(0, &e))?.len();
        Ok(SharedPages { file, len })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The file, to map it or hand it to another process.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

fn physical_error(len: u64, e: &std::io::Error) -> DriverError {
    DriverError::Native {
        code: -1,
        message: format!("physical memory of {len} bytes (a memory file): {e}"),
    }
}

/// A new, empty memory file, closed on `exec`.
fn memfd() -> std::io::Result<OwnedFd> {
    // SAFETY: the name is a valid NUL-terminated string; the call only creates a file
    // descriptor.
    let fd = unsafe { libc::memfd_create(c"soma-sim-physical".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Raises the soft limit on open files to the hard limit; whether it rose.
fn raise_fd_limit() -> bool {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid rlimit the call writes.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0
        || lim.rlim_cur >= lim.rlim_max
    {
        return false;
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: `lim` is a valid rlimit the call reads.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 }
}
