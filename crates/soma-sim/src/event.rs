//! [`SimEvent`]: markers recorded on streams.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use soma_core::hal::{DriverError, DriverResult, EventHal};

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

/// An event of the software NPU. Implements [`EventHal`].
///
/// The event holds its latest record only: recording again replaces it. A record task that
/// was skipped because its stream had failed still completes (so waiters never hang); its
/// [`synchronize`](EventHal::synchronize) and [`elapsed_ms`](EventHal::elapsed_ms) then report
/// the stream's error.
#[derive(Default)]
pub struct SimEvent {
    latest: Mutex<Option<Arc<RecordState>>>,
}

impl std::fmt::Debug for SimEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let l = self.latest.lock();
        let rec = l.as_ref().map(|r| (r.stream.id(), r.position));
        f.debug_struct("SimEvent").field("latest_record", &rec).finish()
    }
}

impl SimEvent {
    /// A new, never-recorded event.
    pub fn new() -> Self {
        Self::default()
    }

    /// The latest record: `(stream id, position)`, if recorded.
    pub fn latest_record(&self) -> Option<(u64, u64)> {
        self.latest.lock().as_ref().map(|r| (r.stream.id(), r.position))
    }

    pub(crate) fn set_latest(&self, r: Arc<RecordState>) {
        *self.latest.lock() = Some(r);
    }

    pub(crate) fn latest(&self) -> Option<Arc<RecordState>> {
        self.latest.lock().clone()
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
