//! Bad input to the Rust API: one table, each row an input, the error it must get, and the
//! check that nothing changed (pool statistics, device memory and reservations before and
//! after are equal): every public entry point returns an error for bad input instead of
//! panicking or corrupting state.
//!
//! The table is documented in `docs/semantics.md`, section "Bad input"; run with
//! `--nocapture` to print it as markdown.

use std::cell::RefCell;

use soma::hal::DevicePtr;
use soma::sim::Npu;
use soma::{attr, BufferOwner, DriverAlloc, Error, KernelArg, MemPool, PoolStats};

const MIB: u64 = 1 << 20;
const POOL_MAX: u64 = 64 * MIB;

/// The variant of an error (the `Error` enum is non-exhaustive).
fn variant(result: &Result<(), Error>) -> &'static str {
    match result {
        Ok(()) => "Ok",
        Err(Error::InvalidSize(_)) => "InvalidSize",
        Err(Error::InvalidArgument(_)) => "InvalidArgument",
        Err(Error::InvalidConfig(_)) => "InvalidConfig",
        Err(Error::WrongDevice(_)) => "WrongDevice",
        Err(Error::PeerAccess(_)) => "PeerAccess",
        Err(Error::OutOfMemory(_)) => "OutOfMemory",
        Err(Error::TooManyStreams { .. }) => "TooManyStreams",
        Err(Error::Driver(_)) => "Driver",
        Err(_) => "other",
    }
}

type Row<'a> = (&'static str, &'static str, Box<dyn Fn() -> Result<(), Error> + 'a>);

