//! Pools on capturing streams: allocations served from graph-private memory at capture time,
//! valid at every launch with no allocator or driver call; frees inside a capture reused by
//! the same stream's later captured allocations only; outputs; graph pools shared by several
//! graphs; statistics, trimming and release when the graphs go.

use std::sync::Arc;

use soma::hal::{
    AccessMode, BufferAccess, CaptureErrorKind, DevicePtr, DriverError, ReplayableKernel,
};
use soma::sim::{Npu, ReportKind, SanitizerMode};
use soma::{
    CaptureMode, Error, GraphMemoryOwner, KernelArg, MemPool, PoolAlloc, ReuseKind, ReusePolicy,
    Stream,
};

use crate::common::{device_of, npu};

const MIB: usize = 1 << 20;

/// The kind of a capture error of the typed API.
fn capture_kind(e: &Error) -> CaptureErrorKind {
    match e {
        Error::Driver(DriverError::Capture { kind, .. }) => *kind,
        other => panic!("expected a capture error, got {other:?}"),
    }
}

/// `out[i] = in[i] * mul + add`, replayable.
fn affine(
    s: &Stream<'_>,
    input: &PoolAlloc<'_, u32>,
    out: &mut PoolAlloc<'_, u32>,
    mul: u32,
    add: u32,
) {
    s.launch_replayable("affine", &[KernelArg::read(input), KernelArg::write(out)], move |b| {
        let (x, y) = (b.read::<u32>(0)?, b.write::<u32>(1)?);
        y.iter_mut().zip(x).for_each(|(y, x)| *y = x.wrapping_mul(mul).wrapping_add(add));
        Ok(())
    })
    .unwrap();
}

/// Driver calls of device 0 that map or allocate memory.
fn memory_calls(npu: &Npu) -> u64 {
    let c = npu.sim_device(0).unwrap().stats().calls;
    c.malloc + c.free + c.alloc_physical + c.free_physical + c.map + c.unmap
}

#[test]
fn captured_allocations_stay_valid_across_100_launches_without_allocator_or_driver_calls() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut input = pool.alloc_async::<u32>(4096, &s).unwrap();

    s.begin_capture(CaptureMode::Global).unwrap();
    // A chain of temporaries, each freed inside the capture once used: the later ones reuse
    // the earlier ones' memory.
    let mut a = pool.alloc_async::<u32>(4096, &s).unwrap();
    affine(&s, &input, &mut a, 2, 1);
    let mut b = pool.alloc_async::<u32>(4096, &s).unwrap();
    affine(&s, &a, &mut b, 3, 0);
    let a_ptr = a.device_ptr();
    drop(a);
    let mut c = pool.alloc_async::<u32>(4096, &s).unwrap();
    assert_eq!(c.device_ptr(), a_ptr, "a captured free serves the same stream's next request");
    assert_eq!(c.reuse_kind(), Some(ReuseKind::SameStream));
    affine(&s, &b, &mut c, 1, 7);
    drop(b);
    let mut out = pool.alloc_async::<u32>(4096, &s).unwrap();
    affine(&s, &c, &mut out, 1, 0);
    drop(c);
    let graph = s.end_capture().unwrap();
    assert_eq!(graph.task_count(), 4);

    let stats = pool.stats();
    let calls = memory_calls(&npu);
    for step in 0..100u32 {
        s.copy_from_host(&mut input, &vec![step; 4096]).unwrap();
        graph.launch(&s).unwrap();
        let host = s.download(&out).unwrap();
        assert_eq!(host, vec![(step * 2 + 1) * 3 + 7; 4096], "launch {step}");
    }
    let after = pool.stats();
    assert_eq!(
        (after.allocations, after.frees, after.map_calls, after.unmap_calls),
        (stats.allocations, stats.frees, stats.map_calls, stats.unmap_calls),
        "no launch ran the allocator"
    );
    assert_eq!(memory_calls(&npu), calls, "no launch made a driver call for memory");
    drop((graph, out));
}

