//! What `PoolStats` reports after synchronisations — the same whether or not the pool took a
//! shortcut for a stream alone on its device — and after the pool settled frees the device
//! completed.

use soma::MemPool;

use crate::common::{device_of, npu};

const MIB: usize = 1 << 20;

#[test]
fn synchronized_frees_are_not_pending_when_one_stream_is_alone_on_the_device() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    drop(pool.alloc_async::<u8>(4 * MIB, &s).unwrap());
    assert_eq!(pool.stats().pending_bytes, 4 << 20, "freed on s, not observed yet");
    s.synchronize().unwrap();
    let alone = pool.stats();
    assert_eq!(alone.pending_bytes, 0, "synchronised frees are reusable by every stream");
    assert_eq!(alone.free_bytes, alone.reserved);

    // The same with a second stream on the device.
    let other = dev.create_stream().unwrap();
    drop(pool.alloc_async::<u8>(4 * MIB, &s).unwrap());
    s.synchronize().unwrap();
    assert_eq!(pool.stats().pending_bytes, 0);
    // A successful query observes as a synchronisation does (nothing is settled by it).
    let mut x = pool.alloc_async::<u8>(4 * MIB, &s).unwrap();
    s.memset(&mut x, 1).unwrap();
    drop(x);
    assert_eq!(pool.stats().pending_bytes, 4 << 20, "freed after work the host has not seen");
    crate::common::wait_device_only(&s);
    assert!(s.query().unwrap());
    assert_eq!(pool.stats().pending_bytes, 0);
    // And the memory is what a stream created afterwards gets.
    let reused = pool.alloc_async::<u8>(4 * MIB, &other).unwrap();
    assert_eq!(pool.stats().fresh_allocations, 1, "only the first allocation was fresh");
    drop(reused);
}

/// While several streams free, an allocation settles the frees the device completed: they
/// are reusable by every stream from then on and leave the pending count without a
/// synchronisation; a free whose work is still in flight stays pending.
#[test]
fn frees_settled_on_completion_are_not_pending() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let (a, b) = (pool.alloc_async::<u8>(MIB, &s1).unwrap(), pool.alloc_async::<u8>(MIB, &s2));
    let mut busy = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    let gate = crate::common::Gate::close(&s2);
    s2.memset(&mut busy, 1).unwrap();
    drop((a, b.unwrap()));
    crate::common::wait_device_only(&s1);
    assert_eq!(pool.stats().pending_bytes, 2 << 20, "nothing observed yet");
    // s1's free completed; s2's waits behind the gate.
    let c = pool.alloc_async::<u8>(512, &s1).unwrap();
    assert_eq!(pool.stats().pending_bytes, 1 << 20, "s1's free settled, s2's pending");
    drop(gate);
    s2.synchronize().unwrap();
    drop((busy, c));
}
