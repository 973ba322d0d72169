//! The sanitizer's vector clocks.

use std::sync::Arc;

use smallvec::SmallVec;

/// A vector clock: for each stream id, the highest task position ordered before.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Clock(pub(super) SmallVec<[(u64, u64); 4]>);

impl Clock {
    pub(super) fn get(&self, stream: u64) -> u64 {
        match self.0.binary_search_by_key(&stream, |e| e.0) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }

    pub(super) fn raise(&mut self, stream: u64, pos: u64) -> bool {
        match self.0.binary_search_by_key(&stream, |e| e.0) {
            Ok(i) if self.0[i].1 >= pos => false,
            Ok(i) => {
                self.0[i].1 = pos;
                true
            }
            Err(i) => {
                self.0.insert(i, (stream, pos));
                true
            }
        }
    }

    pub(super) fn join(&mut self, other: &Clock) -> bool {
        let mut changed = false;
        for &(s, p) in &other.0 {
            changed |= self.raise(s, p);
        }
        changed
    }

    pub(super) fn covers(&self, other: &Clock) -> bool {
        other.0.iter().all(|&(s, p)| self.get(s) >= p)
    }

    /// Removes the entries of the streams `keep` rejects, copying a shared clock only when
    /// it has such entries.
    pub(super) fn retain_streams(clock: &mut Arc<Clock>, keep: impl Fn(u64) -> bool) {
        if clock.0.iter().any(|e| !keep(e.0)) {
            Arc::make_mut(clock).0.retain(|e| keep(e.0));
        }
    }
}
