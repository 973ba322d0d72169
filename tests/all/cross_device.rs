//! Calls that mix two devices without peer access are refused before anything is enqueued on
//! either.

use soma::prelude::*;
use soma::{Error, KernelArg, MemPool};

fn enqueued(s: &soma::Stream<'_>) -> u64 {
    s.hal().enqueued()
}

#[test]
fn a_refused_cross_device_call_changes_nothing() {
    let npu = soma::sim::Npu::builder().devices(2).build().unwrap();
    let (d0, d1) = (npu.device(0).unwrap(), npu.device(1).unwrap());
    let (a, b) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (p0, p1) = (MemPool::builder().build(&d0).unwrap(), MemPool::builder().build(&d1).unwrap());
    let mut x = p0.alloc_zeros::<u8>(64, &a).unwrap();
    let y = p1.alloc_zeros::<u8>(64, &b).unwrap();
    let before = (enqueued(&a), enqueued(&b));
    // Ordering streams of unlinked devices, and an event recorded on another device's stream.
    let wrong_device: Vec<(&str, soma::Result<()>)> = vec![
        ("wait_stream", a.wait_stream(&b)),
        ("wait_stream back", b.wait_stream(&a)),
        ("record", b.record(&d0.create_event().unwrap())),
        ("wait_event", b.wait_event(&d0.create_event().unwrap())),
    ];
    for (what, result) in wrong_device {
        assert!(matches!(result, Err(Error::WrongDevice(_))), "{what}: {result:?}");
        assert_eq!((enqueued(&a), enqueued(&b)), before, "{what} enqueued work");
    }
    // Memory of a device the stream's device has no peer access to.
    let no_access: Vec<(&str, soma::Result<()>)> = vec![
        ("record_use", x.record_use(&b)),
        ("copy", a.copy(&mut x, &y)),
        ("copy on the other stream", b.copy(&mut x, &y)),
        ("launch", a.launch("k", &[KernelArg::write(&mut x), KernelArg::read(&y)], |_| Ok(()))),
        ("copy_from_host", b.copy_from_host(&mut x, &[1])),
        ("memset", b.memset(&mut x, 1)),
        ("fill", b.fill(&mut x, 1)),
    ];
    for (what, result) in no_access {
        match &result {
            Err(Error::PeerAccess(m)) => assert!(m.contains("is not enabled"), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!((enqueued(&a), enqueued(&b)), before, "{what} enqueued work");
    }
    let hb = soma::HostBuffer::new(&d1, 8).unwrap();
    assert!(matches!(a.copy_to_host_async(&x, hb), Err(Error::WrongDevice(_))));
    assert!(matches!(p0.alloc_async::<u8>(1, &b), Err(Error::WrongDevice(_))));
    assert_eq!((enqueued(&a), enqueued(&b)), before);
}
