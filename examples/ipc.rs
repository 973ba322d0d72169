//! A KV cache shared between two processes: the exporting process owns a pool of KV blocks
//! and exports it; the importing process (this program again, started with `--importer`)
//! imports the pool, opens the blocks it is handed, checks what the exporter wrote and
//! writes into half of them; the exporter checks those writes. Both run on the software NPU
//! of their own process, over the same bytes (the pool's physical memory is shared).
//!
//! ```sh
//! cargo run --release --example ipc                # 16 blocks of 4 MiB
//! cargo run --release --example ipc -- --quick     # 4 blocks of 256 KiB
//! SOMA_SANITIZER=fail cargo run --release --example ipc -- --quick
//! ```
//!
//! * **Export**: a pool built with `handle_type(HandleType::Posix)` gives a descriptor
//!   (`pool.export()`), the importing process's id goes on its whitelist
//!   (`pool.allow_process`), and each block an `ExportedPointer` (`block.export_pointer()`).
//!   All three travel as text, here on the importer's stdin.
//! * **Import**: `MemPool::import(&descriptor, &device)` gives a pool that cannot allocate
//!   (the two processes order their work on shared bytes themselves, as on a device);
//!   `pool.open::<f32>(&pointer)` a typed, writable handle over the exporter's block.
//! * **Order across processes** is the lines the two trade: the exporter synchronizes before
//!   it hands the pointers over, and reads the importer's writes after the importer said it
//!   synchronized.
//! * **Lifetime**: the exporter frees block 0 while the importer holds it: the free waits
//!   (the block stays allocated) until the importer drops its handle, then goes through in
//!   stream order. The importer's drop synchronizes its device first.

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use soma::prelude::*;
use soma::sim::Npu;
use soma::{ExportedPointer, HandleType, MemPool, PoolDescriptor, Stream};

/// How long either process waits for the other before giving up.
const PATIENCE: Duration = Duration::from_secs(60);

type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let (blocks, elems) = if quick { (4, 64 << 10) } else { (16, 1 << 20) };
    if args.iter().any(|a| a == "--importer") {
        importer()
    } else {
        exporter(blocks, elems, quick)
    }
}

/// What block `b` holds at element `i`, as the exporter writes it.
fn exporter_value(b: usize, i: usize) -> f32 {
    (b * 1000 + i % 1000) as f32
}

/// What the importer writes into the odd blocks.
fn importer_value(b: usize, i: usize) -> f32 {
    -exporter_value(b, i)
}

/// The importing process, seen from the exporter: its stdin, and its stdout's lines.
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn start(quick: bool) -> Result<Peer> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("--importer").stdin(Stdio::piped()).stdout(Stdio::piped());
        if quick {
            cmd.arg("--quick");
        }
        let mut child = cmd.spawn()?;
        let stdout = std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                println!("  importer | {line}");
                let _ = tx.send(line);
            }
        });
        Ok(Peer { child, lines })
    }

    fn send(&mut self, line: impl std::fmt::Display) -> Result<()> {
        writeln!(self.child.stdin.as_mut().ok_or("no stdin")?, "{line}")?;
        Ok(())
    }

    /// Waits for the importer's line that starts with `word`.
    fn expect(&mut self, word: &str) -> Result<String> {
        loop {
            let line = self.lines.recv_timeout(PATIENCE).map_err(|_| {
                let _ = self.child.kill();
                format!("the importing process did not say {word:?} in time")
            })?;
            if line.starts_with(word) {
                return Ok(line);
            }
        }
    }

    fn finish(mut self) -> Result<()> {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("the importing process failed: {status}").into())
                };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        Err("the importing process did not exit in time".into())
    }
}

