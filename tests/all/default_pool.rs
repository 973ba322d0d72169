//! A device's default pool: made on first use, configurable before it, used by
//! `Stream::alloc_async`, and gone with the device.

use soma::{Error, MemPool};

#[test]
fn streams_allocate_from_one_default_pool() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_owned_stream().unwrap());
    let a = s1.alloc_async::<u8>(4096).unwrap();
    let b = s2.alloc_async::<u8>(8192).unwrap(); // OwnedAlloc
    let pool = dev.default_pool().unwrap();
    assert!(pool.same_pool(&dev.default_pool().unwrap()));
    assert!(pool.same_pool(b.pool()));
    assert_eq!(pool.stats().used, 4096 + 8192);
    // The same-stream reuse of any pool applies.
    drop(a);
    let c = s1.alloc_async::<u8>(4096).unwrap();
    assert_eq!(pool.stats().reuses.same_stream, 1);
    drop((b, c));
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn the_default_pool_is_configured_before_its_first_use() {
    let npu = crate::common::npu();
    let dev = npu.device(0).unwrap();
    let too_big = MemPool::builder().max_size(u64::MAX / 2);
    assert!(matches!(dev.set_default_pool(too_big), Err(Error::InvalidConfig(_))));
    dev.set_default_pool(MemPool::builder().max_size(8 << 20)).unwrap();
    let s = dev.create_stream().unwrap();
    let x = s.alloc_async::<u8>(4 << 20).unwrap();
    assert!(matches!(s.alloc_async::<u8>(6 << 20), Err(Error::OutOfMemory(_))));
    assert_eq!(dev.default_pool().unwrap().max_size(), 8 << 20);
    let again = dev.set_default_pool(MemPool::builder());
    assert!(matches!(again, Err(Error::InvalidConfig(m)) if m.contains("already in use")));
    drop(x);
}

#[test]
fn the_default_pool_goes_with_the_device() {
    // The device holds its default pool and the pool a handle to the device: they must not
    // keep each other alive, or every device that used `alloc_async` would leak its memory.
    let npu = crate::common::npu();
    let sim = npu.sim_device(0).unwrap();
    {
        let dev = npu.device(0).unwrap();
        let s = dev.create_stream().unwrap();
        let x = s.alloc_async::<u8>(1 << 20).unwrap();
        s.synchronize().unwrap();
        drop(x);
        assert!(sim.stats().mapped_bytes > 0, "the pool caches the freed block");
    }
    drop(npu);
    assert_eq!(sim.stats().mapped_bytes, 0, "the default pool was torn down with the device");
    assert_eq!(sim.stats().live_streams, 0);
}

#[test]
fn a_held_default_pool_outlives_the_device_handles() {
    let npu = crate::common::npu();
    let sim = npu.sim_device(0).unwrap();
    let pool = npu.device(0).unwrap().default_pool().unwrap();
    drop(npu);
    let s = pool.device().create_owned_stream().unwrap();
    let x = pool.upload(&[1u32, 2, 3], &s).unwrap();
    assert_eq!(s.download(&x).unwrap(), vec![1, 2, 3]);
    drop((x, s, pool));
    assert_eq!(sim.stats().mapped_bytes, 0);
}
