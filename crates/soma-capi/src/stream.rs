//! Streams, events and host functions.

use std::ffi::c_void;

use ascend_sys::{
    aclError, aclrtEvent, aclrtEventRecordedStatus, aclrtHostFunc, aclrtStream, aclrtStreamStatus,
};

use crate::error::{guard, AclErr};
use crate::runtime::{out_ptr, rt, write_out, EventObj, Runtime, StreamObj};

/// Creates a stream on the calling thread's current device.
///
/// # Safety
/// `stream` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError {
    guard("aclrtCreateStream", || {
        let out = out_ptr(stream, "stream")?;
        let rt = rt()?;
        let dev = rt.current();
        let s = dev.device.create_stream()?;
        let h = rt.streams.insert(StreamObj { dev: dev.index, stream: s });
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Destroys a stream after its work has completed (the destroy drains the stream). The
/// default stream (null) cannot be destroyed.
#[no_mangle]
pub extern "C" fn aclrtDestroyStream(stream: aclrtStream) -> aclError {
    guard("aclrtDestroyStream", || {
        let s = rt()?.streams.remove(stream)?;
        // Drain now, so that the stream's work is complete when this returns even if another
        // thread still holds the object for a moment; its drop drains again (a no-op).
        let _ = s.stream.hal().synchronize();
        drop(s);
        Ok(())
    })
}

/// Blocks until the stream's work has completed, then applies the release threshold of the
/// device's pools.
#[no_mangle]
pub extern "C" fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError {
    guard("aclrtSynchronizeStream", || Ok(rt()?.stream(stream)?.stream.synchronize()?))
}

/// `ACL_STREAM_STATUS_COMPLETE` when everything enqueued so far has completed, else
/// `ACL_STREAM_STATUS_NOT_READY`; never blocks.
///
/// # Safety
/// `status` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtStreamQuery(
    stream: aclrtStream,
    status: *mut aclrtStreamStatus,
) -> aclError {
    guard("aclrtStreamQuery", || {
        let out = out_ptr(status, "status")?;
        let done = rt()?.stream(stream)?.stream.query()?;
        let st = if done {
            aclrtStreamStatus::ACL_STREAM_STATUS_COMPLETE
        } else {
            aclrtStreamStatus::ACL_STREAM_STATUS_NOT_READY
        };
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, st) };
        Ok(())
    })
}

