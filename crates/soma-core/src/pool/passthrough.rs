//! Pass-through mode ([`MemPoolBuilder::passthrough`](super::MemPoolBuilder::passthrough)):
//! no caching, for debugging. A free is handed to the engine only once it has completed in
//! stream order (a host function enqueued on the freeing stream reports it), so that nothing,
//! not even the same stream, reuses the block before; the next pool call then frees it and
//! releases every fully free granule.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::engine::{BlockId, FreeTag};
use crate::hal::StreamHal;

#[derive(Default)]
struct State {
    /// Frees enqueued, not yet complete, with their tags.
    in_flight: Vec<(BlockId, FreeTag)>,
    /// Frees complete on their stream, to hand to the engine.
    done: Vec<(BlockId, FreeTag)>,
}

/// The deferred frees of a pass-through pool.
#[derive(Default)]
pub(crate) struct Passthrough {
    state: Arc<Mutex<State>>,
}

/// Moves its block from in flight to done when dropped: when its host function has run, or
/// was dropped unrun because the stream failed (the position still completes).
struct Completion {
    state: Arc<Mutex<State>>,
    block: BlockId,
    tag: FreeTag,
}

impl Drop for Completion {
    fn drop(&mut self) {
        let mut st = self.state.lock();
        st.in_flight.retain(|b| b.0 != self.block);
        st.done.push((self.block, self.tag));
    }
}

impl Passthrough {
    /// Defers the free of `block` until `stream` completes what is enqueued so far. If the
    /// host function cannot be enqueued, the free is handed to the engine at the next pool
    /// call with its tag (the engine's stream-order rules then apply as usual).
    ///
    /// # Errors
    /// The block's free is already deferred (a double free).
    pub(crate) fn defer(
        &self,
        block: BlockId,
        tag: FreeTag,
        stream: &dyn StreamHal,
    ) -> Result<(), ()> {
        {
            let mut st = self.state.lock();
            if st.in_flight.iter().chain(&st.done).any(|d| d.0 == block) {
                return Err(());
            }
            st.in_flight.push((block, tag));
        }
        let completion = Completion { state: Arc::clone(&self.state), block, tag };
        // On failure the closure, and so the completion, is dropped unrun: done at once.
        let _ = stream.host_fn(Box::new(move || drop(completion)));
        Ok(())
    }

    /// The frees that completed since the last call.
    pub(crate) fn take_done(&self) -> Vec<(BlockId, FreeTag)> {
        std::mem::take(&mut self.state.lock().done)
    }

    /// Every deferred free, complete or not, taken (the pool is going away: those still in
    /// flight become the engine's pending frees, with their tags).
    pub(crate) fn take_all(&self) -> Vec<(BlockId, FreeTag)> {
        let mut st = self.state.lock();
        let mut all = std::mem::take(&mut st.done);
        all.append(&mut st.in_flight);
        all
    }
}
