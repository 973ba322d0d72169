//! Dropping a pool never waits for a stream: memory that work enqueued before the drop may
//! still use goes back to the device once that work has completed, at a later device call.

use std::time::{Duration, Instant};

use soma::MemPool;

use crate::common::{device_of, npu, Gate};

const MIB: usize = 1 << 20;

/// The device's physical bytes, and reservations not released.
fn held(npu: &soma::sim::Npu) -> (u64, u64) {
    let st = npu.sim_device(0).unwrap().stats();
    (st.physical_bytes, st.calls.reserve - st.calls.release)
}

#[test]
fn dropping_a_pool_does_not_wait_for_a_stream_held_by_a_host_function() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s, other) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    // Memory whose free is complete, and memory whose use waits behind the gate.
    let done = pool.alloc_async::<u8>(4 * MIB, &other).unwrap();
    let gate = Gate::close(&s);
    let mut busy = pool.alloc_async::<u8>(2 * MIB, &s).unwrap();
    s.memset(&mut busy, 7).unwrap();
    drop(busy);
    drop(done);
    other.synchronize().unwrap();

    let started = Instant::now();
    drop(pool);
    assert!(!gate.passed(), "the drop returned while the stream was still held");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(held(&npu), (2 << 20, 1), "what the gated memset uses stays, the rest went");

    other.synchronize().unwrap();
    assert_eq!(held(&npu).0, 2 << 20, "an unrelated synchronisation releases nothing early");
    gate.open();
    // The memset ran on memory still mapped (a use of unmapped memory fails the stream).
    s.synchronize().unwrap();
    assert_eq!(held(&npu), (0, 0), "released at the synchronisation after the work");
}

#[test]
fn raw_blocks_a_dropped_pool_leaves_wait_for_every_stream() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s, user) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).raw_pointers(true).build(&dev).unwrap();
    let (ptr, size) = pool.alloc_raw(2 << 20, &s).unwrap();
    let gate = Gate::close(&user);
    // A use on another stream that the pool was not told of: raw pointers are the caller's.
    user.hal().memset(ptr, 1, size).unwrap();
    drop(pool);
    assert!(!gate.passed());
    assert_eq!(held(&npu), (2 << 20, 1));
    gate.open();
    user.synchronize().unwrap();
    assert_eq!(held(&npu), (0, 0));
}

#[test]
fn a_pass_through_pool_drops_with_frees_in_flight() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).passthrough(true).build(&dev).unwrap();
    let gate = Gate::close(&s);
    let mut x = pool.alloc_async::<u32>(MIB, &s).unwrap();
    s.memset(&mut x, 0).unwrap();
    assert_eq!(x.len(), MIB);
    drop(x);
    drop(pool);
    assert!(!gate.passed());
    assert_eq!(held(&npu).1, 1);
    gate.open();
    s.synchronize().unwrap();
    assert_eq!(held(&npu), (0, 0));
}

#[test]
fn dropping_the_stream_releases_what_a_dropped_pool_left() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let gate = Gate::close(&s);
    let mut x = pool.alloc_async::<u8>(2 * MIB, &s).unwrap();
    s.memset(&mut x, 7).unwrap();
    drop(x);
    drop(pool);
    assert_eq!(held(&npu).1, 1);
    gate.open();
    drop(s); // drains the stream
    assert_eq!(held(&npu), (0, 0));
}
