//! The atomics of the lock-free parts that loom models (`tests/loom.rs`): std's, or loom's
//! under `--cfg loom`.

#[cfg(loom)]
pub(crate) use loom::sync::atomic;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic;

/// A busy-wait hint (loom: a yield, so that the model makes progress).
#[inline]
pub(crate) fn spin_loop() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Yields the thread.
#[inline]
pub(crate) fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}
