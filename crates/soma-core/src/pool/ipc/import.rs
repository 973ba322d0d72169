//! The importing side: [`ImportedPool`], a range of the exporter's size where the segments
//! behind opened pointers are mapped at the exporter's offsets, and [`ImportedAlloc`], a
//! typed handle over one exported allocation.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::marker::PhantomData;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use parking_lot::Mutex;

use super::service::address;
use super::wire::{parse_error, SegmentLine};
use super::{ExportedPointer, PoolDescriptor};
use crate::buffer::{BufferOwner, DeviceBuffer, DeviceBufferMut, Sealed};
use crate::device::Device;
use crate::error::{Error, IpcErrorKind, Result};
use crate::hal::{DevicePtr, PhysicalHandle, ShareableHandle};
use crate::stream::Stream;

/// How long an importer waits for the exporting process's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// The pools this process imported, as `(exporting process, service, pool)`: one import each.
static IMPORTED: Mutex<Option<HashSet<(u32, u32, u64)>>> = Mutex::new(None);

/// A pool of another process, imported with [`MemPool::import`](crate::MemPool::import). It
/// cannot allocate: [`open`](Self::open) gives typed handles over the exporter's
/// allocations, at the same offsets of a range of the same size on this process's device.
///
/// Dropping it unmaps what it mapped and gives the range back (its handles borrow it, so
/// none is left); the connection to the exporting process closes.
pub struct ImportedPool<'d> {
    device: Device,
    _device: PhantomData<&'d Device>,
    descriptor: PoolDescriptor,
    base: DevicePtr,
    link: Mutex<Link>,
    /// Segments mapped so far, by offset.
    segments: Mutex<BTreeMap<u64, MappedSegment>>,
}

