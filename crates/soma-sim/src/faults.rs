//! Fault injection: make chosen driver calls or tasks fail, at run time.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

/// Driver calls whose failure can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// [`DeviceHal::alloc_physical`](soma_core::hal::DeviceHal::alloc_physical).
    AllocPhysical,
    /// [`DeviceHal::map`](soma_core::hal::DeviceHal::map).
    Map,
    /// [`DeviceHal::malloc`](soma_core::hal::DeviceHal::malloc).
    Malloc,
}

impl FaultKind {
    fn index(self) -> usize {
        match self {
            FaultKind::AllocPhysical => 0,
            FaultKind::Map => 1,
            FaultKind::Malloc => 2,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
enum Rule {
    #[default]
    Off,
    /// Fail once, when `seen` reaches `k`.
    Nth { k: u64, seen: u64 },
    /// Fail every `k`-th call.
    Every { k: u64, seen: u64 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TaskFault {
    At { stream: u64, position: u64 },
    Next { stream: u64 },
}

/// The fault injection controls of one device ([`SimDevice::faults`](crate::SimDevice::faults)).
///
/// A driver call that fails by injection returns [`DriverError::Injected`] and leaves no state
/// behind (no capacity accounted, nothing mapped). A task that fails by injection fails its
/// stream like any failing task ([`DriverError::TaskFailed`] with an "injected fault" message).
///
/// Calls are counted from the moment a rule is set, every call of the kind — one with bad
/// arguments too, as in [`SimStats::calls`](crate::SimStats) (the rule is consulted before the
/// arguments are checked); setting a rule replaces the previous rule of the same kind.
///
/// [`DriverError::Injected`]: soma_core::hal::DriverError::Injected
/// [`DriverError::TaskFailed`]: soma_core::hal::DriverError::TaskFailed
#[derive(Debug, Default)]
pub struct Faults {
    rules: [Mutex<Rule>; 3],
    tasks_armed: AtomicBool,
    tasks: Mutex<Vec<TaskFault>>,
}

impl Faults {
    /// Makes the `k`-th call of `kind` from now on fail, once (`k >= 1`; `0` clears the rule).
    pub fn fail_nth(&self, kind: FaultKind, k: u64) {
        *self.rules[kind.index()].lock() =
            if k == 0 { Rule::Off } else { Rule::Nth { k, seen: 0 } };
    }

    /// Makes every `k`-th call of `kind` from now on fail (`k = 1`: every call; `0` clears).
    pub fn fail_every(&self, kind: FaultKind, k: u64) {
        *self.rules[kind.index()].lock() =
            if k == 0 { Rule::Off } else { Rule::Every { k, seen: 0 } };
    }

    /// Removes the rule of `kind`.
    pub fn clear(&self, kind: FaultKind) {
        *self.rules[kind.index()].lock() = Rule::Off;
    }

    /// Makes the task at `position` of stream `stream` fail instead of running.
    pub fn fail_task(&self, stream: u64, position: u64) {
        self.tasks.lock().push(TaskFault::At { stream, position });
        self.tasks_armed.store(true, Ordering::Release);
    }

    /// Makes the next task of stream `stream` that starts executing after this call fail.
    pub fn fail_next_task(&self, stream: u64) {
        self.tasks.lock().push(TaskFault::Next { stream });
        self.tasks_armed.store(true, Ordering::Release);
    }

    /// Removes every armed task fault.
    pub fn clear_tasks(&self) {
        let mut t = self.tasks.lock();
        t.clear();
        self.tasks_armed.store(false, Ordering::Release);
    }

    /// Drops the task faults armed for a stream that has been dropped and drained: none of
    /// them can fire any more.
    pub(crate) fn forget_stream(&self, stream: u64) {
        if !self.tasks_armed() {
            return;
        }
        let mut t = self.tasks.lock();
        t.retain(|f| match *f {
            TaskFault::At { stream: s, .. } | TaskFault::Next { stream: s } => s != stream,
        });
        if t.is_empty() {
            self.tasks_armed.store(false, Ordering::Release);
        }
    }

    /// Counts a call of `kind`; `true` if it must fail.
    pub(crate) fn hit(&self, kind: FaultKind) -> bool {
        let mut rule = self.rules[kind.index()].lock();
        match &mut *rule {
            Rule::Off => false,
            Rule::Nth { k, seen } => {
                *seen += 1;
                if *seen == *k {
                    *rule = Rule::Off;
                    true
                } else {
                    false
                }
            }
            Rule::Every { k, seen } => {
                *seen += 1;
                *seen % *k == 0
            }
        }
    }

    /// Whether any task fault is armed (tasks then all go through their stream's queue,
    /// where [`Faults::task_hit`] sees them).
    pub(crate) fn tasks_armed(&self) -> bool {
        self.tasks_armed.load(Ordering::Acquire)
    }

    /// Whether task `position` of `stream`, about to execute, must fail (consumes the fault).
    pub(crate) fn task_hit(&self, stream: u64, position: u64) -> bool {
        if !self.tasks_armed() {
            return false;
        }
        let mut t = self.tasks.lock();
        let found = t.iter().position(|f| match *f {
            TaskFault::At { stream: s, position: p } => s == stream && p == position,
            TaskFault::Next { stream: s } => s == stream,
        });
        if let Some(i) = found {
            t.swap_remove(i);
            if t.is_empty() {
                self.tasks_armed.store(false, Ordering::Release);
            }
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use soma_core::hal::StreamHal;

    use super::*;

    #[test]
    fn nth_and_every() {
        let f = Faults::default();
        f.fail_nth(FaultKind::Map, 3);
        let hits: Vec<bool> = (0..5).map(|_| f.hit(FaultKind::Map)).collect();
        assert_eq!(hits, [false, false, true, false, false]);
        assert!(!f.hit(FaultKind::Malloc));
        f.fail_every(FaultKind::Malloc, 2);
        let hits: Vec<bool> = (0..4).map(|_| f.hit(FaultKind::Malloc)).collect();
        assert_eq!(hits, [false, true, false, true]);
        f.clear(FaultKind::Malloc);
        assert!(!f.hit(FaultKind::Malloc));
    }

    #[test]
    fn tasks() {
        let f = Faults::default();
        f.fail_task(1, 5);
        f.fail_next_task(2);
        assert!(!f.task_hit(1, 4));
        assert!(f.task_hit(1, 5));
        assert!(!f.task_hit(1, 5));
        assert!(f.task_hit(2, 9));
        assert!(!f.task_hit(2, 10));
    }

    #[test]
    fn a_dropped_stream_takes_its_task_faults_with_it() {
        let dev = crate::Npu::builder().build().unwrap().device(0).unwrap();
        let (dropped, kept) = (dev.create_sim_stream().unwrap(), dev.create_sim_stream().unwrap());
        let f = dev.faults();
        f.fail_task(dropped.id(), 7);
        f.fail_next_task(dropped.id());
        f.fail_task(kept.id(), 7);
        drop(dropped);
        assert_eq!(*f.tasks.lock(), [TaskFault::At { stream: kept.id(), position: 7 }]);
        drop(kept);
        assert!(f.tasks.lock().is_empty());
        assert!(!f.tasks_armed());
    }
}