#[test]
fn graph_memory_serves_no_other_stream_while_the_graph_lives() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s, other) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let tmp = pool.alloc_async::<u8>(MIB, &s).unwrap();
    let ptr = tmp.device_ptr();
    drop(tmp);
    let graph = s.end_capture().unwrap();
    s.synchronize().unwrap();
    dev.synchronize().unwrap();

    // Neither another stream, nor the capturing stream outside the capture, nor trimming
    // gets the graph's memory.
    let x = pool.alloc_async::<u8>(MIB, &other).unwrap();
    let y = pool.alloc_async::<u8>(MIB, &s).unwrap();
    assert!(x.device_ptr() != ptr && y.device_ptr() != ptr);
    drop((x, y));
    dev.synchronize().unwrap();
    let held = pool.stats().graph_reserved;
    assert!(held >= MIB as u64, "{held}");
    pool.trim_to(0).unwrap();
    assert!(pool.stats().reserved >= held, "trim_to never releases a live graph's memory");
    assert_eq!(pool.graph_memory()[0].owner, GraphMemoryOwner::Graph(graph.id()));

    // Once the graph is gone, its memory is the pool's again.
    drop(graph);
    assert!(pool.graph_memory().is_empty());
    assert_eq!(pool.stats().graph_reserved, 0);
    assert_eq!(pool.alloc_async::<u8>(MIB, &other).unwrap().device_ptr(), ptr);
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved, 0);
}

#[test]
fn captured_allocations_take_only_memory_no_launch_can_race_with() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder()
        .max_size(64 << 20)
        .reuse(ReusePolicy::new(true, false, false))
        .build(&dev)
        .unwrap();
    // Whole granules: no fresh rest of a granule serves a request before a cached block.
    let g = dev.info().granularity as usize;
    let gate = crate::common::Gate::close(&t);
    let a = pool.alloc_async::<u8>(g, &t).unwrap();
    let ptr = a.device_ptr();
    drop(a);
    s.wait_event(&t.record_event().unwrap()).unwrap();
    // Freed on t, and s is ordered after the free by an event: a launch on another stream
    // is not, so a captured request does not take the block.
    s.begin_capture(CaptureMode::Global).unwrap();
    let c = pool.alloc_async::<u8>(g, &s).unwrap();
    assert_ne!(c.device_ptr(), ptr);
    drop(c);
    let first = s.end_capture().unwrap();
    // An ordinary request of s does (the event rule).
    let b = pool.alloc_async::<u8>(g, &s).unwrap();
    assert_eq!((b.device_ptr(), b.reuse_kind()), (ptr, Some(ReuseKind::EventDependency)));
    // Freed on s behind the gate: not complete, so not for a captured request of s either.
    drop(b);
    s.begin_capture(CaptureMode::Global).unwrap();
    let c = pool.alloc_async::<u8>(g, &s).unwrap();
    assert_ne!(c.device_ptr(), ptr);
    drop(c);
    let second = s.end_capture().unwrap();
    gate.open();
    // Host-observed: now it may.
    dev.synchronize().unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let d = pool.alloc_async::<u8>(g, &s).unwrap();
    assert_eq!((d.device_ptr(), d.reuse_kind()), (ptr, Some(ReuseKind::HostSynchronized)));
    drop(d);
    drop((s.end_capture().unwrap(), first, second));
}

#[test]
fn streams_of_one_capture_share_its_memory_but_not_their_frees() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    s1.begin_capture(CaptureMode::Global).unwrap();
    s2.wait_event(&s1.record_event().unwrap()).unwrap(); // s2 joins the capture
    let a = pool.alloc_async::<u8>(MIB, &s1).unwrap();
    let ptr = a.device_ptr();
    drop(a);
    // The captured branches may run concurrently at launch: s1's free is not s2's to reuse.
    let b = pool.alloc_async::<u8>(MIB, &s2).unwrap();
    assert_ne!(b.device_ptr(), ptr);
    drop(b);
    s1.wait_event(&s2.record_event().unwrap()).unwrap();
    let graph = s1.end_capture().unwrap();
    let mem = pool.graph_memory();
    assert_eq!(mem.len(), 1, "one region for the capture, whichever stream allocated");
    assert_eq!(mem[0].owner, GraphMemoryOwner::Graph(graph.id()));
    assert_eq!(mem[0].used, 0);
    assert!(mem[0].reserved >= 2 * MIB as u64);
    drop(graph);
    assert!(pool.graph_memory().is_empty());
}