#[test]
fn bad_input_matrix() {
    let npu = Npu::builder().devices(2).capacity(1 << 30).build().unwrap();
    let dev = npu.device(0).unwrap();
    let other_dev = npu.device(1).unwrap();
    let sim = npu.sim_device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let s2 = dev.create_stream().unwrap();
    let foreign_stream = other_dev.create_stream().unwrap();
    let other_npu = Npu::builder().capacity(1 << 30).build().unwrap();
    let other_npu_dev = other_npu.device(0).unwrap();
    let other_npu_stream = other_npu_dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(POOL_MAX).raw_pointers(true).build(&dev).unwrap();
    let typed_pool = MemPool::builder().max_size(POOL_MAX).build(&dev).unwrap();
    let other_pool = MemPool::builder().max_size(POOL_MAX).raw_pointers(true).build(&dev).unwrap();
    let foreign_pool = MemPool::builder().max_size(POOL_MAX).build(&other_dev).unwrap();

    // Fixtures: live raw blocks, a freed pointer, typed allocations on two streams, events.
    let (live_raw, _) = pool.alloc_raw(8192, &s).unwrap();
    let (foreign_raw, _) = other_pool.alloc_raw(4096, &s).unwrap();
    let interior = DevicePtr::new(live_raw.addr() + 512).unwrap();
    let on_s = RefCell::new(pool.alloc_async::<u32>(1024, &s).unwrap());
    let on_s2 = RefCell::new(pool.alloc_async::<u32>(1024, &s2).unwrap());
    let of_typed_pool = RefCell::new(typed_pool.alloc_async::<u32>(1024, &s).unwrap());
    let on_foreign = RefCell::new(foreign_pool.alloc_async::<u32>(1024, &foreign_stream).unwrap());
    // Last, so that no later fixture reuses its block.
    let (freed_raw, _) = pool.alloc_raw(4096, &s).unwrap();
    pool.free_raw(freed_raw, &s).unwrap();
    let unrecorded = (dev.create_event().unwrap(), dev.create_event().unwrap());
    let recorded = s.record_event().unwrap();
    let foreign_event = foreign_stream.record_event().unwrap();
    s.synchronize().unwrap();
    foreign_stream.synchronize().unwrap();

    let rows: Vec<Row<'_>> = vec![
        (
            "`alloc_async::<u8>(0, s)`",
            "InvalidSize",
            Box::new(|| pool.alloc_async::<u8>(0, &s).map(drop)),
        ),
        (
            "`alloc_async::<u64>(usize::MAX, s)` (bytes overflow)",
            "InvalidSize",
            Box::new(|| pool.alloc_async::<u64>(usize::MAX, &s).map(drop)),
        ),
        (
            "`alloc_async::<u8>(usize::MAX, s)` (rounding overflows)",
            "InvalidSize",
            Box::new(|| pool.alloc_async::<u8>(usize::MAX, &s).map(drop)),
        ),
        (
            "`alloc_async::<()>(8, s)` (zero-sized element)",
            "InvalidSize",
            Box::new(|| pool.alloc_async::<()>(8, &s).map(drop)),
        ),
        ("`alloc_raw(0, s)`", "InvalidSize", Box::new(|| pool.alloc_raw(0, &s).map(drop))),
        (
            "`alloc_raw(u64::MAX, s)` (rounding overflows)",
            "InvalidSize",
            Box::new(|| pool.alloc_raw(u64::MAX, &s).map(drop)),
        ),
        (
            "`alloc_raw(max_size + 1, s)`",
            "InvalidSize",
            Box::new(|| pool.alloc_raw(POOL_MAX + 1, &s).map(drop)),
        ),
        (
            "`alloc_async` on a stream of another device",
            "WrongDevice",
            Box::new(|| pool.alloc_async::<u8>(16, &foreign_stream).map(drop)),
        ),
        (
            "`alloc_async` on device 0 of another `Npu`",
            "WrongDevice",
            Box::new(|| pool.alloc_async::<u8>(16, &other_npu_stream).map(drop)),
        ),
        (
            "`alloc_raw` on a stream of another device",
            "WrongDevice",
            Box::new(|| pool.alloc_raw(16, &foreign_stream).map(drop)),
        ),
        (
            "builder `alignment(0)`",
            "InvalidConfig",
            Box::new(|| MemPool::builder().alignment(0).build(&dev).map(drop)),
        ),
        (
            "builder `alignment(48)` (not a power of two)",
            "InvalidConfig",
            Box::new(|| MemPool::builder().alignment(48).build(&dev).map(drop)),
        ),
        (
            "builder `alignment(16)` (below 32)",
            "InvalidConfig",
            Box::new(|| MemPool::builder().alignment(16).build(&dev).map(drop)),
        ),
        (
            "builder `alignment(4 MiB)` (above the granularity)",
            "InvalidConfig",
            Box::new(|| MemPool::builder().alignment(4 * MIB).build(&dev).map(drop)),
        ),
        (
            "builder `max_size` above device memory",
            "InvalidConfig",
            Box::new(|| MemPool::builder().max_size(2 << 30).build(&dev).map(drop)),
        ),
        (
            "builder `max_size(u64::MAX)` (rounding overflows)",
            "InvalidConfig",
            Box::new(|| MemPool::builder().max_size(u64::MAX).build(&dev).map(drop)),
        ),
        (
            "builder `release_threshold` above `max_size`",
            "InvalidConfig",
            Box::new(|| {
                MemPool::builder()
                    .max_size(POOL_MAX)
                    .release_threshold(POOL_MAX + 1)
                    .build(&dev)
                    .map(drop)
            }),
        ),
        (
            "`set::<ReleaseThreshold>(max_size + 1)`",
            "InvalidArgument",
            Box::new(|| pool.set::<attr::ReleaseThreshold>(POOL_MAX + 1)),
        ),
        (
            "`set::<ReleaseThreshold>(max_size)` (boundary)",
            "Ok",
            Box::new(|| pool.set::<attr::ReleaseThreshold>(POOL_MAX)),
        ),
        (
            "`trim_to(max_size + 1)`",
            "InvalidArgument",
            Box::new(|| pool.trim_to(POOL_MAX + 1).map(drop)),
        ),
        (
            "`trim_to(0)` below used (releases what it can)",
            "Ok",
            Box::new(|| {
                // Nothing is free and complete-and-unused here: it releases nothing.
                pool.trim_to(0).map(|released| assert_eq!(released, 0))
            }),
        ),
        (
            "`free_raw` of another pool's pointer",
            "InvalidArgument",
            Box::new(|| pool.free_raw(foreign_raw, &s)),
        ),
        (
            "`free_raw` of an interior pointer",
            "InvalidArgument",
            Box::new(|| pool.free_raw(interior, &s)),
        ),
        (
            "`free_raw` of an already freed pointer",
            "InvalidArgument",
            Box::new(|| pool.free_raw(freed_raw, &s)),
        ),
        (
            "`free_raw` of a pointer below the pool's range",
            "InvalidArgument",
            Box::new(|| pool.free_raw(DevicePtr::new(1).unwrap(), &s)),
        ),
        (
            "`free_raw` on a pool built without `raw_pointers`",
            "InvalidArgument",
            Box::new(|| typed_pool.free_raw(of_typed_pool.borrow().device_ptr(), &s)),
        ),
        (
            "`free_raw` on a stream of another device",
            "WrongDevice",
            Box::new(|| pool.free_raw(live_raw, &foreign_stream)),
        ),
        (
            "`compact(s, [allocation of stream s2])`",
            "InvalidArgument",
            Box::new(|| pool.compact(&s, &mut [&mut *on_s2.borrow_mut()]).map(drop)),
        ),
        (
            "`compact(s, [allocation of another pool])`",
            "WrongDevice",
            Box::new(|| pool.compact(&s, &mut [&mut *of_typed_pool.borrow_mut()]).map(drop)),
        ),
        (
            "`compact(s, [])` (boundary)",
            "Ok",
            Box::new(|| pool.compact::<u32>(&s, &mut []).map(|n| assert_eq!(n, 0))),
        ),
        (
            "`elapsed_ms` between unrecorded events",
            "Driver",
            Box::new(|| unrecorded.0.elapsed_ms(&unrecorded.1).map(drop)),
        ),
        (
            "`elapsed_ms` from a recorded to an unrecorded event",
            "Driver",
            Box::new(|| recorded.elapsed_ms(&unrecorded.1).map(drop)),
        ),
        (
            "`elapsed_ms` between events of two devices",
            "WrongDevice",
            Box::new(|| recorded.elapsed_ms(&foreign_event).map(drop)),
        ),
        (
            "`wait_event` on an event of another device",
            "WrongDevice",
            Box::new(|| s.wait_event(&foreign_event)),
        ),
        (
            "`record` of an event of another device",
            "WrongDevice",
            Box::new(|| s.record(&foreign_event)),
        ),
        (
            "`copy_from_host` of more elements than the buffer",
            "InvalidArgument",
            Box::new(|| s.copy_from_host(&mut *on_s.borrow_mut(), &[0u32; 1025])),
        ),
        (
            "`copy_to_host` into more elements than the buffer",
            "InvalidArgument",
            Box::new(|| s.copy_to_host(&*on_s.borrow(), &mut [0u32; 1025])),
        ),
        (
            "`copy` from a longer buffer",
            "InvalidArgument",
            Box::new(|| {
                let src = typed_pool.alloc_async::<u32>(1025, &s)?;
                let r = s.copy(&mut *on_s.borrow_mut(), &src);
                drop(src);
                r
            }),
        ),
        (
            "`copy_from_host` into a buffer of a device without peer access",
            "PeerAccess",
            Box::new(|| s.copy_from_host(&mut *on_foreign.borrow_mut(), &[1u32; 4])),
        ),
        (
            "`memset` of a buffer of a device without peer access",
            "PeerAccess",
            Box::new(|| s.memset(&mut *on_foreign.borrow_mut(), 0)),
        ),
        (
            "`launch` with a buffer of a device without peer access",
            "PeerAccess",
            Box::new(|| s.launch("k", &[KernelArg::read(&*on_foreign.borrow())], |_| Ok(()))),
        ),
        (
            "`DriverAlloc::new(dev, 0)`",
            "InvalidSize",
            Box::new(|| DriverAlloc::<u8>::new(&dev, 0).map(drop)),
        ),
        (
            "`DriverAlloc::<u32>::new(dev, usize::MAX)`",
            "InvalidSize",
            Box::new(|| DriverAlloc::<u32>::new(&dev, usize::MAX).map(drop)),
        ),
        (
            "`DriverAlloc` larger than device memory",
            "Driver",
            Box::new(|| DriverAlloc::<u8>::new(&dev, 2 << 30).map(drop)),
        ),
        ("`Npu::device(ordinal)` out of range", "Driver", Box::new(|| npu.device(7).map(drop))),
        (
            "`Npu::builder().granularity(3 MiB)`",
            "Driver",
            Box::new(|| Npu::builder().granularity(3 * MIB).build().map(drop)),
        ),
        (
            "`Npu::builder().capacity(0)`",
            "Driver",
            Box::new(|| Npu::builder().capacity(0).build().map(drop)),
        ),
        (
            "`Npu::builder().devices(0)`",
            "Driver",
            Box::new(|| Npu::builder().devices(0).build().map(drop)),
        ),
        (
            "`Npu::builder().devices(17)`",
            "Driver",
            Box::new(|| Npu::builder().devices(17).capacity(1 << 30).build().map(drop)),
        ),
        (
            "`copy` from a buffer of a device without peer access",
            "PeerAccess",
            Box::new(|| s.copy(&mut *on_s.borrow_mut(), &*on_foreign.borrow())),
        ),
        (
            "`record_use` on a stream of a device without peer access",
            "PeerAccess",
            Box::new(|| on_s.borrow().record_use(&foreign_stream)),
        ),
        (
            "`can_access_peer(itself)`",
            "PeerAccess",
            Box::new(|| dev.can_access_peer(&dev).map(drop)),
        ),
        (
            "`can_access_peer` to a device of another `Npu`",
            "Ok",
            Box::new(|| dev.can_access_peer(&other_npu_dev).map(|can| assert!(!can))),
        ),
        ("`enable_peer_access(itself)`", "PeerAccess", Box::new(|| dev.enable_peer_access(&dev))),
        (
            "`enable_peer_access` to a device of another `Npu`",
            "PeerAccess",
            Box::new(|| dev.enable_peer_access(&other_npu_dev)),
        ),
        (
            "`disable_peer_access` not enabled",
            "PeerAccess",
            Box::new(|| dev.disable_peer_access(&other_dev)),
        ),
        (
            "`enable_peer_access` already enabled",
            "PeerAccess",
            Box::new(|| {
                dev.enable_peer_access(&other_dev)?;
                let again = dev.enable_peer_access(&other_dev);
                dev.disable_peer_access(&other_dev)?;
                again
            }),
        ),
    ];

    let snapshot = || -> (Vec<PoolStats>, u64, u64, u64, u64) {
        let st = sim.stats();
        (
            vec![pool.stats(), typed_pool.stats(), other_pool.stats(), foreign_pool.stats()],
            st.mapped_bytes,
            st.physical_bytes,
            st.malloc_bytes,
            st.calls.reserve - st.calls.release,
        )
    };
    let threshold = pool.get::<attr::ReleaseThreshold>().unwrap();
    let mut failures = Vec::new();
    println!("| input | error |\n|---|---|");
    for (input, expected, run) in &rows {
        let before = snapshot();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        let Ok(result) = result else {
            failures.push(format!("{input}: panicked"));
            continue;
        };
        let got = variant(&result);
        println!(
            "| {input} | {} |",
            if got == "Ok" { "— (accepted)".to_string() } else { format!("`{got}`") }
        );
        if got != *expected {
            failures.push(format!("{input}: expected {expected}, got {got} ({result:?})"));
        }
        let mut after = snapshot();
        // The `copy` row allocates its source from `typed_pool` and frees it: counters move.
        if input.starts_with("`copy` from") {
            after.0[1] = before.0[1];
        }
        if before != after {
            failures
                .push(format!("{input}: state changed:\n  before {before:?}\n  after  {after:?}"));
        }
    }
    assert_eq!(pool.get::<attr::ReleaseThreshold>().unwrap(), POOL_MAX.max(threshold));
    // By value, `hand_off` to another device's stream errs and frees the allocation onto its
    // own stream (it cannot hand it back): used memory returns to what it was before it.
    let used = pool.stats().used;
    let x = pool.alloc_async::<u8>(4096, &s).unwrap();
    assert!(matches!(x.hand_off(&foreign_stream), Err(Error::WrongDevice(_))));
    assert_eq!(pool.stats().used, used);

    assert!(failures.is_empty(), "bad input handled wrongly:\n{}", failures.join("\n"));
}

