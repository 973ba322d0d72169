//! Fuzz target: the public pool API on the software NPU, including bad input and injected
//! driver faults.
//!
//! Two raw-pointer pools (one tight, so that growth fails, internal dependencies and the
//! out-of-memory path run), two pools of typed allocations (`PoolAlloc`, freed through the
//! lock-free free ring; one split in two stream shards), three streams, two events. After
//! every op: no panic, no two live allocations overlap, each pool's `used` is the sum of its
//! live sizes, `reserved >= used`,
//! the device maps exactly the pools' reserved bytes, and bad input is an error that changes
//! nothing. At the end everything is freed, synchronised and trimmed, and the device holds no
//! memory.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use soma::hal::DevicePtr;
use soma::sim::{FaultKind, Npu};
use soma::{attr, MemPool, ReusePolicy};

const MIB: u64 = 1 << 20;

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc { pool: bool, stream: u8, bytes: u32 },
    Free { which: u8, stream: u8 },
    FreeBadPointer { pool: bool, offset: u32 },
    DoubleFree { pool: bool },
    Record { stream: u8, event: bool },
    Wait { stream: u8, event: bool },
    SyncStream { stream: u8 },
    SyncEvent { event: bool },
    SyncDevice,
    Trim { pool: bool, mib: u16 },
    Reuse { pool: bool, follow: bool, opportunistic: bool, internal: bool },
    Threshold { pool: bool, mib: u16 },
    Sleep { stream: u8 },
    Fault { map: bool, every: u8 },
    ClearFaults,
    AllocTyped { sharded: bool, stream: u8, len: u32 },
    DropTyped { which: u8 },
    FreeTyped { which: u8 },
    HandOff { which: u8, stream: u8 },
}

/// The size the pool gives a typed allocation of `len` bytes (its 512-byte alignment).
fn rounded(len: usize) -> u64 {
    (len as u64).div_ceil(512) * 512
}

fn npu() -> &'static Npu {
    static NPU: OnceLock<Npu> = OnceLock::new();
    NPU.get_or_init(|| Npu::builder().capacity(1 << 30).build().expect("software NPU"))
}

