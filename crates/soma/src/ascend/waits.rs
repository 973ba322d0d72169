//! What a stream's event waits prove about other streams: once a stream has completed a wait
//! at its position `p`, the event's record at position `q` of its recording stream has
//! completed too. [`StreamShared::mark_completed`](super::stream::StreamShared::mark_completed)
//! passes that on along every chain of waits, so that the check of unmaps against work in
//! flight knows what the event chains already prove, without a driver call: memory used on
//! a stream that is still busy with later work, freed on another stream after waiting for
//! that use, is released once the freeing stream has run the free.

use std::sync::{Mutex, Weak};

use super::device::lock;
use super::stream::StreamShared;

/// Waits kept per stream before the oldest are forgotten (forgetting loses knowledge, never
/// safety: completion is then learnt later, from the recording stream itself).
const MAX_WAITS: usize = 256;

/// One wait of a stream on an event.
struct Wait {
    /// The waiting stream's position of the wait.
    at: u64,
    /// The stream the event was recorded on.
    recorder: Weak<StreamShared>,
    /// The record's position on it.
    record: u64,
}

/// The waits of one stream whose completion the stream has not passed on yet.
#[derive(Default)]
pub(crate) struct Waits(Mutex<Vec<Wait>>);

impl Waits {
    /// Notes that the stream waits, at its position `at`, for the record at position
    /// `record` of `recorder`.
    pub(crate) fn push(&self, at: u64, recorder: Weak<StreamShared>, record: u64) {
        let mut waits = lock(&self.0);
        if waits.len() >= MAX_WAITS {
            // Waits whose record is known complete prove nothing more.
            waits.retain(|w| w.recorder.upgrade().is_some_and(|s| s.completed() < w.record));
            if waits.len() >= MAX_WAITS {
                waits.drain(..MAX_WAITS / 2);
            }
        }
        waits.push(Wait { at, recorder, record });
    }

    /// Takes the waits at positions up to `completed` (the stream has passed them): the
    /// records they waited for, by stream.
    fn take_done(&self, completed: u64) -> Vec<(Weak<StreamShared>, u64)> {
        let mut waits = lock(&self.0);
        if !waits.iter().any(|w| w.at <= completed) {
            return Vec::new();
        }
        let mut done = Vec::new();
        waits.retain(|w| {
            let passed = w.at <= completed;
            if passed {
                done.push((w.recorder.clone(), w.record));
            }
            !passed
        });
        done
    }
}

impl StreamShared {
    /// Records that every task at position `<= position` has completed, and so has every
    /// record that a completed wait waited for, along chains of streams. The waits' lock is
    /// never held while another stream's is taken.
    pub(crate) fn mark_completed(&self, position: u64) {
        let mut due = self.waits().take_done(self.advance_completed(position));
        while let Some((recorder, record)) = due.pop() {
            if let Some(s) = recorder.upgrade() {
                due.extend(s.waits().take_done(s.advance_completed(record)));
            }
        }
    }
}
