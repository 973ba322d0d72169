//! The pools' annotations for the stream-order sanitizer.

use super::DevicePtr;

/// What a pool tells the device about its allocations, for the stream-order sanitizer.
///
/// Positions are the stream's [`StreamHal::enqueued`](super::StreamHal::enqueued) count at
/// the call: an allocation at position `p` is usable by tasks of that stream at positions
/// `> p` (and by tasks of other streams ordered after that point); a free at position `p`
/// ends the lifetime for tasks ordered after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolAnnotation {
    /// A block was handed out.
    Alloc {
        /// Pool id.
        pool: u64,
        /// First byte.
        ptr: DevicePtr,
        /// Bytes asked for (accesses beyond are out of bounds).
        size: u64,
        /// Backend id of the stream it was allocated for.
        stream: u64,
        /// That stream's enqueued position at the allocation.
        position: u64,
    },
    /// A block was freed onto a stream.
    Free {
        /// Pool id.
        pool: u64,
        /// First byte.
        ptr: DevicePtr,
        /// Backend id of the stream it was freed onto.
        stream: u64,
        /// That stream's enqueued position at the free.
        position: u64,
    },
    /// A block was handed out to a capturing stream from graph memory (region `region` of
    /// the pool): the launches of the graph(s) that region serves may use it, at their own
    /// positions, until the region is released, whatever frees the captures make; other work
    /// may use it from the allocation point until it goes back to the region
    /// ([`GraphFree`](Self::GraphFree)).
    GraphAlloc {
        /// Pool id.
        pool: u64,
        /// The region's key (unique in the process).
        region: u64,
        /// First byte.
        ptr: DevicePtr,
        /// Bytes asked for (accesses beyond are out of bounds).
        size: u64,
        /// Backend id of the capturing stream.
        stream: u64,
        /// That stream's enqueued position at the allocation (captured work takes none).
        position: u64,
    },
    /// A block of region `region` went back to it: freed inside a capture, or freed outside
    /// (a graph's output) while the region is reserved. Launches may still use it; other work
    /// enqueued from now on may not.
    GraphFree {
        /// Pool id.
        pool: u64,
        /// The region's key.
        region: u64,
        /// First byte.
        ptr: DevicePtr,
    },
    /// Region `region` was released (its graphs are gone, their launches complete): the
    /// blocks that went back to it are freed, its live blocks become ordinary allocations.
    GraphRelease {
        /// Pool id.
        pool: u64,
        /// The region's key.
        region: u64,
    },
}
