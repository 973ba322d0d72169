//! The replicas of torch_npu's caching allocator and llama.cpp's CANN pool: correct
//! allocators, and the rules of the originals.

use super::*;
use crate::workload::{free_all, random_allocations, replay, SEED};
use crate::MIB;

/// Random allocations (small and large) and frees against a shadow list of live ranges: no
/// overlap, every range at least the request; `range_of` gives a handle's `(address, size)`.
fn exercise<A: Allocator>(a: &mut A, range_of: impl Fn(&A, A::Handle) -> (u64, u64))
where
    A::Handle: Copy,
{
    let mut live: Vec<(A::Handle, u64, u64)> = Vec::new();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for step in 0..4000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x % 3 != 0 || live.is_empty() {
            let bytes = if x % 5 == 0 { 1 + (x >> 24) % (30 * MIB) } else { 1 + (x >> 24) % MIB };
            let h = a.alloc(bytes).expect("alloc");
            let (off, size) = range_of(a, h);
            assert!(size >= bytes, "step {step}: size {size} < {bytes}");
            for &(_, o, s) in &live {
                assert!(off + size <= o || o + s <= off, "overlap at step {step}");
            }
            live.push((h, off, size));
        } else {
            let i = (x >> 8) as usize % live.len();
            a.free(live.swap_remove(i).0);
        }
    }
    for (h, _, _) in live {
        a.free(h);
    }
}

#[test]
fn torch_npu_is_a_correct_allocator_and_merges_back_into_whole_segments() {
    let mut t = TorchNpu::new(1 << 40);
    exercise(&mut t, TorchNpu::range_of);
    let calls = t.driver_calls();
    assert!(calls.malloc > 0 && calls.free == 0, "segments stay cached");
    assert_eq!(t.reserved_high(), t.reserved());
    t.empty_cache();
    assert_eq!(t.reserved(), 0, "every segment merged back whole");
    assert_eq!(t.driver_calls().free, calls.malloc);
}

#[test]
fn torch_npu_rounds_pads_and_sizes_segments_as_torch_npu() {
    let mut t = TorchNpu::new(1 << 40);
    // 1 + 32 B pad -> 512 B; 480 + 32 -> 512; 481 + 32 -> 1 KiB; one 2 MiB small segment.
    let a = t.alloc(1).unwrap();
    let b = t.alloc(480).unwrap();
    let c = t.alloc(481).unwrap();
    assert_eq!((t.range_of(a), t.range_of(b), t.range_of(c)), ((0, 512), (512, 512), (1024, 1024)));
    assert_eq!((t.reserved(), t.driver_calls().malloc), (2 * MIB, 1));
    // 1 MiB - 32 B is the largest small request; one byte more goes to a 20 MiB segment.
    let small = t.alloc(MIB - 32).unwrap();
    assert_eq!(t.range_of(small).1, MIB);
    assert_eq!(t.driver_calls().malloc, 1, "still the small segment");
    let large = t.alloc(MIB - 31).unwrap();
    assert_eq!(t.range_of(large).1, MIB + 512);
    assert_eq!((t.reserved(), t.driver_calls().malloc), (22 * MIB, 2));
    // 11 MiB fits the 20 MiB segment's free rest (best fit before any new segment).
    let mid = t.alloc(11 * MIB).unwrap();
    assert_eq!(t.range_of(mid).1, 11 * MIB + 512);
    assert_eq!(t.driver_calls().malloc, 2);
    // From 10 MiB a new segment has the request's size, rounded up to 2 MiB; the block keeps
    // it whole (what would remain is not over 1 MiB).
    let big = t.alloc(21 * MIB).unwrap();
    assert_eq!(t.range_of(big).1, 22 * MIB);
    assert_eq!(t.reserved(), 44 * MIB);
}

#[test]
fn torch_npu_splits_best_fits_and_merges_within_segments() {
    let mut t = TorchNpu::new(1 << 40);
    // A large block keeps its whole segment when at most 1 MiB would remain.
    let whole = t.alloc(19 * MIB - 32).unwrap();
    assert_eq!(t.range_of(whole).1, 20 * MIB);
    let a = t.alloc(2 * MIB).unwrap();
    let b = t.alloc(3 * MIB).unwrap();
    let c = t.alloc(4 * MIB).unwrap();
    assert_eq!(t.driver_calls().malloc, 2, "a, b and c split one 20 MiB segment");
    assert_eq!(t.range_of(b).0, t.range_of(a).0 + t.range_of(a).1);
    t.free(a);
    t.free(c); // merges with the free tail of the segment
               // Best fit: a 2 MiB request takes a's hole, not the larger tail.
    let d = t.alloc(2 * MIB - 32).unwrap();
    assert_eq!(d, a);
    t.free(d);
    t.free(b); // a's hole, b and the tail merge: the segment is whole again
    t.free(whole);
    t.empty_cache();
    assert_eq!((t.reserved(), t.driver_calls().free), (0, 2), "segments never merge");
}

