//! [`SimGraph`]: a captured graph of the software NPU, and how a launch runs it.
//!
//! A launch is one task of its stream. It takes the stream's position and one sanitizer
//! stamp, records the graph's events at that position, and resolves the graph's waits on
//! records made outside the capture against the events' latest records at launch time. When
//! it runs, each captured task runs in capture order as the task it was (same kernel body,
//! same addresses, same checks: mapping, data races, the stream-order sanitizer at the
//! launch's position), except that the latency model's launch cost is paid once per launch
//! rather than per task.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use parking_lot::Mutex;
use soma_core::hal::{CaptureErrorKind, DriverError, DriverResult, GraphHal, StreamHal};

use crate::capture::{self, CapEnd, Op};
use crate::device::DeviceCore;
use crate::event::{Latest, RecordState};
use crate::memory::{End, HostSpan};
use crate::model_delay;
use crate::sanitizer::{Sanitizer, Stamp};
use crate::stream::{execute_task, panic_message, task_failed, SimStream, StreamShared, TaskKind};

/// What a graph holds: its captured tasks, minus the waits its capture order already covers.
pub(crate) struct GraphBody {
    id: u64,
    captured: usize,
    ops: Vec<Op>,
    /// Whether a task touches device memory (the sanitizer tracks the launch then).
    pub(crate) accesses_device: bool,
}

/// What one launch resolved when it was enqueued, per task of the body.
enum Resolved {
    Nothing,
    Record(Arc<RecordState>),
    Wait(Arc<RecordState>),
}

/// One launch of a graph: the task a stream runs.
pub(crate) struct GraphLaunch {
    body: Arc<GraphBody>,
    resolved: Vec<Resolved>,
}

impl GraphLaunch {
    pub(crate) fn accesses_device(&self) -> bool {
        self.body.accesses_device
    }

    /// Completes the launch's records from task `from` on (with the stream's error when the
    /// launch is skipped or failed).
    pub(crate) fn complete_records(&self, from: usize, error: Option<DriverError>) {
        for r in &self.resolved[from.min(self.resolved.len())..] {
            if let Resolved::Record(r) = r {
                r.complete(error.clone());
            }
        }
    }
}

/// A captured graph of the software NPU. Implements [`GraphHal`].
///
/// Dropping it waits until every launch made so far has completed.
pub struct SimGraph {
    body: Arc<GraphBody>,
    core: Arc<DeviceCore>,
    /// The latest launch on each stream: what the drop waits for.
    launches: Mutex<Vec<(Arc<StreamShared>, u64)>>,
}

impl std::fmt::Debug for SimGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimGraph")
            .field("id", &self.body.id)
            .field("tasks", &self.body.captured)
            .finish()
    }
}

impl SimGraph {
    pub(crate) fn new(ended: capture::Ended, core: Arc<DeviceCore>) -> Self {
        let captured = ended.ops.len();
        let ops: Vec<Op> =
            ended.ops.into_iter().filter(|op| !matches!(op, Op::InternalWait)).collect();
        let accesses_device = ops.iter().any(|op| match op {
            Op::Kernel(k) => k.buffers.iter().any(|b| b.len > 0),
            Op::Copy { dst, src, .. } => {
                matches!(dst, CapEnd::Device(_)) || matches!(src, CapEnd::Device(_))
            }
            Op::Memset { .. } => true,
            _ => false,
        });
        let body = Arc::new(GraphBody { id: ended.id, captured, ops, accesses_device });
        SimGraph { body, core, launches: Mutex::new(Vec::new()) }
    }

    /// The records a launch waits on, per task: the events' latest records now.
    fn resolve_waits(&self) -> DriverResult<Vec<Option<Arc<RecordState>>>> {
        self.body
            .ops
            .iter()
            .map(|op| match op {
                Op::ExternalWait(slot) => match slot.entry() {
                    Some(Latest::Captured { capture, .. }) => Err(capture::error(
                        CaptureErrorKind::Dependency,
                        format!(
                            "graph {} waits on an event whose latest record was captured (capture \
                             {}); record the event again before launching the graph",
                            self.body.id, capture.id
                        ),
                    )),
                    Some(Latest::Record(r)) => Ok(Some(r)),
                    None => Ok(None),
                },
                _ => Ok(None),
            })
            .collect()
    }
}

