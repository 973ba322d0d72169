//! Ordering, synchronisation, errors and skipping on streams.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use soma_sim::hal::{
    AccessMode, BufferAccess, DeviceHal, KernelError, KernelLaunch, MemRef, StreamHal,
};
use soma_sim::SimStream;

use super::{device, fill_kernel, gate, read, recv, task_failed, MIB};

#[test]
fn one_thread_order_and_positions() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..5000u32 {
        let log = Arc::clone(&log);
        s.host_fn(Box::new(move || log.lock().unwrap().push(i))).unwrap();
    }
    assert_eq!(s.enqueued(), 5000);
    s.synchronize().unwrap();
    assert_eq!(s.completed(), 5000);
    assert!(s.query().unwrap());
    assert_eq!(*log.lock().unwrap(), (0..5000).collect::<Vec<_>>());
}

#[test]
fn several_enqueuing_threads_keep_per_thread_order() {
    let dev = device(64 * MIB);
    let s: Arc<dyn StreamHal> = Arc::from(dev.create_stream().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let (s, log) = (Arc::clone(&s), Arc::clone(&log));
            std::thread::spawn(move || {
                for i in 0..2500u32 {
                    let log = Arc::clone(&log);
                    s.host_fn(Box::new(move || log.lock().unwrap().push((t, i)))).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!((s.enqueued(), s.completed()), (10_000, 10_000));
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 10_000);
    for t in 0..4 {
        let seq: Vec<u32> = log.iter().filter(|(tt, _)| *tt == t).map(|(_, i)| *i).collect();
        assert_eq!(seq, (0..2500).collect::<Vec<_>>(), "thread {t} order");
    }
}

#[test]
fn positions_advance_in_order_and_query_does_not_block() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let (tx, rx) = gate();
    s.host_fn(Box::new(move || recv(&rx))).unwrap();
    s.host_fn(Box::new(|| {})).unwrap();
    assert_eq!(s.enqueued(), 2);
    let t = Instant::now();
    assert!(!s.query().unwrap());
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(s.completed(), 0);
    tx.send(()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(s.completed(), 2);
}

#[test]
fn kernel_copies_memset_round_trip() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let a = dev.malloc(4096).unwrap();
    let b = dev.malloc(4096).unwrap();
    let src: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    let mut back = vec![0u8; 4096];
    let mut h2h = vec![0u8; 4096];
    // SAFETY: both host buffers outlive the synchronize below and are not touched meanwhile.
    unsafe {
        s.copy_async(MemRef::Device(a), MemRef::Host(src.as_ptr().cast_mut()), 4096).unwrap();
    }
    s.copy_d2d(b, a, 4096).unwrap();
    s.memset(b, 0xAB, 16).unwrap();
    s.launch(KernelLaunch {
        name: "double",
        buffers: vec![
            BufferAccess { ptr: a, len: 4096, mode: AccessMode::Read },
            BufferAccess { ptr: b.checked_add(16).unwrap(), len: 16, mode: AccessMode::Write },
        ],
        body: Box::new(|bufs| {
            let src = bufs.read::<u8>(0)?;
            let again = bufs.bytes(0)?; // any number of shared borrows
            for (o, i) in bufs.write::<u8>(1)?.iter_mut().zip(src) {
                *o = i.wrapping_mul(2);
            }
            assert_eq!(again.len(), 4096);
            Ok(())
        }),
    })
    .unwrap();
    // SAFETY: as above.
    unsafe {
        s.copy_async(MemRef::Host(back.as_mut_ptr()), MemRef::Device(b), 4096).unwrap();
        s.copy_async(MemRef::Host(h2h.as_mut_ptr()), MemRef::Host(back.as_mut_ptr()), 4096)
            .unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(&back[..16], &[0xAB; 16]);
    let doubled: Vec<u8> = (0..16u8).map(|i| i.wrapping_mul(2)).collect();
    assert_eq!(&back[16..32], &doubled[..]);
    assert_eq!(&back[32..], &src[32..]);
    assert_eq!(h2h, back);
    drop(s);
    dev.free(a).unwrap();
    dev.free(b).unwrap();
}

#[test]
fn failing_kernel_is_sticky_and_skips_later_tasks() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    let ran = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&ran);
    s.host_fn(Box::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    }))
    .unwrap();
    s.launch(KernelLaunch {
        name: "broken",
        buffers: vec![],
        body: Box::new(|_| Err(KernelError::new("bad input"))),
    })
    .unwrap();
    let r = Arc::clone(&ran);
    s.host_fn(Box::new(move || {
        r.fetch_add(100, Ordering::SeqCst);
    }))
    .unwrap();
    s.launch(fill_kernel(buf, 16, 9)).unwrap();
    let e = s.synchronize().unwrap_err();
    let (stream, task, name, msg) = task_failed(&e);
    assert_eq!((stream, task, name.as_str(), msg.as_str()), (s.id(), 2, "broken", "bad input"));
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the host fn after the failure was skipped");
    assert_eq!(read(&dev, buf, 16), vec![0; 16], "the kernel after the failure was skipped");
    assert_eq!(s.completed(), s.enqueued(), "skipped tasks count as completed");
    // Sticky: still reported, and enqueueing still works (and is skipped).
    assert_eq!(s.query().unwrap_err(), e);
    s.host_fn(Box::new(|| panic!("must not run"))).unwrap();
    assert_eq!(s.synchronize().unwrap_err(), e);
    assert_eq!(dev.synchronize().unwrap_err(), e, "device synchronize reports it too");
    // clear_error makes the stream usable again.
    let sim = s.as_any().downcast_ref::<SimStream>().unwrap();
    assert_eq!(sim.clear_error(), Some(e));
    s.launch(fill_kernel(buf, 16, 9)).unwrap();
    s.synchronize().unwrap();
    assert_eq!(read(&dev, buf, 16), vec![9; 16]);
    drop(s);
    dev.free(buf).unwrap();
}

