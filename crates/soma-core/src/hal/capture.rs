//! Graph capture: what a backend implements for CANN's model runtime instances
//! (`aclmdlRICaptureBegin` … `aclmdlRICaptureEnd`, `aclmdlRIExecuteAsync`, `aclmdlRIDestroy`).
//!
//! Between [`StreamHal::begin_capture`] and [`StreamHal::end_capture`] the tasks enqueued on
//! the stream do not run: they are recorded into a capture, and [`end_capture`] turns the
//! capture into a [`GraphHal`] whose [`launch`](GraphHal::launch) runs them again, in capture
//! order, as often as it is launched.
//!
//! # Positions
//!
//! A task recorded into a capture is not a task of its stream: it takes **no position**,
//! [`StreamHal::enqueued`] does not move, and it never completes. A graph launch is **one
//! task** of the launch stream, at the position the launch returns: it completes when every
//! task of the graph has run (or been skipped after an error). So "`completed() >= p`" keeps
//! its meaning for pools, and a launch is stream-ordered like any other task.
//!
//! # Streams joining a capture
//!
//! A stream that waits on an event whose latest record was captured joins that capture
//! (CANN: more streams enter capture through event dependencies): its later tasks are
//! captured too. Every stream that joined must rejoin the origin stream through events —
//! the origin ends up waiting, directly or through other streams, for everything captured —
//! before [`end_capture`], which otherwise fails with [`CaptureErrorKind::Unjoined`]. Only
//! the origin stream can end the capture; ending it takes every joined stream out of capture.
//!
//! # Forbidden calls
//!
//! While a capture is active, synchronising or querying a capturing stream, an event whose
//! latest record was captured, or the device is an error in every mode, and invalidates the
//! capture(s) concerned. The synchronous copies and memsets ([`DeviceHal::copy_sync`],
//! [`DeviceHal::memset_sync`]) are the unsafe calls the capture modes govern
//! ([`CaptureMode`]); a forbidden one fails and invalidates the captures that forbid it. An
//! invalidated capture refuses further tasks, and [`end_capture`] reports
//! [`CaptureErrorKind::Invalidated`] and takes its streams out of capture. (Unlike other
//! failed calls, a forbidden call does change something: the capture's status.)
//!
//! # Replayable work
//!
//! Kernels and host functions given as `FnOnce` closures ([`StreamHal::launch`],
//! [`StreamHal::host_fn`]) cannot run twice; a capturing stream refuses them with
//! [`CaptureErrorKind::NotCapturable`] and accepts their [`ReplayableKernel`] /
//! [`ReplayableHostFn`] forms ([`StreamHal::launch_replayable`],
//! [`StreamHal::host_fn_replayable`]), which run at every launch.
//!
//! [`end_capture`]: StreamHal::end_capture
//! [`StreamHal::begin_capture`]: super::StreamHal::begin_capture
//! [`StreamHal::end_capture`]: super::StreamHal::end_capture
//! [`StreamHal::enqueued`]: super::StreamHal::enqueued
//! [`StreamHal::launch`]: super::StreamHal::launch
//! [`StreamHal::host_fn`]: super::StreamHal::host_fn
//! [`StreamHal::launch_replayable`]: super::StreamHal::launch_replayable
//! [`StreamHal::host_fn_replayable`]: super::StreamHal::host_fn_replayable
//! [`DeviceHal::copy_sync`]: super::DeviceHal::copy_sync
//! [`DeviceHal::memset_sync`]: super::DeviceHal::memset_sync

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use super::{BufferAccess, DriverResult, KernelBuffers, KernelError, KernelLaunch, StreamHal};

/// Which threads may make the unsafe calls (synchronous copies and memsets) while a capture
/// is active (`aclmdlRICaptureMode`; the discriminants are CANN's values).
///
/// A capture is begun in a mode; every thread also has a mode of its own, [`Global`] until
/// it exchanges it (`aclmdlRICaptureThreadExchangeMode`). An unsafe call from a thread whose
/// own mode is
///
/// * [`Relaxed`]: is allowed;
/// * [`ThreadLocal`]: is forbidden while that thread has a capture begun in a mode other than
///   [`Relaxed`];
/// * [`Global`]: is forbidden as for [`ThreadLocal`], and also while another thread has a
///   capture begun in [`Global`] mode on the device.
///
/// [`Global`]: CaptureMode::Global
/// [`ThreadLocal`]: CaptureMode::ThreadLocal
/// [`Relaxed`]: CaptureMode::Relaxed
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CaptureMode {
    /// `ACL_MODEL_RI_CAPTURE_MODE_GLOBAL` (0): no thread may make unsafe calls.
    #[default]
    Global = 0,
    /// `ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL` (1): the capturing thread may not.
    ThreadLocal = 1,
    /// `ACL_MODEL_RI_CAPTURE_MODE_RELAXED` (2): every thread may.
    Relaxed = 2,
}

impl CaptureMode {
    /// The mode of a C `aclmdlRICaptureMode` value, `None` for values CANN does not define.
    pub const fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            0 => Some(Self::Global),
            1 => Some(Self::ThreadLocal),
            2 => Some(Self::Relaxed),
            _ => None,
        }
    }

    /// The C value.
    pub const fn raw(self) -> u32 {
        self as u32
    }
}

impl fmt::Display for CaptureMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Global => "global",
            Self::ThreadLocal => "thread-local",
            Self::Relaxed => "relaxed",
        })
    }
}

