//! Per-request alignment: blocks whose first byte and length are multiples of what the
//! request asked for, up to the granularity.

use soma::{Error, MemPool};

const GRANULE: u64 = 2 << 20;

#[test]
fn aligned_requests_get_aligned_blocks_of_aligned_length() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    for shards in [1, 2] {
        let pool = MemPool::builder().stream_shards(shards).build(&dev).unwrap();
        let mut keep = Vec::new();
        for (i, align) in [4096u64, 64 << 10, 1 << 20, GRANULE].into_iter().enumerate() {
            // An odd small block first, so that the next free byte is misaligned.
            keep.push(pool.alloc_async::<u8>(1000 + i, &s).unwrap());
            let used = pool.stats().used;
            let x = pool.alloc_aligned_async::<u8>(3000, align, &s).unwrap();
            assert_eq!(x.device_ptr().addr() % align, 0, "align {align}");
            assert_eq!(pool.stats().used - used, align.max(3072), "length rounded to {align}");
            keep.push(x);
        }
        drop(keep);
        assert_eq!(pool.stats().used, 0);
    }
}

#[test]
fn owned_pools_align_too() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let pool = MemPool::builder().build_owned(&dev).unwrap();
    let s = dev.create_owned_stream().unwrap();
    let _pad = pool.alloc_async::<u8>(512, &s).unwrap();
    let x = pool.alloc_aligned_async::<f32>(100, GRANULE, &s).unwrap();
    assert_eq!(x.device_ptr().addr() % GRANULE, 0);
    assert_eq!(s.download(&x).unwrap().len(), 100);
}

#[test]
fn bad_alignments_are_refused() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().alignment(1024).build(&dev).unwrap();
    for align in [0, 3, 512, 3 << 20, 4 << 20] {
        let r = pool.alloc_aligned_async::<u8>(10, align, &s);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "align {align}: {r:?}");
    }
    assert_eq!(pool.stats().used, 0, "a refused request takes nothing");
    assert!(pool.alloc_aligned_async::<u8>(10, 1024, &s).is_ok(), "the pool's own alignment");
}

#[test]
fn unaligned_requests_are_served_as_before() {
    // The same program with and without an aligned request in between: the unaligned
    // allocations land where they would without it (aligned blocks come after them).
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let place = |with_aligned: bool| {
        let pool = MemPool::builder().build(&dev).unwrap();
        let a = pool.alloc_async::<u8>(5000, &s).unwrap();
        let big = with_aligned.then(|| pool.alloc_aligned_async::<u8>(1, GRANULE, &s).unwrap());
        let b = pool.alloc_async::<u8>(7000, &s).unwrap();
        let offsets = (b.device_ptr().addr() - a.device_ptr().addr(), big.is_some());
        drop((a, b, big));
        offsets.0
    };
    assert_eq!(place(false), place(true));
}
