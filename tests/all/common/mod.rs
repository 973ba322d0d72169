//! Helpers shared by the integration tests.

mod rng;

pub use rng::TestRng;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use soma::{Device, Stream};

/// A software NPU with one device and no latency (the test default).
pub fn npu() -> soma::sim::Npu {
    soma::sim::Npu::builder().build().expect("software NPU")
}

/// A software NPU whose device has `capacity` bytes.
pub fn npu_with_capacity(capacity: u64) -> soma::sim::Npu {
    soma::sim::Npu::builder().capacity(capacity).build().expect("software NPU")
}

/// Holds a stream's worker inside a host function until opened (or dropped), so that work
/// enqueued after it — including frees — is deterministically not complete.
pub struct Gate {
    tx: Option<mpsc::Sender<()>>,
    passed: Arc<AtomicBool>,
}

impl Gate {
    /// Closes a gate on `stream`: its worker waits in a host function until the gate is
    /// opened or dropped (or 30 s have passed, so that a broken test fails instead of hanging).
    pub fn close(stream: &Stream<'_>) -> Gate {
        let (tx, rx) = mpsc::channel::<()>();
        let passed = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&passed);
        stream
            .host_fn(move || {
                let _ = rx.recv_timeout(Duration::from_secs(30));
                flag.store(true, Ordering::SeqCst);
            })
            .expect("enqueue gate");
        Gate { tx: Some(tx), passed }
    }

    /// Opens the gate: the stream's worker goes on.
    pub fn open(mut self) {
        self.tx.take();
    }

    /// Whether the stream got past the gate (it was opened, or it timed out): a call that
    /// returned while this is false did not wait for the gated stream.
    pub fn passed(&self) -> bool {
        self.passed.load(Ordering::SeqCst)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(());
        }
    }
}

/// Spins (with sleeps) until the stream's backend has completed everything enqueued so far,
/// without telling the pool (no host-observed synchronisation).
pub fn wait_device_only(stream: &Stream<'_>) {
    let target = stream.hal().enqueued();
    let deadline = Instant::now() + Duration::from_secs(30);
    while stream.hal().completed() < target {
        assert!(Instant::now() < deadline, "stream did not complete");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Device 0 of `npu`.
pub fn device_of(npu: &soma::sim::Npu) -> Device {
    npu.device(0).expect("device 0")
}
