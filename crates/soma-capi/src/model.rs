//! Model runtime instances built by stream capture ("ACL graph"): `aclmdlRICapture*`,
//! `aclmdlRIExecuteAsync`, `aclmdlRIExecute`, `aclmdlRIDestroy`.
//!
//! A capture gets its `aclmdlRI` handle when it begins (so that `aclmdlRICaptureGetInfo` can
//! return it, as CANN does); `aclmdlRICaptureEnd` returns the same handle, now holding the
//! graph, or removes it when the capture ends without one.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ascend_sys::{
    aclError, aclmdlRI, aclmdlRICaptureMode, aclmdlRICaptureStatus, aclrtStream, AclError,
};
use parking_lot::Mutex;
use soma_core::{CaptureMode, CaptureStatus, Graph, Stream};

use crate::error::{guard, AclErr, AclResult};
use crate::runtime::{out_ptr, rt, write_out, Runtime, StreamObj};

/// What a model handle holds.
pub(crate) enum ModelState {
    /// The capture `capture`, begun on `origin`, has not ended.
    Capturing {
        /// The backend's capture id.
        capture: u64,
        /// The stream it was begun on (a destroyed stream ends its capture).
        origin: Weak<StreamObj>,
    },
    /// The captured graph.
    Ready(Arc<Graph<'static>>),
}

/// A model runtime instance created by `aclmdlRICaptureBegin`.
pub(crate) struct ModelObj {
    pub(crate) dev: u32,
    pub(crate) state: Mutex<ModelState>,
    /// The stream `aclmdlRIExecute` runs the model on, created at its first use.
    exec: Mutex<Option<Stream<'static>>>,
}

impl ModelObj {
    /// The graph, or `ACL_ERROR_RT_MODEL_CAPTURED` while the capture has not ended.
    fn graph(&self) -> AclResult<Arc<Graph<'static>>> {
        match &*self.state.lock() {
            ModelState::Ready(g) => Ok(Arc::clone(g)),
            ModelState::Capturing { capture, .. } => Err(AclErr::new(
                AclError::ERROR_RT_MODEL_CAPTURED,
                format!("the model is still capturing (capture {capture}); end the capture first"),
            )),
        }
    }

    /// Whether the model's capture is still going on.
    fn capturing(&self) -> bool {
        match &*self.state.lock() {
            ModelState::Ready(_) => false,
            ModelState::Capturing { capture, origin } => origin.upgrade().is_some_and(|s| {
                s.stream.capture_info().is_ok_and(|i| i.capture == Some(*capture))
            }),
        }
    }
}

/// The model handle of capture `capture`, null when none.
fn model_of(rt: &Runtime, capture: Option<u64>) -> aclmdlRI {
    capture
        .and_then(|c| rt.capture_models.lock().get(&c).copied())
        .map_or(std::ptr::null_mut(), |h| h as aclmdlRI)
}

/// Starts capturing the tasks of `stream` (not the default stream) into a new model runtime
/// instance; `mode` restricts the unsafe calls while the capture is active.
#[no_mangle]
pub extern "C" fn aclmdlRICaptureBegin(stream: aclrtStream, mode: aclmdlRICaptureMode) -> aclError {
    guard("aclmdlRICaptureBegin", || {
        if stream.is_null() {
            return Err(AclErr::param("a capture cannot begin on the default stream (null)"));
        }
        let mode = CaptureMode::from_raw(mode.0).ok_or_else(|| {
            AclErr::param(format!("mode {} is not an aclmdlRICaptureMode", mode.0))
        })?;
        let rt = rt()?;
        let s = rt.streams.get(stream)?;
        s.stream.begin_capture(mode)?;
        let capture = s.stream.capture_info()?.capture.ok_or_else(|| {
            AclErr::new(AclError::ERROR_RT_STREAM_NOT_CAPTURED, "the capture ended at once")
        })?;
        let model = ModelObj {
            dev: s.dev,
            state: Mutex::new(ModelState::Capturing { capture, origin: Arc::downgrade(&s) }),
            exec: Mutex::new(None),
        };
        let h = rt.models.insert(model);
        rt.capture_models.lock().insert(capture, h as usize);
        Ok(())
    })
}

/// The capture status of `stream` and the model runtime instance it captures into (null when
/// it is not capturing).
///
/// # Safety
/// `status` and `modelRI` are null or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureGetInfo(
    stream: aclrtStream,
    status: *mut aclmdlRICaptureStatus,
    modelRI: *mut aclmdlRI,
) -> aclError {
    guard("aclmdlRICaptureGetInfo", || {
        let status_out = out_ptr(status, "status")?;
        let model_out = out_ptr(modelRI, "modelRI")?;
        let rt = rt()?;
        let info = rt.stream(stream)?.stream.capture_info()?;
        let st = aclmdlRICaptureStatus(match info.status {
            CaptureStatus::None => 0,
            CaptureStatus::Active => 1,
            CaptureStatus::Invalidated => 2,
        });
        // SAFETY: both checked non-null; the caller guarantees they are writable.
        unsafe {
            write_out(status_out, st);
            write_out(model_out, model_of(rt, info.capture));
        }
        Ok(())
    })
}

