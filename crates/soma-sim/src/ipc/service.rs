//! The socket an exporting process serves its exports on, and the importing side's request.
//!
//! One request per connection: the importer sends the export's number (8 bytes, little
//! endian); the exporter answers with one status byte — 0 and the memory file attached, or
//! a [`Refusal`] code — and closes the connection.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

use parking_lot::Mutex;
use soma_core::hal::{DriverError, DriverResult, ShareableHandle};

use super::{lookup, own_pid, split, Refusal};
use crate::memory::{peer_pid, recv_with_fd, send_with_fd, SharedPages};

/// How long either side waits for the other's message before giving up on a connection.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The process whose listener is running (a child made by `fork` has none), and its service
/// number.
static SERVING: Mutex<Option<(i32, u32)>> = Mutex::new(None);

/// Services one process may run (copies of this library loaded side by side).
const SERVICES: u32 = 16;

fn address(pid: i32, service: u32) -> std::io::Result<SocketAddr> {
    match service {
        0 => SocketAddr::from_abstract_name(format!("soma-sim-ipc-{pid}")),
        k => SocketAddr::from_abstract_name(format!("soma-sim-ipc-{pid}-{k}")),
    }
}

/// Whether `service` is this copy's.
pub(super) fn serves(service: u32) -> bool {
    *SERVING.lock() == Some((own_pid(), service))
}

/// Starts this process's listener, unless it runs already; its service number.
pub(super) fn ensure_serving() -> DriverResult<u32> {
    let mut serving = SERVING.lock();
    let pid = own_pid();
    if let Some((p, service)) = *serving {
        if p == pid {
            return Ok(service);
        }
    }
    // The first name no other copy of this library in the process took.
    let mut bound = Err(std::io::Error::from(std::io::ErrorKind::AddrInUse));
    for service in 0..SERVICES {
        bound =
            address(pid, service).and_then(|a| UnixListener::bind_addr(&a)).map(|l| (l, service));
        if bound.is_ok() {
            break;
        }
    }
    let (listener, service) = bound.map_err(|e| DriverError::Native {
        code: -1,
        message: format!("cannot serve this process's exports (socket soma-sim-ipc-{pid}): {e}"),
    })?;
    std::thread::Builder::new()
        .name("soma-sim-ipc".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                // A broken connection only fails that importer's request.
                let _ = serve(&stream);
            }
        })
        .map_err(|e| DriverError::Native {
            code: -1,
            message: format!("cannot start the thread serving exports: {e}"),
        })?;
    *serving = Some((pid, service));
    Ok(service)
}

/// Answers one request.
fn serve(stream: &UnixStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    let pid = peer_pid(stream)?;
    let mut request = [0u8; 8];
    (&*stream).read_exact(&mut request)?;
    let (_, _, n) = split(ShareableHandle(u64::from_le_bytes(request)));
    match lookup(n, pid) {
        Ok(pages) => send_with_fd(stream, &[0], Some(pages.fd())),
        Err(refusal) => send_with_fd(stream, &[refusal as u8], None),
    }
}

/// Asks the exporting process for the memory of `handle`.
pub(crate) fn fetch(handle: ShareableHandle) -> DriverResult<SharedPages> {
    let (pid, service, _) = split(handle);
    let unreachable = |e: std::io::Error| {
        DriverError::InvalidHandle(format!(
            "shareable handle {:#x}: its exporting process {pid} does not answer (exited?): {e}",
            handle.0
        ))
    };
    let stream =
        address(pid, service).and_then(|a| UnixStream::connect_addr(&a)).map_err(unreachable)?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(unreachable)?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(unreachable)?;
    (&stream).write_all(&handle.0.to_le_bytes()).map_err(unreachable)?;
    let mut status = [0u8; 1];
    let (n, fd) = recv_with_fd(&stream, &mut status).map_err(unreachable)?;
    match (n, status[0], fd) {
        (1, 0, Some(fd)) => SharedPages::adopt(fd),
        (1, code, _) if code == Refusal::NotAllowed as u8 => {
            Err(DriverError::InvalidValue(format!(
                "not allowed: process {} is not on the whitelist of shareable handle {:#x} \
             (aclrtMemSetPidToShareableHandle in the exporting process {pid})",
                own_pid(),
                handle.0
            )))
        }
        (1, code, _) if code == Refusal::Unknown as u8 => Err(DriverError::InvalidHandle(format!(
            "shareable handle {:#x} is not exported by process {pid} (never exported, or its \
             memory was freed)",
            handle.0
        ))),
        _ => Err(DriverError::InvalidHandle(format!(
            "shareable handle {:#x}: process {pid} answered with no memory",
            handle.0
        ))),
    }
}
