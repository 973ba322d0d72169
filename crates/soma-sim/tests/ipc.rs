//! Physical memory shared between two processes: the test binary runs itself as the
//! importing process (the ignored `importer` test, run only by the parent).

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use soma_sim::hal::{
    AccessMode, BufferAccess, DeviceHal, DevicePtr, DriverError, KernelLaunch, MemRef,
    ShareableHandle,
};
use soma_sim::{Npu, SimDevice};

const G: u64 = 2 << 20;

fn device() -> std::sync::Arc<SimDevice> {
    Npu::builder().capacity(1 << 30).build().unwrap().device(0).unwrap()
}

fn read_byte(dev: &SimDevice, at: DevicePtr) -> u8 {
    let mut b = [0u8; 1];
    // SAFETY: `b` is a live host buffer of one byte for the duration of the call.
    unsafe { dev.copy_sync(MemRef::Host(b.as_mut_ptr()), MemRef::Device(at), 1) }.unwrap();
    b[0]
}

/// Whether a kernel writing 64 bytes at `at` is handed the device bytes themselves (rather
/// than a private copy of them).
fn kernel_sees_device_bytes(dev: &SimDevice, at: DevicePtr) -> bool {
    let s = dev.create_stream().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    s.launch(KernelLaunch {
        name: "where",
        buffers: vec![BufferAccess { ptr: at, len: 64, mode: AccessMode::Write }],
        body: Box::new(move |b| {
            tx.send(b.bytes_mut(0)?.as_ptr() as u64).unwrap();
            Ok(())
        }),
    })
    .unwrap();
    s.synchronize().unwrap();
    rx.recv().unwrap() == at.addr()
}