/// Ends the capture begun on `stream` and returns its model runtime instance. A capture that
/// ends without a graph (invalidated, or streams that joined it did not rejoin) loses its
/// handle.
///
/// # Safety
/// `modelRI` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureEnd(
    stream: aclrtStream,
    modelRI: *mut aclmdlRI,
) -> aclError {
    guard("aclmdlRICaptureEnd", || {
        let out = out_ptr(modelRI, "modelRI")?;
        let rt = rt()?;
        let s = rt.stream(stream)?;
        let capture = s.stream.capture_info()?.capture;
        let result = s.stream.end_capture();
        let ended = s.stream.capture_info()?.capture != capture;
        let handle = match capture {
            Some(c) if ended => rt.capture_models.lock().remove(&c),
            _ => None,
        };
        match (result, handle) {
            (Ok(graph), Some(h)) => {
                let model = rt.models.get(h as aclmdlRI)?;
                *model.state.lock() = ModelState::Ready(Arc::new(graph));
                // SAFETY: checked non-null; the caller guarantees it is writable.
                unsafe { write_out(out, h as aclmdlRI) };
                Ok(())
            }
            (result, handle) => {
                if let Some(h) = handle {
                    let _ = rt.models.remove(h as aclmdlRI);
                }
                result.map(drop)?;
                Err(AclErr::new(
                    AclError::ERROR_RT_STREAM_NOT_CAPTURED,
                    "the capture has no model runtime instance",
                ))
            }
        }
    })
}

/// Sets the calling thread's capture mode to `*mode` and returns the previous one in `*mode`.
///
/// # Safety
/// `mode` is null or valid for a read and a write.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureThreadExchangeMode(
    mode: *mut aclmdlRICaptureMode,
) -> aclError {
    guard("aclmdlRICaptureThreadExchangeMode", || {
        let p = out_ptr(mode, "mode")?;
        // SAFETY: checked non-null; the caller guarantees it is readable.
        let raw = unsafe { p.read_unaligned() };
        let new = CaptureMode::from_raw(raw.0).ok_or_else(|| {
            AclErr::param(format!("mode {} is not an aclmdlRICaptureMode", raw.0))
        })?;
        let old = rt()?.current().device.exchange_capture_mode(new)?;
        // SAFETY: as above, writable.
        unsafe { write_out(p, aclmdlRICaptureMode(old.raw())) };
        Ok(())
    })
}

/// Runs the model once on `stream` (null: the default stream), ordered after the stream's
/// earlier work.
#[no_mangle]
pub extern "C" fn aclmdlRIExecuteAsync(modelRI: aclmdlRI, stream: aclrtStream) -> aclError {
    guard("aclmdlRIExecuteAsync", || {
        let rt = rt()?;
        let model = rt.models.get(modelRI)?;
        let s = rt.stream(stream)?;
        Ok(model.graph()?.launch(&s.stream)?)
    })
}

/// Runs the model once and waits for it: `timeout` -1 waits as long as it takes, a positive
/// value at most that many milliseconds (`ACL_ERROR_RT_WAIT_TIMEOUT` after it; the run goes
/// on). The model runs on a stream of its own.
#[no_mangle]
pub extern "C" fn aclmdlRIExecute(modelRI: aclmdlRI, timeout: i32) -> aclError {
    guard("aclmdlRIExecute", || {
        if timeout != -1 && timeout <= 0 {
            return Err(AclErr::param(format!(
                "timeout {timeout}: expected -1 or a positive value"
            )));
        }
        let rt = rt()?;
        let model = rt.models.get(modelRI)?;
        let graph = model.graph()?;
        let mut exec = model.exec.lock();
        let s = match &mut *exec {
            Some(s) => s,
            slot @ None => slot.insert(rt.dev(model.dev).device.create_stream()?),
        };
        graph.launch(s)?;
        if timeout == -1 {
            return Ok(s.synchronize()?);
        }
        let deadline = Instant::now() + Duration::from_millis(timeout.unsigned_abs().into());
        while !s.query()? {
            if Instant::now() >= deadline {
                return Err(AclErr::new(
                    AclError::ERROR_RT_WAIT_TIMEOUT,
                    format!("the model did not complete within {timeout} ms"),
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    })
}

/// Destroys a model runtime instance after its runs have completed. A model whose capture
/// has not ended cannot be destroyed (`ACL_ERROR_RT_MODEL_CAPTURED`).
#[no_mangle]
pub extern "C" fn aclmdlRIDestroy(modelRI: aclmdlRI) -> aclError {
    guard("aclmdlRIDestroy", || {
        let rt = rt()?;
        let model = rt.models.get(modelRI)?;
        if model.capturing() {
            return Err(AclErr::new(
                AclError::ERROR_RT_MODEL_CAPTURED,
                "the model is still capturing; end the capture first (aclmdlRICaptureEnd)",
            ));
        }
        if let ModelState::Capturing { capture, .. } = &*model.state.lock() {
            rt.capture_models.lock().remove(capture);
        }
        drop(model);
        // The graph waits for its launches when the last reference goes.
        drop(rt.models.remove(modelRI)?);
        Ok(())
    })
}
