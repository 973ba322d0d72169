//! Device memory: capacity, VMM calls, malloc, address validation, products.

use soma_sim::hal::{
    AccessMode, BufferAccess, DeviceHal, DevicePtr, DriverError, KernelLaunch, MemRef,
    PhysicalHandle,
};
use soma_sim::{Npu, Product};

use super::{device, fill_kernel, gate, read, recv, MIB};

const G: u64 = 2 * MIB;

fn is_invalid_address(e: &DriverError) -> bool {
    matches!(e, DriverError::InvalidAddress { .. })
}

#[test]
fn defaults_products_and_devices() {
    let npu = Npu::builder().devices(2).product(Product::Atlas300IDuo).build().unwrap();
    assert_eq!(npu.device_count(), 2);
    let d1 = npu.device(1).unwrap();
    let info = d1.info();
    assert_eq!(info.ordinal, 1);
    assert_eq!(info.total_memory, 64 << 30);
    assert_eq!(info.granularity, G);
    assert_eq!(info.product, "Atlas 300I Duo");
    assert!(!info.supports_native_pool);
    assert!(info.supports_vmm);
    assert!(npu.device(2).is_err());
    let a2 = Npu::builder().build().unwrap().device(0).unwrap();
    assert!(a2.info().supports_native_pool);
    assert_eq!(a2.info().product, "Atlas A2");
    // A 64 GiB device hands out a pool range as large as the device, several times.
    let r: Vec<DevicePtr> = (0..8).map(|_| a2.reserve(64 << 30).unwrap()).collect();
    for p in r {
        a2.release(p).unwrap();
    }
    assert!(Npu::builder().devices(0).build().is_err());
    assert!(Npu::builder().granularity(3 * MIB).build().is_err());
    assert!(Npu::builder().capacity(MIB).build().is_err());
}

