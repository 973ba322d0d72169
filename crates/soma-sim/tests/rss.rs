//! Freed device memory goes back to the OS; unmapped physical memory stays with its handle.
//! (Own test binary: it reads the resident set of the whole process.)

use soma_sim::hal::DeviceHal;
use soma_sim::Npu;

const MIB: u64 = 1 << 20;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn rss_follows_map_and_unmap() {
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
