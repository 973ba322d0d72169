//! `DriverAlloc`, the plain driver path the pool is measured against: it must hold data
//! through copies and kernels like a pool allocation, and its free must synchronise the device
//! before giving the memory back (the cost the pool removes), reporting a failed stream
//! without keeping the memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use soma::hal::KernelError;
use soma::sim::Npu;
use soma::{DeviceBuffer, DriverAlloc, KernelArg, MemPool};

const MIB: u64 = 1 << 20;

#[test]
fn holds_data_through_copies_and_kernels() {
    let npu = Npu::builder().capacity(256 * MIB).build().unwrap();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let mut a = DriverAlloc::<u32>::new(&dev, 1000).unwrap();
    let mut b = DriverAlloc::<u32>::new(&dev, 1000).unwrap();
    assert_eq!((a.len(), a.is_empty(), a.byte_len()), (1000, false, 4000));
    assert_ne!(a.device_ptr(), b.device_ptr());

    let src: Vec<u32> = (0..1000).collect();
    s.copy_from_host(&mut a, &src).unwrap();
    s.launch("times3", &[KernelArg::read(&a), KernelArg::write(&mut b)], |k| {
        let (x, y) = (k.read::<u32>(0)?, k.write::<u32>(1)?);
        y.iter_mut().zip(x).for_each(|(y, x)| *y = 3 * x);
        Ok(())
    })
    .unwrap();
    let mut out = vec![0u32; 1000];
    s.copy_to_host(&b, &mut out).unwrap();
    s.synchronize().unwrap();
    assert_eq!(out, src.iter().map(|x| 3 * x).collect::<Vec<_>>());

    // Device-to-device between the driver path and a pool allocation, both ways.
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut p = pool.alloc_async::<u32>(1000, &s).unwrap();
    s.copy(&mut p, &b).unwrap();
    s.memset(&mut a, 0).unwrap();
    s.copy(&mut a, &p).unwrap();
    let mut back = vec![0u32; 1000];
    s.copy_to_host(&a, &mut back).unwrap();
    s.synchronize().unwrap();
    assert_eq!(back, out);
}

#[test]
fn free_waits_for_the_device_then_gives_the_memory_back() {
    let npu = Npu::builder().capacity(256 * MIB).build().unwrap();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let free_before = dev.mem_info().unwrap().free;
    let a = DriverAlloc::<u8>::new(&dev, (8 * MIB) as usize).unwrap();
    assert!(dev.mem_info().unwrap().free <= free_before - 8 * MIB);

    let done = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&done);
    s.host_fn(move || {
        std::thread::sleep(Duration::from_millis(50));
        flag.store(true, Ordering::SeqCst);
    })
    .unwrap();
    a.free().unwrap();
    assert!(done.load(Ordering::SeqCst), "free returned before the device's pending work ran");
    assert_eq!(dev.mem_info().unwrap().free, free_before);
}

#[test]
fn free_reports_a_failed_stream_and_still_frees() {
    let npu = Npu::builder().capacity(256 * MIB).build().unwrap();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let free_before = dev.mem_info().unwrap().free;
    let mut a = DriverAlloc::<u32>::new(&dev, 64).unwrap();
    s.launch("fails", &[KernelArg::write(&mut a)], |_| Err(KernelError::new("planted"))).unwrap();
    let err = a.free().expect_err("the failed kernel is reported by the free's synchronize");
    assert!(err.to_string().contains("planted"), "{err}");
    assert_eq!(dev.mem_info().unwrap().free, free_before, "the memory is freed regardless");

    // Dropping (instead of `free`) frees too, reporting nothing.
    let b = DriverAlloc::<u32>::new(&dev, 64).unwrap();
    assert!(dev.mem_info().unwrap().free < free_before);
    drop(b);
    assert_eq!(dev.mem_info().unwrap().free, free_before);
}
