//! Handing a physical allocation's memory file to another process: a message with the file
//! descriptor attached (`SCM_RIGHTS`) over a Unix socket, and the credentials of the process
//! at the other end (`SO_PEERCRED`), which the exporting side checks against its whitelist.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// The process id of the peer of `stream`, as the kernel recorded it at `connect`.
pub(crate) fn peer_pid(stream: &UnixStream) -> io::Result<i32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` is the size of `cred`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::from_mut(&mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.pid)
}

/// Room for the control message of one file descriptor (a `cmsghdr` and an `int`, aligned).
const CONTROL_LEN: usize = 64;

/// Control buffer, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct Control([u8; CONTROL_LEN]);

/// Sends `bytes` (not empty) on `stream` with `fd`, if any, attached to them.
pub(crate) fn send_with_fd(
    stream: &UnixStream,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    let mut control = Control([0; CONTROL_LEN]);
    // SAFETY: an all-zero msghdr is a valid empty message header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) };
        debug_assert!(space as usize <= CONTROL_LEN);
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer is aligned and large enough for one header and an int
        // (checked above), so CMSG_FIRSTHDR returns a valid pointer into it and CMSG_DATA a
        // pointer to the int's place.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
            libc::CMSG_DATA(header).cast::<libc::c_int>().write_unaligned(fd.as_raw_fd());
        }
    }
    // SAFETY: `msg` points to `iov` (which describes `bytes`) and to the control buffer,
    // all alive during the call; the kernel only reads them.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    match sent {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize == bytes.len() => Ok(()),
        _ => Err(io::Error::new(io::ErrorKind::WriteZero, "short send of a handoff message")),
    }
}

/// Receives up to `buf.len()` bytes from `stream` and the file descriptor attached to them,
/// if any (closed on `exec`). Returns the byte count (0 at end of stream).
pub(crate) fn recv_with_fd(
    stream: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = Control([0; CONTROL_LEN]);
    // SAFETY: an all-zero msghdr is a valid empty message header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = CONTROL_LEN as _;
    // SAFETY: `msg` describes `buf` and the control buffer, both writable and alive during
    // the call.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut received = None;
    // SAFETY: after a successful recvmsg, the control buffer holds `msg_controllen` bytes of
    // well-formed control messages, which the CMSG macros walk within those bounds.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let fd = libc::CMSG_DATA(header).cast::<libc::c_int>().read_unaligned();
                // The kernel installed the descriptor in this process for us alone.
                let owned = OwnedFd::from_raw_fd(fd);
                if received.is_none() {
                    received = Some(owned);
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "handoff control message cut"));
    }
    Ok((n as usize, received))
}
