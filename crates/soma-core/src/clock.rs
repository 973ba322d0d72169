//! Vector clocks over stream slots: the pool's happens-before knowledge.
//!
//! Entry `(s, q)` in stream T's clock means "T's later work is ordered after everything
//! stream slot `s` had enqueued up to global position `q`" — learnt by waiting on an event
//! recorded at `q`, directly or through a chain of streams.

use smallvec::SmallVec;

use crate::engine::StreamSlot;

/// A sparse vector clock: `(slot, position)` pairs sorted by slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VectorClock {
    entries: SmallVec<[(StreamSlot, u64); 8]>,
}

impl VectorClock {
    /// An empty clock (ordered after nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// The entry for `slot` (0 when absent).
    pub fn get(&self, slot: StreamSlot) -> u64 {
        match self.entries.binary_search_by_key(&slot, |e| e.0) {
            Ok(i) => self.entries[i].1,
            Err(_) => 0,
        }
    }

    /// Raises the entry for `slot` to at least `pos`.
    pub fn raise(&mut self, slot: StreamSlot, pos: u64) {
        match self.entries.binary_search_by_key(&slot, |e| e.0) {
            Ok(i) => self.entries[i].1 = self.entries[i].1.max(pos),
            Err(i) => self.entries.insert(i, (slot, pos)),
        }
    }

    /// Point-wise maximum with `other` (what waiting on an event does).
    pub fn join(&mut self, other: &VectorClock) {
        for &(slot, pos) in &other.entries {
            self.raise(slot, pos);
        }
    }

    /// The `(slot, position)` entries, sorted by slot.
    pub fn entries(&self) -> &[(StreamSlot, u64)] {
        &self.entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_is_pointwise_max() {
        let mut a = VectorClock::new();
        a.raise(3, 10);
        a.raise(1, 5);
        let mut b = VectorClock::new();
        b.raise(1, 7);
        b.raise(2, 1);
        b.raise(3, 4);
        a.join(&b);
        assert_eq!(a.entries(), &[(1, 7), (2, 1), (3, 10)]);
        assert_eq!(a.get(9), 0);
    }

    #[test]
    fn raise_never_lowers() {
        let mut a = VectorClock::new();
        a.raise(0, 9);
        a.raise(0, 3);
        assert_eq!(a.get(0), 9);
    }
}
