//! The memory module's invariants: mapping, parking, in-flight accesses.

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

/// Unmapping with `unmap_keep` keeps the bytes, wherever they are mapped again, also after
/// another mapping was made over their old place; discarding them frees them; a refused
/// unmap or map changes nothing.
#[test]
fn parked_pages_keep_their_bytes() {
    let m = DeviceMemory::new(8 * G, G).unwrap();
    let a = m.start();
    let fill = |at: u64, v: u8| {
        let mut acc = m.acquire(Owner::Host("t"), &[r(at, G, AccessMode::Write)], true).unwrap();
        acc.fill(at, v, G).unwrap();
    };
    let read = |at: u64| {
        let acc = m.acquire(Owner::Host("t"), &[r(at, G, AccessMode::Read)], true).unwrap();
        let b = KernelBuffers::bytes(&acc, 0).unwrap();
        (b[0], b[G as usize - 1], b.iter().all(|&x| x == b[0]))
    };
    m.map(a, G).unwrap();
    fill(a, 0xAB);
    {
        let _busy = m.acquire(Owner::Host("t"), &[r(a, 1, AccessMode::Read)], true).unwrap();
        assert!(m.unmap_keep(a, G, 1).is_err(), "in-flight range must not be unmapped");
    }
    assert!(m.unmap_keep(a, 2 * G, 1).is_err(), "not a mapping of that size");
    m.unmap_keep(a, G, 1).unwrap();
    assert!(m.check_mapped(&[r(a, 1, AccessMode::Read)]).is_err(), "unmapped");
    // Back in place: nothing moved.
    assert!(m.map_parked(a, 2 * G, 1).is_err(), "wrong length");
    assert!(m.map_parked(a, G, 2).is_err(), "nothing parked under that key");
    m.map_parked(a, G, 1).unwrap();
    assert_eq!(read(a), (0xAB, 0xAB, true));
    // Elsewhere: copied.
    m.unmap_keep(a, G, 1).unwrap();
    m.map(a + 3 * G, G).unwrap();
    assert!(m.map_parked(a + 3 * G, G, 1).is_err(), "target already mapped");
    m.map_parked(a + 2 * G, G, 1).unwrap();
    assert_eq!(read(a + 2 * G), (0xAB, 0xAB, true));
    // A fresh mapping over parked bytes reads zero, and the parked bytes survive it.
    fill(a + 2 * G, 0x5C);
    m.unmap_keep(a + 2 * G, G, 1).unwrap();
    m.map(a + 2 * G, G).unwrap();
    assert_eq!(read(a + 2 * G), (0, 0, true));
    m.map_parked(a, G, 1).unwrap();
    assert_eq!(read(a), (0x5C, 0x5C, true));
    // Discarded bytes are gone: the range reads zero when mapped again.
    m.unmap_keep(a, G, 1).unwrap();
    m.discard_parked(1);
    assert!(m.map_parked(a, G, 1).is_err(), "discarded");
    m.map(a, G).unwrap();
    assert_eq!(read(a), (0, 0, true));
    // A parked range overlapped by a larger mapping is moved aside too.
    m.unmap(a + 2 * G, G).unwrap();
    fill(a, 0x11);
    m.unmap_keep(a, G, 7).unwrap();
    m.map(a, 3 * G).unwrap();
    assert_eq!(read(a), (0, 0, true));
    m.map_parked(a + 5 * G, G, 7).unwrap();
    assert_eq!(read(a + 5 * G), (0x11, 0x11, true));
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
