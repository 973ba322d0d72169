//! Fault injection leaves no state behind.

use soma_sim::hal::{DeviceHal, DriverError};
use soma_sim::FaultKind;

use super::{device, fill_kernel, read, task_failed, MIB};

const G: u64 = 2 * MIB;

#[test]
fn injected_alloc_physical_leaves_no_state() {
    let dev = device(64 * MIB);
    dev.faults().fail_nth(FaultKind::AllocPhysical, 2);
    let h1 = dev.alloc_physical(G).unwrap();
    let before = (dev.stats().physical_bytes, dev.mem_info().unwrap());
    assert!(matches!(dev.alloc_physical(G), Err(DriverError::Injected(_))));
    assert_eq!((dev.stats().physical_bytes, dev.mem_info().unwrap()), before);
    let h3 = dev.alloc_physical(G).unwrap(); // the rule fired once
    dev.free_physical(h1).unwrap();
    dev.free_physical(h3).unwrap();
    assert_eq!(dev.stats().physical_bytes, 0);
    assert_eq!(dev.stats().calls.alloc_physical, 3);
}

/// Every call counts towards the k of a rule, one with bad arguments too, for every kind.
#[test]
fn calls_with_bad_arguments_count_towards_a_rule() {
    let dev = device(64 * MIB);
    let va = dev.reserve(2 * G).unwrap();
    dev.faults().fail_nth(FaultKind::AllocPhysical, 2);
    assert!(matches!(dev.alloc_physical(G + 1), Err(DriverError::InvalidValue(_))));
    assert!(matches!(dev.alloc_physical(G), Err(DriverError::Injected(_))));
    dev.faults().fail_nth(FaultKind::Malloc, 2);
    assert!(dev.malloc(0).is_err());
    assert!(matches!(dev.malloc(G), Err(DriverError::Injected(_))));
    let h = dev.alloc_physical(G).unwrap();
    dev.faults().fail_nth(FaultKind::Map, 2);
    assert!(matches!(
        dev.map(va, soma_sim::hal::PhysicalHandle(999)),
        Err(DriverError::InvalidHandle(_))
    ));
    assert!(matches!(dev.map(va, h), Err(DriverError::Injected(_))));
    dev.map(va, h).unwrap();
    dev.unmap(va).unwrap();
    dev.free_physical(h).unwrap();
    dev.release(va).unwrap();
    let calls = dev.stats().calls;
    assert_eq!((calls.alloc_physical, calls.malloc, calls.map), (3, 2, 3));
}

#[test]
fn injected_map_leaves_nothing_mapped() {
    let dev = device(64 * MIB);
    let va = dev.reserve(4 * G).unwrap();
    let h = dev.alloc_physical(G).unwrap();
    dev.faults().fail_every(FaultKind::Map, 1);
    assert!(matches!(dev.map(va, h), Err(DriverError::Injected(_))));
    assert_eq!(dev.stats().mapped_bytes, 0);
    assert!(dev.memset_sync(va, 0, 1).is_err(), "not accessible");
    assert!(dev.unmap(va).is_err(), "nothing to unmap");
    assert!(dev.map(va, h).is_err(), "still failing every call");
    dev.faults().clear(FaultKind::Map);
    dev.map(va, h).unwrap(); // the handle was not consumed
    dev.memset_sync(va, 0, 1).unwrap();
    dev.unmap(va).unwrap();
    dev.free_physical(h).unwrap();
    dev.release(va).unwrap(); // nothing left mapped in the reservation
}

#[test]
fn injected_malloc_leaves_no_state() {
    let dev = device(64 * MIB);
    let p1 = dev.malloc(G).unwrap();
    dev.free(p1).unwrap();
    dev.faults().fail_every(FaultKind::Malloc, 2);
    let p2 = dev.malloc(G).unwrap();
    assert!(matches!(dev.malloc(G), Err(DriverError::Injected(_))));
    assert_eq!(dev.stats().malloc_bytes, G);
    assert_eq!(dev.mem_info().unwrap().free, 64 * MIB - G);
    let p3 = dev.malloc(G).unwrap();
    assert_eq!(p3.addr(), p2.addr() + G, "no address space was consumed by the failure");
    assert!(dev.malloc(G).is_err());
    dev.faults().fail_nth(FaultKind::Malloc, 0); // clears
    dev.free(p2).unwrap();
    dev.free(p3).unwrap();
    assert_eq!(p1, dev.malloc(G).unwrap());
}

#[test]
fn injected_task_faults() {
    let dev = device(64 * MIB);
    let s = dev.create_stream().unwrap();
    let buf = dev.malloc(G).unwrap();
    dev.faults().fail_task(s.id(), 2);
    s.launch(fill_kernel(buf, 16, 1)).unwrap();
    s.launch(fill_kernel(buf, 16, 2)).unwrap();
    s.launch(fill_kernel(buf, 16, 3)).unwrap();
    let (stream, task, name, msg) = task_failed(&s.synchronize().unwrap_err());
    assert_eq!((stream, task, name.as_str()), (s.id(), 2, "fill"));
    assert!(msg.contains("injected"), "{msg}");
    assert_eq!(read(&dev, buf, 16), vec![1; 16], "task 2 and later did not run");

    let s2 = dev.create_stream().unwrap();
    s2.launch(fill_kernel(buf, 16, 4)).unwrap();
    s2.synchronize().unwrap();
    dev.faults().fail_next_task(s2.id());
    s2.launch(fill_kernel(buf, 16, 5)).unwrap();
    let (_, task, _, _) = task_failed(&s2.synchronize().unwrap_err());
    assert_eq!(task, 2);
    assert_eq!(read(&dev, buf, 16), vec![4; 16]);
}