#[test]
fn a_free_inside_a_capture_is_ordered_after_uses_on_the_captures_other_streams() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut input = pool.alloc_async::<u32>(1024, &s1).unwrap();
    let mut out = pool.alloc_async::<u32>(1024, &s1).unwrap();
    s1.begin_capture(CaptureMode::Global).unwrap();
    let mut x = pool.alloc_async::<u32>(1024, &s1).unwrap();
    affine(&s1, &input, &mut x, 2, 0);
    // s2 reads x: a use by another stream of the capture, recorded with captured events.
    s2.wait_event(&s1.record_event().unwrap()).unwrap();
    affine(&s2, &x, &mut out, 1, 1);
    let before = s1.hal().enqueued();
    let ptr = x.device_ptr();
    drop(x); // captured: after s2's use, through an event captured on s2 and waited on by s1
    assert_eq!(s1.hal().enqueued(), before, "captured work takes no position");
    let mut y = pool.alloc_async::<u32>(1024, &s1).unwrap();
    assert_eq!(y.device_ptr(), ptr);
    s1.memset(&mut y, 0).unwrap(); // would race with s2's read of x, were they not ordered
    let graph = s1.end_capture().unwrap(); // s2 rejoined s1 through the free's event
    for step in 1..4u32 {
        s1.copy_from_host(&mut input, &[step; 1024]).unwrap();
        graph.launch(&s1).unwrap();
        assert_eq!(s1.download(&out).unwrap(), vec![step * 2 + 1; 1024]);
    }
    drop((graph, y));
}

#[test]
fn outputs_live_until_freed_and_stay_the_graphs_until_it_goes() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s, other) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let mut input = pool.alloc_async::<u32>(1024, &s).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let mut out = pool.alloc_async::<u32>(1024, &s).unwrap();
    affine(&s, &input, &mut out, 1, 1);
    let graph = s.end_capture().unwrap();
    let ptr = out.device_ptr();
    for step in 0..3 {
        s.copy_from_host(&mut input, &[step; 1024]).unwrap();
        graph.launch(&s).unwrap();
        assert_eq!(s.download(&out).unwrap(), vec![step + 1; 1024]);
    }
    assert_eq!(pool.graph_memory()[0].used, 4096);
    // Freed outside the graph: every launch still writes it, so no one else gets it.
    drop(out);
    dev.synchronize().unwrap();
    assert_eq!(pool.graph_memory()[0].used, 4096, "kept for the graph");
    let x = pool.alloc_async::<u32>(1024, &other).unwrap();
    assert_ne!(x.device_ptr(), ptr);
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    drop(graph);
    assert_eq!(pool.stats().graph_reserved, 0);
    dev.synchronize().unwrap();
    assert_eq!(pool.alloc_async::<u32>(1024, &other).unwrap().device_ptr(), ptr);
    drop(x);
}

#[test]
fn an_output_handed_off_and_freed_on_another_stream_stays_the_graphs() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let mut out = pool.alloc_async::<u32>(1024, &s).unwrap();
    s.memset(&mut out, 7).unwrap();
    let graph = s.end_capture().unwrap();
    graph.launch(&s).unwrap();
    let out = out.hand_off(&t).unwrap();
    let ptr = out.device_ptr();
    drop(out);
    dev.synchronize().unwrap();
    let x = pool.alloc_async::<u32>(1024, &t).unwrap();
    assert_ne!(x.device_ptr(), ptr, "the free on t parked the graph's block");
    drop((x, graph));
}

#[test]
fn a_graph_pool_shares_memory_between_graphs_of_several_sizes() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let sizes = [1usize, 2, 3, 4];
    // Each size's step: two temporaries, freed inside the capture, and a small output.
    let capture = |pool: &MemPool<'_>, batch: usize, shared: Option<&soma::GraphPool>| {
        match shared {
            Some(g) => s.begin_capture_with_pool(CaptureMode::Global, g).unwrap(),
            None => s.begin_capture(CaptureMode::Global).unwrap(),
        }
        let mut a = pool.alloc_async::<u32>(batch * MIB / 4, &s).unwrap();
        s.memset(&mut a, 1).unwrap();
        let mut b = pool.alloc_async::<u32>(batch * MIB / 4, &s).unwrap();
        s.copy(&mut b, &a).unwrap();
        drop(a);
        drop(b);
        s.end_capture().unwrap()
    };
    let separate_pool = MemPool::builder().max_size(256 << 20).build(&dev).unwrap();
    let separate: Vec<_> = sizes.iter().map(|&n| capture(&separate_pool, n, None)).collect();
    let shared_pool = MemPool::builder().max_size(256 << 20).build(&dev).unwrap();
    let handle = shared_pool.graph_pool();
    let shared: Vec<_> = sizes.iter().map(|&n| capture(&shared_pool, n, Some(&handle))).collect();

    let per_graph: Vec<u64> = separate_pool.graph_memory().iter().map(|g| g.reserved).collect();
    assert_eq!(per_graph.len(), sizes.len(), "a region per graph");
    let one = shared_pool.graph_memory();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].owner, GraphMemoryOwner::GraphPool(handle.id()));
    let (sum, largest) = (per_graph.iter().sum::<u64>(), *per_graph.iter().max().unwrap());
    assert_eq!(one[0].reserved, largest, "shared: the largest graph's memory");
    assert!(sum > 2 * largest, "separate: every graph's ({sum} vs {largest})");
    assert_eq!(shared_pool.stats().graph_reserved, largest);
    assert_eq!(separate_pool.stats().graph_reserved, sum);

    // Launched one after another on one stream (never concurrently), each still works.
    for g in shared.iter().chain(&separate) {
        g.launch(&s).unwrap();
    }
    s.synchronize().unwrap();
    // The region stays while the handle or a graph captured into it lives.
    drop(shared);
    assert_eq!(shared_pool.graph_memory().len(), 1);
    drop(handle);
    assert!(shared_pool.graph_memory().is_empty());
    drop(separate);
    assert!(separate_pool.graph_memory().is_empty());
}

