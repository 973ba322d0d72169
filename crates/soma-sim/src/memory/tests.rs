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
    assert!(m.map_shared(a, 2 * G, &pages, false).is_err(), "wrong length");
    m.map_shared(a, G, &pages, false).unwrap();
    assert!(m.map_shared(a, G, &pages, false).is_err(), "already mapped");
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
    m.map_shared(a + 2 * G, G, &pages, false).unwrap();
    assert_eq!(read(&m, a + 2 * G), (0xAB, 0xAB, true));
    // Mapped in a second arena at the same time: one set of bytes.
    let b = other.start() + G;
    other.map_shared(b, G, &pages, false).unwrap();
    assert_eq!(read(&other, b), (0xAB, 0xAB, true));
    fill(&other, b, 0x5C);
    assert_eq!(read(&m, a + 2 * G), (0x5C, 0x5C, true));
    other.unmap_shared(b, G).unwrap();
    m.unmap_shared(a + 2 * G, G).unwrap();
    // A fresh file is another allocation: zero.
    let fresh = SharedPages::create(G).unwrap();
    m.map_shared(a + 2 * G, G, &fresh, false).unwrap();
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

/// The bytes `[at, at + len)` of `m` as a kernel reading them sees them.
fn read_bytes(m: &DeviceMemory, at: u64, len: u64) -> Vec<u8> {
    let acc = m.acquire(Owner::Host("t"), &[r(at, len, AccessMode::Read)], true).unwrap();
    KernelBuffers::bytes(&acc, 0).unwrap().to_vec()
}

/// A range shared across processes is never handed to a kernel as a slice of the shared
/// bytes: the kernel works on a private copy, which reaches the memory file (what the other
/// process sees, here a second arena mapping the same file) only when the access ends.
#[test]
fn cross_process_ranges_reach_kernels_as_private_copies() {
    let m = DeviceMemory::new(4 * G, G).unwrap();
    let other = DeviceMemory::new(4 * G, G).unwrap();
    let (a, b) = (m.start(), other.start());
    let pages = SharedPages::create(G).unwrap();
    m.map_shared(a, G, &pages, true).unwrap();
    other.map_shared(b, G, &pages, false).unwrap();
    {
        let acc = m.acquire(Owner::Host("t"), &[r(a + 3, 100, AccessMode::Write)], true).unwrap();
        let buf = acc.bytes_mut(0).unwrap();
        assert_ne!(buf.as_ptr() as u64, a + 3, "a private copy, not the shared bytes");
        assert_eq!(buf.as_ptr() as u64 % 4096, (a + 3) % 4096, "aligned as the device bytes");
        buf.fill(0x11);
        assert_eq!(read_bytes(&other, b, 200), vec![0; 200], "not written back before the end");
    }
    let seen = read_bytes(&other, b, 200);
    assert_eq!((seen[2], seen[3], seen[102], seen[103]), (0, 0x11, 0x11, 0));
    // Written by the other side, read here through a copy.
    other
        .acquire(Owner::Host("t"), &[r(b, 64, AccessMode::Write)], true)
        .unwrap()
        .fill(b, 0x22, 64)
        .unwrap();
    let acc = m.acquire(Owner::Host("t"), &[r(a, 64, AccessMode::Read)], true).unwrap();
    let seen = KernelBuffers::bytes(&acc, 0).unwrap();
    assert_ne!(seen.as_ptr() as u64, a);
    assert_eq!(seen, &[0x22; 64]);
}

