//! Freed device memory goes back to the OS; unmapped physical memory stays with its handle,
//! in its memory file. (Own test binary: it reads the resident set of the whole process.)

use soma_sim::hal::DeviceHal;
use soma_sim::Npu;

const MIB: u64 = 1 << 20;

/// The tests read the resident set of the whole process: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Bytes held by the memory files of the process's physical allocations (resident whether
/// mapped or not).
fn physical_file_bytes() -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let is_physical = std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:soma-sim-physical"));
        if let (true, Ok(meta)) = (is_physical, std::fs::metadata(entry.path())) {
            total += meta.blocks() * 512;
        }
    }
    total
}

#[test]
fn rss_follows_map_and_unmap() {
    let _serial = serial();
    let dev = Npu::builder().capacity(1 << 30).build().unwrap().device(0).unwrap();
    let size = 64 * MIB;
    let va = dev.reserve(size).unwrap();
    let h = dev.alloc_physical(size).unwrap();
    let base = rss_bytes();
    dev.map(va, h).unwrap();
    assert!(rss_bytes() < base + 8 * MIB, "mapping alone commits nothing");
    dev.memset_sync(va, 0x5A, size).unwrap(); // touch every page
    let touched = rss_bytes();
    assert!(touched >= base + 60 * MIB, "base {base}, touched {touched}");
    // Unmapped, the physical memory keeps its bytes in its file (it could be mapped again).
    dev.unmap(va).unwrap();
    let kept = physical_file_bytes();
    assert!(kept >= 64 * MIB, "unmapped memory holds {kept} bytes");
    dev.free_physical(h).unwrap();
    let after = rss_bytes();
    assert!(after < base + 8 * MIB, "base {base}, touched {touched}, after free {after}");
    assert_eq!(physical_file_bytes(), 0, "freed memory goes back to the OS");

    // The same through malloc / free.
    let p = dev.malloc(size).unwrap();
    dev.memset_sync(p, 1, size).unwrap();
    assert!(rss_bytes() >= base + 60 * MIB);
    dev.free(p).unwrap();
    assert!(rss_bytes() < base + 8 * MIB);

    dev.release(va).unwrap();
}

/// Mapping unmapped physical memory again after another mapping was made at its place copies
/// nothing: its file holds what was written, not its whole size.
#[test]
fn unmapped_memory_holds_what_was_written() {
    let _serial = serial();
    let dev = Npu::builder().capacity(1 << 30).build().unwrap().device(0).unwrap();
    let size = 256 * MIB;
    let va = dev.reserve(size).unwrap();
    let (h1, h2) = (dev.alloc_physical(size).unwrap(), dev.alloc_physical(size).unwrap());
    dev.map(va, h1).unwrap();
    dev.memset_sync(va, 0x5A, 4096).unwrap(); // one page written
    dev.unmap(va).unwrap();
    let base = rss_bytes();
    dev.map(va, h2).unwrap(); // another allocation at h1's place
    dev.unmap(va).unwrap();
    dev.map(va, h1).unwrap(); // h1 again
    let after = rss_bytes();
    assert!(after < base + 16 * MIB, "base {base}, after {after}");
    let held = physical_file_bytes();
    assert!(held < MIB, "one written page, {held} bytes held");
    let mut b = [0u8; 2];
    // SAFETY: `b` is a live host buffer of 2 bytes for the duration of the call.
    unsafe {
        dev.copy_sync(
            soma_sim::hal::MemRef::Host(b.as_mut_ptr()),
            soma_sim::hal::MemRef::Device(va.checked_add(4095).unwrap()),
            2,
        )
    }
    .unwrap();
    assert_eq!(b, [0x5A, 0], "the written page came back, the rest reads zero");
    dev.unmap(va).unwrap();
    dev.free_physical(h1).unwrap();
    dev.free_physical(h2).unwrap();
    dev.release(va).unwrap();
}
