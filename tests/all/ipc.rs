//! Pools shared between processes: the test binary runs itself as the importing process (the
//! ignored `ipc::importer_process` test, started only by the tests here), which takes its
//! lines from stdin and answers on stdout.

use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use soma::{
    Device, DeviceBuffer, Error, ExportedPointer, HandleType, IpcErrorKind, MemPool, PoolDescriptor,
};

use crate::common::npu;

const MIB: u64 = 1 << 20;
/// How long the parent waits for any line of the importer before failing.
const PATIENCE: Duration = Duration::from_secs(60);

/// The importing process, seen from the test.
struct Importer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Importer {
    /// Starts the importing process in `mode`.
    fn start(mode: &str) -> Importer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "ipc::importer_process", "--ignored", "--nocapture"])
            .args(["--test-threads=1"])
            .env("SOMA_IPC_TEST", mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                // The harness prints the test's name on the line of its first output.
                if let Some(i) = line.find("child: ") {
                    let _ = tx.send(line[i + 7..].to_owned());
                }
            }
        });
        Importer { child, stdin, lines }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn send(&mut self, line: impl std::fmt::Display) {
        writeln!(self.stdin, "{line}").unwrap();
    }

    /// The importer's next line.
    fn next(&mut self) -> String {
        match self.lines.recv_timeout(PATIENCE) {
            Ok(line) => line,
            Err(_) => {
                let _ = self.child.kill();
                panic!("the importing process said nothing in time (it failed or hangs)");
            }
        }
    }

    /// Waits for the importer to exit, successfully.
    fn finish(mut self) {
        let deadline = std::time::Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "the importing process failed: {status}");
                return;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the importing process did not exit in time");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn read_line() -> String {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    line.trim().to_owned()
}

fn kind(e: &Error) -> IpcErrorKind {
    match e {
        Error::Ipc { kind, .. } => *kind,
        other => panic!("not an IPC error: {other}"),
    }
}

/// What the importer's device says of its memory after the imported pool is gone.
fn importer_memory_line(npu: &soma::sim::Npu) -> String {
    let st = npu.sim_device(0).unwrap().stats();
    format!("memory {} {} {}", st.imported_bytes, st.mapped_bytes, st.physical_bytes)
}

/// The importing process.
#[test]
#[ignore = "the importing process of the IPC tests, started by them"]
fn importer_process() {
    let mode = std::env::var("SOMA_IPC_TEST").expect("run by the IPC tests");
    let npu = npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let desc: PoolDescriptor = read_line().parse().unwrap();
    // Every exchange below is ordered by the lines the two processes trade: the exporter
    // synchronizes before it sends a pointer and reads the importer's bytes only after the
    // importer said it wrote them (and synchronized).
    let imported = MemPool::import(&desc, &dev);
    let pool = match (mode.as_str(), imported) {
        ("refused", Err(e)) => return println!("child: {:?}", kind(&e)),
        (_, imported) => imported.unwrap(),
    };
    let twice = MemPool::import(&desc, &dev).unwrap_err();
    println!("child: twice {:?}", kind(&twice));
    match mode.as_str() {
        "share" => {
            let a: ExportedPointer = read_line().parse().unwrap();
            let b: ExportedPointer = read_line().parse().unwrap();
            let a = pool.open::<u32>(&a).unwrap();
            let mut host = vec![0u32; a.len()];
            s.copy_to_host(&a, &mut host).unwrap();
            println!("child: a {} {}", host.len(), host.iter().map(|&x| u64::from(x)).sum::<u64>());
            let mut b = pool.open::<u32>(&b).unwrap();
            let values: Vec<u32> = (0..b.len() as u32).map(|i| i * 3).collect();
            s.copy_from_host(&mut b, &values).unwrap();
            s.synchronize().unwrap();
            println!("child: wrote b");
            drop((a, b));
        }
        "hold" => {
            let a: ExportedPointer = read_line().parse().unwrap();
            let held = pool.open::<u8>(&a).unwrap();
            println!("child: held");
            assert_eq!(read_line(), "release");
            drop(held);
            println!("child: released");
            let again = pool.open::<u8>(&a).map(drop).map_err(|e| kind(&e));
            println!("child: reopen {again:?}");
        }
        "bad" => {
            let a: ExportedPointer = read_line().parse().unwrap();
            let odd = pool.open::<u64>(&ExportedPointer::clone(&a)).map(drop);
            println!("child: odd {:?}", odd.map_err(|e| kind(&e)));
            let foreign: ExportedPointer =
                format!("soma-ptr:{}:0:{}:0:64", a.process_id(), a.pool_id() + 1000)
                    .parse()
                    .unwrap();
            let foreign = pool.open::<u8>(&foreign).map(drop).map_err(|e| kind(&e));
            println!("child: foreign {foreign:?}");
            let unexported: ExportedPointer = a
                .to_string()
                .replace(&format!(":{}:{}", a.offset(), a.byte_len()), ":0:64")
                .parse()
                .unwrap();
            let unexported = pool.open::<u8>(&unexported).map(drop).map_err(|e| kind(&e));
            println!("child: unexported {unexported:?}");
            assert_eq!(read_line(), "dropped");
            let gone = pool.open::<u8>(&a).map(drop).map_err(|e| kind(&e));
            println!("child: gone {gone:?}");
        }
        other => panic!("unknown mode {other}"),
    }
    drop(pool);
    println!("child: {}", importer_memory_line(&npu));
}

