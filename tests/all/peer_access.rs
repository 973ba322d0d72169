//! Peer access: a pool's allocations used by copies and kernels on another device's streams,
//! their frees ordered after those uses, and the happens-before knowledge kept per device.

use soma::prelude::*;
use soma::sim::Npu;
use soma::{Error, KernelArg, MemPool, ReusePolicy};

use crate::common::Gate;

fn two_devices() -> Npu {
    Npu::builder().devices(2).capacity(1 << 30).build().unwrap()
}

#[test]
fn access_is_enabled_per_ordered_pair() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    assert!(d0.can_access_peer(&d1).unwrap() && d1.can_access_peer(&d0).unwrap());
    assert!(!d1.has_peer_access(&d0) && d1.has_peer_access(&d1));
    d1.enable_peer_access(&d0).unwrap();
    assert!(d1.has_peer_access(&d0) && !d0.has_peer_access(&d1));

    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (p0, p1) = (MemPool::builder().build(&d0).unwrap(), MemPool::builder().build(&d1).unwrap());
    let x = p0.upload(&[1u32, 2, 3, 4], &s0).unwrap();
    let mut y = p1.alloc_zeros::<u32>(4, &s1).unwrap();
    // Device 1 pulls from device 0; device 0 may not push into device 1.
    s1.copy(&mut y, &x).unwrap();
    assert_eq!(s1.download(&y).unwrap(), vec![1, 2, 3, 4]);
    let mut z = p0.alloc_zeros::<u32>(4, &s0).unwrap();
    assert!(matches!(s0.copy(&mut z, &y), Err(Error::PeerAccess(_))));

    d1.disable_peer_access(&d0).unwrap();
    let refused = s1.copy(&mut y, &x);
    assert!(
        matches!(&refused, Err(Error::PeerAccess(m)) if m.contains("not enabled")),
        "{refused:?}"
    );
    assert!(matches!(d1.disable_peer_access(&d0), Err(Error::PeerAccess(_))));
}

#[test]
fn kernels_read_and_write_peer_allocations() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&d0).unwrap();
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (p0, p1) = (MemPool::builder().build(&d0).unwrap(), MemPool::builder().build(&d1).unwrap());
    let mut sum = p0.upload(&[10.0f32; 256], &s0).unwrap();
    let part = p1.upload(&[0.5f32; 256], &s1).unwrap();
    // A kernel on device 1 accumulates its partial result into device 0's buffer.
    s1.launch("accumulate", &[KernelArg::write(&mut sum), KernelArg::read(&part)], |b| {
        let (sum, part) = (b.write::<f32>(0)?, b.read::<f32>(1)?);
        sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        Ok(())
    })
    .unwrap();
    // Device 0's stream reads it after device 1's work: an event across the devices.
    s0.wait_stream(&s1).unwrap();
    assert_eq!(s0.download(&sum).unwrap(), vec![10.5; 256]);
}

#[test]
fn a_free_waits_for_a_peer_devices_use() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&d0).unwrap();
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (p0, p1) = (MemPool::builder().build(&d0).unwrap(), MemPool::builder().build(&d1).unwrap());
    let x = p0.upload(&[7u8; 4096], &s0).unwrap();
    let mut copy = p1.alloc_zeros::<u8>(4096, &s1).unwrap();
    let gate = Gate::close(&s1);
    // Queued on device 1 behind the gate: it reads `x` only once the gate opens.
    s1.copy(&mut copy, &x).unwrap();
    let at = x.device_ptr();
    drop(x);
    // Same stream, same size: the block comes back, but its overwrite is ordered after device
    // 1's copy (the free waited for it), not before.
    let mut again = p0.alloc_async::<u8>(4096, &s0).unwrap();
    assert_eq!(again.device_ptr(), at);
    s0.memset(&mut again, 0xEE).unwrap();
    gate.open();
    assert_eq!(s1.download(&copy).unwrap(), vec![7; 4096]);
    assert_eq!(s0.download(&again).unwrap(), vec![0xEE; 4096]);
}

#[test]
fn a_wait_across_devices_teaches_the_pool_nothing() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&d0).unwrap();
    // Slot 0 and slot 1 on each device.
    let (u1, u2) = (d0.create_stream().unwrap(), d0.create_stream().unwrap());
    let (t1, t2) = (d1.create_stream().unwrap(), d1.create_stream().unwrap());
    let events_only = ReusePolicy::new(true, false, false);
    let pool = MemPool::builder().reuse(events_only).build(&d1).unwrap();
    let block = pool.alloc_async::<u8>(1 << 16, &t1).unwrap();
    let at = block.device_ptr();
    drop(block); // freed on t1 (slot 0 of device 1) at a small position
                 // Device 0's slot 0 runs far ahead; an event there, waited on by t2, names "slot 0" at a
                 // position past the free, but it is device 0's slot 0.
    for _ in 0..8 {
        u1.host_fn(|| {}).unwrap();
    }
    let ev = u1.record_event().unwrap();
    t2.wait_event(&ev).unwrap();
    let other = pool.alloc_async::<u8>(1 << 16, &t2).unwrap();
    assert_ne!(other.device_ptr(), at, "t2 is not ordered after t1's free");
    assert_eq!(pool.stats().reuses.event_dependency, 0);
    drop((other, u2));
}

#[test]
fn owned_allocations_record_peer_uses_too() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d0.enable_peer_access(&d1).unwrap();
    let pool = MemPool::builder().build_owned(&d1).unwrap();
    let (s0, s1) = (d0.create_owned_stream().unwrap(), d1.create_owned_stream().unwrap());
    let weights = pool.upload(&[3u16; 64], &s1).unwrap();
    weights.record_use(&s0).unwrap();
    weights.record_use(&s0).unwrap(); // once per stream
    let local = MemPool::builder().build_owned(&d0).unwrap();
    let mut mine = local.alloc_zeros::<u16>(64, &s0).unwrap();
    s0.copy(&mut mine, &weights).unwrap();
    drop(weights);
    assert_eq!(s0.download(&mine).unwrap(), vec![3; 64]);
}

#[test]
fn a_driver_allocation_waits_for_its_peer_users() {
    let npu = two_devices();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    d1.enable_peer_access(&d0).unwrap();
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let mut plain = soma::DriverAlloc::<u8>::new(&d0, 4096).unwrap();
    s0.fill(&mut plain, 3).unwrap();
    s0.synchronize().unwrap();
    let pool = MemPool::builder().build(&d1).unwrap();
    let mut copy = pool.alloc_zeros::<u8>(4096, &s1).unwrap();
    s1.host_fn(|| std::thread::sleep(std::time::Duration::from_millis(30))).unwrap();
    s1.copy(&mut copy, &plain).unwrap();
    // Freeing synchronises device 1 too: the copy queued there reads the memory first.
    plain.free().unwrap();
    assert_eq!(s1.download(&copy).unwrap(), vec![3; 4096]);
}