/// Builds a launch at `pos` of `stream`: records the graph's events there.
pub(crate) fn new_launch(
    body: &Arc<GraphBody>,
    stream: &Arc<StreamShared>,
    pos: u64,
    stamp: Option<&Stamp>,
    waits: Vec<Option<Arc<RecordState>>>,
) -> GraphLaunch {
    let resolved = body
        .ops
        .iter()
        .zip(waits)
        .map(|(op, wait)| match (op, wait) {
            (Op::Record(slot), _) => {
                let clock = stamp.map(|st| Sanitizer::record_clock(&st.clock, stream.id(), pos));
                let r = Arc::new(RecordState::new(Arc::clone(stream), pos, clock));
                slot.set_latest(Arc::clone(&r));
                Resolved::Record(r)
            }
            (_, Some(r)) if !r.is_complete() => Resolved::Wait(r),
            _ => Resolved::Nothing,
        })
        .collect();
    GraphLaunch { body: Arc::clone(body), resolved }
}

impl GraphHal for SimGraph {
    fn id(&self) -> u64 {
        self.body.id
    }

    fn task_count(&self) -> usize {
        self.body.captured
    }

    fn launch(&self, stream: &dyn StreamHal) -> DriverResult<u64> {
        let s = stream.as_any().downcast_ref::<SimStream>().ok_or_else(|| {
            DriverError::InvalidHandle("the stream does not belong to the software NPU".into())
        })?;
        if !Arc::ptr_eq(s.core(), &self.core) {
            return Err(DriverError::InvalidHandle(format!(
                "graph {} belongs to another device than stream {}",
                self.body.id,
                s.id()
            )));
        }
        if let Some(cap) = s.shared().capture.current() {
            return Err(capture::error(
                CaptureErrorKind::NotCapturable,
                format!(
                    "launching graph {} on stream {}, which is capturing (capture {}), cannot be \
                     recorded into a graph",
                    self.body.id,
                    s.id(),
                    cap.id
                ),
            ));
        }
        let waits = self.resolve_waits()?;
        let pos = s.enqueue_graph(&self.body, waits)?;
        let mut launches = self.launches.lock();
        match launches.iter_mut().find(|(l, _)| Arc::ptr_eq(l, s.shared())) {
            Some(l) => l.1 = l.1.max(pos),
            None => launches.push((Arc::clone(s.shared()), pos)),
        }
        Ok(pos)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for SimGraph {
    fn drop(&mut self) {
        // `aclmdlRIDestroy` after the launches: host memory of captured copies is the
        // caller's until then.
        for (stream, pos) in self.launches.get_mut().drain(..) {
            stream.wait_for(pos);
        }
    }
}

/// Runs launch `launch` (task `pos` of `s`): the graph's tasks in capture order.
pub(crate) fn run(
    core: &DeviceCore,
    s: &StreamShared,
    pos: u64,
    launch: GraphLaunch,
    stamp: Option<&Stamp>,
) -> Result<(), String> {
    model_delay(core.latency().launch);
    let body = Arc::clone(&launch.body);
    for (i, op) in body.ops.iter().enumerate() {
        let Some(kind) = task_of(op, &launch.resolved[i]) else { continue };
        let name = kind.name();
        let result =
            catch_unwind(AssertUnwindSafe(|| execute_task(core, s, pos, kind, stamp, false)))
                .unwrap_or_else(|p| Err(format!("panicked: {}", panic_message(p.as_ref()))));
        if let Err(message) = result {
            let message = format!("{name} (task {i} of graph {}): {message}", body.id);
            launch.complete_records(i + 1, Some(task_failed(s, pos, "graph_launch", &message)));
            return Err(message);
        }
    }
    Ok(())
}

/// The task that runs `op` in a launch (`None`: nothing to do).
fn task_of(op: &Op, resolved: &Resolved) -> Option<TaskKind> {
    Some(match op {
        Op::Kernel(k) => TaskKind::Kernel(k.once()),
        Op::Host(f) => {
            let f = Arc::clone(f);
            TaskKind::Host(Box::new(move || f()))
        }
        Op::Copy { dst, src, len, name } => {
            TaskKind::Copy { dst: end(*dst), src: end(*src), len: *len, name }
        }
        Op::Memset { dst, value, len } => TaskKind::Memset { dst: *dst, value: *value, len: *len },
        Op::Record(_) => match resolved {
            Resolved::Record(r) => TaskKind::Record(Arc::clone(r)),
            _ => return None,
        },
        Op::ExternalWait(_) => match resolved {
            Resolved::Wait(r) => TaskKind::Wait(Arc::clone(r)),
            _ => return None,
        },
        Op::InternalWait => return None,
    })
}

fn end(e: CapEnd) -> End {
    match e {
        CapEnd::Device(a) => End::Device(a),
        // SAFETY: the caller of `copy_async` on the capturing stream guaranteed that the host
        // memory stays valid, and is not otherwise accessed while a launch runs, until the
        // graph is dropped; the graph's drop waits for this launch.
        CapEnd::Host { ptr, len } => End::Host(unsafe { HostSpan::new(ptr, len) }),
    }
}
