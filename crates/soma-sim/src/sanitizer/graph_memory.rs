//! Graph memory (see the module docs of [`sanitizer`](super)): blocks going back to their
//! region, and the release of a region.

use std::sync::Arc;

use smallvec::SmallVec;

use super::{poison, Clock, FreeInfo, Point, Sanitizer, HOST};
use crate::memory::DeviceMemory;

impl Sanitizer {
    /// The graph block at `ptr` of region `region` went back to its region: launches may
    /// still use it, other work enqueued from now on may not.
    pub(super) fn on_graph_free(&self, region: u64, ptr: u64) {
        let mut st = self.state.lock();
        st.seq += 1;
        let seq = st.seq;
        let newest = st.graph.range_mut((ptr, 0)..=(ptr, u64::MAX)).rev().find_map(|(_, g)| {
            g.graph.as_mut().filter(|m| m.region == region && m.returned.is_none())
        });
        if let Some(mark) = newest {
            mark.returned = Some(seq);
        }
    }

    /// Region `region` was released (its graphs are gone and their launches complete): the
    /// blocks that went back to it are freed — every task enqueued from now on comes after
    /// the free — and its live blocks become ordinary allocations.
    pub(super) fn on_graph_release(&self, region: u64, memory: &DeviceMemory) {
        let mut st = self.state.lock();
        st.seq += 1;
        let point = Point::new(HOST, 0, st.seq);
        let keys: Vec<(u64, u64)> = st
            .graph
            .iter()
            .filter(|(_, g)| g.graph.is_some_and(|m| m.region == region))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let Some(mut g) = st.graph.remove(&key) else { continue };
            let returned = g.graph.take().is_some_and(|m| m.returned.is_some());
            if !returned {
                st.live.insert(key, g);
                continue;
            }
            // The uses were checked by the pool's own ordering of the frees (and launches
            // record none): nothing is left to order the release after.
            g.uses = SmallVec::new();
            g.free =
                Some(FreeInfo { point, clock: Arc::new(Clock::default()), observed_seq: None });
            if let Some(value) = self.poison {
                poison(memory, g.ptr, g.size, value);
            }
            st.freed_max_size = st.freed_max_size.max(g.size);
            st.freed.insert(key, g);
        }
        st.graph_max_size = st.graph.values().map(|g| g.size).max().unwrap_or(0);
        if st.freed.len() > st.prune_at {
            Self::prune(&mut st);
        }
    }
}
