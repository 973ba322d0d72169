//! Graph capture on the typed API: record a stream's work once, launch it many times
//! (CANN's model runtime instance: `aclmdlRICaptureBegin` … `aclmdlRICaptureEnd`,
//! `aclmdlRIExecuteAsync`, `aclmdlRIDestroy`).
//!
//! # What the typed layer learns from captured work
//!
//! Nothing. A captured task does not run at capture time, so a record captured on a stream
//! publishes no vector clock (an event recorded inside a capture carries an empty clock: a
//! stream that waits on it, and the host that synchronises it, learn no ordering from it),
//! and a wait enqueued on a capturing stream joins no clock (the stream's real work is not
//! ordered after anything by it). Whether a record or a wait was captured is read from the
//! stream's capture epoch around the call ([`StreamHal::capture_epoch`]), so a stream that
//! enters or leaves a capture concurrently is treated as capturing. A graph launch is one
//! task of its stream and teaches the layer nothing either: its waits are ordering the pools
//! do not see, which only costs them reuse opportunities.
//!
//! Buffer uses by captured work are not recorded with their pools either — except a use by
//! one stream of a capture of an allocation of another stream of the same capture, recorded
//! with captured events so that a free inside the capture is ordered after it in the graph:
//! memory a graph uses must stay allocated until the graph is dropped (as CANN requires of a
//! model's memory), and ordering a launch on another stream after the allocation is the
//! caller's job (the sanitizer reports a launch that is not).
//!
//! # Graph memory
//!
//! Pools allocate and free on a capturing stream from graph-private memory (see the pool's
//! `graph_region.rs` and [`GraphPool`]): the allocation is served at capture time and stays
//! the graph's while the graph lives, so launches make no allocator call. Each capture begun
//! here is listed with the device (the pool's `ActiveCaptures`) with the token that keeps
//! that memory; streams that join the capture find it by the capture's id.
//! The [`Graph`] takes the token over (and drops it after its launches have completed); a
//! capture that ends without a graph drops it at once.

use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::hal::{
    CaptureErrorKind, CaptureInfo, CaptureMode, DriverError, GraphHal, KernelBuffers, KernelError,
    ReplayableKernel, StreamHal,
};
use crate::pool::{CaptureMemory, GraphPool};
use crate::stream::{KernelArg, Stream};

/// A captured graph of one device: the work recorded between [`Stream::begin_capture`] and
/// [`Stream::end_capture`], launched with [`Graph::launch`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let npu = soma_sim::Npu::builder().build()?;
/// # let dev = &soma_core::Device::new(npu.device(0)?);
/// use soma_core::{CaptureMode, DriverAlloc, KernelArg};
/// let s = dev.create_stream()?;
/// let mut x = DriverAlloc::<u32>::new(dev, 4)?;
/// s.memset(&mut x, 0)?;
/// s.begin_capture(CaptureMode::Global)?;
/// s.launch_replayable("increment", &[KernelArg::write(&mut x)], |b| {
///     b.write::<u32>(0)?.iter_mut().for_each(|v| *v += 1);
///     Ok(())
/// })?;
/// let graph = s.end_capture()?; // nothing ran yet
/// for _ in 0..3 {
///     graph.launch(&s)?;
/// }
/// let mut host = [0u32; 4];
/// s.copy_to_host(&x, &mut host)?;
/// assert_eq!(host, [3; 4]);
/// # Ok(()) }
/// ```
///
/// Dropping the graph destroys it (`aclmdlRIDestroy`) after its launches have completed.
pub struct Graph<'d> {
    /// A handle to the device (reference-counted); `'d` is the borrow the API promises.
    device: Device,
    _device: std::marker::PhantomData<&'d Device>,
    hal: Box<dyn GraphHal>,
    /// The graph memory of its capture; dropped after `hal` (fields drop in order), whose
    /// drop waits for the launches: only then may the pools take the memory back.
    _memory: Option<Arc<CaptureMemory>>,
}

impl<'d> Graph<'d> {
    /// The device the graph belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The id of the capture the graph came from (what [`CaptureInfo::capture`] reported).
    pub fn id(&self) -> u64 {
        self.hal.id()
    }

    /// Number of tasks captured, on every stream of the capture.
    pub fn task_count(&self) -> usize {
        self.hal.task_count()
    }

    /// The backend graph.
    pub fn hal(&self) -> &dyn GraphHal {
        &*self.hal
    }

