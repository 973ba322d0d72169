//! Pools shared between processes (IPC).
//!
//! A pool built with [`HandleType::Posix`] keeps a table of its mapped segments (offset,
//! size, physical handle) and of the allocations it exported. [`MemPool::export`] registers
//! it with this process's pool service (`service.rs`: an abstract Unix socket,
//! `soma-pool-<pid>`) and gives the [`PoolDescriptor`] another process imports
//! ([`MemPool::import`], `import.rs`). The importer reserves a range of the pool's size and
//! maps, at the same offsets, the segments behind each [`ExportedPointer`] it opens: the
//! exporter exports those segments' physical memory to it (the backend's whitelist then
//! names it) when it asks.
//!
//! Lifetime: opening a pointer *holds* the allocation in the exporting process, dropping the
//! importer's handle releases it (a release message; the importer's process exiting releases
//! all it held). The exporter's free of an allocation still held is deferred: the block stays
//! allocated (it counts as used) until the last importer releases it, and then goes to the
//! engine with the free's own stream position, as any free. So an importer never sees the
//! exporter's memory reused under it.

use std::collections::{BTreeMap, HashMap, HashSet};

use parking_lot::Mutex;

use super::api::MemPool;
use super::core::PoolCore;
use super::handle::{Handle, PoolHolder, StreamHolder};
use crate::engine::{BlockId, Engine, FreeTag};
use crate::error::{Error, IpcErrorKind, Result};
use crate::hal::{DeviceHal, DevicePtr, PhysicalHandle, ShareableHandle};

mod import;
mod service;
mod wire;

pub use import::{ImportedAlloc, ImportedPool};
pub use wire::{ExportedPointer, HandleType, PoolDescriptor};

/// The sharing state of a pool built with [`HandleType::Posix`].
#[derive(Default)]
pub(super) struct ExportState {
    inner: Mutex<ExportInner>,
}

#[derive(Default)]
struct ExportInner {
    /// Processes that may import the pool.
    allowed: HashSet<i32>,
    /// Mapped segments by offset.
    segments: BTreeMap<u64, Segment>,
    /// Exported allocations by offset.
    blocks: HashMap<u64, SharedBlock>,
}

struct Segment {
    size: u64,
    handle: PhysicalHandle,
    /// Set when an importer first needs the segment.
    shareable: Option<ShareableHandle>,
}

/// An allocation exported with `export_pointer`.
struct SharedBlock {
    block: BlockId,
    len: u64,
    /// Importers' opens not released yet.
    holds: u32,
    /// The exporter's free, waiting for the last release.
    freed: Option<FreeTag>,
}

/// A refusal of the service, sent to the importer as it is.
type Refusal = (IpcErrorKind, String);

impl ExportState {
    /// The engine mapped `size` bytes at `offset` with physical memory `token`.
    pub(super) fn mapped(&self, offset: u64, size: u64, token: u64) {
        let segment = Segment { size, handle: PhysicalHandle(token), shareable: None };
        self.inner.lock().segments.insert(offset, segment);
    }

    /// The engine unmaps the segment at `offset` (its export ends when it is freed).
    pub(super) fn unmapped(&self, offset: u64) {
        self.inner.lock().segments.remove(&offset);
    }

    /// Lets process `pid` import the pool.
    fn allow(&self, pid: i32) {
        self.inner.lock().allowed.insert(pid);
    }

    /// Whether process `pid` may import the pool.
    fn allows(&self, pid: i32) -> bool {
        self.inner.lock().allowed.contains(&pid)
    }

    /// Whether the allocation at `offset` is exported (it must not move).
    fn has_block(&self, offset: u64) -> bool {
        self.inner.lock().blocks.contains_key(&offset)
    }

    /// Records the exported allocation `block` of `len` bytes at `offset`.
    fn export_block(&self, offset: u64, block: BlockId, len: u64) {
        let mut inner = self.inner.lock();
        inner.blocks.entry(offset).or_insert(SharedBlock { block, len, holds: 0, freed: None });
    }

    /// The exporter frees `block`: whether the free waits for importers (and is kept here).
    fn defer_free(&self, offset: u64, block: BlockId, tag: FreeTag) -> bool {
        let mut inner = self.inner.lock();
        match inner.blocks.get_mut(&offset) {
            Some(b) if b.block == block && b.holds > 0 => {
                b.freed = Some(tag);
                true
            }
            Some(b) if b.block == block => {
                inner.blocks.remove(&offset);
                false
            }
            _ => false,
        }
    }

