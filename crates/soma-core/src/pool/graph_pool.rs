//! Graph-private memory, the handles: [`GraphPool`] (memory that several captures share),
//! the token that keeps a graph's memory reserved, and the device's table of the captures
//! begun through the typed API. The regions themselves are in `graph_region.rs`.
//!
//! Every capture begun with [`Stream::begin_capture`](crate::Stream::begin_capture) gets a
//! token of its own; one begun with
//! [`begin_capture_with_pool`](crate::Stream::begin_capture_with_pool) also holds the graph
//! pool's. A pool serves the capture's allocations from the region keyed by the graph pool's
//! token when the graph pool is one of its own, by the capture's token otherwise. The
//! capture's [`Graph`](crate::Graph) holds both tokens (a capture that ends without a graph
//! drops them), a [`GraphPool`] handle holds its own; when a token's last holder goes, the
//! device tells every pool, and each releases the region keyed by it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::api::{Backend, MemPool};
use crate::device::DeviceShared;
use crate::engine::StreamSlot;

/// Ids of graph pools and keys of regions: unique in the process, never reused.
static NEXT_GRAPH_MEMORY: AtomicU64 = AtomicU64::new(1);

/// Whose graph-private memory a region of a pool is (see [`MemPool::graph_memory`]).
///
/// [`MemPool::graph_memory`]: crate::MemPool::graph_memory
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GraphMemoryOwner {
    /// The graph of the capture with this id ([`Graph::id`](crate::Graph::id)): its
    /// allocations from a pool other than its graph pool's, or from any pool when it was
    /// captured without one.
    Graph(u64),
    /// The graph pool with this id ([`GraphPool::id`]), shared by the graphs captured into it.
    GraphPool(u64),
}

/// What one region of a pool holds for its graph(s) (see [`MemPool::graph_memory`]).
///
/// [`MemPool::graph_memory`]: crate::MemPool::graph_memory
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphMemoryStats {
    /// Whose memory it is.
    pub owner: GraphMemoryOwner,
    /// Bytes of the allocations captured into it that are live (not freed yet, rounded
    /// sizes); outputs freed outside the graph while it is reserved count here until then.
    pub used: u64,
    /// Everything it holds: `used` plus the memory freed back to it inside captures, which
    /// only later allocations of captures into it reuse. None of it goes back to the pool,
    /// nor to [`trim_to`](crate::MemPool::trim_to), while the region is reserved.
    pub reserved: u64,
}

/// A token whose last holder's drop releases the regions keyed by it, in every pool of the
/// device.
pub(crate) struct MemoryToken {
    pub(crate) key: u64,
    pub(crate) owner: GraphMemoryOwner,
    device: Weak<DeviceShared>,
}

impl MemoryToken {
    fn new(device: &Arc<DeviceShared>, key: u64, owner: GraphMemoryOwner) -> Arc<MemoryToken> {
        Arc::new(MemoryToken { key, owner, device: Arc::downgrade(device) })
    }
}

impl Drop for MemoryToken {
    fn drop(&mut self) {
        if let Some(device) = self.device.upgrade() {
            device.graph_memory_released(self.key);
        }
    }
}

/// Graph-private memory that several graphs share: each pool of the handle's device serves
/// the allocations captured into it ([`Stream::begin_capture_with_pool`]) from one region,
/// and a block freed inside one capture may serve an allocation of a later capture into the
/// same graph pool. The graphs captured into it must therefore **never run concurrently**
/// with one another (as with PyTorch's `graph_pool_handle()`): launch them on one stream,
/// or order their launches with events. Graphs of several batch sizes then need the memory
/// of the largest, not the sum — capture the largest first, so that the smaller ones fit in
/// what it freed.
///
/// Made by [`MemPool::graph_pool`]; the region lives in that pool (allocations of the
/// captures from other pools get regions of their own, per capture). Cheap to clone; the
/// region stays reserved while a clone or a graph captured into it lives.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let npu = soma_sim::Npu::builder().build()?;
/// # let dev = soma_core::Device::new(npu.device(0)?);
/// use soma_core::{CaptureMode, MemPool};
/// let s = dev.create_stream()?;
/// let pool = MemPool::builder().build(&dev)?;
/// let shared = pool.graph_pool();
/// let mut graphs = Vec::new();
/// for batch in [8usize, 4, 2, 1] {
///     s.begin_capture_with_pool(CaptureMode::Global, &shared)?;
///     let mut act = pool.alloc_async::<f32>(batch << 16, &s)?; // served at capture time
///     s.memset(&mut act, 0)?;
///     drop(act); // inside the capture: the next capture into `shared` reuses it
///     graphs.push(s.end_capture()?);
/// }
/// // One region, as large as the largest batch's activations (8 << 16 floats = 2 MiB).
/// assert_eq!(pool.graph_memory()[0].reserved, 2 << 20);
/// for g in &graphs {
///     g.launch(&s)?; // one stream: never concurrently
/// }
/// # Ok(()) }
/// ```
///
/// [`Stream::begin_capture_with_pool`]: crate::Stream::begin_capture_with_pool
/// [`MemPool::graph_pool`]: crate::MemPool::graph_pool
#[derive(Clone)]
pub struct GraphPool {
    token: Arc<MemoryToken>,
    /// The pool whose region it names ([`MemPool`](crate::MemPool)'s id).
    pool: u64,
}

