//! Several devices and peer access: copies and kernels across devices, the access matrix, the
//! link's modelled cost, in-flight ranges held on the owning device, one sanitizer for all.

use std::time::{Duration, Instant};

use soma_sim::hal::{
    AccessMode, BufferAccess, DeviceHal, DevicePtr, DriverError, KernelLaunch, MemRef,
    PoolAnnotation, StreamHal,
};
use soma_sim::{LatencyModel, Npu, ReportKind, SanitizerMode, MAX_DEVICES};

use super::{fill_kernel, gate, read, recv, task_failed, MIB};

fn two_devices() -> Npu {
    Npu::builder().devices(2).capacity(64 * MIB).build().unwrap()
}

#[test]
fn an_npu_has_one_to_sixteen_devices() {
    assert_eq!(MAX_DEVICES, 16);
    let npu = Npu::builder().devices(MAX_DEVICES).capacity(64 * MIB).build().unwrap();
    assert_eq!(npu.device_count(), 16);
    let e = Npu::builder().devices(MAX_DEVICES + 1).capacity(64 * MIB).build().unwrap_err();
    assert!(matches!(&e, DriverError::InvalidValue(m) if m.contains("at most 16")), "{e:?}");
}

#[test]
fn peer_access_is_per_ordered_pair_and_checked_at_the_enqueue() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (a, b) = (d0.malloc(MIB).unwrap(), d1.malloc(MIB).unwrap());
    d0.memset_sync(a, 7, MIB).unwrap();

    assert!(d1.can_access_peer(&*d0).unwrap());
    assert!(!d1.peer_access_enabled(&*d0));
    let refused = s1.copy_d2d(b, a, MIB).unwrap_err();
    match &refused {
        DriverError::InvalidAddress { reason, .. } => {
            assert!(reason.contains("peer access from device 1 is not enabled"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s1.enqueued(), 0, "a refused copy enqueues nothing");

    d1.enable_peer_access(&*d0).unwrap();
    assert!(d1.peer_access_enabled(&*d0) && !d0.peer_access_enabled(&*d1));
    s1.copy_d2d(b, a, MIB).unwrap();
    s1.synchronize().unwrap();
    assert_eq!(read(&d1, b, MIB), vec![7; MIB as usize]);
    // The other direction is another pair.
    assert!(s0.copy_d2d(a, b, MIB).is_err());

    // Enabling twice, disabling what is not enabled, a device and itself: refused.
    assert!(matches!(d1.enable_peer_access(&*d0), Err(DriverError::InvalidValue(_))));
    assert!(matches!(d0.disable_peer_access(&*d1), Err(DriverError::InvalidValue(_))));
    assert!(d0.enable_peer_access(&*d0).is_err());
    assert!(d0.can_access_peer(&*d0).is_err());
    let other_npu = two_devices();
    let stranger = other_npu.device(1).unwrap();
    assert!(!d0.can_access_peer(&*stranger).unwrap());
    assert!(d0.enable_peer_access(&*stranger).is_err());

    d1.disable_peer_access(&*d0).unwrap();
    assert!(s1.copy_d2d(b, a, MIB).is_err());
    drop((s0, s1));
    d0.free(a).unwrap();
    d1.free(b).unwrap();
}

#[test]
fn kernels_and_memsets_use_peer_memory_and_synchronous_copies_cross_devices() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&*d0).unwrap();
    let s1 = d1.create_stream().unwrap();
    let (a, b) = (d0.malloc(4096).unwrap(), d1.malloc(4096).unwrap());
    s1.memset(a, 3, 4096).unwrap();
    s1.memset(b, 4, 4096).unwrap();
    // One kernel over a buffer of each device: the sum lands in device 0's memory.
    s1.launch(KernelLaunch {
        name: "add_into_peer",
        buffers: vec![
            BufferAccess { ptr: a, len: 4096, mode: AccessMode::Write },
            BufferAccess { ptr: b, len: 4096, mode: AccessMode::Read },
        ],
        body: Box::new(|bufs| {
            let (x, y) = (bufs.write::<u8>(0)?, bufs.read::<u8>(1)?);
            x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
            Ok(())
        }),
    })
    .unwrap();
    s1.synchronize().unwrap();
    assert_eq!(read(&d0, a, 4096), vec![7; 4096]);
    // `aclrtMemcpy` between devices: the current device needs access to the other end.
    // SAFETY: no host end.
    unsafe { d1.copy_sync(MemRef::Device(b), MemRef::Device(a), 4096) }.unwrap();
    assert_eq!(read(&d1, b, 4096), vec![7; 4096]);
    // SAFETY: no host end.
    let refused = unsafe { d0.copy_sync(MemRef::Device(a), MemRef::Device(b), 4096) };
    assert!(matches!(refused, Err(DriverError::InvalidAddress { .. })), "{refused:?}");
    drop(s1);
    d0.free(a).unwrap();
    d1.free(b).unwrap();
}

