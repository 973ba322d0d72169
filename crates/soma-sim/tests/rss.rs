//! Freed device memory goes back to the OS; unmapped physical memory stays with its handle.
//! (Own test binary: it reads the resident set of the whole process.)

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
    // Unmapped, the physical memory keeps its bytes (it is mapped again below): still resident.
    dev.unmap(va).unwrap();
    let unmapped = rss_bytes();
    assert!(unmapped >= base + 60 * MIB, "base {base}, touched {touched}, unmapped {unmapped}");
    dev.free_physical(h).unwrap();
    let after = rss_bytes();
    assert!(after < base + 8 * MIB, "base {base}, touched {touched}, after free {after}");

    // The same through malloc / free.
    let p = dev.malloc(size).unwrap();
    dev.memset_sync(p, 1, size).unwrap();
    assert!(rss_bytes() >= base + 60 * MIB);
    dev.free(p).unwrap();
    assert!(rss_bytes() < base + 8 * MIB);

    dev.release(va).unwrap();
}

/// Moving unmapped physical memory aside (another mapping is made over it) copies what was
/// written, not its whole size.
#[test]
fn moving_unmapped_memory_aside_costs_what_was_written() {
    let _serial = serial();
    let dev = Npu::builder().capacity(1 << 30).build().unwrap().device(0).unwrap();
    let size = 256 * MIB;
    let va = dev.reserve(size).unwrap();
    let (h1, h2) = (dev.alloc_physical(size).unwrap(), dev.alloc_physical(size).unwrap());
    dev.map(va, h1).unwrap();
    dev.memset_sync(va, 0x5A, 4096).unwrap(); // one page written
    dev.unmap(va).unwrap();
    let base = rss_bytes();
    dev.map(va, h2).unwrap(); // h1's bytes move aside
    dev.unmap(va).unwrap();
    dev.map(va, h1).unwrap(); // and come back
    let after = rss_bytes();
    assert!(after < base + 16 * MIB, "base {base}, after {after}");
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