/// A KV pool of the exporter, shareable.
fn shared_pool(dev: &Device) -> MemPool<'_> {
    MemPool::builder().handle_type(HandleType::Posix).max_size(64 * MIB).build(dev).unwrap()
}

#[test]
fn another_process_reads_and_writes_the_pool() {
    let npu = npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = shared_pool(&dev);
    let mut a = pool.alloc_async::<u32>(1000, &s).unwrap();
    s.copy_from_host(&mut a, &(0..1000).collect::<Vec<u32>>()).unwrap();
    // Larger than a segment's worth at first: the importer maps several.
    let b = pool.alloc_async::<u32>(3 << 20, &s).unwrap();
    s.synchronize().unwrap();
    let desc = pool.export().unwrap();
    let own = MemPool::import(&desc, &dev).unwrap_err();
    assert_eq!(kind(&own), IpcErrorKind::SameProcess);

    let mut child = Importer::start("share");
    pool.allow_process(child.pid()).unwrap();
    child.send(desc);
    assert_eq!(child.next(), "twice AlreadyImported");
    child.send(a.export_pointer().unwrap());
    child.send(b.export_pointer().unwrap());
    assert_eq!(child.next(), format!("a 1000 {}", (0..1000u64).sum::<u64>()));
    assert_eq!(child.next(), "wrote b");
    let mut host = vec![0u32; b.len()];
    s.copy_to_host(&b, &mut host).unwrap();
    assert!(host.iter().enumerate().all(|(i, &x)| x == i as u32 * 3), "the importer's writes");
    assert_eq!(child.next(), "memory 0 0 0", "the importer's device gave everything back");
    child.finish();
    drop((a, b));
    assert_eq!(pool.stats().used, 0);
    drop(pool);
    let st = npu.sim_device(0).unwrap().stats();
    assert_eq!((st.physical_bytes, st.mapped_bytes), (0, 0));
}

#[test]
fn the_exporters_free_waits_for_the_importers_release() {
    let npu = npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = shared_pool(&dev);
    let a = pool.alloc_async::<u8>(MIB as usize, &s).unwrap();
    let a_ptr = a.device_ptr();
    s.synchronize().unwrap();
    let mut child = Importer::start("hold");
    pool.allow_process(child.pid()).unwrap();
    child.send(pool.export().unwrap());
    assert_eq!(child.next(), "twice AlreadyImported");
    child.send(a.export_pointer().unwrap());
    assert_eq!(child.next(), "held");
    let mut exported = a;
    let mut moved = [&mut exported];
    assert!(pool.compact(&s, &mut moved).is_err(), "an exported allocation cannot move");
    drop(exported);
    // Held by the importer: the block stays allocated, the same stream cannot reuse it.
    assert_eq!(pool.stats().used, MIB);
    let other = pool.alloc_async::<u8>(MIB as usize, &s).unwrap();
    assert_ne!(other.device_ptr(), a_ptr);
    child.send("release");
    assert_eq!(child.next(), "released");
    assert_eq!(child.next(), "reopen Err(Destroyed)", "freed by the exporter meanwhile");
    assert_eq!(child.next(), "memory 0 0 0");
    child.finish();
    // Released: the exporter's free went through, on its stream, in stream order.
    assert_eq!(pool.stats().used, MIB);
    let again = pool.alloc_async::<u8>(MIB as usize, &s).unwrap();
    assert_eq!(again.device_ptr(), a_ptr);
    drop((other, again));
}