#[test]
fn torch_npu_empties_its_cache_when_the_device_is_full() {
    let mut t = TorchNpu::new(40 * MIB);
    let a = t.alloc(9 * MIB).unwrap();
    let b = t.alloc(15 * MIB).unwrap();
    assert_eq!(t.reserved(), 20 * MIB + 16 * MIB);
    t.free(a);
    t.free(b);
    // 30 MiB does not fit beside the 36 MiB cached: both segments go back, then the malloc.
    let c = t.alloc(30 * MIB - 32).unwrap();
    assert_eq!(t.range_of(c).1, 30 * MIB);
    assert_eq!((t.driver_calls().free, t.driver_calls().malloc), (2, 3));
    assert_eq!(t.alloc(20 * MIB), None, "out of memory with everything in use");
}

#[test]
fn torch_npu_warm_replays_make_no_driver_calls() {
    let w = random_allocations(2_000, 64, 16_000, SEED);
    let mut t = TorchNpu::new(1 << 40);
    let h = replay(&mut t, &w.ops, w.slots);
    free_all(&mut t, h);
    let cold = t.driver_calls();
    assert!(cold.malloc > 0);
    let h = replay(&mut t, &w.ops, w.slots);
    free_all(&mut t, h);
    assert_eq!(t.driver_calls(), cold, "the cache serves the same sequence again");
    assert!(t.reserved_high() >= w.stats.peak_live_bytes);
}

#[test]
fn llama_cpp_is_a_correct_allocator() {
    let mut l = LlamaCppPrio::new();
    exercise(&mut l, LlamaCppPrio::range_of);
    let calls = l.driver_calls();
    assert!(calls.malloc > 0);
    assert_eq!(l.reserved_high(), l.reserved(), "nothing given back within 20 000 calls");
    assert_eq!(calls.free, 0);
}

#[test]
fn llama_cpp_reuses_the_smallest_buffer_within_4_mib() {
    let mut l = LlamaCppPrio::new();
    let a = l.alloc(1).unwrap();
    assert_eq!(l.range_of(a), (0, 128));
    l.free(a);
    assert_eq!(l.alloc(100).unwrap(), a, "reused");
    let six = l.alloc(6 * MIB).unwrap();
    let five = l.alloc(5 * MIB).unwrap();
    let eight = l.alloc(8 * MIB).unwrap();
    l.free(six);
    l.free(five);
    l.free(eight);
    assert_eq!(l.alloc(4 * MIB + 1).unwrap(), five, "smallest that holds it");
    assert_eq!(l.driver_calls().malloc, 4);
    // The smallest free buffer (6 MiB) is more than 4 MiB above 1 MiB: a new buffer of
    // exactly the request, though both free buffers hold it.
    let one = l.alloc(MIB).unwrap();
    assert_eq!((l.range_of(one).1, l.driver_calls().malloc), (MIB, 5));
    assert_eq!(l.alloc(4 * MIB).unwrap(), six);
    assert_eq!(l.alloc(4 * MIB).unwrap(), eight, "exactly 4 MiB above still serves");
    assert_eq!(l.driver_calls().malloc, 5);
}

#[test]
fn llama_cpp_gives_back_stale_buffers_it_looks_at() {
    let mut l = LlamaCppPrio::new();
    let old = l.alloc(2 * MIB).unwrap();
    let small = l.alloc(512).unwrap();
    l.free(old);
    l.free(small);
    let stale_after = (100_000 / LlamaCppPrio::CALL_TIME.as_micros()) as u64;
    assert_eq!(stale_after, 20_000);
    // Small requests find `small` first and never look at `old`.
    for _ in 0..stale_after / 2 {
        let h = l.alloc(256).unwrap();
        l.free(h);
    }
    assert_eq!(l.driver_calls().free, 0);
    // A larger request looks at `old` (2 MiB < 8 MiB) and frees it: unused for 20 000 calls.
    let big = l.alloc(8 * MIB).unwrap();
    assert_eq!(l.driver_calls().free, 1);
    assert_eq!(l.reserved(), 8 * MIB + 512);
    // Buffers of 1 MiB or less are kept whatever their age.
    l.free(big);
    for _ in 0..stale_after {
        let h = l.alloc(100).unwrap();
        l.free(h);
    }
    let h = l.alloc(64 * MIB).unwrap();
    assert_eq!(l.driver_calls().free, 2, "the stale 8 MiB buffer, not the 512 B one");
    assert_eq!(l.reserved(), 64 * MIB + 512);
    l.free(h);
}

#[test]
fn llama_cpp_call_time_is_the_ascend_like_launch() {
    assert_eq!(LlamaCppPrio::CALL_TIME, soma::sim::LatencyModel::ascend_like().launch);
}
