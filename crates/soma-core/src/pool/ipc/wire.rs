//! What crosses processes: the pool descriptor, exported pointers and the lines of the pool
//! service's protocol, all plain text.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, IpcErrorKind, Result};

/// How a pool's physical memory may be shared with other processes (the C API's
/// `aclrtMemPoolProps::handleType`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HandleType {
    /// Not shared (`ACL_MEM_HANDLE_TYPE_NONE`, the default).
    #[default]
    None,
    /// Exportable to other processes of the machine (`ACL_MEM_HANDLE_TYPE_POSIX`):
    /// [`MemPool::export`](crate::MemPool::export) and friends.
    Posix,
}

/// What another process needs to import a pool ([`MemPool::import`](crate::MemPool::import)):
/// the exporting process, the pool's number there, its size and granularity. Made by
/// [`MemPool::export`](crate::MemPool::export); passed as text (its `Display`, parsed back
/// with `str::parse`), e.g. `soma-pool:4242:0:7:1073741824:2097152` (process, its pool
/// service, pool, size, granularity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolDescriptor {
    pub(crate) pid: u32,
    /// The exporting process's pool service (0 unless several copies of soma share it).
    pub(crate) service: u32,
    pub(crate) pool: u64,
    pub(crate) max_size: u64,
    pub(crate) granularity: u64,
}

impl PoolDescriptor {
    /// The exporting process.
    pub fn process_id(&self) -> u32 {
        self.pid
    }

    /// The pool's number in the exporting process.
    pub fn pool_id(&self) -> u64 {
        self.pool
    }

    /// The pool's size: the address range an importer reserves.
    pub fn max_size(&self) -> u64 {
        self.max_size
    }
}

impl fmt::Display for PoolDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let PoolDescriptor { pid, service, pool, max_size, granularity } = self;
        write!(f, "soma-pool:{pid}:{service}:{pool}:{max_size}:{granularity}")
    }
}

impl FromStr for PoolDescriptor {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let [pid, service, pool, max_size, granularity] = fields(s, "soma-pool")?;
        let (pid, service) = (narrow(pid, s)?, narrow(service, s)?);
        Ok(PoolDescriptor { pid, service, pool, max_size, granularity })
    }
}

/// An allocation of an exported pool, named for another process: the pool, the offset of
/// its first byte in the pool and its length in bytes. Made by `export_pointer` on an
/// allocation ([`PoolAlloc::export_pointer`](crate::PoolAlloc::export_pointer)), opened by an
/// importer with [`ImportedPool::open`](crate::ImportedPool::open); passed as text, e.g.
/// `soma-ptr:4242:0:7:4194304:4096` (process, service, pool, offset, length).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExportedPointer {
    pub(crate) pid: u32,
    pub(crate) service: u32,
    pub(crate) pool: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl ExportedPointer {
    /// The exporting process.
    pub fn process_id(&self) -> u32 {
        self.pid
    }

    /// The pool's number in the exporting process.
    pub fn pool_id(&self) -> u64 {
        self.pool
    }

    /// Offset of the first byte in the pool's range.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length in bytes.
    pub fn byte_len(&self) -> u64 {
        self.len
    }
}

impl fmt::Display for ExportedPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ExportedPointer { pid, service, pool, offset, len } = self;
        write!(f, "soma-ptr:{pid}:{service}:{pool}:{offset}:{len}")
    }
}

impl FromStr for ExportedPointer {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let [pid, service, pool, offset, len] = fields(s, "soma-ptr")?;
        let (pid, service) = (narrow(pid, s)?, narrow(service, s)?);
        Ok(ExportedPointer { pid, service, pool, offset, len })
    }
}

fn bad_text(s: &str) -> Error {
    Error::ipc(IpcErrorKind::InvalidDescriptor, format!("{s:?} is not a soma descriptor"))
}

/// The five numbers after `tag:` in `s`.
fn fields(s: &str, tag: &str) -> Result<[u64; 5]> {
    let rest = s.trim().strip_prefix(tag).and_then(|r| r.strip_prefix(':'));
    let numbers: Vec<u64> = rest
        .ok_or_else(|| bad_text(s))?
        .split(':')
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad_text(s))?;
    numbers.try_into().map_err(|_| bad_text(s))
}

