//! The stream-ordered memory pool: [`MemPool`], its builder, attributes and statistics.
//!
//! | file | what it holds |
//! |---|---|
//! | `api.rs` | [`MemPool`]'s public methods, each handed to the engine-backed or the native pool |
//! | `builder.rs` | [`MemPoolBuilder`]: configuration, validation, building |
//! | `policy.rs` | [`ReusePolicy`], the stored settings, [`OomAction`] and [`OomHook`] |
//! | `core.rs` | `PoolCore`: one engine behind its lock, its range, its modes, sticky errors |
//! | `backing.rs` | the engine's backing over the device's driver |
//! | `order.rs` | what the engine learns of stream order; settling observed frees |
//! | `allocate.rs` | one request through a core |
//! | `oom.rs` | a request the engine could not serve at once: waits, retries, hooks, reports |
//! | `free.rs` | typed and raw frees, ordering a free after the block's other uses |
//! | `free_ring.rs` | typed frees handed over without the lock |
//! | `shards.rs` | stream shards: the pool as several cores and their shared budget |
//! | `release.rs` | release threshold, `trim_to`, pass-through's deferred frees |
//! | `compact.rs` | moving allocations down |
//! | `teardown.rs` | the end of a pool, without waiting for any stream |
//! | `deferred.rs` | memory of dropped pools that work may still use, released by the device |
//! | `graph_pool.rs` | [`GraphPool`], the tokens that keep graph memory, the device's captures |
//! | `graph_region.rs` | graph-private memory in a core: captured allocations and frees |
//! | `native.rs` | the driver's own pool behind the same API |
//! | `ipc/` | pools shared with other processes: export, the pool service, import |
//! | `handle.rs` | what both allocation handles hold and do: free, record a use, hand off |
//! | `alloc.rs` | [`PoolAlloc`], the typed allocation that borrows its pool and stream |
//! | `default.rs` | a device's default pool, and `Stream::alloc_async` from it |
//! | `owned.rs` | [`OwnedPool`] and [`OwnedAlloc`]: the same, `'static`, for long-lived engines |
//! | `transfer.rs` | allocations that start with known contents (zeros, an upload) |
//! | `attr.rs`, `stats.rs`, `observe_api.rs` | attributes, counters, snapshots and history |

mod alloc;
mod allocate;
mod api;
pub mod attr;
mod backing;
mod builder;
mod compact;
mod core;
mod default;
pub(crate) mod deferred;
mod free;
pub mod free_ring;
mod graph_pool;
mod graph_region;
mod handle;
mod ipc;
mod native;
mod observe_api;
mod oom;
mod order;
mod owned;
mod passthrough;
mod policy;
mod release;
mod shards;
mod stats;
mod teardown;
mod transfer;

pub use alloc::PoolAlloc;
pub use api::MemPool;
pub use builder::MemPoolBuilder;
pub(crate) use default::DefaultPool;
pub(crate) use graph_pool::{ActiveCaptures, CaptureMemory};
pub use graph_pool::{GraphMemoryOwner, GraphMemoryStats, GraphPool};
pub use ipc::{ExportedPointer, HandleType, ImportedAlloc, ImportedPool, PoolDescriptor};
pub use owned::{OwnedAlloc, OwnedPool};
pub use policy::{OomAction, OomHook, ReusePolicy};
pub use stats::{PoolStats, ReuseCounts};