fuzz_target!(|ops: Vec<Op>| {
    let npu = npu();
    let dev = npu.device(0).unwrap();
    let sim = npu.sim_device(0).unwrap();
    sim.faults().clear(FaultKind::Map);
    sim.faults().clear(FaultKind::AllocPhysical);
    let pools = [
        MemPool::builder().max_size(256 * MIB).raw_pointers(true).build(&dev).unwrap(),
        MemPool::builder()
            .max_size(8 * MIB)
            .raw_pointers(true)
            .reuse(ReusePolicy::ALL)
            .build(&dev)
            .unwrap(),
    ];
    let typed = [
        MemPool::builder().max_size(64 * MIB).build(&dev).unwrap(),
        MemPool::builder().max_size(64 * MIB).stream_shards(2).build(&dev).unwrap(),
    ];
    let streams: Vec<_> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
    // (typed pool, allocation)
    let mut typed_live: Vec<(usize, soma::PoolAlloc<'_, u8>)> = Vec::new();
    let events = [dev.create_event().unwrap(), dev.create_event().unwrap()];
    // (pool, ptr, size)
    let mut live: Vec<(usize, DevicePtr, u64)> = Vec::new();
    let mut freed: Vec<(usize, DevicePtr)> = Vec::new();
    let s = |i: u8| &streams[i as usize % streams.len()];
    let p = |b: bool| b as usize;
    for op in ops.iter().take(200) {
        let before: Vec<_> = pools.iter().map(|p| p.stats()).collect();
        match *op {
            Op::Alloc { pool, stream, bytes } => {
                let pi = p(pool);
                match pools[pi].alloc_raw(u64::from(bytes), s(stream)) {
                    Ok((ptr, size)) => {
                        assert_eq!(size, u64::from(bytes).div_ceil(512) * 512);
                        freed.retain(|&(fp, f)| fp != pi || f != ptr);
                        live.push((pi, ptr, size));
                    }
                    Err(e) => {
                        let after = pools[pi].stats();
                        assert_eq!(after.used, before[pi].used, "{e}");
                        assert_eq!(after.live_allocations, before[pi].live_allocations);
                        assert!(after.reserved <= before[pi].reserved, "failed alloc grew: {e}");
                        if bytes == 0 {
                            assert!(matches!(e, soma::Error::InvalidSize(_)));
                        }
                    }
                }
            }
            Op::Free { which, stream } => {
                if !live.is_empty() {
                    let (pi, ptr, _) = live.swap_remove(which as usize % live.len());
                    pools[pi].free_raw(ptr, s(stream)).unwrap();
                    freed.push((pi, ptr));
                }
            }
            Op::FreeBadPointer { pool, offset } => {
                let pi = p(pool);
                let base = live.iter().find(|l| l.0 == pi).map_or(4096, |l| l.1.addr());
                // Never 0: `base` is a device address far from the top of the address space.
                let ptr = DevicePtr::new(base.wrapping_add(u64::from(offset) + 1)).unwrap();
                if !live.iter().any(|l| l.0 == pi && l.1 == ptr) {
                    assert!(pools[pi].free_raw(ptr, &streams[0]).is_err());
                    assert_eq!(pools[pi].stats(), before[pi]);
                }
            }
            Op::DoubleFree { pool } => {
                let pi = p(pool);
                if let Some(&(_, ptr)) = freed.iter().find(|f| f.0 == pi) {
                    if !live.iter().any(|l| l.0 == pi && l.1 == ptr) {
                        assert!(
                            pools[pi].free_raw(ptr, &streams[0]).is_err(),
                            "double free accepted"
                        );
                        assert_eq!(pools[pi].stats(), before[pi]);
                    }
                }
            }
            Op::Record { stream, event } => s(stream).record(&events[event as usize]).unwrap(),
            Op::Wait { stream, event } => s(stream).wait_event(&events[event as usize]).unwrap(),
            Op::SyncStream { stream } => s(stream).synchronize().unwrap(),
            Op::SyncEvent { event } => events[event as usize].synchronize().unwrap(),
            Op::SyncDevice => dev.synchronize().unwrap(),
            Op::Trim { pool, mib } => {
                let pool = &pools[p(pool)];
                let bytes = u64::from(mib) * MIB;
                let r = pool.trim_to(bytes);
                assert_eq!(r.is_err(), bytes > pool.max_size(), "{r:?}");
            }
            Op::Reuse { pool, follow, opportunistic, internal } => {
                pools[p(pool)].set_reuse_policy(ReusePolicy::new(follow, opportunistic, internal));
            }
            Op::Threshold { pool, mib } => {
                let pool = &pools[p(pool)];
                let bytes = u64::from(mib) * MIB;
                let r = pool.set::<attr::ReleaseThreshold>(bytes);
                assert_eq!(r.is_err(), bytes > pool.max_size(), "{r:?}");
            }
            Op::Sleep { stream } => {
                s(stream).host_fn(|| std::thread::sleep(Duration::from_micros(200))).unwrap();
            }
            Op::Fault { map, every } => {
                let kind = if map { FaultKind::Map } else { FaultKind::AllocPhysical };
                sim.faults().fail_every(kind, u64::from(every % 4) + 1);
            }
            Op::ClearFaults => {
                sim.faults().clear(FaultKind::Map);
                sim.faults().clear(FaultKind::AllocPhysical);
            }
            Op::AllocTyped { sharded, stream, len } => {
                let ti = p(sharded);
                let used_before = typed[ti].stats().used;
                match typed[ti].alloc_async::<u8>(len as usize, s(stream)) {
                    Ok(a) => {
                        assert_eq!(a.len(), len as usize);
                        typed_live.push((ti, a));
                    }
                    Err(e) => {
                        assert_eq!(typed[ti].stats().used, used_before, "{e}");
                        if len == 0 {
                            assert!(matches!(e, soma::Error::InvalidSize(_)));
                        }
                    }
                }
            }
            Op::DropTyped { which } => {
                if !typed_live.is_empty() {
                    drop(typed_live.swap_remove(which as usize % typed_live.len()));
                }
            }
            Op::FreeTyped { which } => {
                if !typed_live.is_empty() {
                    let (_, a) = typed_live.swap_remove(which as usize % typed_live.len());
                    a.free().unwrap();
                }
            }
            Op::HandOff { which, stream } => {
                if !typed_live.is_empty() {
                    let i = which as usize % typed_live.len();
                    let (ti, a) = typed_live.swap_remove(i);
                    // On failure the allocation is freed onto its original stream.
                    if let Ok(a) = a.hand_off(s(stream)) {
                        typed_live.push((ti, a));
                    }
                }
            }
        }
        let mut sorted = live.clone();
        sorted.extend(typed_live.iter().map(|(ti, a)| (2 + ti, a.device_ptr(), rounded(a.len()))));
        sorted.sort_by_key(|l| l.1);
        for w in sorted.windows(2) {
            assert!(w[0].1.addr() + w[0].2 <= w[1].1.addr(), "live allocations overlap: {w:?}");
        }
        let mut reserved = 0;
        // `sorted` holds every live allocation, raw (pools 0, 1) and typed (pools 2, 3).
        // `stats` takes the lock, which first drains the free ring: typed frees show.
        for (pi, pool) in pools.iter().chain(&typed).enumerate() {
            let st = pool.stats();
            let used: u64 = sorted.iter().filter(|l| l.0 == pi).map(|l| l.2).sum();
            assert_eq!(st.used, used, "pool {pi}: {st:?}");
            assert!(st.reserved >= st.used && st.reserved <= st.max_size, "{st:?}");
            assert!(st.used_high >= st.used && st.reserved_high >= st.reserved, "{st:?}");
            reserved += st.reserved;
        }
        assert_eq!(sim.stats().mapped_bytes, reserved, "device vs pools");
    }
    sim.faults().clear(FaultKind::Map);
    sim.faults().clear(FaultKind::AllocPhysical);
    for (pi, ptr, _) in live.drain(..) {
        pools[pi].free_raw(ptr, &streams[0]).unwrap();
    }
    drop(typed_live);
    dev.synchronize().unwrap();
    for pool in pools.iter().chain(&typed) {
        pool.trim_to(0).unwrap();
        assert_eq!(pool.stats().reserved, 0);
    }
    drop(pools);
    drop(typed);
    assert_eq!(sim.stats().mapped_bytes, 0);
    assert_eq!(sim.stats().physical_bytes, 0);
});
