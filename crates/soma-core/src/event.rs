//! Events: markers recorded on streams, the pool's source of cross-stream ordering.

use std::marker::PhantomData;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::clock::VectorClock;
use crate::completion::EventWait;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::hal::{EventHal, StreamHal};
use crate::stream::Stream;

/// An event of a device.
///
/// Recording it on a stream captures the stream's position and everything the stream was
/// ordered after (a vector clock); a stream that waits on it inherits that knowledge, so the
/// pool can reuse memory along chains of streams (s1 → s2 → s3).
pub struct Event<'d> {
    /// A handle to the device (reference-counted); `'d` is the borrow the API promises.
    device: Device,
    _device: PhantomData<&'d Device>,
    hal: Box<dyn EventHal>,
    /// Generation and clock of the latest record; the lock also orders record against wait,
    /// so a waiter never learns a clock newer than the record its wait covers. The
    /// generation tells `synchronize` / `query` whether the record they waited for is still
    /// the one whose clock they publish.
    recorded: Mutex<Option<(u64, VectorClock)>>,
    /// The backend stream of the latest record, for [`wait_async`](Self::wait_async) to
    /// wait behind; weak, so that an event does not keep a dropped stream alive.
    recorded_on: Mutex<Option<Weak<dyn StreamHal>>>,
}

impl<'d> Event<'d> {
    /// Creates an event of `device`; the caller chooses the lifetime the handle claims.
    pub(crate) fn new(device: &Device) -> Result<Self> {
        Ok(Event {
            device: device.clone(),
            _device: PhantomData,
            hal: device.hal().create_event()?,
            recorded: Mutex::new(None),
            recorded_on: Mutex::new(None),
        })
    }

    /// The device this event belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The backend event.
    pub fn hal(&self) -> &dyn EventHal {
        &*self.hal
    }

    pub(crate) fn record_on(&self, stream: &Stream<'_>) -> Result<()> {
        let mut recorded = self.recorded.lock();
        let clock = stream.record_raw(&*self.hal)?;
        let generation = recorded.as_ref().map_or(1, |r| r.0 + 1);
        *recorded = Some((generation, clock));
        *self.recorded_on.lock() = Some(Arc::downgrade(stream.hal()));
        Ok(())
    }

    /// The backend stream of the latest record, while it exists.
    pub(crate) fn recording_stream(&self) -> Option<Arc<dyn StreamHal>> {
        self.recorded_on.lock().as_ref().and_then(Weak::upgrade)
    }

    /// Enqueues the wait on `stream`; returns the clock the wait covers.
    pub(crate) fn wait_on(&self, stream: &Stream<'_>) -> Result<Option<VectorClock>> {
        let recorded = self.recorded.lock();
        stream.wait_raw(&*self.hal)?;
        Ok(recorded.as_ref().map(|r| r.1.clone()))
    }

    /// Whether the latest record has completed (`true` if never recorded).
    ///
    /// # Errors
    /// Backend failures.
    pub fn query(&self) -> Result<bool> {
        let before = self.recorded.lock().clone();
        let done = self.hal.query()?;
        if done {
            self.observe_if_unchanged(before);
        }
        Ok(done)
    }

    /// Blocks until the latest record has completed, then applies the release threshold of
    /// the device's pools. Frees ordered before the record become reusable by every stream.
    ///
    /// # Errors
    /// Backend failures.
    pub fn synchronize(&self) -> Result<()> {
        let before = self.recorded.lock().clone();
        self.hal.synchronize()?;
        self.observe_if_unchanged(before);
        self.device.shared.after_host_sync();
        Ok(())
    }

    /// A future that completes when the latest record (at the time of this call) has
    /// completed, without blocking a thread: the device wakes it. Needs no particular async
    /// runtime. What it observes counts as a host observation, as with
    /// [`synchronize`](Self::synchronize): frees ordered before the record become reusable by
    /// every stream, and the release threshold of the device's pools applies.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let npu = soma_sim::Npu::builder().build()?;
    /// # let dev = soma_core::Device::new(npu.device(0)?);
    /// let s = dev.create_stream()?;
    /// s.host_fn(|| std::thread::sleep(std::time::Duration::from_millis(5)))?;
    /// let done = s.record_event()?;
    /// // Any executor drives it; a minimal one here (tokio's or smol's `block_on` alike).
    /// block_on(done.wait_async())?;
    /// assert!(done.query()?);
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
    /// The failure of the recording stream, if a task before the record failed; backend
    /// failures while arming the wake-up.
    pub fn wait_async(&self) -> EventWait<'_> {
        EventWait::new(self, self.recorded.lock().clone())
    }

    /// Publishes a record's clock as host-observed after a future saw it complete, and
    /// applies the pools' release thresholds.
    pub(crate) fn observe_completed(&self, before: Option<(u64, VectorClock)>) {
        self.observe_if_unchanged(before);
        self.device.shared.after_host_sync();
    }

    /// Publishes the clock of record `before` as host-observed, but only if no other record
    /// replaced it meanwhile: the backend waits for the *latest* record, which may be on
    /// another stream and cover none of `before`'s work.
    fn observe_if_unchanged(&self, before: Option<(u64, VectorClock)>) {
        let Some((generation, clock)) = before else { return };
        if self.recorded.lock().as_ref().is_some_and(|r| r.0 == generation) {
            self.observe(&clock);
        }
    }

    fn observe(&self, clock: &VectorClock) {
        for &(slot, pos) in clock.entries() {
            // Frees strictly before the record are covered (an event recorded before a free
            // gives no right to it).
            self.device.shared.observe(slot, pos);
        }
    }

    /// Milliseconds between this event's record and `end`'s record.
    ///
    /// # Errors
    /// Either event not recorded or not complete, or events of different devices.
    pub fn elapsed_ms(&self, end: &Event<'_>) -> Result<f32> {
        if !self.device.same_as(&end.device) {
            return Err(Error::WrongDevice("events of different devices".into()));
        }
        Ok(self.hal.elapsed_ms(&*end.hal)?)
    }
}

/// Milliseconds between the records of `start` and `end` (`aclrtEventElapsedTime`).
///
/// # Errors
/// As [`Event::elapsed_ms`].
pub fn elapsed_ms(start: &Event<'_>, end: &Event<'_>) -> Result<f32> {
    start.elapsed_ms(end)
}

impl std::fmt::Debug for Event<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("recorded", &self.recorded.lock().is_some()).finish()
    }
}
