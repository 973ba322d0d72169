//! Integration tests of the software NPU, as one binary (a module per topic).

mod capture;
mod events;
mod faults;
mod memory;
mod peer;
mod props;
mod races;
mod streams;

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use soma_sim::hal::{
    AccessMode, BufferAccess, DeviceHal, DevicePtr, DriverError, KernelLaunch, MemRef,
};
use soma_sim::{Npu, SimDevice};

/// One MiB.
pub const MIB: u64 = 1 << 20;

/// One device with `capacity` bytes.
pub fn device(capacity: u64) -> Arc<SimDevice> {
    Npu::builder().capacity(capacity).build().unwrap().device(0).unwrap()
}

/// A kernel that fills `len` bytes at `ptr` with `value`.
pub fn fill_kernel(ptr: DevicePtr, len: u64, value: u8) -> KernelLaunch {
    KernelLaunch {
        name: "fill",
        buffers: vec![BufferAccess { ptr, len, mode: AccessMode::Write }],
        body: Box::new(move |b| {
            b.bytes_mut(0)?.fill(value);
            Ok(())
        }),
    }
}

/// Reads `len` device bytes with a synchronous copy.
pub fn read(dev: &SimDevice, ptr: DevicePtr, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    // SAFETY: `v` is valid for `len` bytes of writes during the call.
    unsafe { dev.copy_sync(MemRef::Host(v.as_mut_ptr()), MemRef::Device(ptr), len) }.unwrap();
    v
}

/// A gate: the kernel / host fn blocks on `Receiver::recv` until the test sends.
pub fn gate() -> (Sender<()>, Receiver<()>) {
    crossbeam_channel::bounded(1)
}

/// Waits (bounded) for a signal; panics on timeout so a broken test fails instead of hanging.
pub fn recv(rx: &Receiver<()>) {
    rx.recv_timeout(Duration::from_secs(20)).expect("signal not received in time");
}

/// The task-failed fields of an error.
pub fn task_failed(e: &DriverError) -> (u64, u64, String, String) {
    match e {
        DriverError::TaskFailed { stream, task, name, message } => {
            (*stream, *task, name.clone(), message.clone())
        }
        other => panic!("expected TaskFailed, got {other:?}"),
    }
}