#[test]
fn a_free_inside_a_capture_of_memory_allocated_outside_it_is_refused() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).raw_pointers(true).build(&dev).unwrap();
    let x = pool.alloc_async::<u32>(16, &s).unwrap();
    let (raw, _) = pool.alloc_raw(4096, &s).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let e = pool.free_raw(raw, &s).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    assert!(e.to_string().contains("pool free"), "{e}");
    let e = x.free().unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    let used = pool.stats().used;
    let graph = s.end_capture().unwrap();
    assert_eq!(pool.stats().used, used, "both blocks stay allocated");
    drop(graph);
    pool.free_raw(raw, &s).unwrap();
    // A typed allocation's drop keeps the refusal for the pool's next fallible call.
    let y = pool.alloc_async::<u32>(16, &s).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    drop(y);
    drop(s.end_capture().unwrap());
    let e = pool.alloc_async::<u32>(16, &s).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
}

#[test]
fn blocks_of_another_graphs_memory_cannot_be_freed_inside_a_capture() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let out = pool.alloc_async::<u32>(16, &s).unwrap();
    let first = s.end_capture().unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    assert_eq!(capture_kind(&out.free().unwrap_err()), CaptureErrorKind::NotCapturable);
    let second = s.end_capture().unwrap();
    // Within one graph pool, a later capture may free an earlier one's output.
    let shared = pool.graph_pool();
    s.begin_capture_with_pool(CaptureMode::Global, &shared).unwrap();
    let out = pool.alloc_async::<u32>(16, &s).unwrap();
    let third = s.end_capture().unwrap();
    s.begin_capture_with_pool(CaptureMode::Global, &shared).unwrap();
    out.free().unwrap();
    let fourth = s.end_capture().unwrap();
    assert_eq!(pool.graph_memory().iter().map(|g| g.used).sum::<u64>(), 512, "first's output");
    drop((first, second, third, fourth));
    assert_eq!(pool.graph_memory().len(), 1, "the graph pool's, while its handle lives");
    drop(shared);
    assert!(pool.graph_memory().is_empty());
}

#[test]
fn an_invalidated_capture_refuses_allocations_and_gives_its_memory_back_at_its_end() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let kept = pool.alloc_async::<u8>(MIB, &s).unwrap();
    drop(kept);
    assert_eq!(pool.graph_memory().len(), 1);
    assert!(s.synchronize().is_err(), "forbidden: invalidates the capture");
    let e = pool.alloc_async::<u8>(MIB, &s).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::Invalidated);
    assert_eq!(capture_kind(&s.end_capture().unwrap_err()), CaptureErrorKind::Invalidated);
    assert!(pool.graph_memory().is_empty(), "no graph: its memory went back at once");
    pool.alloc_async::<u8>(MIB, &s).unwrap();
}

#[test]
fn a_capture_begun_on_a_backend_stream_gets_no_graph_memory() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    // `s` joins a capture begun on a raw backend stream: nothing would tell the pool when
    // that capture's graph goes.
    let raw = dev.hal().create_stream().unwrap();
    raw.begin_capture(CaptureMode::Global).unwrap();
    let ev = dev.create_event().unwrap();
    raw.record(ev.hal()).unwrap();
    s.wait_event(&ev).unwrap();
    let e = pool.alloc_async::<u8>(MIB, &s).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    assert!(e.to_string().contains("begin_capture"), "{e}");
    // s rejoins the raw stream, whose capture then ends with a graph.
    raw.wait(s.record_event().unwrap().hal()).unwrap();
    assert!(raw.end_capture().is_ok());
}

