//! Owned handles for long-lived engines: streams without a borrow of their device.
//!
//! The borrowed handles (`Stream<'d>`, `MemPool<'d>`, `PoolAlloc<'s, T>`) let the borrow
//! checker prove that an allocation is freed onto a live stream. An engine that keeps its
//! device, pools, streams and weights in one struct, moves them into threads or holds them
//! across `.await` needs `'static` handles instead: the owned ones keep what they depend on
//! alive by reference counting (as tokio's `OwnedSemaphorePermit` keeps its semaphore), and
//! go through the same pool, rules and free ring.

use std::ops::Deref;
use std::sync::Arc;

use crate::device::Device;
use crate::error::Result;
use crate::event::Event;
use crate::stream::Stream;

/// A stream that owns its place on the device: `'static`, `Send + Sync`, and cheap to clone
/// (every clone is the same stream; it is dropped, after draining, with the last clone and
/// the last allocation freed onto it).
///
/// It offers every method of [`Stream`] through `Deref`, and is accepted wherever a
/// `&Stream` is.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let npu = soma_sim::Npu::builder().build()?;
/// # let dev = soma_core::Device::new(npu.device(0)?);
/// use soma_core::{Device, OwnedStream};
/// struct Engine {
///     device: Device,
///     decode: OwnedStream, // no lifetime on Engine
/// }
/// let engine = Engine { decode: dev.create_owned_stream()?, device: dev };
/// let worker = std::thread::spawn(move || engine.decode.synchronize());
/// worker.join().unwrap()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct OwnedStream(Arc<Stream<'static>>);

impl Device {
    /// Creates a stream that owns its handle to the device ([`OwnedStream`]).
    ///
    /// # Errors
    /// As [`Device::create_stream`].
    pub fn create_owned_stream(&self) -> Result<OwnedStream> {
        Ok(OwnedStream(Arc::new(Stream::new(self)?)))
    }
}

impl OwnedStream {
    /// Records a new event at the current end of this stream: an `Event<'static>` an engine
    /// can keep (as [`Stream::record_event`]).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// let (prefill, decode) = (dev.create_owned_stream()?, dev.create_owned_stream()?);
    /// let ready: soma_core::Event<'static> = prefill.record_owned_event()?;
    /// decode.wait_event(&ready)?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Stream::record_event`].
    pub fn record_owned_event(&self) -> Result<Event<'static>> {
        self.0.record_event()
    }

    /// Whether `self` and `other` are clones of the same stream.
    pub fn same_stream(&self, other: &OwnedStream) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Deref for OwnedStream {
    type Target = Stream<'static>;

    fn deref(&self) -> &Stream<'static> {
        &self.0
    }
}

impl AsRef<Stream<'static>> for OwnedStream {
    fn as_ref(&self) -> &Stream<'static> {
        &self.0
    }
}

impl std::fmt::Debug for OwnedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedStream").field(&*self.0).finish()
    }
}
