//! [`AscendEvent`]: an `aclrtEvent`, implementing [`EventHal`].

use std::any::Any;
use std::sync::{Arc, Mutex, Weak};

use ascend_sys::aclrtEventRecordedStatus;
use soma_core::hal::{DriverError, DriverResult, EventHal};

use super::conv::{map_call_err, map_create_err};
use super::device::{lock, DeviceInner};
use super::raw;
use super::stream::{Handle, Slot, StreamShared};

/// The latest record of an event: the stream and the record's position on it.
type LastRecord = Option<(Weak<StreamShared>, u64)>;

/// An event of an [`AscendDevice`](super::AscendDevice): implements [`EventHal`].
///
/// It remembers its latest record (stream and position), so that a never-recorded event is
/// complete without asking the driver, waiting on it is a no-op (as the HAL specifies), and
/// seeing it complete advances the recording stream's `completed`. Dropping it waits for its
/// latest record, then destroys it (`aclrtDestroyEvent`); errors there are kept by the device
/// and returned by its next fallible call.
pub struct AscendEvent {
    dev: Arc<DeviceInner>,
    raw: Handle,
    last: Mutex<LastRecord>,
}

impl std::fmt::Debug for AscendEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let last = lock(&self.last).as_ref().map(|(s, p)| (s.upgrade().map(|s| s.id()), *p));
        f.debug_struct("AscendEvent")
            .field("device", &self.dev.id)
            .field("last_record", &last)
            .finish()
    }
}

impl AscendEvent {
    /// `aclrtCreateEvent`; the device is current.
    pub(crate) fn new(dev: &Arc<DeviceInner>) -> DriverResult<Self> {
        let raw = raw::event::create(&dev.acl).map_err(|e| map_create_err(e, "event"))?;
        Ok(Self { dev: dev.clone(), raw: Handle(raw), last: Mutex::new(None) })
    }

    /// The runtime handle, valid while `self` lives.
    pub fn as_raw(&self) -> ascend_sys::aclrtEvent {
        self.raw.0
    }

    pub(crate) fn same_device(&self, dev: &Arc<DeviceInner>) -> bool {
        Arc::ptr_eq(&self.dev, dev)
    }

    /// Whether `self` is an event of the runtime library `dev` is driven through (any of its
    /// devices).
    pub(crate) fn same_runtime(&self, dev: &Arc<DeviceInner>) -> bool {
        Arc::ptr_eq(&self.dev.acl, &dev.acl)
    }

    /// Enqueues `aclrtRecordEvent(self, stream)`; returns its position (a captured record
    /// has none: the stream's enqueued count, and the event remembers a record of no stream,
    /// whose completion says nothing about any stream's positions).
    pub(crate) fn record_on(&self, stream: &Arc<StreamShared>) -> DriverResult<u64> {
        // Held across the enqueue so that concurrent records leave `last` matching the
        // driver's order (lock order: event → stream).
        let mut last = lock(&self.last);
        let slot = stream.enqueue(|s, _| {
            // SAFETY: both handles are live (owned by live objects) and of this device.
            unsafe { raw::event::record(&self.dev.acl, self.raw.0, s) }.map_err(map_call_err)
        })?;
        Ok(match slot {
            Slot::Position(position) => {
                *last = Some((Arc::downgrade(stream), position));
                position
            }
            Slot::Captured(_) => {
                *last = Some((Weak::new(), 0));
                stream.enqueued()
            }
        })
    }

    /// Enqueues `aclrtStreamWaitEvent(stream, self)`, unless the event was never recorded.
    /// A stream that may join a capture through the wait (a capture is active and the record
    /// belongs to no live stream) is drained first.
    pub(crate) fn wait_on(&self, stream: &Arc<StreamShared>) -> DriverResult<()> {
        let last = lock(&self.last);
        let Some((recorded_on, record)) = &*last else { return Ok(()) };
        if self.dev.captures.active()
            && recorded_on.upgrade().is_none()
            && stream.capture.id().is_none()
        {
            stream.drain()?;
        }
        let slot = stream.enqueue_wait(|s, _| {
            // SAFETY: both handles are live (owned by live objects) and of one runtime
            // library; a stream may wait on an event of another device.
            unsafe { raw::event::stream_wait(&self.dev.acl, s, self.raw.0) }.map_err(map_call_err)
        })?;
        // Once `stream` is past the wait, the record has completed on its stream (a captured
        // wait runs only at launches and proves nothing now).
        if let Slot::Position(at) = slot {
            stream.waits().push(at, recorded_on.clone(), *record);
        }
        Ok(())
    }