/// Creates an event on the calling thread's current device.
///
/// # Safety
/// `event` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(event: *mut aclrtEvent) -> aclError {
    guard("aclrtCreateEvent", || {
        let out = out_ptr(event, "event")?;
        let rt = rt()?;
        let dev = rt.current();
        let e = dev.device.create_event()?;
        let h = rt.events.insert(EventObj { dev: dev.index, event: e });
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Destroys an event.
#[no_mangle]
pub extern "C" fn aclrtDestroyEvent(event: aclrtEvent) -> aclError {
    guard("aclrtDestroyEvent", || {
        rt()?.events.remove(event)?;
        Ok(())
    })
}

/// Records `event` at the current end of `stream` (null: the default stream); a previous
/// record is replaced.
#[no_mangle]
pub extern "C" fn aclrtRecordEvent(event: aclrtEvent, stream: aclrtStream) -> aclError {
    guard("aclrtRecordEvent", || {
        let rt = rt()?;
        let e = rt.events.get(event)?;
        let s = rt.stream(stream)?;
        check_same_device(&s, &e)?;
        Ok(s.stream.record(&e.event)?)
    })
}

/// Makes `stream`'s later work wait for `event`'s latest record. Pools learn the ordering
/// (reuse rule "follow event dependencies").
#[no_mangle]
pub extern "C" fn aclrtStreamWaitEvent(stream: aclrtStream, event: aclrtEvent) -> aclError {
    guard("aclrtStreamWaitEvent", || {
        let rt = rt()?;
        let e = rt.events.get(event)?;
        let s = rt.stream(stream)?;
        check_linked(rt, &s, &e)?;
        Ok(s.stream.wait_event(&e.event)?)
    })
}

/// A stream may wait on an event of its device, or of a device linked to it by peer access
/// (in either direction).
fn check_linked(rt: &'static Runtime, s: &StreamObj, e: &EventObj) -> Result<(), AclErr> {
    let (a, b) = (&rt.dev(s.dev).device, &rt.dev(e.dev).device);
    if a.has_peer_access(b) || b.has_peer_access(a) {
        Ok(())
    } else {
        Err(AclErr::param(format!(
            "the event belongs to device {} and the stream to device {}, without peer access \
             between them",
            e.dev, s.dev
        )))
    }
}

fn check_same_device(s: &StreamObj, e: &EventObj) -> Result<(), AclErr> {
    if s.dev == e.dev {
        Ok(())
    } else {
        Err(AclErr::param(format!(
            "the event belongs to device {} and the stream to device {}",
            e.dev, s.dev
        )))
    }
}

/// Blocks until `event`'s latest record has completed (immediately if never recorded), then
/// applies the release threshold of the device's pools.
#[no_mangle]
pub extern "C" fn aclrtSynchronizeEvent(event: aclrtEvent) -> aclError {
    guard("aclrtSynchronizeEvent", || Ok(rt()?.events.get(event)?.event.synchronize()?))
}

/// `ACL_EVENT_RECORDED_STATUS_COMPLETE` when the latest record has completed (or the event
/// was never recorded), else `ACL_EVENT_RECORDED_STATUS_NOT_READY`.
///
/// # Safety
/// `status` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtQueryEventStatus(
    event: aclrtEvent,
    status: *mut aclrtEventRecordedStatus,
) -> aclError {
    guard("aclrtQueryEventStatus", || {
        let out = out_ptr(status, "status")?;
        let done = rt()?.events.get(event)?.event.query()?;
        let st = if done {
            aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE
        } else {
            aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_NOT_READY
        };
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, st) };
        Ok(())
    })
}

/// Milliseconds between the completions of `startEvent`'s and `endEvent`'s records; both must
/// be recorded and complete.
///
/// # Safety
/// `ms` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclrtEventElapsedTime(
    ms: *mut f32,
    startEvent: aclrtEvent,
    endEvent: aclrtEvent,
) -> aclError {
    guard("aclrtEventElapsedTime", || {
        let out = out_ptr(ms, "ms")?;
        let rt = rt()?;
        let start = rt.events.get(startEvent)?;
        let end = rt.events.get(endEvent)?;
        let v = start.event.elapsed_ms(&end.event)?;
        // SAFETY: checked non-null; the caller guarantees it is writable.
        unsafe { write_out(out, v) };
        Ok(())
    })
}

/// The argument of a host function, sent to the stream's worker.
struct HostArg(*mut c_void);

// SAFETY: the pointer is only handed back to the C callback, as CANN does; what it points to
// is the C caller's business (the documented contract of aclrtLaunchHostFunc).
unsafe impl Send for HostArg {}
// SAFETY: as above: sharing the holder only lets the callback be called with the pointer
// again, at each launch of a model that captured it.
unsafe impl Sync for HostArg {}

impl HostArg {
    fn get(&self) -> *mut c_void {
        self.0
    }
}

/// Enqueues `fn(args)` on `stream`: it runs on the stream's worker thread after the work
/// enqueued before it; captured, it runs at every launch of the model.
///
/// # Safety
/// `fn` is null or a function that may be called with `args` from another thread.
#[no_mangle]
pub unsafe extern "C" fn aclrtLaunchHostFunc(
    stream: aclrtStream,
    r#fn: aclrtHostFunc,
    args: *mut c_void,
) -> aclError {
    guard("aclrtLaunchHostFunc", || {
        let Some(f) = r#fn else { return Err(AclErr::param("fn is null")) };
        let s = rt()?.stream(stream)?;
        let arg = HostArg(args);
        s.stream.host_fn_replayable(move || {
            // SAFETY: the caller of aclrtLaunchHostFunc guarantees `f` may be called with
            // `args` on another thread.
            unsafe { f(arg.get()) }
        })?;
        Ok(())
    })
}