/// Starts the importing process with `mode`; it reads its shareable handle from stdin.
fn spawn_importer(mode: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "importer", "--ignored", "--nocapture", "--test-threads=1"])
        .env("SOMA_SIM_IPC_TEST", mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// Sends `handle` to the importer and returns the lines it printed (within 60 s).
fn converse(mut child: Child, handle: ShareableHandle) -> Vec<String> {
    writeln!(child.stdin.take().unwrap(), "{}", handle.0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = std::io::BufReader::new(child.stdout.take().unwrap());
            let lines: Vec<String> = out.lines().map_while(Result::ok).collect();
            assert!(status.success(), "importer failed: {lines:?}");
            // The harness prints the test's name on the line of its first output.
            return lines
                .iter()
                .filter_map(|l| l.find("importer:").map(|i| l[i..].to_owned()))
                .collect();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the importing process did not finish in time");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The importing process: imports the handle it reads from stdin, per `SOMA_SIM_IPC_TEST`.
#[test]
#[ignore = "the importing process of the IPC tests, started by them"]
fn importer() {
    let mode = std::env::var("SOMA_SIM_IPC_TEST").expect("run by the IPC tests");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let handle = ShareableHandle(line.trim().parse().unwrap());
    let dev = device();
    let imported = dev.import_physical(handle, 0);
    match mode.as_str() {
        "share" => {
            let h = imported.unwrap();
            dev.free_physical(h).unwrap();
            let wrong = dev.import_physical(handle, 2 * G);
            assert!(
                matches!(wrong, Err(DriverError::InvalidValue(m)) if m.contains("not 4194304"))
            );
            let h = dev.import_physical(handle, G).unwrap();
            let again = dev.import_physical(handle, 0);
            assert!(
                matches!(again, Err(DriverError::InvalidValue(m)) if m.contains("already imported"))
            );
            assert_eq!(dev.stats().imported_bytes, G);
            assert_eq!(dev.stats().physical_bytes, 0, "not this device's memory");
            let va = dev.reserve(G).unwrap();
            dev.map(va, h).unwrap();
            println!("importer: read {:#x}", read_byte(&dev, va));
            assert!(!kernel_sees_device_bytes(&dev, va), "imported memory is shared");
            dev.memset_sync(va, 0xC3, G).unwrap();
            dev.unmap(va).unwrap();
            assert!(dev.export_physical(h, false).is_err(), "imports are not exported again");
            dev.free_physical(h).unwrap();
            dev.release(va).unwrap();
            let st = dev.stats();
            assert_eq!((st.imported_bytes, st.mapped_bytes), (0, 0));
        }
        _ => println!("importer: refused: {}", imported.unwrap_err()),
    }
}

#[test]
fn two_processes_see_the_same_bytes() {
    let dev = device();
    let va = dev.reserve(G).unwrap();
    let h = dev.alloc_physical(G).unwrap();
    dev.map(va, h).unwrap();
    dev.memset_sync(va, 0x5A, G).unwrap();
    let handle = dev.export_physical(h, true).unwrap();
    assert!(dev.export_physical(h, true).is_err(), "one shareable handle per handle");
    let own = dev.import_physical(handle, 0);
    assert!(matches!(own, Err(DriverError::InvalidValue(m)) if m.contains("across processes")));
    let child = spawn_importer("share");
    dev.allow_shareable_pids(handle, &[child.id() as i32]).unwrap();
    let lines = converse(child, handle);
    assert_eq!(lines, ["importer: read 0x5a"]);
    assert_eq!(read_byte(&dev, va), 0xC3, "the importer's write");
    dev.unmap(va).unwrap();
    dev.free_physical(h).unwrap();
    dev.release(va).unwrap();
    assert!(dev.allow_shareable_pids(handle, &[1]).is_err(), "freed: no longer exported");
}

/// Memory no other process can map keeps the direct path; from its export on, kernels get
/// private copies of it, wherever it is mapped.
#[test]
fn exported_memory_reaches_kernels_as_copies() {
    let dev = device();
    let va = dev.reserve(G).unwrap();
    let h = dev.alloc_physical(G).unwrap();
    dev.map(va, h).unwrap();
    assert!(kernel_sees_device_bytes(&dev, va), "not shared: the device bytes");
    let handle = dev.export_physical(h, true).unwrap();
    assert!(!kernel_sees_device_bytes(&dev, va), "exported: a private copy");
    dev.unmap(va).unwrap();
    dev.map(va, h).unwrap();
    assert!(!kernel_sees_device_bytes(&dev, va), "mapped again: still shared");
    dev.memset_sync(va, 0x3C, G).unwrap();
    assert_eq!(read_byte(&dev, DevicePtr::new(va.addr() + G - 1).unwrap()), 0x3C);
    dev.unmap(va).unwrap();
    dev.free_physical(h).unwrap();
    dev.release(va).unwrap();
    assert!(dev.allow_shareable_pids(handle, &[1]).is_err());
}

#[test]
fn a_process_not_on_the_whitelist_is_refused() {
    let dev = device();
    let h = dev.alloc_physical(G).unwrap();
    let handle = dev.export_physical(h, true).unwrap();
    assert!(dev.allow_shareable_pids(handle, &[]).is_err(), "an empty list");
    let lines = converse(spawn_importer("refused"), handle);
    assert_eq!(lines.len(), 1);
    assert!(lines[0].contains("not on the whitelist"), "{lines:?}");
    dev.free_physical(h).unwrap();
}

#[test]
fn a_freed_export_is_refused() {
    let dev = device();
    let h = dev.alloc_physical(G).unwrap();
    let handle = dev.export_physical(h, false).unwrap();
    dev.free_physical(h).unwrap();
    let lines = converse(spawn_importer("refused"), handle);
    assert!(lines[0].contains("not exported"), "{lines:?}");
    // A process that does not exist answers nothing.
    let dev2 = device();
    let e = dev2.import_physical(ShareableHandle(0x7fff_fff0 << 32 | 1), G);
    assert!(matches!(e, Err(DriverError::InvalidHandle(m)) if m.contains("does not answer")));
}
