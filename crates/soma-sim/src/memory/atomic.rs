//! Copies to and from bytes another process may write at the same time (memory shared across
//! processes): every access to those bytes is a relaxed atomic load or store, so a race with
//! the other process gives torn bytes, never a data race in this one.
//!
//! Whole aligned 8-byte words are moved with [`AtomicU64`], the unaligned bytes at either end
//! with [`AtomicU8`]. The other side of the copies is private memory (a buffer of this process,
//! or device memory the in-flight table protects), accessed with plain reads and writes.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

const WORD: usize = std::mem::size_of::<u64>();

/// Bytes moved at a time by [`move_shared`].
const CHUNK: usize = 64 << 10;

/// How many bytes from `p` up to the next word boundary, at most `n`.
fn head_len(p: *const u8, n: usize) -> usize {
    ((WORD - p.addr() % WORD) % WORD).min(n)
}

/// Copies `n` bytes from `src` to `dst` (memmove semantics), each of them shared across
/// processes (`*_shared`) or private.
///
/// # Safety
/// Both are valid for reads and writes of `n` bytes (a private `src`: for reads); a private end
/// is accessed by nothing else while the call runs, a shared one only atomically in this
/// process. A shared end and a private one do not overlap.
pub(super) unsafe fn copy(
    dst: *mut u8,
    dst_shared: bool,
    src: *const u8,
    src_shared: bool,
    n: usize,
) {
    match (dst_shared, src_shared) {
        // SAFETY: both private and valid per the contract; `ptr::copy` allows overlap.
        (false, false) => unsafe { std::ptr::copy(src, dst, n) },
        // SAFETY: per the contract, as `store` asks.
        (true, false) => unsafe { store(dst, src, n) },
        // SAFETY: per the contract, as `load` asks.
        (false, true) => unsafe { load(dst, src, n) },
        // SAFETY: per the contract, as `move_shared` asks.
        (true, true) => unsafe { move_shared(dst, src, n) },
    }
}

/// Copies `n` bytes from shared memory `src` into private memory `dst`.
///
/// # Safety
/// `src` is valid for reads and writes of `n` bytes (mapped read-write) and accessed in this
/// process only atomically while the call runs; `dst` is valid for writes of `n` bytes, does not
/// overlap `src`, and nothing else accesses it while the call runs.
pub(super) unsafe fn load(dst: *mut u8, src: *const u8, n: usize) {
    let head = head_len(src, n);
    let words = (n - head) / WORD;
    for i in (0..head).chain(head + words * WORD..n) {
        // SAFETY: `i < n`: inside both ranges; an `AtomicU8` has no alignment requirement and
        // `src` is mapped read-write per the contract.
        unsafe {
            dst.add(i).write(AtomicU8::from_ptr(src.add(i).cast_mut()).load(Ordering::Relaxed))
        };
    }
    for w in 0..words {
        let i = head + w * WORD;
        // SAFETY: `src + i` is word aligned (past the head) and the word lies inside `src`'s
        // `n` bytes; `dst` is written unaligned, inside its `n` bytes.
        unsafe {
            let word = AtomicU64::from_ptr(src.add(i).cast_mut().cast()).load(Ordering::Relaxed);
            dst.add(i).cast::<u64>().write_unaligned(word);
        }
    }
}

/// Copies `n` bytes from private memory `src` into shared memory `dst`.
///
/// # Safety
/// `dst` is valid for reads and writes of `n` bytes and accessed in this process only
/// atomically while the call runs; `src` is valid for reads of `n` bytes, does not overlap
/// `dst`, and nothing writes it while the call runs.
pub(super) unsafe fn store(dst: *mut u8, src: *const u8, n: usize) {
    let head = head_len(dst, n);
    let words = (n - head) / WORD;
    for i in (0..head).chain(head + words * WORD..n) {
        // SAFETY: `i < n`: inside both ranges; an `AtomicU8` has no alignment requirement.
        unsafe { AtomicU8::from_ptr(dst.add(i)).store(src.add(i).read(), Ordering::Relaxed) };
    }
    for w in 0..words {
        let i = head + w * WORD;
        // SAFETY: `dst + i` is word aligned (past the head) and the word lies inside `dst`'s
        // `n` bytes; `src` is read unaligned, inside its `n` bytes.
        unsafe {
            let word = src.add(i).cast::<u64>().read_unaligned();
            AtomicU64::from_ptr(dst.add(i).cast()).store(word, Ordering::Relaxed);
        }
    }
}