/// `free_raw` is documented to free only "the start of a live raw block of this pool"; on a
/// `raw_pointers` pool it also frees the block of a live typed `PoolAlloc`, which then still
/// points at memory the pool hands to the next allocation (safe code, two owners).
#[test]
fn free_raw_refuses_the_block_of_a_typed_allocation() {
    let npu = Npu::builder().capacity(1 << 30).build().unwrap();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(POOL_MAX).raw_pointers(true).build(&dev).unwrap();
    let x = pool.alloc_async::<u32>(1024, &s).unwrap();
    let result = pool.free_raw(x.device_ptr(), &s);
    let y = pool.alloc_async::<u32>(1024, &s).unwrap();
    assert_ne!(x.device_ptr(), y.device_ptr(), "two live allocations share one block");
    assert!(matches!(result, Err(Error::InvalidArgument(_))), "{result:?}");
    drop((x, y));
}

/// One stream more than `MAX_STREAMS` is an error; the backend stream made for it is not
/// leaked, and a slot freed by dropping a stream is usable again.
#[test]
fn too_many_streams_is_an_error_not_a_leak() {
    let npu = Npu::builder().capacity(1 << 30).build().unwrap();
    let dev = npu.device(0).unwrap();
    let sim = npu.sim_device(0).unwrap();
    let mut streams: Vec<_> =
        (0..soma::MAX_STREAMS).map(|_| dev.create_stream().unwrap()).collect();
    let err = dev.create_stream().unwrap_err();
    assert!(matches!(err, Error::TooManyStreams { max } if max == soma::MAX_STREAMS), "{err}");
    assert_eq!(sim.stats().live_streams, soma::MAX_STREAMS, "the refused stream's worker leaked");
    streams.pop();
    let again = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(POOL_MAX).build(&dev).unwrap();
    drop(pool.alloc_async::<u8>(16, &again).unwrap());
    drop(streams);
}