    /// Process `pid` (allowed: the caller checked) opens the allocation at `offset` of `len`
    /// bytes: holds it and answers the segments behind it, their memory exported and open to
    /// `pid`.
    fn hold(
        &self,
        hal: &dyn DeviceHal,
        pid: i32,
        offset: u64,
        len: u64,
    ) -> std::result::Result<Vec<wire::SegmentLine>, Refusal> {
        let mut inner = self.inner.lock();
        match inner.blocks.get(&offset) {
            Some(b) if b.len == len && b.freed.is_none() => {}
            _ => {
                return Err((
                    IpcErrorKind::Destroyed,
                    format!(
                        "no exported allocation of {len} bytes at offset {offset} (freed, or \
                         never exported)"
                    ),
                ))
            }
        }
        let end = offset + len;
        let mut lines = Vec::new();
        let mut covered = offset;
        let first = inner.segments.range(..=offset).next_back().map_or(offset, |(&o, _)| o);
        for (&seg_offset, seg) in inner.segments.range_mut(first..end) {
            if seg_offset + seg.size <= offset {
                continue;
            }
            if seg_offset > covered {
                break;
            }
            let shareable =
                match seg.shareable {
                    Some(s) => s,
                    None => *seg.shareable.insert(hal.export_physical(seg.handle, true).map_err(
                        |e| (IpcErrorKind::NotExportable, format!("segment at {seg_offset}: {e}")),
                    )?),
                };
            hal.allow_shareable_pids(shareable, &[pid])
                .map_err(|e| (IpcErrorKind::NotExportable, e.to_string()))?;
            lines.push(wire::SegmentLine {
                offset: seg_offset,
                size: seg.size,
                shareable: shareable.0,
            });
            covered = seg_offset + seg.size;
        }
        if covered < end {
            return Err((
                IpcErrorKind::Destroyed,
                format!("the allocation at offset {offset} is not mapped any more"),
            ));
        }
        if let Some(b) = inner.blocks.get_mut(&offset) {
            b.holds += 1;
        }
        Ok(lines)
    }

    /// An importer releases the allocation at `offset`: the exporter's free, when it was the
    /// last hold of a freed allocation.
    fn release(&self, offset: u64) -> Option<(BlockId, FreeTag)> {
        let mut inner = self.inner.lock();
        let b = inner.blocks.get_mut(&offset)?;
        b.holds = b.holds.saturating_sub(1);
        match (b.holds, b.freed) {
            (0, Some(tag)) => {
                let block = b.block;
                inner.blocks.remove(&offset);
                Some((block, tag))
            }
            _ => None,
        }
    }

    /// The frees waiting for importers, for a pool that ends.
    pub(super) fn take_deferred(&self) -> Vec<(BlockId, FreeTag)> {
        let mut inner = self.inner.lock();
        let deferred = inner.blocks.values().filter_map(|b| b.freed.map(|tag| (b.block, tag)));
        let deferred = deferred.collect();
        inner.blocks.clear();
        deferred
    }
}

impl PoolCore {
    /// Whether the free of `block` with `tag` waits for importers that hold it (then kept by
    /// the pool's sharing state, and done at the last release).
    pub(super) fn held_by_importers(&self, engine: &Engine, block: BlockId, tag: FreeTag) -> bool {
        let Some(ipc) = &self.ipc else { return false };
        engine.block(block).is_some_and(|info| ipc.defer_free(info.offset, block, tag))
    }

    /// Whether the allocation at `ptr` was exported (it must not move).
    pub(super) fn is_exported(&self, ptr: DevicePtr) -> bool {
        let Some(ipc) = &self.ipc else { return false };
        self.offset_of(ptr).is_some_and(|offset| ipc.has_block(offset))
    }

    /// Hands a free that waited for importers to the engine.
    pub(super) fn finish_deferred_free(&self, block: BlockId, tag: FreeTag) {
        let mut inner = self.lock();
        if let Err(e) = inner.engine.free(block, tag) {
            let error = Error::InvalidArgument(format!(
                "free of block {block:?} after its importers released it: {e:?}"
            ));
            self.put_sticky(&mut inner, error);
        }
    }
}