    /// Runs the graph once on `stream` (`aclmdlRIExecuteAsync`): one task, ordered after the
    /// stream's earlier work, including earlier launches.
    ///
    /// # Errors
    /// A stream of another device, a capturing stream, backend failures.
    pub fn launch(&self, stream: &Stream<'_>) -> Result<()> {
        stream.check_device(&self.device, "the graph")?;
        self.hal.launch(&**stream.hal())?;
        Ok(())
    }
}

impl std::fmt::Debug for Graph<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph").field("id", &self.id()).field("tasks", &self.task_count()).finish()
    }
}

impl<'d> Stream<'d> {
    /// Starts recording this stream's work into a graph (`aclmdlRICaptureBegin`): from now on
    /// the work enqueued on it (and on streams that wait on events recorded in the capture)
    /// does not run; [`end_capture`](Self::end_capture) returns it as a [`Graph`]. `mode`
    /// says which threads may still make synchronous copies and memsets ([`CaptureMode`]).
    ///
    /// Pool allocations and frees on the capture's streams are served from memory kept for
    /// the graph, one region per pool that allocates, while the graph lives (see
    /// [`GraphPool`]; [`begin_capture_with_pool`](Self::begin_capture_with_pool) shares it
    /// between graphs).
    ///
    /// # Errors
    /// The stream is already capturing, or the backend has no graph capture.
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        self.begin_capture_in(mode, None)
    }

    /// As [`begin_capture`](Self::begin_capture), with the allocations the capture makes from
    /// `pool`'s own [`MemPool`](crate::MemPool) served from the graph pool's memory, which
    /// every graph captured into it shares (PyTorch's `graph_pool_handle()`). The graphs of
    /// one graph pool must never run concurrently (see [`GraphPool`]).
    ///
    /// # Errors
    /// As [`begin_capture`](Self::begin_capture); a graph pool of another device.
    pub fn begin_capture_with_pool(&self, mode: CaptureMode, pool: &GraphPool) -> Result<()> {
        if !pool.is_of(&self.device().shared) {
            return Err(Error::WrongDevice(format!(
                "graph pool {} belongs to another device than stream {}",
                pool.id(),
                self.id()
            )));
        }
        self.begin_capture_in(mode, Some(pool))
    }

    fn begin_capture_in(&self, mode: CaptureMode, pool: Option<&GraphPool>) -> Result<()> {
        self.set_flag(crate::stream::CAPTURED);
        self.hal().begin_capture(mode)?;
        let shared = &self.device().shared;
        // No capture id: it ended at once, and there is nothing to keep memory for.
        if let Some(capture) = self.hal().capture_info()?.capture {
            shared.captures.begin(shared, capture, self.slot(), pool);
        }
        Ok(())
    }

    /// Ends the capture begun on this stream and returns its graph (`aclmdlRICaptureEnd`).
    /// Every stream that joined the capture leaves it. The graph keeps the memory its
    /// capture allocated from pools; a capture that ends without a graph gives it back.
    ///
    /// # Errors
    /// The stream is not capturing, joined the capture rather than began it, or was begun on
    /// another thread in a mode other than relaxed; streams that joined did not rejoin it;
    /// the capture was invalidated by a forbidden call.
    pub fn end_capture(&self) -> Result<Graph<'d>> {
        let capture = self.hal().capture_info()?.capture;
        let result = self.hal().end_capture();
        let captures = &self.device().shared.captures;
        let ended = self.hal().capture_info().map_or(true, |i| i.capture != capture);
        // Taken off the list only once the capture has ended: a refused end leaves it going.
        let memory = capture.filter(|_| ended).and_then(|c| captures.end(c));
        let hal = result?;
        Ok(Graph {
            device: self.device().clone(),
            _device: std::marker::PhantomData,
            hal,
            _memory: memory,
        })
    }

    /// The stream's capture state (`aclmdlRICaptureGetInfo`).
    ///
    /// # Errors
    /// Backend failures.
    pub fn capture_info(&self) -> Result<CaptureInfo> {
        Ok(self.hal().capture_info()?)
    }

    /// The capture this stream is recording into, if any (one atomic load when it is not
    /// capturing): what a pool asks before it allocates or frees on the stream.
    #[inline]
    pub(crate) fn capture_id(&self) -> Option<u64> {
        if self.flags() & crate::stream::CAPTURED == 0 || self.hal().capture_epoch() % 2 == 0 {
            return None;
        }
        self.hal().capture_info().ok().and_then(|info| info.capture)
    }

    /// [`CaptureErrorKind::NotCapturable`] when the stream is capturing: `what` cannot be
    /// recorded into a graph.
    #[inline(always)]
    pub(crate) fn refuse_in_capture(&self, what: &'static str) -> Result<()> {
        self.refuse_in_capture_with(self.flags(), what)
    }

    /// [`refuse_in_capture`](Self::refuse_in_capture), with the stream's flags read by the
    /// caller.
    #[inline(always)]
    pub(crate) fn refuse_in_capture_with(&self, flags: u8, what: &'static str) -> Result<()> {
        if flags & crate::stream::CAPTURED != 0 {
            return self.refuse_if_capturing(what);
        }
        Ok(())
    }

    /// [`refuse_in_capture`](Self::refuse_in_capture) for a stream that began or joined a
    /// capture at some point: asks the backend.
    #[cold]
    #[inline(never)]
    pub(crate) fn refuse_if_capturing(&self, what: &'static str) -> Result<()> {
        refuse_capturing(&**self.hal(), what)
    }

    /// The stream's capture epoch, read before a record or a wait.
    pub(crate) fn capture_epoch(&self) -> u64 {
        self.hal().capture_epoch()
    }

    /// Whether the stream was outside any capture from the read of `epoch` until now: a
    /// record or a wait made in between really ran (or will), and teaches ordering.
    pub(crate) fn outside_capture_since(&self, epoch: u64) -> bool {
        epoch % 2 == 0 && self.hal().capture_epoch() == epoch
    }

    /// Enqueues a kernel whose body may run many times: as [`launch`](Self::launch), but a
    /// capturing stream records it, and it runs at every launch of the graph (with the same
    /// buffers: the memory must stay allocated until the graph is dropped).
    ///
    /// # Errors
    /// As [`launch`](Self::launch).
    pub fn launch_replayable<F>(
        &self,
        name: &'static str,
        args: &[KernelArg<'_>],
        body: F,
    ) -> Result<()>
    where
        F: Fn(&dyn KernelBuffers) -> std::result::Result<(), KernelError> + Send + Sync + 'static,
    {
        for arg in args {
            self.note_use(arg.owner)?;
        }
        let buffers = args.iter().map(|a| a.access).collect();
        let kernel = ReplayableKernel { name, buffers, body: std::sync::Arc::new(body) };
        Ok(self.hal().launch_replayable(kernel)?)
    }

    /// Enqueues a host function that may run many times: as [`host_fn`](Self::host_fn), but
    /// a capturing stream records it, and it runs at every launch of the graph.
    ///
    /// # Errors
    /// Backend failures.
    pub fn host_fn_replayable(&self, f: impl Fn() + Send + Sync + 'static) -> Result<()> {
        Ok(self.hal().host_fn_replayable(std::sync::Arc::new(f))?)
    }
}

