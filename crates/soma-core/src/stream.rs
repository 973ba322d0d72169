//! Streams: ordered queues of device work, and the typed copy / kernel API.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::buffer::{BufferOwner, DeviceBuffer, DeviceBufferMut};
use crate::clock::VectorClock;
use crate::completion::StreamSync;
use crate::device::Device;
use crate::engine::StreamSlot;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::hal::{
    AccessMode, BufferAccess, KernelBuffers, KernelError, KernelLaunch, MemRef, StreamHal,
};

/// A stream flag: the raw handle was handed out, so work soma does not see may be enqueued
/// on it at any time, and every free first lets the backend count a position for it.
pub(crate) const FOREIGN_WORK: u8 = 1 << 0;
/// A stream flag: the stream began or joined a capture at some point (see the `graph`
/// module); until then the pool's capture checks cost one load, not a backend call.
pub(crate) const CAPTURED: u8 = 1 << 1;
/// A stream flag: an allocation was handed off to this stream from one with [`CAPTURED`] or
/// this flag, so frees on it may be of memory a graph holds (see the pool's
/// `graph_region.rs`).
pub(crate) const GRAPH_BLOCKS: u8 = 1 << 2;
/// The flags under which a free may concern graph memory and takes the slow path.
pub(crate) const GRAPH_PATH: u8 = CAPTURED | GRAPH_BLOCKS;

/// A stream of a device: work enqueued on it executes in order, asynchronously to the host.
///
/// `Stream<'d>` borrows its [`Device`]. Allocations made for a stream borrow the stream, so
/// a stream cannot be dropped while an allocation that would be freed onto it is alive.
/// Dropping a stream waits for its work to finish. [`OwnedStream`](crate::OwnedStream) is
/// the same stream without the borrow, for engines that keep their streams in structs.
pub struct Stream<'d> {
    /// A handle to the device (reference-counted); `'d` is the borrow the API promises.
    device: Device,
    _device: PhantomData<&'d Device>,
    hal: Arc<dyn StreamHal>,
    slot: StreamSlot,
    base: u64,
    /// What this stream's future work is ordered after, learnt from event waits.
    clock: Mutex<VectorClock>,
    /// [`FOREIGN_WORK`], [`CAPTURED`] and [`GRAPH_BLOCKS`]: what makes a free on this stream
    /// take the slow path. One byte, so that the pool's free reads them with one load.
    flags: AtomicU8,
    /// The device's default pool, once this stream allocated from it (`alloc_async`).
    pub(crate) default_pool: OnceLock<crate::pool::OwnedPool>,
}

impl<'d> Stream<'d> {
    /// Creates a stream of `device`; the caller chooses the lifetime the handle claims
    /// (the borrow of `device` for [`Device::create_stream`], `'static` for an owned stream).
    pub(crate) fn new(device: &Device) -> Result<Self> {
        device.shared.check_stream_room()?;
        let hal: Arc<dyn StreamHal> = Arc::from(device.shared.hal.create_stream()?);
        let (slot, base) = device.shared.attach_stream(Arc::clone(&hal))?;
        Ok(Stream {
            device: device.clone(),
            _device: PhantomData,
            hal,
            slot,
            base,
            clock: Mutex::new(VectorClock::new()),
            flags: AtomicU8::new(0),
            default_pool: OnceLock::new(),
        })
    }

    /// The device this stream belongs to.
    #[inline]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The backend's id of this stream (as it appears in reports).
    pub fn id(&self) -> u64 {
        self.hal.id()
    }

    /// The backend stream, for what the typed API does not cover.
    pub fn hal(&self) -> &Arc<dyn StreamHal> {
        &self.hal
    }

    #[inline]
    pub(crate) fn slot(&self) -> StreamSlot {
        self.slot
    }

    /// The global position this stream's slot started at when the stream took it: every
    /// position of this stream is at least this, every position of an earlier stream in the
    /// slot below it.
    #[inline]
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Global position: the number of tasks enqueued so far, offset so that positions of a
    /// slot never repeat across the streams that used it (see [`positions`](Self::positions)).
    #[inline]
    pub(crate) fn position(&self) -> u64 {
        self.positions().1
    }

    /// The backend's enqueued count and the global position it gives, from one read; where
    /// a free is tagged. After [`expect_foreign_work`](Self::expect_foreign_work) the backend
    /// first counts a position for work enqueued on the raw handle.
    #[inline]
    pub(crate) fn positions(&self) -> (u64, u64) {
        self.positions_with(self.flags())
    }