#[test]
fn a_process_not_allowed_is_refused() {
    let npu = npu();
    let dev = npu.device(0).unwrap();
    let pool = shared_pool(&dev);
    let mut child = Importer::start("refused");
    child.send(pool.export().unwrap());
    assert_eq!(child.next(), "NotAllowed");
    child.finish();
}

#[test]
fn dropped_pools_and_freed_allocations_are_errors_not_crashes() {
    let npu = npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    // A pool dropped before the import.
    let pool = shared_pool(&dev);
    let desc = pool.export().unwrap();
    drop(pool);
    let mut child = Importer::start("refused");
    child.send(desc);
    assert_eq!(child.next(), "Destroyed");
    child.finish();
    // Bad pointers, then the pool dropped while imported.
    let pool = shared_pool(&dev);
    let a = pool.alloc_async::<u8>(100, &s).unwrap();
    let mut child = Importer::start("bad");
    pool.allow_process(child.pid()).unwrap();
    child.send(pool.export().unwrap());
    assert_eq!(child.next(), "twice AlreadyImported");
    child.send(a.export_pointer().unwrap());
    assert_eq!(child.next(), "odd Err(InvalidDescriptor)", "100 bytes are no whole [u64]");
    assert_eq!(child.next(), "foreign Err(InvalidDescriptor)");
    assert_eq!(child.next(), "unexported Err(Destroyed)");
    drop(a);
    drop(pool);
    child.send("dropped");
    assert_eq!(child.next(), "gone Err(Destroyed)");
    assert_eq!(child.next(), "memory 0 0 0");
    child.finish();
}

#[test]
fn pools_that_cannot_be_shared_say_so() {
    let npu = npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let plain = MemPool::builder().build(&dev).unwrap();
    assert_eq!(kind(&plain.export().unwrap_err()), IpcErrorKind::NotExportable);
    assert_eq!(kind(&plain.allow_process(1).unwrap_err()), IpcErrorKind::NotExportable);
    let a = plain.alloc_async::<u8>(64, &s).unwrap();
    assert_eq!(kind(&a.export_pointer().unwrap_err()), IpcErrorKind::NotExportable);
    for builder in [
        MemPool::builder().handle_type(HandleType::Posix).stream_shards(2),
        MemPool::builder().handle_type(HandleType::Posix).passthrough(true),
        MemPool::builder().handle_type(HandleType::Posix).native(),
    ] {
        assert!(matches!(builder.build(&dev), Err(Error::InvalidConfig(_))));
    }
    // A device of another granularity, and a process that is not there.
    let other = soma::sim::Npu::builder().granularity(4 << 20).build().unwrap();
    let desc: PoolDescriptor = format!("soma-pool:1:0:1:{}:{}", 64 * MIB, 2 * MIB).parse().unwrap();
    let e = MemPool::import(&desc, &other.device(0).unwrap()).unwrap_err();
    assert_eq!(kind(&e), IpcErrorKind::InvalidDescriptor);
    let gone: PoolDescriptor =
        format!("soma-pool:{}:0:1:{}:{}", 0x7fff_fff0u32, 64 * MIB, 2 * MIB).parse().unwrap();
    let e = MemPool::import(&gone, &dev).unwrap_err();
    assert_eq!(kind(&e), IpcErrorKind::Unreachable);
}