#[test]
fn raw_allocations_follow_the_same_rules() {
    let npu = npu();
    let dev = device_of(&npu);
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).raw_pointers(true).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let (tmp, _) = pool.alloc_raw(MIB as u64, &s).unwrap();
    pool.free_raw(tmp, &s).unwrap();
    let (again, _) = pool.alloc_raw(MIB as u64, &s).unwrap();
    assert_eq!(again, tmp, "reused inside the capture");
    let (out, _) = pool.alloc_raw(4096, &s).unwrap();
    let graph = s.end_capture().unwrap();
    assert_eq!(pool.graph_memory()[0].used, MIB as u64 + 4096);
    // Outputs freed outside the capture, on any stream: parked until the graph goes.
    pool.free_raw(again, &s).unwrap();
    pool.free_raw(out, &t).unwrap();
    assert!(pool.free_raw(out, &t).is_err(), "a double free is still one");
    dev.synchronize().unwrap();
    let (x, _) = pool.alloc_raw(4096, &t).unwrap();
    assert_ne!(x, out);
    drop(graph);
    pool.free_raw(x, &t).unwrap();
    assert!(pool.graph_memory().is_empty());
}

#[test]
fn sharded_pools_serve_captures_from_the_streams_shard() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).stream_shards(2).build(&dev).unwrap();
    let mut input = pool.alloc_async::<u32>(256, &s).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let mut tmp = pool.alloc_async::<u32>(256, &s).unwrap();
    affine(&s, &input, &mut tmp, 5, 0);
    let mut out = pool.alloc_async::<u32>(256, &s).unwrap();
    affine(&s, &tmp, &mut out, 1, 1);
    drop(tmp);
    let graph = s.end_capture().unwrap();
    s.copy_from_host(&mut input, &[3; 256]).unwrap();
    graph.launch(&s).unwrap();
    assert_eq!(s.download(&out).unwrap(), vec![16; 256]);
    assert_eq!(pool.graph_memory().len(), 1);
    drop((graph, out));
    assert_eq!(pool.stats().graph_reserved, 0);
}

#[test]
fn compaction_leaves_a_graphs_blocks_where_its_launches_use_them() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let low = pool.alloc_async::<u8>(MIB, &s).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let mut out = pool.alloc_async::<u8>(MIB, &s).unwrap();
    let e = pool.compact(&s, &mut [&mut out]).unwrap_err();
    assert_eq!(capture_kind(&e), CaptureErrorKind::NotCapturable);
    let graph = s.end_capture().unwrap();
    drop(low);
    s.synchronize().unwrap();
    let ptr = out.device_ptr();
    assert_eq!(pool.compact(&s, &mut [&mut out]).unwrap(), 0);
    assert_eq!(out.device_ptr(), ptr);
    drop((graph, out));
}

#[test]
fn dropping_the_pool_before_its_graph_releases_the_graphs_memory_later() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    drop(pool.alloc_async::<u8>(MIB, &s).unwrap());
    let graph = s.end_capture().unwrap();
    drop(pool);
    drop(graph);
    s.synchronize().unwrap();
    let stats = npu.sim_device(0).unwrap().stats();
    assert_eq!(stats.mapped_bytes, 0, "everything went back to the device");
}

#[test]
fn the_stream_enqueues_nothing_for_a_captured_allocation() {
    let npu = npu();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let before = s.hal().enqueued();
    let x = pool.alloc_async::<u8>(MIB, &s).unwrap();
    drop(x);
    assert_eq!(s.hal().enqueued(), before);
    let graph = s.end_capture().unwrap();
    assert_eq!(graph.task_count(), 0);
}

// ---- the sanitizer's view of graph memory -------------------------------------------------

fn sanitized() -> Npu {
    Npu::builder().capacity(1 << 30).sanitizer(SanitizerMode::Report).build().unwrap()
}

/// A replayable raw kernel through the HAL writing `[ptr, ptr + len)`.
fn raw_fill(s: &Stream<'_>, ptr: DevicePtr, len: u64) {
    s.hal()
        .launch_replayable(ReplayableKernel {
            name: "raw_fill",
            buffers: vec![BufferAccess { ptr, len, mode: AccessMode::Write }],
            body: Arc::new(|b| {
                b.bytes_mut(0)?.fill(1);
                Ok(())
            }),
        })
        .unwrap();
}