#[test]
fn capacity_limit_is_out_of_memory_not_a_crash() {
    let dev = device(64 * MIB);
    let h1 = dev.alloc_physical(32 * MIB).unwrap();
    let p = dev.malloc(16 * MIB).unwrap();
    assert_eq!(dev.mem_info().unwrap().free, 16 * MIB);
    match dev.alloc_physical(32 * MIB) {
        Err(DriverError::OutOfMemory { requested, free }) => {
            assert_eq!((requested, free), (32 * MIB, 16 * MIB))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(dev.malloc(16 * MIB + 1), Err(DriverError::OutOfMemory { .. })));
    let h2 = dev.alloc_physical(16 * MIB).unwrap();
    assert_eq!(dev.mem_info().unwrap().free, 0);
    dev.free_physical(h1).unwrap();
    dev.free_physical(h2).unwrap();
    dev.free(p).unwrap();
    let mi = dev.mem_info().unwrap();
    assert_eq!((mi.free, mi.total), (64 * MIB, 64 * MIB));
    let st = dev.stats();
    assert_eq!((st.physical_bytes, st.malloc_bytes, st.mapped_bytes), (0, 0, 0));
}

#[test]
fn reserve_map_unmap_release() {
    let dev = device(64 * MIB);
    let va = dev.reserve(4 * G).unwrap();
    assert_eq!(va.addr() % G, 0);
    let h1 = dev.alloc_physical(G).unwrap();
    let h2 = dev.alloc_physical(G).unwrap();
    // Not mapped yet: tasks and sync copies are rejected.
    assert!(is_invalid_address(&dev.memset_sync(va, 1, 1).unwrap_err()));
    dev.map(va, h1).unwrap();
    let va2 = va.checked_add(G).unwrap();
    dev.map(va2, h2).unwrap();
    assert_eq!(dev.stats().mapped_bytes, 2 * G);
    // A range spanning two adjacent mappings is fine; past the end is not.
    let s = dev.create_stream().unwrap();
    s.launch(fill_kernel(va.checked_add(G - 8).unwrap(), 16, 5)).unwrap();
    s.synchronize().unwrap();
    assert_eq!(read(&dev, va.checked_add(G - 8).unwrap(), 16), vec![5; 16]);
    assert!(s.launch(fill_kernel(va2, G + 1, 5)).is_err());
    // Bad map calls.
    let h3 = dev.alloc_physical(G).unwrap();
    assert!(dev.map(va, h3).is_err(), "already mapped there");
    assert!(dev.map(va2, h1).is_err(), "handle already mapped");
    assert!(dev.map(va.checked_add(4096 + 2 * G).unwrap(), h3).is_err(), "misaligned");
    assert!(dev.map(va.checked_add(4 * G).unwrap(), h3).is_err(), "outside the reservation");
    assert!(dev.map(va, PhysicalHandle(9999)).is_err(), "unknown handle");
    assert!(dev.free_physical(h1).is_err(), "still mapped");
    assert!(dev.release(va).is_err(), "still mapped");
    assert!(dev.unmap(va.checked_add(4096).unwrap()).is_err(), "not a mapping start");
    assert!(dev.release(va.checked_add(G).unwrap()).is_err(), "not a reservation base");
    assert!(dev.reserve(G + 1).is_err() && dev.reserve(0).is_err());
    assert!(dev.alloc_physical(G / 2).is_err());
    // Unmap returns the handle; the physical memory keeps its contents, wherever it is
    // mapped again (as on a device: only `free_physical` gives the memory up).
    assert_eq!(dev.unmap(va).unwrap(), h1);
    assert!(is_invalid_address(&dev.memset_sync(va, 1, 1).unwrap_err()));
    let va3 = va.checked_add(2 * G).unwrap();
    dev.map(va3, h1).unwrap();
    assert_eq!(read(&dev, va3.checked_add(G - 8).unwrap(), 8), vec![5; 8]);
    // The address h1 left reads as fresh memory under another handle.
    dev.map(va, h3).unwrap();
    assert_eq!(read(&dev, va.checked_add(G - 8).unwrap(), 8), vec![0; 8]);
    assert_eq!(dev.unmap(va).unwrap(), h3);
    assert_eq!(dev.unmap(va2).unwrap(), h2);
    assert_eq!(dev.unmap(va.checked_add(2 * G).unwrap()).unwrap(), h1);
    for h in [h1, h2, h3] {
        dev.free_physical(h).unwrap();
    }
    assert!(dev.free_physical(h1).is_err(), "double free");
    dev.release(va).unwrap();
    assert!(dev.release(va).is_err(), "double release");
    // The address space is reused (first fit).
    assert_eq!(dev.reserve(4 * G).unwrap(), va);
    let c = dev.stats().calls;
    assert!(c.map >= 8 && c.unmap >= 4 && c.reserve >= 4 && c.release >= 3);
}

#[test]
fn malloc_free_and_bad_pointers() {
    let dev = device(64 * MIB);
    let p = dev.malloc(100).unwrap();
    assert_eq!(p.addr() % G, 0);
    assert_eq!(dev.stats().malloc_bytes, G, "granule rounded");
    assert!(dev.malloc(0).is_err());
    assert!(dev.malloc(u64::MAX).is_err());
    assert!(dev.free(p.checked_add(64).unwrap()).is_err(), "interior pointer");
    assert!(dev.release(p).is_err(), "malloc memory is not a reservation");
    assert!(dev.unmap(p).is_err(), "malloc memory is not a user mapping");
    dev.free(p).unwrap();
    assert!(is_invalid_address(&dev.free(p).unwrap_err()), "double free");
    assert!(dev.free(DevicePtr::new(0x1000).unwrap()).is_err(), "never allocated");
    assert_eq!(dev.stats().malloc_bytes, 0);
}

#[test]
fn invalid_ranges_are_errors_at_enqueue() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let p = dev.malloc(G).unwrap();
    let out = p.checked_add(G).unwrap();
    let wild = DevicePtr::new(0x10).unwrap();
    assert!(is_invalid_address(&s.memset(out, 0, 1).unwrap_err()));
    assert!(is_invalid_address(&s.memset(wild, 0, 1).unwrap_err()));
    assert!(is_invalid_address(&s.copy_d2d(p, p.checked_add(1).unwrap(), G).unwrap_err()));
    assert!(s.memset(DevicePtr::new(u64::MAX - 1).unwrap(), 0, 16).is_err(), "overflow");
    let mut host = [0u8; 16];
    // SAFETY: `host` is valid for 16 bytes; the copies are rejected before anything runs.
    unsafe {
        assert!(s.copy_async(MemRef::Host(host.as_mut_ptr()), MemRef::Device(wild), 16).is_err());
        assert!(dev.copy_sync(MemRef::Device(out), MemRef::Host(host.as_mut_ptr()), 16).is_err());
    }
    assert!(is_invalid_address(&s.launch(fill_kernel(wild, 4, 1)).unwrap_err()));
    // Overlapping write buffers are rejected at launch.
    let overlapping = KernelLaunch {
        name: "overlap",
        buffers: vec![
            BufferAccess { ptr: p, len: 64, mode: AccessMode::Write },
            BufferAccess { ptr: p.checked_add(32).unwrap(), len: 64, mode: AccessMode::Read },
        ],
        body: Box::new(|_| Ok(())),
    };
    assert!(matches!(s.launch(overlapping), Err(DriverError::InvalidValue(_))));
    assert_eq!(s.enqueued(), 0, "nothing was enqueued");
    s.synchronize().unwrap();
    drop(s);
    dev.free(p).unwrap();
}

#[test]
fn memory_freed_before_a_queued_task_runs_fails_the_task() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let p = dev.malloc(G).unwrap();
    let (tx, rx) = gate();
    s.host_fn(Box::new(move || recv(&rx))).unwrap();
    s.launch(fill_kernel(p, 64, 1)).unwrap();
    dev.free(p).unwrap(); // the kernel has not started: nothing is in flight
    tx.send(()).unwrap();
    let e = s.synchronize().unwrap_err();
    match e {
        DriverError::TaskFailed { task: 2, message, .. } => {
            // With SOMA_SANITIZER=fail the sanitizer reports it first, as a use after free.
            assert!(
                message.contains("not inside mapped device memory")
                    || message.contains("use after free"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn sync_copies_round_trip() {
    let dev = device(64 * MIB);
    let p = dev.malloc(G).unwrap();
    let data: Vec<u8> = (0..255).collect();
    // SAFETY: `data` is valid for reads of its length during the call.
    unsafe {
        dev.copy_sync(MemRef::Device(p), MemRef::Host(data.as_ptr().cast_mut()), 255).unwrap();
        dev.copy_sync(MemRef::Device(p.checked_add(1000).unwrap()), MemRef::Device(p), 255)
            .unwrap();
    }
    dev.memset_sync(p, 7, 10).unwrap();
    assert_eq!(read(&dev, p.checked_add(1000).unwrap(), 255), data);
    assert_eq!(read(&dev, p, 11), [vec![7; 10], vec![10]].concat());
    dev.free(p).unwrap();
}
