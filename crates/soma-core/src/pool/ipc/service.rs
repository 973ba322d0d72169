//! The pool service of an exporting process: an abstract Unix socket, `soma-pool-<pid>`,
//! started by the first [`MemPool::export`](crate::MemPool::export), with one thread per
//! importer connection.
//!
//! The protocol is one line per request and per answer:
//!
//! | request | answer |
//! |---|---|
//! | `ATTACH <pool>` | `OK` once the pool is exported and the peer allowed |
//! | `HOLD <offset> <len>` | `OK <offset>,<size>,<shareable> …`: the segments behind the allocation |
//! | `RELEASE <offset>` | `OK` |
//!
//! or `ERR <kind> <message>`. The peer is who the kernel says it is (`SO_PEERCRED`), checked
//! against the pool's whitelist at every `ATTACH` and `HOLD`. When the connection ends (the
//! imported pool is dropped, or its process exits) every hold it still has is released.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::wire::kind_word;
use super::Refusal;
use crate::error::{Error, IpcErrorKind, Result};
use crate::hal::DriverError;
use crate::pool::core::PoolCore;

/// Exported pools of this process by number.
static POOLS: Mutex<Option<HashMap<u64, Weak<PoolCore>>>> = Mutex::new(None);

/// The process whose listener runs (a child made by `fork` has none), and its service
/// number.
static SERVING: Mutex<Option<(u32, u32)>> = Mutex::new(None);

/// Services one process may run (copies of soma loaded side by side: a Rust program and the
/// C library, each with its own pools).
const SERVICES: u32 = 16;

/// The socket of process `pid`'s pool service `service`.
pub(super) fn address(pid: u32, service: u32) -> std::io::Result<SocketAddr> {
    match service {
        0 => SocketAddr::from_abstract_name(format!("soma-pool-{pid}")),
        k => SocketAddr::from_abstract_name(format!("soma-pool-{pid}-{k}")),
    }
}

/// Makes `core` reachable by importers, starting the service if needed; the service's
/// number.
pub(super) fn register(core: &Arc<PoolCore>) -> Result<u32> {
    let service = ensure_serving()?;
    let mut pools = POOLS.lock();
    let pools = pools.get_or_insert_with(HashMap::new);
    pools.retain(|_, weak| weak.strong_count() > 0);
    pools.insert(core.id, Arc::downgrade(core));
    Ok(service)
}

fn ensure_serving() -> Result<u32> {
    let mut serving = SERVING.lock();
    let pid = std::process::id();
    if let Some((p, service)) = *serving {
        if p == pid {
            return Ok(service);
        }
    }
    let failed = |e: std::io::Error| {
        Error::Driver(DriverError::Native {
            code: -1,
            message: format!("cannot serve exported pools (socket soma-pool-{pid}): {e}"),
        })
    };
    // The first name no other copy of soma in the process took.
    let mut bound = Err(std::io::Error::from(std::io::ErrorKind::AddrInUse));
    for service in 0..SERVICES {
        bound =
            address(pid, service).and_then(|a| UnixListener::bind_addr(&a)).map(|l| (l, service));
        if bound.is_ok() {
            break;
        }
    }
    let (listener, service) = bound.map_err(failed)?;
    std::thread::Builder::new()
        .name("soma-pool-ipc".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                // A connection lives as long as the importer's pool: a thread each.
                let _ = std::thread::Builder::new()
                    .name("soma-pool-importer".into())
                    .spawn(move || Connection::default().serve(stream));
            }
        })
        .map_err(failed)?;
    *serving = Some((pid, service));
    Ok(service)
}

/// The exported pool `id`, if it is alive.
fn lookup(id: u64) -> std::result::Result<Arc<PoolCore>, Refusal> {
    let pools = POOLS.lock();
    pools
        .as_ref()
        .and_then(|p| p.get(&id))
        .and_then(Weak::upgrade)
        .filter(|core| !core.torn_down.load(Ordering::Acquire))
        .ok_or_else(|| {
            let pid = std::process::id();
            (
                IpcErrorKind::Destroyed,
                format!("pool {id} of process {pid} is not exported (dropped?)"),
            )
        })
}

