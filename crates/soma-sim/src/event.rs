//! [`SimEvent`]: markers recorded on streams.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use soma_core::hal::{DriverError, DriverResult, EventHal};

use crate::capture::Capture;
use crate::sanitizer::Clock;
use crate::stream::StreamShared;

/// One record of an event: a position on a stream, stamped when it completes.
pub(crate) struct RecordState {
    pub(crate) stream: Arc<StreamShared>,
    pub(crate) position: u64,
    /// The sanitizer's clock of the record (its stream's clock plus its position), when on.
    pub(crate) clock: Option<Arc<Clock>>,
    /// Completion time, and the stream error if the record task was skipped.
    stamp: Mutex<Option<(Instant, Option<DriverError>)>>,
}

impl RecordState {
    pub(crate) fn new(stream: Arc<StreamShared>, position: u64, clock: Option<Arc<Clock>>) -> Self {
        Self { stream, position, clock, stamp: Mutex::new(None) }
    }

    /// Tells the sanitizer that the host observed this record's completion.
    fn observed(&self) {
        if let (Some(san), Some(clock)) = (&self.stream.san, &self.clock) {
            san.observe_clock(clock);
        }
    }

    /// Called by the worker just before the record task counts as completed.
    pub(crate) fn complete(&self, error: Option<DriverError>) {
        *self.stamp.lock() = Some((Instant::now(), error));
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.stream.completed_pos() >= self.position
    }

    fn stamp(&self) -> Option<(Instant, Option<DriverError>)> {
        if !self.is_complete() {
            return None;
        }
        self.stamp.lock().clone()
    }
}

/// An event's latest record: one that runs, or one captured into a graph.
#[derive(Clone)]
pub(crate) enum Latest {
    /// A record task of a stream (or of a graph launch).
    Record(Arc<RecordState>),
    /// Task `task` of a capture: it runs only when the graph is launched.
    Captured {
        /// The capture.
        capture: Arc<Capture>,
        /// Index of the record among the capture's tasks.
        task: usize,
    },
}

/// Where an event keeps its latest record; shared with the graphs that record or wait on the
/// event at their launches.
#[derive(Default)]
pub(crate) struct EventSlot {
    latest: Mutex<Option<Latest>>,
}

impl EventSlot {
    pub(crate) fn set_latest(&self, r: Arc<RecordState>) {
        *self.latest.lock() = Some(Latest::Record(r));
    }

    pub(crate) fn set_captured(&self, capture: Arc<Capture>, task: usize) {
        *self.latest.lock() = Some(Latest::Captured { capture, task });
    }

    /// The latest record, captured or not.
    pub(crate) fn entry(&self) -> Option<Latest> {
        self.latest.lock().clone()
    }

    /// The latest record if it is one that runs (`None` for a captured one).
    pub(crate) fn latest(&self) -> Option<Arc<RecordState>> {
        match &*self.latest.lock() {
            Some(Latest::Record(r)) => Some(Arc::clone(r)),
            _ => None,
        }
    }
}

/// An event of the software NPU. Implements [`EventHal`].
///
/// The event holds its latest record only: recording again replaces it. A record task that
/// was skipped because its stream had failed still completes (so waiters never hang); its
/// [`synchronize`](EventHal::synchronize) and [`elapsed_ms`](EventHal::elapsed_ms) then report
/// the stream's error. An event whose latest record was captured into a graph cannot be
/// synchronised, queried or timed (the capture, while active, is invalidated by the attempt);
/// each launch of the graph records it again.
#[derive(Default)]
pub struct SimEvent {
    slot: Arc<EventSlot>,
}

impl std::fmt::Debug for SimEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimEvent").field("latest_record", &self.latest_record()).finish()
    }
}

impl SimEvent {
    /// A new, never-recorded event.
    pub fn new() -> Self {
        Self::default()
    }

    /// The latest record: `(stream id, position)`, if recorded (`None` also when the latest
    /// record was captured into a graph).
    pub fn latest_record(&self) -> Option<(u64, u64)> {
        self.slot.latest().map(|r| (r.stream.id(), r.position))
    }

    pub(crate) fn slot(&self) -> &Arc<EventSlot> {
        &self.slot
    }

    pub(crate) fn set_latest(&self, r: Arc<RecordState>) {
        self.slot.set_latest(r);
    }

    pub(crate) fn latest(&self) -> Option<Arc<RecordState>> {
        self.slot.latest()
    }

    /// [`CaptureErrorKind::EventCaptured`](soma_core::hal::CaptureErrorKind::EventCaptured)
    /// when the latest record was captured (invalidating its capture while it is active).
    fn refuse_captured(&self, what: &str) -> DriverResult<()> {
        match self.slot.entry() {
            Some(Latest::Captured { capture, .. }) => Err(capture.event_captured(what)),
            _ => Ok(()),
        }
    }
}

pub(crate) fn downcast_event(e: &dyn EventHal) -> DriverResult<&SimEvent> {
    e.as_any().downcast_ref::<SimEvent>().ok_or_else(|| {
        DriverError::InvalidHandle("event does not belong to the software NPU".into())
    })
}

fn not_recorded(which: &str) -> DriverError {
    DriverError::InvalidValue(format!("{which} event has no completed record"))
}

impl EventHal for SimEvent {
    fn query(&self) -> DriverResult<bool> {
        self.refuse_captured("query")?;
        match self.latest() {
            None => Ok(true),
            Some(r) if r.is_complete() => {
                r.observed();
                // A record after a failed task completes with the failure: report it, as
                // `synchronize` does.
                match r.stamp() {
                    Some((_, Some(e))) => Err(e),
                    _ => Ok(true),
                }
            }
            Some(_) => Ok(false),
        }
    }

    fn synchronize(&self) -> DriverResult<()> {
        self.refuse_captured("synchronize")?;
        let Some(r) = self.latest() else { return Ok(()) };
        r.stream.wait_for(r.position);
        r.observed();
        match r.stamp() {
            Some((_, Some(e))) => Err(e),
            _ => Ok(()),
        }
    }

    fn elapsed_ms(&self, end: &dyn EventHal) -> DriverResult<f32> {
        let end = downcast_event(end)?;
        self.refuse_captured("elapsed time")?;
        end.refuse_captured("elapsed time")?;
        let a = self.latest().and_then(|r| r.stamp()).ok_or_else(|| not_recorded("start"))?;
        let b = end.latest().and_then(|r| r.stamp()).ok_or_else(|| not_recorded("end"))?;
        if let Some(e) = a.1.or(b.1) {
            return Err(e);
        }
        let ms = if b.0 >= a.0 {
            (b.0 - a.0).as_secs_f64() * 1e3
        } else {
            -((a.0 - b.0).as_secs_f64() * 1e3)
        };
        Ok(ms as f32)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