/// Whether a stream is capturing (`aclmdlRICaptureStatus`; the discriminants are CANN's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CaptureStatus {
    /// `ACL_MODEL_RI_CAPTURE_STATUS_NONE` (0): not capturing; tasks run.
    #[default]
    None = 0,
    /// `ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE` (1): tasks are recorded into a capture.
    Active = 1,
    /// `ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED` (2): the capture was invalidated by a
    /// forbidden call; it refuses tasks until it is ended.
    Invalidated = 2,
}

/// A stream's capture state (`aclmdlRICaptureGetInfo`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CaptureInfo {
    /// Capturing or not.
    pub status: CaptureStatus,
    /// The backend's id of the capture the stream belongs to (unique, never reused), when
    /// `status` is not [`CaptureStatus::None`]. The graph the capture ends in has the same id.
    pub capture: Option<u64>,
}

impl CaptureInfo {
    /// A stream outside any capture.
    pub const NONE: CaptureInfo = CaptureInfo { status: CaptureStatus::None, capture: None };
}

/// Which capture rule a [`DriverError::Capture`](super::DriverError::Capture) is about; each
/// kind names the CANN status it corresponds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CaptureErrorKind {
    /// The stream is capturing (`ACL_ERROR_RT_STREAM_CAPTURED`): `begin_capture` on a
    /// capturing stream; synchronising or querying a capturing stream, or the device while a
    /// capture is active (those also invalidate the capture).
    StreamCaptured,
    /// The event's latest record was captured (`ACL_ERROR_RT_EVENT_CAPTURED`): synchronising,
    /// querying or timing it (invalidating the capture while it is active).
    EventCaptured,
    /// Not allowed while capturing (`ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT`): an unsafe call
    /// the capture modes forbid (the captures concerned are invalidated), or work that cannot
    /// be recorded into a graph (`FnOnce` kernels and host functions, graph launches, a pool
    /// free of memory that is not the capture's graph memory, pool allocations of a native
    /// pool or in a capture begun on a backend stream; nothing is invalidated).
    NotCapturable,
    /// The stream is not capturing (`ACL_ERROR_RT_STREAM_NOT_CAPTURED`).
    NotCapturing,
    /// The capture was not begun on this stream or thread (`ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED`):
    /// `end_capture` on a stream that joined it, or from another thread than the one that
    /// began a capture in a mode other than relaxed.
    Unmatched,
    /// Streams that joined the capture have captured work the origin stream does not wait
    /// for (`ACL_ERROR_RT_STREAM_UNJOINED`); the capture is ended without a graph.
    Unjoined,
    /// A dependency the capture cannot express (`ACL_ERROR_RT_CAPTURE_DEPENDENCY`): a wait on
    /// a record captured into another capture, or into one that has ended.
    Dependency,
    /// The capture was invalidated by an earlier forbidden call
    /// (`ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED`).
    Invalidated,
}

/// The body of a kernel that may run any number of times: a captured kernel runs at every
/// launch of its graph.
pub type ReplayableKernelBody =
    Arc<dyn Fn(&dyn KernelBuffers) -> Result<(), KernelError> + Send + Sync>;

/// A host function that may run any number of times (see [`ReplayableKernelBody`]).
pub type ReplayableHostFn = Arc<dyn Fn() + Send + Sync>;

/// A kernel launch whose body may run many times: what a capturing stream accepts.
#[derive(Clone)]
pub struct ReplayableKernel {
    /// Name used in error and sanitizer reports.
    pub name: &'static str,
    /// Every device range the kernel reads or writes (the same at every run).
    pub buffers: Vec<BufferAccess>,
    /// The work.
    pub body: ReplayableKernelBody,
}

impl ReplayableKernel {
    /// The launch that runs the body once (what a stream that is not capturing enqueues).
    pub fn once(&self) -> KernelLaunch {
        let body = Arc::clone(&self.body);
        KernelLaunch {
            name: self.name,
            buffers: self.buffers.clone(),
            body: Box::new(move |b| body(b)),
        }
    }
}

impl fmt::Debug for ReplayableKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayableKernel")
            .field("name", &self.name)
            .field("buffers", &self.buffers)
            .finish()
    }
}

/// A captured graph (CANN's model runtime instance, `aclmdlRI`).
///
/// Dropping it is `aclmdlRIDestroy`: it first waits until every launch made so far has
/// completed (or been skipped), so the graph's host memory and closures outlive their last
/// use. It must therefore not be dropped from a host function of a stream it was launched on.
pub trait GraphHal: Send + Sync + 'static {
    /// The backend's id of the capture this graph came from ([`CaptureInfo::capture`]).
    fn id(&self) -> u64;

    /// Number of tasks captured (every kernel, copy, memset, host function, event record and
    /// event wait recorded on any stream of the capture).
    fn task_count(&self) -> usize;

    /// Enqueues one run of the graph on `stream` (`aclmdlRIExecuteAsync`): a single task at
    /// the returned position, ordered after the stream's earlier work (and so after the
    /// previous launches on it); its tasks run in capture order, each with the arguments it
    /// was captured with. Event records of the graph are recorded again at each launch (a
    /// wait on the event afterwards waits for that launch); event waits on records made
    /// outside the capture wait on the event's latest record at launch time.
    ///
    /// # Errors
    /// A stream of another device or backend, a capturing stream
    /// ([`CaptureErrorKind::NotCapturable`]), a wait on an event whose latest record was
    /// captured ([`CaptureErrorKind::Dependency`]), backend failures.
    fn launch(&self, stream: &dyn StreamHal) -> DriverResult<u64>;

    /// The object as [`Any`].
    fn as_any(&self) -> &dyn Any;
}

impl fmt::Debug for dyn GraphHal + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphHal")
            .field("id", &self.id())
            .field("tasks", &self.task_count())
            .finish()
    }
}