impl MemPool<'_> {
    /// The core of a pool built with [`HandleType::Posix`].
    fn shared_core(&self) -> Result<&std::sync::Arc<PoolCore>> {
        match self.single_core() {
            Some(core) if core.ipc.is_some() => Ok(core),
            _ => Err(Error::ipc(
                IpcErrorKind::NotExportable,
                "the pool was not built with handle_type(HandleType::Posix)",
            )),
        }
    }

    /// Exports the pool: the descriptor another process passes to [`MemPool::import`]
    /// (`cudaMemPoolExportToShareableHandle`'s counterpart). The pool stays usable as before;
    /// only processes named with [`allow_process`](Self::allow_process) can import it. See
    /// `docs/semantics.md`, *IPC*.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{HandleType, MemPool};
    /// let s = dev.create_stream()?;
    /// let kv = MemPool::builder().handle_type(HandleType::Posix).build(&dev)?;
    /// let desc = kv.export()?;                 // text: "soma-pool:<pid>:<service>:<id>:…"
    /// kv.allow_process(4242)?;                 // the importing process's id
    /// let block = kv.alloc_async::<u16>(4096, &s)?;
    /// let ptr = block.export_pointer()?;       // text too: what the importer opens
    /// assert_eq!((ptr.pool_id(), ptr.byte_len()), (desc.pool_id(), 8192));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`IpcErrorKind::NotExportable`] for a pool not built with [`HandleType::Posix`];
    /// [`Error::Driver`] when the pool service cannot start (its socket).
    pub fn export(&self) -> Result<PoolDescriptor> {
        let core = self.shared_core()?;
        let service = service::register(core)?;
        Ok(PoolDescriptor {
            pid: std::process::id(),
            service,
            pool: core.id,
            max_size: core.max_size,
            granularity: self.device().info().granularity,
        })
    }

    /// Lets process `pid` import the pool (CANN's `aclrtMemSetPidToShareableHandle` for each
    /// of its segments): its id as [`Device::process_id`](crate::Device::process_id) gives it
    /// there. Whitelisting is needed before the process imports; it never expires.
    ///
    /// # Errors
    /// [`IpcErrorKind::NotExportable`] for a pool not built with [`HandleType::Posix`].
    pub fn allow_process(&self, pid: i32) -> Result<()> {
        let core = self.shared_core()?;
        if let Some(ipc) = &core.ipc {
            ipc.allow(pid);
        }
        Ok(())
    }

    /// Imports a pool another process exported ([`MemPool::export`]) onto `device`: a pool
    /// that cannot allocate, whose [`ImportedPool::open`] turns the exporter's
    /// [`ExportedPointer`]s into typed handles over the same memory.
    ///
    /// The pool's memory is shared with the exporting process and every other importer, and
    /// nothing orders their work with this process's (as on a device): ordering is the
    /// programs' job — e.g. the exporter synchronizes its stream before it hands a pointer
    /// over, and waits for the importer's word (or its release) before it touches the
    /// allocation again. An unordered race (one process writing bytes while another reads or
    /// writes them) leaves those bytes unspecified, as on a device; it is never undefined
    /// behaviour, since the backend never lets a Rust reference cover bytes another process
    /// may write.
    ///
    /// # Errors
    /// [`Error::Ipc`]: [`IpcErrorKind::SameProcess`] for this process's own pool,
    /// [`IpcErrorKind::AlreadyImported`] for a pool imported here already,
    /// [`IpcErrorKind::InvalidDescriptor`] for a device whose granularity is not the pool's,
    /// [`IpcErrorKind::Unreachable`] when the exporting process does not answer,
    /// [`IpcErrorKind::Destroyed`] for a pool it dropped (or never exported),
    /// [`IpcErrorKind::NotAllowed`] for a process it did not allow; backend failures.
    pub fn import<'d>(
        descriptor: &PoolDescriptor,
        device: &'d crate::Device,
    ) -> Result<ImportedPool<'d>> {
        ImportedPool::attach(descriptor, device)
    }
}

impl<P: PoolHolder, S: StreamHolder, T> Handle<P, S, T> {
    /// What `export_pointer` on either allocation handle does.
    pub(crate) fn export_pointer(&self) -> Result<ExportedPointer> {
        let pool = self.pool.pool();
        let core = pool.shared_core()?;
        let (Some(ipc), Some(block)) = (&core.ipc, self.block) else {
            return Err(Error::ipc(IpcErrorKind::NotExportable, "an allocation without a block"));
        };
        let offset = core.offset_of(self.ptr).ok_or_else(|| {
            Error::ipc(IpcErrorKind::NotExportable, "the allocation is not in the pool's range")
        })?;
        let len = self.byte_len();
        let service = service::register(core)?;
        ipc.export_block(offset, block, len);
        Ok(ExportedPointer { pid: std::process::id(), service, pool: core.id, offset, len })
    }
}