/// The connection to the exporting process's pool service.
struct Link {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Link {
    /// Sends `request` and returns what follows `OK` in the answer.
    fn ask(&mut self, request: &str, pid: u32) -> Result<String> {
        let lost = |e: std::io::Error| {
            Error::ipc(
                IpcErrorKind::Unreachable,
                format!("the exporting process {pid} does not answer (exited?): {e}"),
            )
        };
        writeln!(self.writer, "{request}").map_err(lost)?;
        let mut answer = String::new();
        if self.reader.read_line(&mut answer).map_err(lost)? == 0 {
            return Err(lost(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let answer = answer.trim_end();
        match answer.strip_prefix("OK") {
            Some(rest) => Ok(rest.trim().to_owned()),
            None => Err(parse_error(answer)),
        }
    }
}

struct MappedSegment {
    size: u64,
    shareable: ShareableHandle,
    handle: PhysicalHandle,
    /// Open handles that use it.
    users: u32,
}

impl<'d> ImportedPool<'d> {
    /// Connects to the exporting process, checks what can be checked, reserves the range.
    pub(super) fn attach(descriptor: &PoolDescriptor, device: &'d Device) -> Result<Self> {
        let d = *descriptor;
        if d.pid == std::process::id() {
            return Err(Error::ipc(
                IpcErrorKind::SameProcess,
                format!("pool {} is this process's own: import it in another process", d.pool),
            ));
        }
        let granularity = device.info().granularity;
        if d.granularity != granularity || d.max_size == 0 || d.max_size % granularity != 0 {
            return Err(Error::ipc(
                IpcErrorKind::InvalidDescriptor,
                format!(
                    "pool {} has {} bytes in {}-byte granules; device {} has {granularity}-byte \
                     granules",
                    d.pool,
                    d.max_size,
                    d.granularity,
                    device.info().ordinal
                ),
            ));
        }
        if !IMPORTED.lock().get_or_insert_with(HashSet::new).insert((d.pid, d.service, d.pool)) {
            return Err(Error::ipc(
                IpcErrorKind::AlreadyImported,
                format!("pool {} of process {} is already imported in this process", d.pool, d.pid),
            ));
        }
        let attached = Self::connect(&d).and_then(|mut link| {
            link.ask(&format!("ATTACH {}", d.pool), d.pid)?;
            let base = device.hal().reserve(d.max_size)?;
            Ok((link, base))
        });
        match attached {
            Ok((link, base)) => Ok(ImportedPool {
                device: device.clone(),
                _device: PhantomData,
                descriptor: d,
                base,
                link: Mutex::new(link),
                segments: Mutex::new(BTreeMap::new()),
            }),
            Err(e) => {
                forget_import(&d);
                Err(e)
            }
        }
    }

    fn connect(d: &PoolDescriptor) -> Result<Link> {
        let unreachable = |e: std::io::Error| {
            Error::ipc(
                IpcErrorKind::Unreachable,
                format!("process {} does not serve exported pools (exited?): {e}", d.pid),
            )
        };
        let stream = address(d.pid, d.service).and_then(|a| UnixStream::connect_addr(&a));
        let stream = stream.map_err(unreachable)?;
        stream.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(unreachable)?;
        let writer = stream.try_clone().map_err(unreachable)?;
        Ok(Link { reader: BufReader::new(stream), writer })
    }

    /// The device the pool is imported on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The descriptor it was imported from.
    pub fn descriptor(&self) -> &PoolDescriptor {
        &self.descriptor
    }

    /// Opens an allocation the exporting process exported: a typed handle over the same
    /// bytes, which holds the allocation in the exporter (its free there waits) until it is
    /// dropped.
    ///
    /// # Errors
    /// [`IpcErrorKind::InvalidDescriptor`] for a pointer of another pool, outside the pool,
    /// or whose bytes are not a whole, aligned `[T]`; [`IpcErrorKind::Destroyed`] for an
    /// allocation the exporter freed (or a pool it dropped); [`IpcErrorKind::NotAllowed`],
    /// [`IpcErrorKind::Unreachable`]; backend failures of the import and map.
    pub fn open<T: bytemuck::Pod + Send + Sync>(
        &self,
        pointer: &ExportedPointer,
    ) -> Result<ImportedAlloc<'_, T>> {
        let d = &self.descriptor;
        let elem = std::mem::size_of::<T>() as u64;
        let fits = pointer.offset.checked_add(pointer.len).is_some_and(|e| e <= d.max_size);
        if (pointer.pid, pointer.service, pointer.pool) != (d.pid, d.service, d.pool)
            || !fits
            || pointer.len == 0
            || elem == 0
            || pointer.len % elem != 0
            || pointer.offset % std::mem::align_of::<T>() as u64 != 0
        {
            return Err(Error::ipc(
                IpcErrorKind::InvalidDescriptor,
                format!(
                    "{pointer} is not a whole, aligned [{}] of pool {} of process {}",
                    std::any::type_name::<T>(),
                    d.pool,
                    d.pid
                ),
            ));
        }
        let answer =
            self.link.lock().ask(&format!("HOLD {} {}", pointer.offset, pointer.len), d.pid)?;
        let segments: Vec<SegmentLine> =
            answer.split_whitespace().map(str::parse).collect::<Result<_>>()?;
        if let Err(e) = self.map_segments(&segments) {
            self.release(pointer.offset);
            return Err(e);
        }
        let ptr = self.base.checked_add(pointer.offset).unwrap_or(self.base);
        Ok(ImportedAlloc {
            pool: self,
            ptr,
            offset: pointer.offset,
            len: (pointer.len / elem) as usize,
            segments: segments.iter().map(|s| s.offset).collect(),
            peers: Mutex::new(Vec::new()),
            _elem: PhantomData,
        })
    }

    /// Maps the segments one allocation needs, and counts a user of each. A segment mapped
    /// earlier that the exporter has replaced since (unmapped, and mapped anew) goes, if no
    /// handle uses it.
    fn map_segments(&self, wanted: &[SegmentLine]) -> Result<()> {
        let mut segments = self.segments.lock();
        let mut counted = Vec::new();
        let result = wanted.iter().try_for_each(|w| {
            let same = segments
                .get(&w.offset)
                .is_some_and(|m| m.size == w.size && m.shareable.0 == w.shareable);
            if !same {
                self.unmap_stale(&mut segments, w)?;
                let mapped = self.map_one(w)?;
                segments.insert(w.offset, mapped);
            }
            if let Some(m) = segments.get_mut(&w.offset) {
                m.users += 1;
                counted.push(w.offset);
            }
            Ok(())
        });
        if result.is_err() {
            for offset in counted {
                if let Some(m) = segments.get_mut(&offset) {
                    m.users -= 1;
                }
            }
        }
        result
    }

    /// Unmaps the segments overlapping `w` (none may be in use).
    fn unmap_stale(
        &self,
        segments: &mut BTreeMap<u64, MappedSegment>,
        w: &SegmentLine,
    ) -> Result<()> {
        let end = w.offset + w.size;
        let stale: Vec<u64> = segments
            .range(..end)
            .filter(|(&o, m)| o + m.size > w.offset)
            .map(|(&o, _)| o)
            .collect();
        for offset in stale {
            if segments.get(&offset).is_some_and(|m| m.users > 0) {
                return Err(Error::ipc(
                    IpcErrorKind::InvalidDescriptor,
                    format!("the exporter remapped offset {offset}, which an open handle uses"),
                ));
            }
            if let Some(m) = segments.remove(&offset) {
                self.unmap_one(offset, &m);
            }
        }
        Ok(())
    }

    /// Imports the memory of `w` and maps it at its offset.
    fn map_one(&self, w: &SegmentLine) -> Result<MappedSegment> {
        let hal = self.device.hal();
        let shareable = ShareableHandle(w.shareable);
        let handle = hal.import_physical(shareable, w.size)?;
        let va = self.base.checked_add(w.offset).unwrap_or(self.base);
        if let Err(e) = hal.map(va, handle) {
            let _ = hal.free_physical(handle);
            return Err(e.into());
        }
        Ok(MappedSegment { size: w.size, shareable, handle, users: 0 })
    }

    fn unmap_one(&self, offset: u64, m: &MappedSegment) {
        let hal = self.device.hal();
        let va = self.base.checked_add(offset).unwrap_or(self.base);
        // Nothing to report to: the device's counters show a failure.
        if hal.unmap(va).is_ok() {
            let _ = hal.free_physical(m.handle);
        }
    }

    /// Tells the exporter one open of the allocation at `offset` is over.
    fn release(&self, offset: u64) {
        // The exporting process gone: its pool went with it, nothing to release.
        let _ = self.link.lock().ask(&format!("RELEASE {offset}"), self.descriptor.pid);
    }
}

impl Drop for ImportedPool<'_> {
    fn drop(&mut self) {
        let segments = std::mem::take(&mut *self.segments.lock());
        for (offset, m) in &segments {
            self.unmap_one(*offset, m);
        }
        let _ = self.device.hal().release(self.base);
        forget_import(&self.descriptor);
    }
}

fn forget_import(d: &PoolDescriptor) {
    if let Some(set) = IMPORTED.lock().as_mut() {
        set.remove(&(d.pid, d.service, d.pool));
    }
}

impl std::fmt::Debug for ImportedPool<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedPool")
            .field("descriptor", &self.descriptor.to_string())
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

/// An allocation of another process's pool, opened with [`ImportedPool::open`]: a typed,
/// writable device buffer over the same bytes, which copies, memsets and kernels take like
/// any other.
///
/// Dropping it **synchronises the importing device** (and the peers whose streams used it),
/// then releases the allocation in the exporting process: only then may the exporter's
/// free of it take effect (see `docs/semantics.md`, *IPC*).
pub struct ImportedAlloc<'p, T> {
    pool: &'p ImportedPool<'p>,
    ptr: DevicePtr,
    offset: u64,
    len: usize,
    /// Offsets of the segments it uses.
    segments: Vec<u64>,
    /// Peer devices whose streams used it: synchronised too before the release.
    peers: Mutex<Vec<Device>>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> ImportedAlloc<'_, T> {
    /// Offset of the first byte in the pool's range (the exporter's offset).
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl<T> Drop for ImportedAlloc<'_, T> {
    fn drop(&mut self) {
        // Nothing to report to; the release happens regardless once the work has drained.
        let _ = self.pool.device.synchronize();
        for peer in std::mem::take(&mut *self.peers.lock()) {
            let _ = peer.synchronize();
        }
        {
            let mut segments = self.pool.segments.lock();
            for offset in &self.segments {
                if let Some(m) = segments.get_mut(offset) {
                    m.users -= 1;
                }
            }
        }
        self.pool.release(self.offset);
    }
}

impl<T> Sealed for ImportedAlloc<'_, T> {}

impl<T> BufferOwner for ImportedAlloc<'_, T> {
    fn device(&self) -> &Device {
        &self.pool.device
    }
    fn record_use(&self, stream: &Stream<'_>) -> Result<()> {
        stream.check_access(&self.pool.device, "the imported allocation")?;
        // The drop synchronises the device, which covers its own streams; a peer's are
        // covered by synchronising the peer too.
        let user = stream.device();
        if !user.same_as(&self.pool.device) {
            let mut peers = self.peers.lock();
            if !peers.iter().any(|p| p.same_as(user)) {
                peers.push(user.without_owner());
            }
        }
        Ok(())
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBuffer for ImportedAlloc<'_, T> {
    type Elem = T;
    fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl<T: bytemuck::Pod + Send + Sync> DeviceBufferMut for ImportedAlloc<'_, T> {}

impl<T> std::fmt::Debug for ImportedAlloc<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedAlloc")
            .field("ptr", &self.ptr)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}
