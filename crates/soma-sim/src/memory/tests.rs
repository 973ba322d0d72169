//! The memory module's invariants: mapping, shared memory files, in-flight accesses.

use super::*;
use soma_core::hal::KernelBuffers;

const G: u64 = 2 << 20;

fn r(addr: u64, len: u64, mode: AccessMode) -> Range {
    Range { addr, len, mode }
}

#[test]
fn map_access_unmap() {
    let m = DeviceMemory::new(8 * G, G).unwrap();
    let a = m.start();
    assert_eq!(a % G, 0);
    assert!(m.check_mapped(&[r(a, 1, AccessMode::Read)]).is_err());
    m.map(a, G).unwrap();
    m.map(a + G, G).unwrap();
    assert!(m.map(a, G).is_err());
    // A range spanning two adjacent mappings is valid.
    m.check_mapped(&[r(a + G - 1, 2, AccessMode::Read)]).unwrap();
    assert!(m.check_mapped(&[r(a + G, G + 1, AccessMode::Read)]).is_err());
    {
        let mut acc = m.acquire(Owner::Host("t"), &[r(a, 16, AccessMode::Write)], true).unwrap();
        acc.fill(a, 7, 16).unwrap();
        assert!(acc.fill(a, 7, 17).is_err());
        assert!(m.unmap(a, G).is_err(), "in-flight range must not be unmapped");
        let bytes = KernelBuffers::bytes(&acc, 0).unwrap();
        assert_eq!(bytes, &[7u8; 16]);
        assert!(acc.bytes_mut(0).is_err());
    }
    assert_eq!(m.inflight_len(), 0);
    m.unmap(a, G).unwrap();
    assert!(m.unmap(a, G).is_err());
    m.map(a, G).unwrap();
    let acc = m.acquire(Owner::Host("t"), &[r(a, 16, AccessMode::Read)], true).unwrap();
    assert_eq!(KernelBuffers::bytes(&acc, 0).unwrap(), &[0u8; 16], "fresh pages are zero");
}

/// A memory file keeps its bytes while unmapped, shows them wherever it is mapped next, and
/// shows the same bytes at two places at once (two arenas: what two processes see); a
/// refused unmap or map changes nothing, and an unmapped range reads as zero when mapped
/// fresh.
#[test]
fn shared_pages_keep_their_bytes_wherever_mapped() {
    let m = DeviceMemory::new(8 * G, G).unwrap();
    let other = DeviceMemory::new(8 * G, G).unwrap();
    let a = m.start();
    let fill = |m: &DeviceMemory, at: u64, v: u8| {
        let mut acc = m.acquire(Owner::Host("t"), &[r(at, G, AccessMode::Write)], true).unwrap();
        acc.fill(at, v, G).unwrap();
    };
    let read = |m: &DeviceMemory, at: u64| {
        let acc = m.acquire(Owner::Host("t"), &[r(at, G, AccessMode::Read)], true).unwrap();
        let b = KernelBuffers::bytes(&acc, 0).unwrap();
        (b[0], b[G as usize - 1], b.iter().all(|&x| x == b[0]))
    };
    let pages = SharedPages::create(G).unwrap();
    assert!(m.map_shared(a, 2 * G, &pages).is_err(), "wrong length");
    m.map_shared(a, G, &pages).unwrap();
    assert!(m.map_shared(a, G, &pages).is_err(), "already mapped");
    assert_eq!(read(&m, a), (0, 0, true), "fresh memory reads as zero");
    fill(&m, a, 0xAB);
    {
        let _busy = m.acquire(Owner::Host("t"), &[r(a, 1, AccessMode::Read)], true).unwrap();
        assert!(m.unmap_shared(a, G).is_err(), "in-flight range must not be unmapped");
    }
    assert!(m.unmap_shared(a, 2 * G).is_err(), "not a mapping of that size");
    m.unmap_shared(a, G).unwrap();
    assert!(m.check_mapped(&[r(a, 1, AccessMode::Read)]).is_err(), "unmapped");
    // The range itself is fresh again; the file kept the bytes, mapped elsewhere.
    m.map(a, G).unwrap();
    assert_eq!(read(&m, a), (0, 0, true));
    m.map_shared(a + 2 * G, G, &pages).unwrap();
    assert_eq!(read(&m, a + 2 * G), (0xAB, 0xAB, true));
    // Mapped in a second arena at the same time: one set of bytes.
    let b = other.start() + G;
    other.map_shared(b, G, &pages).unwrap();
    assert_eq!(read(&other, b), (0xAB, 0xAB, true));
    fill(&other, b, 0x5C);
    assert_eq!(read(&m, a + 2 * G), (0x5C, 0x5C, true));
    other.unmap_shared(b, G).unwrap();
    m.unmap_shared(a + 2 * G, G).unwrap();
    // A fresh file is another allocation: zero.
    let fresh = SharedPages::create(G).unwrap();
    m.map_shared(a + 2 * G, G, &fresh).unwrap();
    assert_eq!(read(&m, a + 2 * G), (0, 0, true));
}

#[test]
fn conflicts() {
    let m = DeviceMemory::new(4 * G, G).unwrap();
    let a = m.start();
    m.map(a, G).unwrap();
    let own = |t| Owner::Task { stream: 1, task: t };
    let r1 = m.acquire(own(1), &[r(a, 100, AccessMode::Read)], true).unwrap();
    let r2 = m.acquire(own(2), &[r(a + 50, 100, AccessMode::Read)], true).unwrap();
    let e = m.acquire(own(3), &[r(a + 99, 1, AccessMode::Write)], true).err().unwrap();
    assert!(e.message().contains("data race"), "{}", e.message());
    drop((r1, r2));
    let _w = m.acquire(own(4), &[r(a + 99, 1, AccessMode::Write)], true).unwrap();
    assert!(m.acquire(own(5), &[r(a + 100, 1, AccessMode::Write)], true).is_ok());
    // Self overlap of a write.
    assert!(m
        .acquire(
            own(6),
            &[r(a + 200, 10, AccessMode::Write), r(a + 205, 10, AccessMode::Read)],
            true
        )
        .is_err());
}