#[test]
fn panicking_kernel_and_host_fn_fail_the_stream_not_the_process() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    s.launch(KernelLaunch {
        name: "panics",
        buffers: vec![],
        body: Box::new(|_| panic!("kernel exploded")),
    })
    .unwrap();
    let (_, task, name, msg) = task_failed(&s.synchronize().unwrap_err());
    assert_eq!((task, name.as_str()), (1, "panics"));
    assert!(msg.contains("kernel exploded"), "{msg}");

    let s2 = dev.create_stream().unwrap();
    s2.host_fn(Box::new(|| panic!("host fn exploded"))).unwrap();
    let (_, task, name, msg) = task_failed(&s2.synchronize().unwrap_err());
    assert_eq!((task, name.as_str()), (1, "host_fn"));
    assert!(msg.contains("host fn exploded"), "{msg}");
}

#[test]
fn kernel_buffer_borrow_rules() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(MIB).unwrap();
    type Check = fn(&dyn soma_sim::hal::KernelBuffers) -> bool;
    let cases: Vec<(&'static str, Check)> = vec![
        ("mut_of_read_buffer", |b| b.bytes_mut(1).is_err()),
        ("twice_mut", |b| b.bytes_mut(0).is_ok() && b.bytes_mut(0).is_err()),
        ("shared_after_mut", |b| b.bytes_mut(0).is_ok() && b.bytes(0).is_err()),
        ("mut_after_shared", |b| b.bytes(0).is_ok() && b.bytes_mut(0).is_err()),
        ("out_of_range", |b| b.bytes(2).is_err() && b.bytes_mut(7).is_err()),
        ("shared_many", |b| b.bytes(1).is_ok() && b.bytes(1).is_ok()),
    ];
    for (name, check) in cases {
        let ok = Arc::new(AtomicU64::new(0));
        let o = Arc::clone(&ok);
        s.launch(KernelLaunch {
            name,
            buffers: vec![
                BufferAccess { ptr: buf, len: 64, mode: AccessMode::Write },
                BufferAccess { ptr: buf.checked_add(64).unwrap(), len: 64, mode: AccessMode::Read },
            ],
            body: Box::new(move |b| {
                o.store(check(b) as u64, Ordering::SeqCst);
                Ok(())
            }),
        })
        .unwrap();
        s.synchronize().unwrap();
        assert_eq!(ok.load(Ordering::SeqCst), 1, "{name}");
    }
    // A misaligned typed view is an error, not UB.
    s.launch(KernelLaunch {
        name: "misaligned",
        buffers: vec![BufferAccess {
            ptr: buf.checked_add(1).unwrap(),
            len: 8,
            mode: AccessMode::Read,
        }],
        body: Box::new(|b| b.read::<u32>(0).map(drop)),
    })
    .unwrap();
    assert!(s.synchronize().is_err());
}

#[test]
fn device_synchronize_waits_for_every_stream() {
    let dev = device(64 * MIB);
    let streams: Vec<_> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
    assert_eq!(dev.stats().live_streams, 3);
    let done = Arc::new(AtomicU64::new(0));
    for s in &streams {
        let d = Arc::clone(&done);
        s.host_fn(Box::new(move || {
            std::thread::sleep(Duration::from_millis(30));
            d.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(done.load(Ordering::SeqCst), 3);
    drop(streams);
    assert_eq!(dev.stats().live_streams, 0);
    dev.synchronize().unwrap();
}

#[test]
fn dropping_a_stream_drains_its_queue() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let n = Arc::new(AtomicU64::new(0));
    let c = Arc::clone(&n);
    s.host_fn(Box::new(move || {
        std::thread::sleep(Duration::from_millis(50));
        c.fetch_add(1, Ordering::SeqCst);
    }))
    .unwrap();
    for _ in 0..99 {
        let c = Arc::clone(&n);
        s.host_fn(Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
    }
    drop(s);
    assert_eq!(n.load(Ordering::SeqCst), 100);
}

#[test]
fn latency_model_delays_driver_calls_and_tasks() {
    let dev = device(64 * MIB);
    dev.set_latency(
        soma_sim::LatencyModel::none()
            .with_driver_alloc(Duration::from_millis(20))
            .with_launch(Duration::from_millis(10))
            .with_copy_bandwidth(100 * MIB),
    );
    let t = Instant::now();
    let buf = dev.malloc(MIB).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(20));
    let s = dev.create_stream().unwrap();
    let t = Instant::now();
    s.copy_d2d(buf.checked_add(MIB / 2).unwrap(), buf, MIB / 2).unwrap(); // 5 ms + launch
    s.host_fn(Box::new(|| {})).unwrap();
    assert!(t.elapsed() < Duration::from_millis(10), "enqueue does not sleep");
    s.synchronize().unwrap();
    assert!(t.elapsed() >= Duration::from_millis(25), "{:?}", t.elapsed());
    assert_eq!(soma_sim::LatencyModel::ascend_like().driver_alloc, Duration::from_millis(1));
    dev.set_latency(soma_sim::LatencyModel::none());
    drop(s);
    dev.free(buf).unwrap();
}