    /// The event's latest record completed: advance the recording stream.
    fn completed(last: &LastRecord) {
        if let Some((s, p)) = last {
            if let Some(s) = s.upgrade() {
                s.mark_completed(*p);
            }
        }
    }

    /// The failure a completed record reports: that of a task of its stream before it (a
    /// record after a failed task does on the software NPU).
    fn failure(last: &LastRecord) -> DriverResult<()> {
        match last {
            Some((stream, position)) => {
                stream.upgrade().map_or(Ok(()), |s| s.failed_before(*position))
            }
            None => Ok(()),
        }
    }

    fn query_locked(&self, last: &LastRecord) -> DriverResult<bool> {
        if last.is_none() {
            return Ok(true);
        }
        self.dev.enter()?;
        // SAFETY: the event is live while `self` is.
        let st =
            unsafe { raw::event::query_status(&self.dev.acl, self.raw.0) }.map_err(map_call_err)?;
        if st == aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE {
            Self::completed(last);
            Self::failure(last)?;
            Ok(true)
        } else if st == aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_NOT_READY {
            Ok(false)
        } else {
            Err(DriverError::Native {
                code: st.0 as i32,
                message: format!("aclrtQueryEventStatus returned unknown status {}", st.0),
            })
        }
    }
}

impl Drop for AscendEvent {
    fn drop(&mut self) {
        let acl = &self.dev.acl;
        // Only a record of a live stream can be pending: a dropped stream drained, and a
        // captured record (no stream) runs only in its graph, which a synchronisation during
        // the capture would invalidate.
        let recorded = lock(&self.last).as_ref().is_some_and(|(s, _)| s.strong_count() > 0);
        let result = self.dev.enter().and_then(|()| {
            if recorded {
                // SAFETY: the event is live until the destroy below.
                unsafe { raw::event::synchronize(acl, self.raw.0) }.map_err(map_call_err)?;
            }
            // SAFETY: live, its record (if any) completed, not used afterwards.
            unsafe { raw::event::destroy(acl, self.raw.0) }.map_err(map_call_err)
        });
        if let Err(e) = result {
            self.dev.record_err(e);
        }
    }
}

impl EventHal for AscendEvent {
    fn query(&self) -> DriverResult<bool> {
        self.dev.check_err()?;
        let last = lock(&self.last);
        self.query_locked(&last)
    }

    fn synchronize(&self) -> DriverResult<()> {
        let last = lock(&self.last);
        if last.is_some() {
            self.dev.enter()?;
            // SAFETY: the event is live while `self` is.
            unsafe { raw::event::synchronize(&self.dev.acl, self.raw.0) }.map_err(map_call_err)?;
            Self::completed(&last);
        }
        // A deferred error is reported only after the wait, which callers count on even when
        // the call fails (the HAL's contract).
        self.dev.check_err()?;
        Self::failure(&last)
    }

    fn elapsed_ms(&self, end: &dyn EventHal) -> DriverResult<f32> {
        self.dev.check_err()?;
        let end = end.as_any().downcast_ref::<AscendEvent>().ok_or_else(|| {
            DriverError::InvalidHandle("the end event is not an event of the ascend backend".into())
        })?;
        if !Arc::ptr_eq(&self.dev, &end.dev) {
            return Err(DriverError::InvalidHandle(
                "the events belong to different devices".into(),
            ));
        }
        for (name, e) in [("start", self), ("end", end)] {
            // Locks taken one at a time (never both): no ordering between two events' locks.
            let last = lock(&e.last);
            if last.is_none() {
                return Err(DriverError::InvalidValue(format!(
                    "the {name} event was never recorded"
                )));
            }
            if !e.query_locked(&last)? {
                return Err(DriverError::InvalidValue(format!(
                    "the {name} event has not completed"
                )));
            }
        }
        self.dev.enter()?;
        // SAFETY: both events are live while `self` and `end` are.
        unsafe { raw::event::elapsed_time(&self.dev.acl, self.raw.0, end.raw.0) }
            .map_err(map_call_err)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