/// Sets `n` bytes of shared memory `dst` to `value`.
///
/// # Safety
/// As [`store`]'s `dst`.
pub(super) unsafe fn fill(dst: *mut u8, value: u8, n: usize) {
    let head = head_len(dst, n);
    let words = (n - head) / WORD;
    for i in (0..head).chain(head + words * WORD..n) {
        // SAFETY: `i < n`, inside `dst`; an `AtomicU8` has no alignment requirement.
        unsafe { AtomicU8::from_ptr(dst.add(i)).store(value, Ordering::Relaxed) };
    }
    let word = u64::from_ne_bytes([value; WORD]);
    for w in 0..words {
        // SAFETY: word aligned (past the head) and inside `dst`'s `n` bytes.
        unsafe {
            AtomicU64::from_ptr(dst.add(head + w * WORD).cast()).store(word, Ordering::Relaxed);
        }
    }
}

/// Copies `n` bytes from shared memory `src` to shared memory `dst`, which may overlap
/// (memmove semantics), through a private buffer of at most [`CHUNK`] bytes.
///
/// # Safety
/// `src` and `dst` are valid for reads and writes of `n` bytes and accessed in this process
/// only atomically while the call runs.
pub(super) unsafe fn move_shared(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the contract is this function's.
    unsafe { move_in_chunks(dst, src, n, CHUNK) }
}

/// [`move_shared`] through a buffer of `chunk` bytes.
///
/// # Safety
/// As [`move_shared`].
unsafe fn move_in_chunks(dst: *mut u8, src: *const u8, n: usize, chunk: usize) {
    let mut buf = vec![0u8; chunk.min(n)];
    // Chunks in the order that reads every source byte before the copy overwrites it: upwards
    // when the destination lies below the source, downwards otherwise.
    let upwards = dst.addr() <= src.addr();
    let chunks = n.div_ceil(chunk);
    for k in 0..chunks {
        let k = if upwards { k } else { chunks - 1 - k };
        let at = k * chunk;
        let len = chunk.min(n - at);
        // SAFETY: `[at, at + len)` lies inside both ranges; `buf` is private and holds `len`
        // bytes; the shared ends are accessed atomically per the contract.
        unsafe {
            load(buf.as_mut_ptr(), src.add(at), len);
            store(dst.add(at), buf.as_ptr(), len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64 bytes starting on a word boundary, numbered.
    fn numbered() -> Vec<u64> {
        (0..8u64)
            .map(|w| u64::from_ne_bytes(std::array::from_fn(|b| (w * 8 + b as u64) as u8)))
            .collect()
    }

    fn bytes(words: &[u64]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    /// Every alignment of either end and every length up to past two words: the atomic
    /// copies move exactly the bytes a plain copy would.
    #[test]
    fn atomic_copies_move_exactly_the_bytes_asked() {
        for at in 0..WORD + 1 {
            for n in 0..2 * WORD + 3 {
                let mut shared = numbered();
                let mut private = [0xEEu8; 64];
                let base = shared.as_mut_ptr().cast::<u8>();
                // SAFETY: `at + n < 64`: inside both buffers, which nothing else accesses.
                unsafe { load(private.as_mut_ptr().add(3), base.add(at), n) };
                let mut want = [0xEEu8; 64];
                want[3..3 + n].copy_from_slice(&bytes(&numbered())[at..at + n]);
                assert_eq!(private, want, "load at {at}, {n} bytes");

                let marked: [u8; 64] = std::array::from_fn(|i| 0xC0 ^ i as u8);
                // SAFETY: as above.
                unsafe { store(base.add(at), marked.as_ptr().add(3), n) };
                let mut want = bytes(&numbered());
                want[at..at + n].copy_from_slice(&marked[3..3 + n]);
                assert_eq!(bytes(&shared), want, "store at {at}, {n} bytes");
                shared = numbered();
                let base = shared.as_mut_ptr().cast::<u8>();

                // SAFETY: as above.
                unsafe { fill(base.add(at), 0xA5, n) };
                let mut want = bytes(&numbered());
                want[at..at + n].fill(0xA5);
                assert_eq!(bytes(&shared), want, "fill at {at}, {n} bytes");
            }
        }
    }

    /// Overlapping moves in either direction, through chunks smaller than the move, give what
    /// `copy_within` (memmove) gives.
    #[test]
    fn shared_moves_are_memmoves() {
        for (from, to, n) in [(0, 5, 40), (5, 0, 40), (3, 11, 50), (11, 3, 50), (8, 8, 16)] {
            for chunk in [1, 3, 8, 64] {
                let mut shared = numbered();
                let base = shared.as_mut_ptr().cast::<u8>();
                // SAFETY: both ranges lie inside the 64 bytes, which nothing else accesses.
                unsafe { move_in_chunks(base.add(to), base.add(from), n, chunk) };
                let mut want = bytes(&numbered());
                want.copy_within(from..from + n, to);
                assert_eq!(bytes(&shared), want, "{n} bytes {from} -> {to}, chunks of {chunk}");
            }
        }
    }
}
