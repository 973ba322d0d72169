//! Stream workers are joined: no thread outlives its stream. (Own test binary: it counts the
//! threads of the whole process.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use soma_sim::hal::{DeviceHal, StreamHal};
use soma_sim::Npu;

/// The process's threads that are not exiting. A joined thread can stay listed in
/// `/proc/self/task` for a moment — `pthread_join` returns once the thread's exit has cleared
/// its id, before the kernel removes the task — but it is flagged exiting (`PF_EXITING`) from
/// the start of its exit, so the count is exact at once; a thread still running is counted.
fn threads() -> usize {
    const PF_EXITING: u64 = 0x4;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .filter(|stat| {
            // Fields after the command's closing parenthesis: state, ppid, pgrp, sid, tty_nr,
            // tpgid, flags, …
            let flags = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(6));
            flags.and_then(|f| f.parse::<u64>().ok()).is_some_and(|f| f & PF_EXITING == 0)
        })
        .count()
}

#[test]
fn no_thread_is_leaked() {
    let before = threads();
    assert!(before > 0);
    let npu = Npu::builder().devices(2).capacity(1 << 30).build().unwrap();
    let counter = Arc::new(AtomicU64::new(0));
    for round in 0..3 {
        let mut streams: Vec<Box<dyn StreamHal>> = Vec::new();
        for d in 0..2 {
            let dev = npu.device(d).unwrap();
            for _ in 0..4 {
                streams.push(dev.create_stream().unwrap());
            }
        }
        assert_eq!(threads(), before + 8, "one worker per stream (round {round})");
        for s in &streams {
            for _ in 0..50 {
                let c = Arc::clone(&counter);
                s.host_fn(Box::new(move || {
                    c.fetch_add(1, Ordering::Relaxed);
                }))
                .unwrap();
            }
        }
        drop(streams); // drains, then joins
        assert_eq!(counter.load(Ordering::Relaxed), (round + 1) * 400);
        assert_eq!(threads(), before, "workers joined (round {round})");
    }
    // Streams outliving their device handle keep working; the device is torn down last.
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let p = dev.malloc(4096).unwrap();
    drop(npu);
    drop(dev);
    s.memset(p, 1, 4096).unwrap();
    s.synchronize().unwrap();
    drop(s);
    assert_eq!(threads(), before);
}
