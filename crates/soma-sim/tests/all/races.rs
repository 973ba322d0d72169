//! The in-flight access table: planted races are caught, concurrent readers are not.

use crossbeam_channel::{Receiver, Sender};
use soma_sim::hal::{
    AccessMode, BufferAccess, DeviceHal, DevicePtr, DriverError, KernelLaunch, MemRef,
};

use super::{device, fill_kernel, gate, read, recv, task_failed, MIB};

/// A kernel over `[ptr, ptr + len)` in `mode` that signals `started` and then blocks until the
/// gate opens: it stays in flight as long as the test wants.
fn held_kernel(
    ptr: DevicePtr,
    len: u64,
    mode: AccessMode,
    started: Sender<()>,
    gate: Receiver<()>,
) -> KernelLaunch {
    KernelLaunch {
        name: "held",
        buffers: vec![BufferAccess { ptr, len, mode }],
        body: Box::new(move |b| {
            if mode == AccessMode::Write {
                b.bytes_mut(0)?.fill(0x11);
            } else {
                let _ = b.bytes(0)?;
            }
            started.send(()).ok();
            recv(&gate);
            Ok(())
        }),
    }
}

fn read_kernel(ptr: DevicePtr, len: u64) -> KernelLaunch {
    KernelLaunch {
        name: "reader",
        buffers: vec![BufferAccess { ptr, len, mode: AccessMode::Read }],
        body: Box::new(|b| b.bytes(0).map(drop)),
    }
}

#[test]
fn planted_race_between_two_streams_is_caught() {
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let buf = dev.malloc(MIB).unwrap();
    let (started_tx, started_rx) = gate();
    let (go_tx, go_rx) = gate();
    // Stream A writes the buffer and stays in flight.
    a.launch(held_kernel(buf, 4096, AccessMode::Write, started_tx, go_rx)).unwrap();
    recv(&started_rx);
    // Stream B reads overlapping bytes with no ordering: a data race.
    b.launch(read_kernel(buf.checked_add(100).unwrap(), 8)).unwrap();
    let (stream, task, name, msg) = task_failed(&b.synchronize().unwrap_err());
    assert_eq!((stream, task, name.as_str()), (b.id(), 1, "reader"));
    assert!(msg.contains("concurrent conflicting access (data race)"), "{msg}");
    assert!(msg.contains(&format!("stream {} task 1", b.id())), "{msg}");
    assert!(msg.contains(&format!("stream {} task 1 writes", a.id())), "{msg}");

    // Copies, memsets and synchronous calls participate too.
    let c = dev.create_stream().unwrap();
    c.memset(buf.checked_add(4000).unwrap(), 0, 200).unwrap();
    assert!(task_failed(&c.synchronize().unwrap_err()).3.contains("data race"));
    let d = dev.create_stream().unwrap();
    let other = dev.malloc(MIB).unwrap();
    d.copy_d2d(other, buf, 16).unwrap();
    assert!(task_failed(&d.synchronize().unwrap_err()).3.contains("data race"));
    let e = dev.memset_sync(buf, 0, 1).unwrap_err();
    assert!(e.to_string().contains("data race"), "{e}");
    let mut host = [0u8; 8];
    // SAFETY: `host` is valid for 8 bytes of writes during the call.
    let e = unsafe { dev.copy_sync(MemRef::Host(host.as_mut_ptr()), MemRef::Device(buf), 8) };
    assert!(e.unwrap_err().to_string().contains("data race"));

    // Memory in flight cannot be freed from under the task.
    assert!(dev.free(buf).is_err());
    // Non-overlapping access at the same time is fine.
    let e2 = dev.create_stream().unwrap();
    e2.launch(fill_kernel(buf.checked_add(4096).unwrap(), 4096, 3)).unwrap();
    e2.synchronize().unwrap();

    go_tx.send(()).unwrap();
    a.synchronize().unwrap();
    assert_eq!(read(&dev, buf, 16), vec![0x11; 16], "the racing writers did not run");
    drop((a, b, c, d, e2));
    dev.free(buf).unwrap();
    dev.free(other).unwrap();
}

#[test]
fn concurrent_readers_are_not_a_race() {
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let buf = dev.malloc(MIB).unwrap();
    let (started_tx, started_rx) = gate();
    let (go_tx, go_rx) = gate();
    a.launch(held_kernel(buf, 4096, AccessMode::Read, started_tx, go_rx)).unwrap();
    recv(&started_rx);
    b.launch(read_kernel(buf, 4096)).unwrap();
    let other = dev.malloc(MIB).unwrap();
    b.copy_d2d(other, buf, 4096).unwrap(); // reads buf: fine
    b.synchronize().unwrap();
    assert_eq!(read(&dev, buf, 8), vec![0; 8], "sync reads are fine too");
    go_tx.send(()).unwrap();
    a.synchronize().unwrap();
}

#[test]
fn ordered_streams_never_conflict_under_load() {
    // Ping-pong writes on one buffer, ordered by events: no false positives.
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (ea, eb) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    let buf = dev.malloc(MIB).unwrap();
    for i in 0..200u32 {
        a.wait(eb.as_ref()).unwrap();
        a.launch(fill_kernel(buf, 4096, (2 * i) as u8)).unwrap();
        a.record(ea.as_ref()).unwrap();
        b.wait(ea.as_ref()).unwrap();
        b.launch(fill_kernel(buf, 4096, (2 * i + 1) as u8)).unwrap();
        b.record(eb.as_ref()).unwrap();
    }
    dev.synchronize().unwrap();
    assert_eq!(read(&dev, buf, 4096), vec![(2 * 199 + 1) as u8; 4096]);
}

#[test]
fn unordered_writers_under_load_fail_rather_than_race() {
    // Two streams hammer the same bytes without ordering. Whatever the interleaving, every
    // kernel either ran alone on the bytes or failed with a data race: the stream errors are
    // the only observable effect, never corrupted memory or UB.
    let dev = device(64 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let buf = dev.malloc(MIB).unwrap();
    for _ in 0..500 {
        a.launch(fill_kernel(buf, 64 * 1024, 1)).unwrap();
        b.launch(fill_kernel(buf, 64 * 1024, 2)).unwrap();
    }
    for s in [&a, &b] {
        if let Err(e) = s.synchronize() {
            assert!(
                matches!(&e, DriverError::TaskFailed { message, .. } if message.contains("data race"))
            );
        }
    }
    let bytes = read(&dev, buf, 64 * 1024);
    assert!(bytes.iter().all(|&x| x == bytes[0]), "no torn kernel writes");
}