impl GraphPool {
    /// A new graph pool of pool `pool` on `device`.
    pub(crate) fn new(device: &Arc<DeviceShared>, pool: u64) -> GraphPool {
        let id = NEXT_GRAPH_MEMORY.fetch_add(1, Ordering::Relaxed);
        GraphPool { token: MemoryToken::new(device, id, GraphMemoryOwner::GraphPool(id)), pool }
    }

    /// The graph pool's id (what [`GraphMemoryOwner::GraphPool`] reports); unique in the
    /// process.
    pub fn id(&self) -> u64 {
        self.token.key
    }

    /// Whether the handle belongs to `device`.
    pub(crate) fn is_of(&self, device: &Arc<DeviceShared>) -> bool {
        std::ptr::eq(self.token.device.as_ptr(), Arc::as_ptr(device))
    }
}

impl std::fmt::Debug for GraphPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphPool").field("id", &self.id()).field("pool", &self.pool).finish()
    }
}

/// The graph memory of one capture: its own token, and the graph pool it was begun with.
pub(crate) struct CaptureMemory {
    own: Arc<MemoryToken>,
    shared: Option<GraphPool>,
    /// The slot of the stream that began the capture (alive while the capture is listed).
    origin: StreamSlot,
}

impl CaptureMemory {
    /// The region key and owner of the allocations of pool `pool` in this capture.
    pub(crate) fn region_for(&self, pool: u64) -> (u64, GraphMemoryOwner) {
        match &self.shared {
            Some(g) if g.pool == pool => (g.token.key, g.token.owner),
            _ => (self.own.key, self.own.owner),
        }
    }
}

/// The device's captures begun through the typed API and not ended yet, by capture id.
#[derive(Default)]
pub(crate) struct ActiveCaptures {
    list: Mutex<Vec<(u64, Arc<CaptureMemory>)>>,
}

impl ActiveCaptures {
    /// Lists capture `capture`, begun on the stream in slot `origin`, with the graph pool
    /// `shared` (if any).
    pub(crate) fn begin(
        &self,
        device: &Arc<DeviceShared>,
        capture: u64,
        origin: StreamSlot,
        shared: Option<&GraphPool>,
    ) {
        let key = NEXT_GRAPH_MEMORY.fetch_add(1, Ordering::Relaxed);
        let own = MemoryToken::new(device, key, GraphMemoryOwner::Graph(capture));
        let memory = Arc::new(CaptureMemory { own, shared: shared.cloned(), origin });
        self.list.lock().push((capture, memory));
    }

    /// The graph memory of capture `capture`, if it is listed.
    pub(crate) fn get(&self, capture: u64) -> Option<Arc<CaptureMemory>> {
        self.list.lock().iter().find(|(c, _)| *c == capture).map(|(_, m)| Arc::clone(m))
    }

    /// Takes capture `capture` off the list (it ended). The caller drops what it gets
    /// without the list's lock: the last token's drop calls the pools.
    pub(crate) fn end(&self, capture: u64) -> Option<Arc<CaptureMemory>> {
        let mut list = self.list.lock();
        let i = list.iter().position(|(c, _)| *c == capture)?;
        Some(list.swap_remove(i).1)
    }

    /// Takes the captures begun on the stream in slot `origin` off the list (it is being
    /// dropped, which ends them).
    pub(crate) fn end_all_of(&self, origin: StreamSlot) -> Vec<Arc<CaptureMemory>> {
        let mut list = self.list.lock();
        let (ended, kept) = std::mem::take(&mut *list).into_iter().partition(|(_, m)| {
            // A capture of the slot's stream: it is alive while its capture is listed.
            m.origin == origin
        });
        *list = kept;
        ended.into_iter().map(|(_, m): (u64, Arc<CaptureMemory>)| m).collect()
    }
}

impl MemPool<'_> {
    /// A new graph pool whose region lives in this pool (see [`GraphPool`]): captures begun
    /// with it ([`Stream::begin_capture_with_pool`](crate::Stream::begin_capture_with_pool))
    /// share the memory of their allocations from this pool.
    pub fn graph_pool(&self) -> GraphPool {
        GraphPool::new(&self.device().shared, self.id())
    }

    /// The memory this pool keeps for captured graphs: one entry per graph or graph pool
    /// that allocated here while capturing, until it goes (their sum is
    /// [`PoolStats::graph_reserved`](crate::PoolStats::graph_reserved)). Empty for a native
    /// pool.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{CaptureMode, GraphMemoryOwner, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// s.begin_capture(CaptureMode::Global)?;
    /// let out = pool.alloc_async::<f32>(1024, &s)?; // an output: it outlives the capture
    /// let graph = s.end_capture()?;
    /// let mem = pool.graph_memory();
    /// assert_eq!(mem[0].owner, GraphMemoryOwner::Graph(graph.id()));
    /// assert_eq!(mem[0].used, 4096);
    /// drop((graph, out)); // the graph's memory goes back to the pool
    /// assert!(pool.graph_memory().is_empty());
    /// # Ok(()) }
    /// ```
    pub fn graph_memory(&self) -> Vec<GraphMemoryStats> {
        let Backend::Engine(cores) = self.backend() else { return Vec::new() };
        let mut all: Vec<GraphMemoryStats> = Vec::new();
        for core in cores.iter() {
            let inner = core.lock();
            for g in inner.graph.stats(&inner.engine) {
                // A region per shard that allocated: one entry per owner.
                match all.iter_mut().find(|a| a.owner == g.owner) {
                    Some(a) => {
                        a.used += g.used;
                        a.reserved += g.reserved;
                    }
                    None => all.push(g),
                }
            }
        }
        all
    }
}
