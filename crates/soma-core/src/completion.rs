//! Awaitable completion: futures for a stream's work and an event's record.
//!
//! The futures need no async runtime: the device wakes them. Each one enqueues a host
//! function on the stream whose completion it waits for; the function wakes the future
//! when it runs, or when the stream skips it after a failed task (the wake lives in the
//! closure's `Drop`, which runs either way). Completion seen through a future counts as a
//! host observation, as `synchronize` does: frees ordered before it become reusable by
//! every stream, and the release threshold of the device's pools applies.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::{Condvar, Mutex};

use crate::clock::VectorClock;
use crate::error::Result;
use crate::event::Event;
use crate::hal::StreamHal;
use crate::stream::Stream;

/// A flag set by the device, with the waker of the task waiting for it (or a blocked
/// thread).
#[derive(Default)]
pub(crate) struct Signal {
    done: AtomicBool,
    waker: Mutex<Option<Waker>>,
    blocked: Condvar,
}

impl Signal {
    /// Whether the device has set the flag; if not, `cx`'s waker will be woken when it does.
    pub(crate) fn poll_done(&self, cx: &mut Context<'_>) -> bool {
        if self.done.load(Ordering::Acquire) {
            return true;
        }
        let mut waker = self.waker.lock();
        match &mut *waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        drop(waker);
        // Set between the first check and storing the waker: nobody will wake us again.
        self.done.load(Ordering::Acquire)
    }

    /// Whether the flag is set, without registering a waker.
    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Blocks the calling thread until the flag is set.
    pub(crate) fn wait(&self) {
        let mut waker = self.waker.lock();
        while !self.done.load(Ordering::Acquire) {
            self.blocked.wait(&mut waker);
        }
    }

    pub(crate) fn set(&self) {
        self.done.store(true, Ordering::Release);
        let mut waker = self.waker.lock();
        let task = waker.take();
        self.blocked.notify_all();
        drop(waker);
        if let Some(w) = task {
            w.wake();
        }
    }
}

/// Sets its signal when dropped: after the host function that owns it ran, or when the
/// stream dropped the function unrun (skipped after a failure, or the stream destroyed).
struct SetOnDrop(Arc<Signal>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set();
    }
}

/// Enqueues on `stream` a host function that sets the returned signal when everything
/// enqueued on it before has completed (or been skipped).
pub(crate) fn signal_after(stream: &dyn StreamHal) -> Result<Arc<Signal>> {
    let signal = Arc::new(Signal::default());
    let guard = SetOnDrop(Arc::clone(&signal));
    stream.host_fn(Box::new(move || drop(guard)))?;
    Ok(signal)
}

/// The future of [`Stream::synchronize_async`].
#[must_use = "futures do nothing unless awaited"]
pub struct StreamSync<'a> {
    stream: &'a Stream<'a>,
    /// The stream's global position at the call, and the signal enqueued after it; or the
    /// error of enqueuing it, reported at the first poll.
    state: Option<Result<(u64, Arc<Signal>)>>,
}

impl<'a> StreamSync<'a> {
    pub(crate) fn new(stream: &'a Stream<'a>) -> Self {
        let position = stream.position();
        let state = signal_after(&**stream.hal()).map(|signal| (position, signal));
        StreamSync { stream, state: Some(state) }
    }
}

impl Future for StreamSync<'_> {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        let (position, signal) = match this.state.take() {
            None => return Poll::Ready(Ok(())),
            Some(Err(e)) => return Poll::Ready(Err(e)),
            Some(Ok(state)) => state,
        };
        if !signal.poll_done(cx) {
            this.state = Some(Ok((position, signal)));
            return Poll::Pending;
        }
        Poll::Ready(this.stream.observe_completed(position))
    }
}

/// The future of [`Event::wait_async`].
#[must_use = "futures do nothing unless awaited"]
pub struct EventWait<'a> {
    event: &'a Event<'a>,
    /// The record waited for (its generation and clock), taken at the call.
    record: Option<(u64, VectorClock)>,
    /// The signal enqueued after the record on its stream, once armed.
    signal: Option<Arc<Signal>>,
    finished: bool,
}

impl<'a> EventWait<'a> {
    pub(crate) fn new(event: &'a Event<'a>, record: Option<(u64, VectorClock)>) -> Self {
        EventWait { event, record, signal: None, finished: false }
    }
}

impl Future for EventWait<'_> {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        if this.finished {
            return Poll::Ready(Ok(()));
        }
        loop {
            if let Some(signal) = &this.signal {
                if !signal.poll_done(cx) {
                    return Poll::Pending;
                }
                this.signal = None;
            }
            match this.event.hal().query() {
                Err(e) => {
                    this.finished = true;
                    return Poll::Ready(Err(e.into()));
                }
                Ok(true) => {
                    this.finished = true;
                    this.event.observe_completed(this.record.take());
                    return Poll::Ready(Ok(()));
                }
                // Not complete yet: wait behind the record on its stream. A stream that is
                // gone has drained, so its record is complete and the query will say so.
                Ok(false) => match this.event.recording_stream() {
                    Some(stream) => match signal_after(&*stream) {
                        Ok(signal) => this.signal = Some(signal),
                        Err(e) => {
                            this.finished = true;
                            return Poll::Ready(Err(e));
                        }
                    },
                    None => std::thread::yield_now(),
                },
            }
        }
    }
}