    /// [`positions`](Self::positions), with the stream's [`flags`](Self::flags) read by the
    /// caller.
    #[inline]
    pub(crate) fn positions_with(&self, flags: u8) -> (u64, u64) {
        if flags & FOREIGN_WORK != 0 {
            self.hal.note_foreign_work();
        }
        let local = self.hal.enqueued();
        (local, self.base + local)
    }

    /// What makes a free on this stream take the slow path ([`FOREIGN_WORK`], [`CAPTURED`],
    /// [`GRAPH_BLOCKS`]); 0 for almost every stream.
    #[inline(always)]
    pub(crate) fn flags(&self) -> u8 {
        self.flags.load(Ordering::Relaxed)
    }

    /// Sets `flag` for the rest of the stream's life.
    pub(crate) fn set_flag(&self, flag: u8) {
        self.flags.fetch_or(flag, Ordering::Relaxed);
    }

    /// Tells soma that work it does not see (an operator launched on the backend's raw stream
    /// handle) was enqueued on this stream: frees made afterwards are ordered after it, for
    /// every reuse rule. Work enqueued on the raw handle is otherwise ordered like soma's own
    /// work on this stream; a buffer it uses on *another* stream needs
    /// [`BufferOwner::record_use`](crate::BufferOwner::record_use) first, as for any use.
    ///
    /// The backends' raw accessors (`as_raw`) call [`expect_foreign_work`](Self::expect_foreign_work),
    /// which covers all later foreign work; call this after foreign work enqueued through a
    /// handle obtained otherwise. Cheap: no driver call.
    pub fn note_foreign_work(&self) {
        self.hal.note_foreign_work();
    }

    /// From now on, treats every free on this stream as possibly preceded by foreign work on
    /// the raw handle (see [`note_foreign_work`](Self::note_foreign_work)): each free first
    /// counts a position for it. Called by the backends' raw accessors when they hand the
    /// handle out; it cannot be undone for the stream's lifetime.
    pub fn expect_foreign_work(&self) {
        self.set_flag(FOREIGN_WORK);
        self.hal.note_foreign_work();
    }

