//! Compaction as the out-of-memory report recommends it: `compact` must work in the state the
//! failed request left the pool in.

use soma::{attr, Error, MemPool};

use crate::common::{device_of, npu};

const MIB: usize = 1 << 20;

#[test]
fn compact_after_a_fragmented_out_of_memory_makes_the_request_fit() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(8 << 20).build(&dev).unwrap();
    let blocks: Vec<_> = (0..4).map(|_| pool.alloc_async::<u8>(2 * MIB, &s).unwrap()).collect();
    let [first, mut second, third, mut fourth] = <[_; 4]>::try_from(blocks).ok().unwrap();
    drop(first);
    drop(third);
    s.synchronize().unwrap();

    let Err(Error::OutOfMemory(oom)) = pool.alloc_async::<u8>(4 * MIB, &s) else {
        panic!("4 MiB fits in no free range of a pool fragmented into 2 MiB pieces");
    };
    let report = oom.to_string();
    assert!(report.contains("hint: compact live allocations (MemPool::compact)"), "{report}");

    // What the report recommends, in the state it was given in.
    let moved = pool.compact(&s, &mut [&mut second, &mut fourth]).unwrap();
    assert_eq!(moved, 2, "both live blocks move down into the free space below them");
    assert!(pool.get::<attr::ReservedMemCurrent>().unwrap() <= 8 << 20, "within max_size");
    let whole = pool.alloc_async::<u8>(4 * MIB, &s).expect("the request fits after compaction");
    let ptrs = [second.device_ptr(), fourth.device_ptr(), whole.device_ptr()];
    for (i, a) in ptrs.iter().enumerate() {
        for b in &ptrs[i + 1..] {
            assert_ne!(a, b);
        }
    }
}

#[test]
fn compact_maps_released_space_below_the_allocation_again() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(8 << 20).build(&dev).unwrap();
    let first = pool.alloc_async::<u8>(2 * MIB, &s).unwrap();
    let mut second = pool.alloc_async::<u8>(2 * MIB, &s).unwrap();
    let _third = pool.alloc_async::<u8>(2 * MIB, &s).unwrap();
    let _fourth = pool.alloc_async::<u8>(2 * MIB, &s).unwrap();
    drop(first);
    s.synchronize().unwrap();
    // Everything the pool may hold is mapped except what the first block held, released now.
    assert_eq!(pool.trim_to(0).unwrap(), 2 << 20);
    let before = second.device_ptr();
    assert_eq!(pool.compact(&s, &mut [&mut second]).unwrap(), 1);
    assert!(second.device_ptr() < before, "moved into the space mapped again below it");
    assert_eq!(pool.get::<attr::ReservedMemCurrent>().unwrap(), 8 << 20);
}