/// One importer's connection: the pool it attached to and the allocations it holds.
#[derive(Default)]
struct Connection {
    pool: Option<(u64, Weak<PoolCore>)>,
    /// Opens not released yet, by offset.
    holds: HashMap<u64, u32>,
}

impl Connection {
    fn serve(mut self, stream: UnixStream) {
        let Ok(pid) = peer_pid(&stream) else { return };
        let Ok(writer) = stream.try_clone() else { return };
        let mut writer = writer;
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let answer = match self.answer(pid, &line) {
                Ok(ok) => ok,
                Err((kind, message)) => format!("ERR {} {message}", kind_word(kind)),
            };
            if writeln!(writer, "{answer}").is_err() {
                break;
            }
        }
        self.release_all();
    }

    fn answer(&mut self, pid: i32, line: &str) -> std::result::Result<String, Refusal> {
        let mut words = line.split(' ');
        let verb = words.next().unwrap_or("");
        let numbers: Vec<u64> = words.filter_map(|w| w.parse().ok()).collect();
        match (verb, numbers.as_slice()) {
            ("ATTACH", &[id]) => {
                let core = lookup(id)?;
                allowed(&core, pid)?;
                self.pool = Some((id, Arc::downgrade(&core)));
                Ok("OK".into())
            }
            ("HOLD", &[offset, len]) => {
                let core = self.attached()?;
                allowed(&core, pid)?;
                let ipc = core.ipc.as_ref().ok_or_else(not_shared)?;
                let segments = ipc.hold(core.hal(), pid, offset, len)?;
                *self.holds.entry(offset).or_insert(0) += 1;
                let listed: Vec<String> = segments.iter().map(ToString::to_string).collect();
                Ok(format!("OK {}", listed.join(" ")))
            }
            ("RELEASE", &[offset]) => {
                match self.holds.get_mut(&offset) {
                    Some(n) if *n > 1 => *n -= 1,
                    Some(_) => {
                        self.holds.remove(&offset);
                    }
                    None => {
                        return Err((
                            IpcErrorKind::InvalidDescriptor,
                            format!("no hold at offset {offset} to release"),
                        ))
                    }
                }
                if let Some((_, weak)) = &self.pool {
                    if let Some(core) = weak.upgrade() {
                        release(&core, offset);
                    }
                }
                Ok("OK".into())
            }
            _ => Err((IpcErrorKind::InvalidDescriptor, format!("unknown request {line:?}"))),
        }
    }

    /// The pool this connection attached to, if it is still exported.
    fn attached(&self) -> std::result::Result<Arc<PoolCore>, Refusal> {
        let Some((id, _)) = &self.pool else {
            return Err((IpcErrorKind::InvalidDescriptor, "no pool attached".into()));
        };
        lookup(*id)
    }

    /// The importer is gone: what it held is released.
    fn release_all(&mut self) {
        let Some(core) = self.pool.as_ref().and_then(|(_, weak)| weak.upgrade()) else { return };
        for (offset, n) in self.holds.drain() {
            for _ in 0..n {
                release(&core, offset);
            }
        }
    }
}

fn not_shared() -> Refusal {
    (IpcErrorKind::NotExportable, "the pool is not shareable".into())
}

fn allowed(core: &PoolCore, pid: i32) -> std::result::Result<(), Refusal> {
    let ipc = core.ipc.as_ref().ok_or_else(not_shared)?;
    if ipc.allows(pid) {
        return Ok(());
    }
    Err((
        IpcErrorKind::NotAllowed,
        format!(
            "process {pid} is not allowed to import pool {} of process {} (allow_process)",
            core.id,
            std::process::id()
        ),
    ))
}

/// One release of the allocation at `offset`, and the exporter's free it let through.
fn release(core: &PoolCore, offset: u64) {
    let done = core.ipc.as_ref().and_then(|ipc| ipc.release(offset));
    if let Some((block, tag)) = done {
        core.finish_deferred_free(block, tag);
    }
}

/// The process id of the peer of `stream`, as the kernel recorded it at `connect`.
fn peer_pid(stream: &UnixStream) -> std::io::Result<i32> {
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
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.pid)
}