fn exporter(blocks: usize, elems: usize, quick: bool) -> Result<()> {
    let npu = Npu::builder().build()?;
    let dev = npu.device(0)?;
    let s = dev.create_stream()?;
    let block_bytes = (elems * 4) as u64;
    let kv = MemPool::builder()
        .handle_type(HandleType::Posix)
        .max_size(blocks as u64 * block_bytes * 2)
        .build(&dev)?;
    let mut kv_blocks = Vec::new();
    for b in 0..blocks {
        let mut block = kv.alloc_async::<f32>(elems, &s)?;
        let values: Vec<f32> = (0..elems).map(|i| exporter_value(b, i)).collect();
        s.copy_from_host(&mut block, &values)?;
        kv_blocks.push(block);
    }
    // What the importer reads must have landed before it reads: order by the host.
    s.synchronize()?;
    let descriptor = kv.export()?;
    println!("exporter: pool {descriptor}, {blocks} blocks of {} KiB", block_bytes >> 10);

    let mut peer = Peer::start(quick)?;
    kv.allow_process(peer.child.id() as i32)?;
    peer.send(descriptor)?;
    for block in &kv_blocks {
        peer.send(block.export_pointer()?)?;
    }
    peer.send("end")?;
    peer.expect("opened")?;

    // Block 0 freed while the importer holds it: kept out of reuse until it lets go.
    let used = kv.stats().used;
    drop(kv_blocks.remove(0));
    assert_eq!(kv.stats().used, used, "a held block stays allocated");
    peer.send("go")?;
    peer.expect("wrote")?;

    let mut checked = 0;
    for (k, block) in kv_blocks.iter().enumerate() {
        let b = k + 1;
        let mut host = vec![0f32; elems];
        s.copy_to_host(block, &mut host)?;
        let want: fn(usize, usize) -> f32 =
            if b % 2 == 1 { importer_value } else { exporter_value };
        if let Some(i) = (0..elems).find(|&i| host[i] != want(b, i)) {
            return Err(
                format!("block {b}, element {i}: {} instead of {}", host[i], want(b, i)).into()
            );
        }
        checked += 1;
    }
    peer.expect("released")?;
    peer.finish()?;
    // Released: block 0's free went through.
    assert_eq!(kv.stats().used, used - block_bytes);
    println!("exporter: {checked} blocks checked, the importer's writes included");
    drop(kv_blocks);
    assert_eq!(kv.stats().used, 0);
    drop(kv);
    let st = npu.sim_device(0)?.stats();
    if (st.physical_bytes, st.mapped_bytes) != (0, 0) {
        return Err(format!("memory left behind: {st:?}").into());
    }
    println!("ipc: ok");
    Ok(())
}

fn read_line() -> Result<String> {
    let mut line = String::new();
    if std::io::stdin().read_line(&mut line)? == 0 {
        return Err("the exporting process closed the conversation".into());
    }
    Ok(line.trim().to_owned())
}

fn importer() -> Result<()> {
    let npu = Npu::builder().build()?;
    let dev = npu.device(0)?;
    let s = dev.create_stream()?;
    let descriptor: PoolDescriptor = read_line()?.parse()?;
    // The two processes order their work on the shared blocks by the lines they trade: the
    // exporter wrote and synchronized before sending the pointers, this process writes only
    // into the blocks the exporter reads after it says "wrote" (having synchronized), and the
    // exporter does not touch them meanwhile.
    let kv = MemPool::import(&descriptor, &dev)?;
    let mut pointers: Vec<ExportedPointer> = Vec::new();
    loop {
        match read_line()?.as_str() {
            "end" => break,
            line => pointers.push(line.parse()?),
        }
    }
    let mut opened = Vec::new();
    for p in &pointers {
        opened.push(kv.open::<f32>(p)?);
    }
    println!("opened {} blocks of pool {}", opened.len(), descriptor.pool_id());
    if read_line()? != "go" {
        return Err("expected go".into());
    }
    let mut written = 0;
    for (b, block) in opened.iter_mut().enumerate() {
        verify(&s, block, b)?;
        if b % 2 == 1 {
            let values: Vec<f32> = (0..block.len()).map(|i| importer_value(b, i)).collect();
            s.copy_from_host(block, &values)?;
            written += 1;
        }
    }
    s.synchronize()?;
    println!("wrote {written} blocks, read {} as the exporter wrote them", opened.len());
    drop(opened);
    drop(kv);
    let st = npu.sim_device(0)?.stats();
    if (st.imported_bytes, st.mapped_bytes) != (0, 0) {
        return Err(format!("memory left behind: {st:?}").into());
    }
    println!("released every block; nothing left mapped");
    Ok(())
}

/// Checks that block `b` holds what the exporter wrote.
fn verify(s: &Stream<'_>, block: &impl DeviceBuffer<Elem = f32>, b: usize) -> Result<()> {
    let mut host = vec![0f32; block.len()];
    s.copy_to_host(block, &mut host)?;
    match (0..host.len()).find(|&i| host[i] != exporter_value(b, i)) {
        Some(i) => Err(format!("block {b}, element {i}: {} read", host[i]).into()),
        None => Ok(()),
    }
}