#[test]
fn a_peer_task_holds_its_ranges_in_the_owning_devices_table() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&*d0).unwrap();
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let a = d0.malloc(MIB).unwrap();
    let (started_tx, started_rx) = gate();
    let (go_tx, go_rx) = gate();
    s1.launch(KernelLaunch {
        name: "held_on_peer",
        buffers: vec![BufferAccess { ptr: a, len: 4096, mode: AccessMode::Write }],
        body: Box::new(move |b| {
            b.bytes_mut(0)?.fill(1);
            started_tx.send(()).ok();
            recv(&go_rx);
            Ok(())
        }),
    })
    .unwrap();
    recv(&started_rx);
    // The owning device refuses to free memory a peer's task is using, and its own stream's
    // conflicting task fails as a data race.
    let e = d0.free(a).unwrap_err();
    assert!(e.to_string().contains("in use by"), "{e}");
    s0.launch(fill_kernel(a, 8, 2)).unwrap();
    let (_, _, _, msg) = task_failed(&s0.synchronize().unwrap_err());
    assert!(msg.contains("data race"), "{msg}");
    go_tx.send(()).unwrap();
    s1.synchronize().unwrap();
    drop((s0, s1));
    d0.free(a).unwrap();
}

#[test]
fn copies_between_devices_cost_the_link_bandwidth() {
    let link = 1 << 30; // 1 GiB/s: 16 MiB take 15.6 ms
    let npu = Npu::builder()
        .devices(2)
        .capacity(256 * MIB)
        .latency(LatencyModel::none().with_peer_bandwidth(link))
        .build()
        .unwrap();
    assert_eq!(LatencyModel::ascend_like().peer_bandwidth, soma_sim::HCCS_BANDWIDTH);
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&*d0).unwrap();
    let s1 = d1.create_stream().unwrap();
    let (a, b, c) =
        (d0.malloc(16 * MIB).unwrap(), d1.malloc(16 * MIB).unwrap(), d1.malloc(16 * MIB).unwrap());
    let t = Instant::now();
    s1.copy_d2d(c, b, 16 * MIB).unwrap();
    s1.synchronize().unwrap();
    let local = t.elapsed();
    let t = Instant::now();
    s1.copy_d2d(b, a, 16 * MIB).unwrap();
    s1.synchronize().unwrap();
    let across = t.elapsed();
    assert!(across >= Duration::from_millis(15), "{across:?}");
    assert!(across > local, "{across:?} vs {local:?}");
    drop(s1);
    d0.free(a).unwrap();
    d1.free(b).unwrap();
    d1.free(c).unwrap();
}

/// A pool-like block on `dev`: reserve, map, annotate the allocation on stream `s`.
fn annotated_block(dev: &soma_sim::SimDevice, s: &dyn StreamHal) -> DevicePtr {
    let g = dev.info().granularity;
    let base = dev.reserve(g).unwrap();
    let h = dev.alloc_physical(g).unwrap();
    dev.map(base, h).unwrap();
    dev.annotate(PoolAnnotation::Alloc {
        pool: 1,
        ptr: base,
        size: 4096,
        stream: s.id(),
        position: s.enqueued(),
    });
    base
}

#[test]
fn one_sanitizer_checks_peer_uses_against_the_owners_allocations() {
    let npu = Npu::builder()
        .devices(2)
        .capacity(64 * MIB)
        .sanitizer(SanitizerMode::Report)
        .sanitizer_strict(true)
        .build()
        .unwrap();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&*d0).unwrap();
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let block = annotated_block(&d0, &*s0);
    // Device 1's stream is not ordered after the allocation on device 0's stream.
    s1.memset(block, 1, 64).unwrap();
    s1.synchronize().unwrap();
    let reports = d1.take_sanitizer_reports();
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0].kind, ReportKind::NotOrderedAfterAlloc);
    assert_eq!(reports[0].stream, s1.id());
    // Ordered by an event of device 0 that device 1's stream waits on: clean, and past the
    // allocation's end it is out of bounds.
    let ev = d0.create_event().unwrap();
    s0.record(&*ev).unwrap();
    s1.wait(&*ev).unwrap();
    s1.memset(block, 2, 64).unwrap();
    s1.memset(block, 2, 4097).unwrap();
    s1.synchronize().unwrap();
    let kinds: Vec<ReportKind> = d0.take_sanitizer_reports().iter().map(|r| r.kind).collect();
    assert_eq!(kinds, vec![ReportKind::OutOfBounds]);
}