/// Copies and fills on a range shared across processes reach the memory file at once, and an
/// overlapping copy within it keeps memmove semantics.
#[test]
fn cross_process_copies_and_fills() {
    let m = DeviceMemory::new(4 * G, G).unwrap();
    let other = DeviceMemory::new(4 * G, G).unwrap();
    let (a, b) = (m.start(), other.start());
    let pages = SharedPages::create(G).unwrap();
    m.map_shared(a, G, &pages, true).unwrap();
    other.map_shared(b, G, &pages, false).unwrap();
    let mut acc = m
        .acquire(
            Owner::Host("t"),
            &[r(a, 64, AccessMode::Write), r(a + 5, 64, AccessMode::Read)],
            false,
        )
        .unwrap();
    let host: Vec<u8> = (0..70).collect();
    // SAFETY: `host` lives, unchanged, until the end of the test, after the span.
    let span = End::Host(unsafe { HostSpan::new(host.as_ptr().cast_mut(), host.len()) });
    acc.copy(&End::Device(a), &span, 64).unwrap();
    assert_eq!(read_bytes(&other, b, 64), host[..64]);
    acc.copy(&End::Device(a), &End::Device(a + 5), 40).unwrap();
    let mut want: Vec<u8> = host[..64].to_vec();
    want.copy_within(5..45, 0);
    assert_eq!(read_bytes(&other, b, 64), want);
    acc.fill(a + 1, 0x7E, 9).unwrap();
    want[1..10].fill(0x7E);
    assert_eq!(read_bytes(&other, b, 64), want);
    let mut back = vec![0u8; 64];
    {
        // SAFETY: `back` lives, unaccessed otherwise, until the span is dropped at the end of
        // the block.
        let span = End::Host(unsafe { HostSpan::new(back.as_mut_ptr(), back.len()) });
        acc.copy(&span, &End::Device(a), 64).unwrap();
    }
    assert_eq!(back, want);
}

/// Memory no other process maps keeps the direct path: kernels get slices of the device bytes
/// themselves.
#[test]
fn private_ranges_stay_zero_copy() {
    let m = DeviceMemory::new(4 * G, G).unwrap();
    let a = m.start();
    m.map(a, G).unwrap();
    let pages = SharedPages::create(G).unwrap();
    m.map_shared(a + G, G, &pages, false).unwrap();
    let other = SharedPages::create(G).unwrap();
    m.map_shared(a + 2 * G, G, &other, true).unwrap();
    for at in [a + 8, a + G + 8] {
        let acc = m.acquire(Owner::Host("t"), &[r(at, 64, AccessMode::Write)], true).unwrap();
        assert_eq!(acc.bytes_mut(0).unwrap().as_ptr() as u64, at);
    }
}

/// Sharing a mapping waits for the accesses that may hold slices of it, and later accesses
/// get private copies.
#[test]
fn share_waits_for_direct_accesses() {
    let m = DeviceMemory::new(4 * G, G).unwrap();
    let a = m.start();
    let pages = SharedPages::create(G).unwrap();
    m.map_shared(a, G, &pages, false).unwrap();
    assert!(m.share(a + 1, G).is_err(), "not a mapping");
    let direct = m.acquire(Owner::Host("t"), &[r(a, 8, AccessMode::Write)], true).unwrap();
    assert_eq!(direct.bytes_mut(0).unwrap().as_ptr() as u64, a);
    let shared = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            m.share(a, G).unwrap();
            shared.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !shared.load(std::sync::atomic::Ordering::SeqCst),
            "returned during a direct access"
        );
        drop(direct);
    });
    assert!(shared.load(std::sync::atomic::Ordering::SeqCst));
    let acc = m.acquire(Owner::Host("t"), &[r(a, 8, AccessMode::Write)], true).unwrap();
    assert_ne!(acc.bytes_mut(0).unwrap().as_ptr() as u64, a);
}

/// A range that is partly shared moves all its bytes atomically, and an overlapping copy from
/// a private range into it keeps memmove semantics.
#[test]
fn copies_into_a_partly_shared_range_are_memmoves() {
    let m = DeviceMemory::new(4 * G, G).unwrap();
    let a = m.start();
    m.map(a, G).unwrap();
    let pages = SharedPages::create(G).unwrap();
    m.map_shared(a + G, G, &pages, true).unwrap();
    let numbered: Vec<u8> = (0..100).collect();
    {
        let mut acc = m.acquire(Owner::Host("t"), &[r(a, 100, AccessMode::Write)], true).unwrap();
        // SAFETY: `numbered` lives, unchanged, until the end of the test, after the span.
        let span = End::Host(unsafe { HostSpan::new(numbered.as_ptr().cast_mut(), 100) });
        acc.copy(&End::Device(a), &span, 100).unwrap();
    }
    let ranges = [r(a + 4, G + 8, AccessMode::Write), r(a, 100, AccessMode::Read)];
    let mut acc = m.acquire(Owner::Host("t"), &ranges, false).unwrap();
    acc.copy(&End::Device(a + 4), &End::Device(a), 64).unwrap();
    drop(acc);
    let mut want = numbered.clone();
    want.copy_within(0..64, 4);
    assert_eq!(read_bytes(&m, a, 100), want);
}