    pub(crate) fn clock(&self) -> parking_lot::MutexGuard<'_, VectorClock> {
        self.clock.lock()
    }

    #[inline]
    pub(crate) fn check_device(&self, device: &Device, what: &str) -> Result<()> {
        if self.device.same_as(device) {
            Ok(())
        } else {
            Err(self.wrong_device(what))
        }
    }

    #[cold]
    #[inline(never)]
    fn wrong_device(&self, what: &str) -> Error {
        Error::WrongDevice(format!("{what} belongs to another device than stream {}", self.id()))
    }

    /// Checks that work on this stream may use memory of `device`: its own device's, or a
    /// peer's this device has access to ([`Device::enable_peer_access`]).
    #[inline]
    pub(crate) fn check_access(&self, device: &Device, what: &str) -> Result<()> {
        if self.device.same_as(device) {
            Ok(())
        } else {
            self.check_peer_access(device, what)
        }
    }

    #[cold]
    #[inline(never)]
    fn check_peer_access(&self, device: &Device, what: &str) -> Result<()> {
        if self.device.has_peer_access(device) {
            return Ok(());
        }
        Err(Error::PeerAccess(format!(
            "{what} is memory of device {}, and peer access from device {} (stream {}) to it is \
             not enabled (Device::enable_peer_access)",
            device.info().ordinal,
            self.device.info().ordinal,
            self.id()
        )))
    }

    /// Checks that this stream may wait on an event of `device`: its own device's, or one
    /// linked to it by peer access in either direction.
    fn check_event_device(&self, device: &Device, what: &str) -> Result<()> {
        if self.device.linked_to(device) {
            Ok(())
        } else {
            Err(self.wrong_device(what))
        }
    }

    /// Blocks until everything enqueued so far has completed, then applies the release
    /// threshold of the device's pools. Frees made on this stream before the call become
    /// reusable by every stream.
    ///
    /// # Errors
    /// The stream's sticky error, if a task failed.
    pub fn synchronize(&self) -> Result<()> {
        let enqueued = self.position();
        let result = self.hal.synchronize();
        // The HAL drains the queue before reporting an error, so this holds either way.
        self.device.shared.observe(self.slot, enqueued + 1);
        self.device.shared.after_host_sync();
        Ok(result?)
    }

    /// A future that completes when everything enqueued so far has completed, without
    /// blocking a thread: the device wakes it. Needs no particular async runtime. When it
    /// completes, the work it covers counts as host-observed, exactly as after
    /// [`synchronize`](Self::synchronize): frees made on this stream before the call become
    /// reusable by every stream, and the release threshold of the device's pools applies.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// let s = dev.create_stream()?;
    /// let ran = std::sync::Arc::new(AtomicBool::new(false));
    /// let flag = ran.clone();
    /// s.host_fn(move || {
    ///     std::thread::sleep(std::time::Duration::from_millis(5));
    ///     flag.store(true, Ordering::Release);
    /// })?;
    /// let done = s.synchronize_async();      // enqueued now: covers the host function
    /// block_on(done)?;                       // any executor (tokio, smol, a hand-made one)
    /// assert!(ran.load(Ordering::Acquire));
    /// # fn block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     struct Unpark(std::thread::Thread);
    /// #     impl std::task::Wake for Unpark { fn wake(self: std::sync::Arc<Self>) { self.0.unpark() } }
    /// #     let waker = std::sync::Arc::new(Unpark(std::thread::current())).into();
    /// #     let mut cx = std::task::Context::from_waker(&waker);
    /// #     let mut f = std::pin::pin!(f);
    /// #     loop { match f.as_mut().poll(&mut cx) { std::task::Poll::Ready(v) => return v, _ => std::thread::park() } }
    /// # }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The stream's sticky error, if a task failed; backend failures while arming the wake-up
    /// (reported when the future is first polled).
    pub fn synchronize_async(&self) -> StreamSync<'_> {
        StreamSync::new(self)
    }

    /// After the host saw every task up to global `position` complete (a future's wake-up):
    /// publishes it, applies the release thresholds, and reports the stream's sticky error.
    pub(crate) fn observe_completed(&self, position: u64) -> Result<()> {
        let failed = self.hal.query().err();
        self.device.shared.observe(self.slot, position + 1);
        self.device.shared.after_host_sync();
        failed.map_or(Ok(()), |e| Err(e.into()))
    }

    /// Whether everything enqueued so far has completed; never blocks.
    ///
    /// # Errors
    /// The stream's sticky error, if a task failed.
    pub fn query(&self) -> Result<bool> {
        let enqueued = self.position();
        let done = self.hal.query()?;
        if done {
            self.device.shared.observe(self.slot, enqueued + 1);
        }
        Ok(done)
    }

    /// Whether everything enqueued so far has completed, without that answer counting as a
    /// host observation: unlike [`query`](Self::query), a `true` here does not make this
    /// stream's frees reusable by other streams under the host-synchronisation rule, so a
    /// test of the reuse rules can look without changing which rule applies. (Opportunistic
    /// reuse, which follows device completion, may still see the frees as complete; a backend
    /// that caches completion refreshes its cache.) Never blocks.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// let s = dev.create_stream()?;
    /// s.host_fn(|| {})?;
    /// while !s.is_complete_unobserved()? {
    ///     std::thread::yield_now();
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The stream's sticky error, if a task failed.
    pub fn is_complete_unobserved(&self) -> Result<bool> {
        Ok(self.hal.query()?)
    }

    /// Records a new event at the current end of this stream.
    ///
    /// # Errors
    /// Backend failures.
    pub fn record_event(&self) -> Result<Event<'d>> {
        let event = Event::new(&self.device)?;
        self.record(&event)?;
        Ok(event)
    }

    /// Records `event` at the current end of this stream; a previous record is replaced.
    ///
    /// # Errors
    /// Backend failures, or an event of another device.
    pub fn record(&self, event: &Event<'_>) -> Result<()> {
        self.check_device(event.device(), "the event")?;
        event.record_on(self)
    }

    pub(crate) fn record_raw(&self, event: &dyn crate::hal::EventHal) -> Result<VectorClock> {
        // The clock lock spans the enqueue: a wait enqueued after this record cannot join its
        // knowledge into the snapshot (a record must never claim a later wait's ordering).
        let clock = self.clock.lock();
        let epoch = self.capture_epoch();
        let pos = self.hal.record(event)?;
        if !self.outside_capture_since(epoch) {
            // A captured record runs only when a graph is launched: it orders nothing now.
            self.set_flag(CAPTURED);
            return Ok(VectorClock::new());
        }
        let mut snapshot = clock.clone();
        drop(clock);
        snapshot.raise(self.slot, self.base + pos);
        Ok(snapshot)
    }

    /// Makes this stream's later work wait until `event`'s latest record has completed. The
    /// pool learns from it: blocks freed before that record (on its stream, or on any stream
    /// it was itself ordered after) become reusable here when `follow_event_dependencies` is on.
    ///
    /// The event may belong to another device linked to this one by peer access (either
    /// direction): the wait orders the work, but the pool learns nothing from it (its
    /// happens-before knowledge is per device), so no block moves between devices.
    ///
    /// # Errors
    /// Backend failures, or an event of another device without peer access between them.
    pub fn wait_event(&self, event: &Event<'_>) -> Result<()> {
        self.check_event_device(event.device(), "the event")?;
        let epoch = self.capture_epoch();
        let clock = event.wait_on(self)?;
        if !self.outside_capture_since(epoch) {
            // A captured wait (or one that made this stream join a capture) orders nothing.
            self.set_flag(CAPTURED);
        } else if let Some(clock) = clock.filter(|_| self.device.same_as(event.device())) {
            // Clocks name stream slots of one device: another device's would mean other
            // streams here.
            self.clock.lock().join(&clock);
        }
        Ok(())
    }

    pub(crate) fn wait_raw(&self, event: &dyn crate::hal::EventHal) -> Result<()> {
        Ok(self.hal.wait(event)?)
    }

    /// Makes this stream wait for everything enqueued on `other` so far (an event recorded
    /// on `other` and waited on here). `other` may be a stream of a device linked to this
    /// one by peer access, as for [`wait_event`](Self::wait_event).
    ///
    /// # Errors
    /// A stream of another device without peer access between them (nothing is enqueued on
    /// either stream then), backend failures.
    pub fn wait_stream(&self, other: &Stream<'_>) -> Result<()> {
        self.check_event_device(other.device(), "wait_stream: the other stream")?;
        let event = other.record_event()?;
        self.wait_event(&event)
    }

    /// Enqueues a host function; it runs on the stream's worker after earlier work.
    ///
    /// # Errors
    /// Backend failures.
    pub fn host_fn(&self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        Ok(self.hal.host_fn(Box::new(f))?)
    }

    /// Records a use of `buffer` by work about to be enqueued here (checks its device: this
    /// stream's, or a peer's it has access to). A use by captured work is recorded only
    /// within the capture the buffer's own stream records into (see the `graph` module).
    pub(crate) fn note_use(&self, buffer: &dyn BufferOwner) -> Result<()> {
        self.check_access(buffer.device(), "the buffer")?;
        buffer.record_use(self)
    }

    /// Enqueues a copy of `src` into the start of `dst`. `src` is staged (copied) at once,
    /// so the host slice is free to change when this returns.
    ///
    /// # Errors
    /// `src` longer than `dst`, a buffer of a device without peer access, or backend failures.
    pub fn copy_from_host<B: DeviceBufferMut>(&self, dst: &mut B, src: &[B::Elem]) -> Result<()> {
        if src.len() > dst.len() {
            return Err(Error::InvalidArgument(format!(
                "copy_from_host: {} elements into a buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        // The staging buffer is freed after the copy's first run: it cannot be replayed.
        self.refuse_in_capture("copy_from_host")?;
        self.note_use(dst)?;
        let staging: Box<[u8]> = bytemuck::cast_slice(src).into();
        if staging.is_empty() {
            return Ok(());
        }
        let host = MemRef::Host(staging.as_ptr().cast_mut());
        // SAFETY: `staging` is moved into the host function enqueued right after the copy, so
        // it is freed only after the copy (earlier on the same stream) has completed. If that
        // enqueue fails, it is leaked instead of freed under the copy.
        unsafe {
            self.hal.copy_async(MemRef::Device(dst.device_ptr()), host, staging.len() as u64)?
        };
        let keep = Arc::new(Mutex::new(Some(staging)));
        let keep_in_task = Arc::clone(&keep);
        if let Err(e) = self.hal.host_fn(Box::new(move || drop(keep_in_task.lock().take()))) {
            if let Some(staging) = keep.lock().take() {
                std::mem::forget(staging);
            }
            return Err(e.into());
        }
        Ok(())
    }

    /// Copies the start of `src` into `dst`, in stream order, and waits for the copy (and
    /// so for everything enqueued on this stream before it).
    ///
    /// The wait is a host observation, as [`synchronize`](Self::synchronize) is: frees made on
    /// this stream before the call become reusable by every stream. (It does not apply the
    /// release threshold.) [`copy_to_host_async`](Self::copy_to_host_async) copies into a
    /// [`HostBuffer`](crate::HostBuffer) without blocking.
    ///
    /// # Errors
    /// `dst` longer than `src`, a buffer of a device without peer access, the stream's sticky error.
    pub fn copy_to_host<B: DeviceBuffer>(&self, src: &B, dst: &mut [B::Elem]) -> Result<()> {
        if dst.len() > src.len() {
            return Err(Error::InvalidArgument(format!(
                "copy_to_host: {} elements out of a buffer of {}",
                dst.len(),
                src.len()
            )));
        }
        // It waits for the copy, which a capturing stream would not run.
        self.refuse_in_capture("copy_to_host")?;
        self.note_use(src)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        if bytes.is_empty() {
            return Ok(());
        }
        let len = bytes.len() as u64;
        let enqueued;
        // SAFETY: `dst` is exclusively borrowed for this whole call, and the call does not
        // return before the copy has completed or was skipped: `synchronize` below waits for
        // every task enqueued before it even when it reports an error.
        unsafe {
            self.hal.copy_async(
                MemRef::Host(bytes.as_mut_ptr()),
                MemRef::Device(src.device_ptr()),
                len,
            )?;
            enqueued = self.position();
        }
        let result = self.hal.synchronize();
        self.device.shared.observe(self.slot, enqueued + 1);
        Ok(result?)
    }

    /// Copies all of `src` into a new `Vec`, waiting for the copy as
    /// [`copy_to_host`](Self::copy_to_host) does (a host observation of this stream).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let x = pool.alloc_zeros::<u16>(3, &s)?;
    /// assert_eq!(s.download(&x)?, vec![0, 0, 0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`copy_to_host`](Self::copy_to_host).
    pub fn download<B: DeviceBuffer>(&self, src: &B) -> Result<Vec<B::Elem>> {
        let mut host = vec![<B::Elem as bytemuck::Zeroable>::zeroed(); src.len()];
        self.copy_to_host(src, &mut host)?;
        Ok(host)
    }

    /// Enqueues a device-to-device copy of the start of `src` into `dst`. Either may be memory
    /// of a peer device this stream's device has access to ([`Device::enable_peer_access`]):
    /// a copy between devices, over the link between them.
    ///
    /// # Errors
    /// `src` longer than `dst`, [`Error::PeerAccess`] for a buffer of another device without
    /// access, backend failures.
    pub fn copy<D, S>(&self, dst: &mut D, src: &S) -> Result<()>
    where
        D: DeviceBufferMut,
        S: DeviceBuffer<Elem = D::Elem>,
    {
        if src.len() > dst.len() {
            return Err(Error::InvalidArgument(format!(
                "copy: {} elements into a buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        // Both devices first: a refused copy records no use (no event) on either buffer.
        self.check_access(dst.device(), "the destination")?;
        self.check_access(src.device(), "the source")?;
        self.note_use(dst)?;
        self.note_use(src)?;
        let len = src.byte_len();
        if len == 0 {
            return Ok(());
        }
        Ok(self.hal.copy_d2d(dst.device_ptr(), src.device_ptr(), len)?)
    }

    /// Enqueues a memset of every byte of `dst` to `value`.
    ///
    /// # Errors
    /// A buffer of a device without peer access ([`Error::PeerAccess`]), backend failures.
    pub fn memset<B: DeviceBufferMut>(&self, dst: &mut B, value: u8) -> Result<()> {
        self.note_use(dst)?;
        if dst.byte_len() == 0 {
            return Ok(());
        }
        Ok(self.hal.memset(dst.device_ptr(), value, dst.byte_len())?)
    }

    /// Enqueues work that sets every element of `dst` to `value` (a memset when all bytes of
    /// `value` are equal; otherwise one element is uploaded and doubled by device-to-device
    /// copies, `log2(len)` of them).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// use soma_core::MemPool;
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(&dev)?;
    /// let mut mask = pool.alloc_async::<f32>(5, &s)?;
    /// s.fill(&mut mask, -1.5)?;
    /// assert_eq!(s.download(&mask)?, vec![-1.5; 5]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A buffer of a device without peer access ([`Error::PeerAccess`]), backend failures.
    pub fn fill<B: DeviceBufferMut>(&self, dst: &mut B, value: B::Elem) -> Result<()> {
        let bytes = bytemuck::bytes_of(&value);
        if bytes.iter().all(|&b| b == bytes[0]) {
            return self.memset(dst, bytes[0]);
        }
        self.note_use(dst)?;
        let len = dst.len();
        if len == 0 {
            return Ok(());
        }
        self.copy_from_host(&mut crate::view::first_mut(dst), std::slice::from_ref(&value))?;
        let elem = bytes.len() as u64;
        let base = dst.device_ptr();
        let mut done = 1usize;
        while done < len {
            let n = done.min(len - done);
            let at = base.checked_add(done as u64 * elem).ok_or_else(|| {
                Error::InvalidArgument("fill: buffer end overflows the address space".into())
            })?;
            self.hal.copy_d2d(at, base, n as u64 * elem)?;
            done += n;
        }
        Ok(())
    }

    /// Enqueues a kernel written as a Rust closure over the buffers in `args` (software NPU).
    ///
    /// The body sees the buffers in the order of `args`: `b.read::<T>(i)` for any argument,
    /// `b.write::<T>(i)` for those made with [`KernelArg::write`].
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = &soma_core::Device::new(npu.device(0)?);
    /// use soma_core::{KernelArg, MemPool};
    /// let s = dev.create_stream()?;
    /// let pool = MemPool::builder().build(dev)?;
    /// let x = pool.alloc_async::<f32>(4, &s)?;
    /// let mut y = pool.alloc_async::<f32>(4, &s)?;
    /// s.memset(&mut y, 0)?;
    /// s.launch("double", &[KernelArg::read(&x), KernelArg::write(&mut y)], |b| {
    ///     let (x, y) = (b.read::<f32>(0)?, b.write::<f32>(1)?);
    ///     y.iter_mut().zip(x).for_each(|(y, x)| *y = 2.0 * x);
    ///     Ok(())
    /// })?;
    /// # Ok(()) }
    /// ```
    ///
    /// Buffers may be memory of peer devices this stream's device has access to.
    ///
    /// # Errors
    /// [`Error::PeerAccess`] for a buffer of another device without access, backends without
    /// closure kernels, overlapping write buffers, backend failures. A failing body fails the stream (reported by the next
    /// synchronize).
    pub fn launch<F>(&self, name: &'static str, args: &[KernelArg<'_>], body: F) -> Result<()>
    where
        F: FnOnce(&dyn KernelBuffers) -> std::result::Result<(), KernelError> + Send + 'static,
    {
        // Every device first: a refused launch records no use (no event) on any buffer.
        for arg in args {
            self.check_access(arg.owner.device(), "a kernel argument")?;
        }
        for arg in args {
            self.note_use(arg.owner)?;
        }
        let buffers = args.iter().map(|a| a.access).collect();
        Ok(self.hal.launch(KernelLaunch { name, buffers, body: Box::new(body) })?)
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        if self.flags() & CAPTURED != 0 {
            // Dropping the stream ends the captures begun on it, without a graph: their
            // graph memory goes.
            drop(self.device.shared.captures.end_all_of(self.slot));
        }
        // Drain: frees made on this stream must be complete before its slot is recycled.
        // A sticky error cannot be reported from here; the queue has drained regardless.
        let _ = self.hal.synchronize();
        let final_global = self.position();
        self.device.shared.detach_stream(self.slot, final_global);
        // Its frees are host-observed now: let them merge with the other streams' memory.
        self.device.shared.settle_pools();
    }
}

impl std::fmt::Debug for Stream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("id", &self.id()).field("slot", &self.slot).finish()
    }
}

/// One buffer argument of [`Stream::launch`].
pub struct KernelArg<'a> {
    pub(crate) access: BufferAccess,
    pub(crate) owner: &'a dyn BufferOwner,
}

impl<'a> KernelArg<'a> {
    /// The kernel reads `buffer`.
    pub fn read<B: DeviceBuffer>(buffer: &'a B) -> Self {
        KernelArg {
            access: BufferAccess {
                ptr: buffer.device_ptr(),
                len: buffer.byte_len(),
                mode: AccessMode::Read,
            },
            owner: buffer,
        }
    }

    /// The kernel writes (and may read) `buffer`; taking `&mut` keeps it from being handed to
    /// the same launch twice.
    pub fn write<B: DeviceBufferMut>(buffer: &'a mut B) -> Self {
        KernelArg {
            access: BufferAccess {
                ptr: buffer.device_ptr(),
                len: buffer.byte_len(),
                mode: AccessMode::Write,
            },
            owner: buffer,
        }
    }
}