fn narrow(pid: u64, s: &str) -> Result<u32> {
    u32::try_from(pid).map_err(|_| bad_text(s))
}

/// The word an error kind travels as in the protocol.
pub(super) fn kind_word(kind: IpcErrorKind) -> &'static str {
    match kind {
        IpcErrorKind::NotExportable => "not-exportable",
        IpcErrorKind::NotAllowed => "not-allowed",
        IpcErrorKind::Destroyed => "destroyed",
        IpcErrorKind::SameProcess => "same-process",
        IpcErrorKind::AlreadyImported => "already-imported",
        IpcErrorKind::Unreachable => "unreachable",
        IpcErrorKind::InvalidDescriptor => "invalid-descriptor",
    }
}

/// The error a protocol line `ERR <kind> <message>` carries.
pub(super) fn parse_error(line: &str) -> Error {
    let mut parts = line.splitn(3, ' ').skip(1);
    let (word, message) = (parts.next().unwrap_or(""), parts.next().unwrap_or(line));
    let kind = [
        IpcErrorKind::NotExportable,
        IpcErrorKind::NotAllowed,
        IpcErrorKind::Destroyed,
        IpcErrorKind::SameProcess,
        IpcErrorKind::AlreadyImported,
        IpcErrorKind::Unreachable,
    ]
    .into_iter()
    .find(|&k| kind_word(k) == word)
    .unwrap_or(IpcErrorKind::InvalidDescriptor);
    Error::ipc(kind, message)
}

/// One segment of a held allocation, as the exporter describes it: its offset, size and the
/// shareable handle of its physical memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SegmentLine {
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) shareable: u64,
}

impl fmt::Display for SegmentLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{},{},{}", self.offset, self.size, self.shareable)
    }
}

impl FromStr for SegmentLine {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let mut it = s.split(',').map(str::parse::<u64>);
        match (it.next(), it.next(), it.next(), it.next()) {
            (Some(Ok(offset)), Some(Ok(size)), Some(Ok(shareable)), None) => {
                Ok(SegmentLine { offset, size, shareable })
            }
            _ => Err(Error::ipc(
                IpcErrorKind::InvalidDescriptor,
                format!("the exporting process answered {s:?}, not a segment"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_and_pointers_round_trip_and_reject_garbage() {
        let d = PoolDescriptor {
            pid: 42,
            service: 1,
            pool: 7,
            max_size: 1 << 30,
            granularity: 2 << 20,
        };
        assert_eq!(d.to_string(), "soma-pool:42:1:7:1073741824:2097152");
        assert_eq!(d.to_string().parse::<PoolDescriptor>(), Ok(d));
        let p = ExportedPointer { pid: 42, service: 0, pool: 7, offset: 512, len: 64 };
        assert_eq!(p.to_string().parse::<ExportedPointer>(), Ok(p));
        for bad in
            ["", "soma-pool:1:2:3:4", "soma-pool:1:2:3:4:5:6", "soma-ptr:1:2:3:4:x", "x:1:2:3:4:5"]
        {
            let e = bad.parse::<PoolDescriptor>().unwrap_err();
            assert!(matches!(e, Error::Ipc { kind: IpcErrorKind::InvalidDescriptor, .. }));
        }
        assert!(p.to_string().parse::<PoolDescriptor>().is_err(), "a pointer is no descriptor");
        assert!("soma-pool:4294967296:0:1:2:3".parse::<PoolDescriptor>().is_err(), "pid range");
    }

    #[test]
    fn protocol_errors_keep_their_kind() {
        let e = parse_error("ERR not-allowed process 9 is not on the whitelist");
        assert_eq!(e, Error::ipc(IpcErrorKind::NotAllowed, "process 9 is not on the whitelist"));
        let seg = SegmentLine { offset: 1, size: 2, shareable: 3 };
        assert_eq!(seg.to_string().parse::<SegmentLine>(), Ok(seg));
        assert!("1,2".parse::<SegmentLine>().is_err());
    }
}