/// The capture `stream` records into, if any (one atomic load when it is not capturing).
pub(crate) fn capture_of(stream: &dyn StreamHal) -> Option<u64> {
    if stream.capture_epoch() % 2 == 0 {
        return None;
    }
    stream.capture_info().ok().and_then(|info| info.capture)
}

/// [`CaptureErrorKind::NotCapturable`] when `stream` is capturing: `what`, which would
/// enqueue work on it, cannot be recorded into a graph. One atomic load when it is not.
pub(crate) fn refuse_capturing(stream: &dyn StreamHal, what: &str) -> Result<()> {
    if stream.capture_epoch() % 2 == 0 {
        return Ok(());
    }
    let capture = stream.capture_info().ok().and_then(|info| info.capture);
    match capture {
        None => Ok(()),
        Some(capture) => Err(Error::Driver(DriverError::Capture {
            kind: CaptureErrorKind::NotCapturable,
            message: format!(
                "{what} on stream {}, which is capturing (capture {capture}), cannot be \
                 recorded into a graph",
                stream.id()
            ),
        })),
    }
}

impl Device {
    /// Sets the calling thread's capture mode and returns the previous one
    /// (`aclmdlRICaptureThreadExchangeMode`): a thread in [`CaptureMode::Relaxed`] may make
    /// synchronous copies and memsets while captures are active. Every thread starts in
    /// [`CaptureMode::Global`].
    ///
    /// # Errors
    /// The backend has no graph capture.
    pub fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        Ok(self.hal().exchange_capture_mode(mode)?)
    }
}