#[test]
fn launches_reusing_graph_memory_run_clean_under_the_sanitizer() {
    let npu = sanitized();
    let dev = device_of(&npu);
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
    let shared = pool.graph_pool();
    let mut input = pool.alloc_async::<u32>(4096, &s).unwrap();
    let mut graphs = Vec::new();
    let mut outs = Vec::new();
    for size in [1024usize, 4096, 2048] {
        s.begin_capture_with_pool(CaptureMode::Global, &shared).unwrap();
        let mut a = pool.alloc_async::<u32>(size, &s).unwrap();
        affine(&s, &input, &mut a, 2, 0);
        let mut b = pool.alloc_async::<u32>(size, &s).unwrap();
        affine(&s, &a, &mut b, 1, 1);
        drop(a);
        let mut c = pool.alloc_async::<u32>(size, &s).unwrap(); // a's memory
        affine(&s, &b, &mut c, 1, 1);
        drop(b);
        let mut out = pool.alloc_async::<u32>(size, &s).unwrap();
        affine(&s, &c, &mut out, 1, 0);
        drop(c);
        graphs.push(s.end_capture().unwrap());
        outs.push(out);
    }
    for step in 0..100u32 {
        s.copy_from_host(&mut input, &vec![step; 4096]).unwrap();
        let g = step as usize % graphs.len();
        graphs[g].launch(&s).unwrap();
        assert_eq!(s.download(&outs[g]).unwrap()[0], step * 2 + 2, "launch {step}");
    }
    // An output read on another stream, then freed while its graph lives; launched again.
    t.wait_stream(&s).unwrap();
    let out = outs.pop().unwrap().hand_off(&t).unwrap();
    drop(out);
    graphs[2].launch(&s).unwrap();
    s.synchronize().unwrap();
    let reports = npu.sim_device(0).unwrap().take_sanitizer_reports();
    assert!(reports.is_empty(), "{reports:#?}");
    drop((graphs, outs, shared));
    dev.synchronize().unwrap();
    assert!(npu.sim_device(0).unwrap().take_sanitizer_reports().is_empty());
}

#[test]
fn the_sanitizer_reports_a_use_of_graph_memory_after_it_went_back() {
    let npu = sanitized();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).raw_pointers(true).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let (tmp, _) = pool.alloc_raw(4096, &s).unwrap();
    raw_fill(&s, tmp, 4096);
    pool.free_raw(tmp, &s).unwrap();
    let graph = s.end_capture().unwrap();
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    let sim = npu.sim_device(0).unwrap();
    assert!(sim.take_sanitizer_reports().is_empty(), "the launch used the graph's memory");

    // Freed inside the capture: only the graph's launches may use it now.
    raw_fill(&s, tmp, 4096);
    let _ = s.synchronize();
    let reports = sim.take_sanitizer_reports();
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0].kind, ReportKind::UseAfterFree);
    assert!(reports[0].to_string().contains("graph memory"), "{}", reports[0]);

    // Once the graph is gone, its memory is free memory of the pool.
    drop(graph);
    raw_fill(&s, tmp, 4096);
    let _ = s.synchronize();
    let reports = sim.take_sanitizer_reports();
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0].kind, ReportKind::UseAfterFree);
}

#[test]
fn the_sanitizer_reports_an_output_used_after_its_graph_and_its_free() {
    let npu = sanitized();
    let dev = device_of(&npu);
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().max_size(64 << 20).raw_pointers(true).build(&dev).unwrap();
    s.begin_capture(CaptureMode::Global).unwrap();
    let (out, _) = pool.alloc_raw(4096, &s).unwrap();
    raw_fill(&s, out, 4096);
    let graph = s.end_capture().unwrap();
    graph.launch(&s).unwrap();
    raw_fill(&s, out, 4096); // the output is the program's until freed
    drop(graph);
    raw_fill(&s, out, 4096); // and stays so after its graph went
    s.synchronize().unwrap();
    let sim = npu.sim_device(0).unwrap();
    assert!(sim.take_sanitizer_reports().is_empty());
    pool.free_raw(out, &s).unwrap();
    raw_fill(&s, out, 4096);
    let _ = s.synchronize();
    let kinds: Vec<_> = sim.take_sanitizer_reports().iter().map(|r| r.kind).collect();
    assert_eq!(kinds, [ReportKind::UseAfterFree]);
}
