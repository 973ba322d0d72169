//! Every baseline is a correct allocator: no overlap, sizes honoured, everything merges back.

use super::*;
use crate::{GRANULE, MIB};
use soma::MemPool;

/// Random alloc/free against a shadow list of live ranges: no overlap, sizes honoured,
/// everything merges back at the end (checked by allocating the whole range again).
fn exercise<A: Allocator>(a: &mut A, range: u64, offset_of: impl Fn(&A, &A::Handle) -> (u64, u64)) {
    let mut live: Vec<(A::Handle, u64, u64)> = Vec::new();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for step in 0..4000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x % 3 != 0 || live.is_empty() {
            let bytes = 1 + (x >> 20) % (3 * MIB);
            let h = a.alloc(bytes).expect("alloc");
            let (off, size) = offset_of(a, &h);
            assert!(size >= bytes, "step {step}: size {size} < {bytes}");
            assert!(off + size <= range);
            for &(_, o, s) in &live {
                assert!(off + size <= o || o + s <= off, "overlap at step {step}");
            }
            live.push((h, off, size));
        } else {
            let i = (x >> 8) as usize % live.len();
            let (h, _, _) = live.swap_remove(i);
            a.free(h);
        }
    }
    for (h, _, _) in live {
        a.free(h);
    }
    // Fully coalesced: the whole range is one block again.
    let h = a.alloc(range).expect("everything merged back");
    assert_eq!(offset_of(a, &h).0, 0);
    assert!(a.reserved_high() >= GRANULE);
}

const RANGE: u64 = 1 << 34;

#[test]
fn tlsf_is_a_correct_allocator() {
    let mut t = Tlsf::new(RANGE);
    exercise(&mut t, RANGE, |t, &h| t.range_of(h));
}

#[test]
fn offset_allocator_is_a_correct_allocator() {
    let mut o = OffsetAlloc::new(1 << 40, 1 << 16);
    // offset-allocator's handle carries the offset; sizes are the requested units.
    let mut live = Vec::new();
    for i in 1..100u64 {
        live.push(o.alloc(i * 1000).unwrap());
    }
    for h in live {
        o.free(h);
    }
    assert!(o.reserved_high() >= GRANULE);
    let h = o.alloc(1 << 39).unwrap();
    assert_eq!(h.offset, 0);
}

#[test]
fn soma_replica_is_a_correct_allocator() {
    let mut r = SomaReplica::new(RANGE);
    exercise(&mut r, RANGE, |_, &(o, s)| (o, s));
    let mut r = SomaReplica::new(RANGE);
    let a = r.alloc(1).unwrap();
    let b = r.alloc(3 * MIB).unwrap();
    assert_eq!((a, b), ((0, 2 * MIB), (2 * MIB, 4 * MIB)));
    r.free(a);
    // best fit: the 2 MiB hole at 0, not the tail
    assert_eq!(r.alloc(100).unwrap(), (0, 2 * MIB));
    assert_eq!(r.reserved_high(), 6 * MIB);
}

#[test]
fn first_fit_is_a_correct_allocator() {
    let mut s = FirstFit::new(RANGE);
    exercise(&mut s, RANGE, |_, &(o, s)| (o, s));
    let mut s = FirstFit::new(RANGE);
    let a = s.alloc(1000).unwrap();
    let b = s.alloc(1000).unwrap();
    let c = s.alloc(1000).unwrap();
    s.free(a);
    s.free(c);
    assert_eq!(s.free_list(), &[(0, 1024), (2048, RANGE - 2048)]);
    s.free(b);
    assert_eq!(s.free_list(), &[(0, RANGE)]);
    let built = FirstFit::from_free_list(vec![(0, 512), (1024, RANGE - 1024)], 1024);
    assert_eq!(built.free_list().len(), 2);
}

#[test]
fn engine_and_api_serve_and_account() {
    let mut e = SomaEngine::new(RANGE, 512);
    let hs: Vec<_> = (1..50u64).map(|i| e.alloc(i * 100_000).unwrap()).collect();
    let used = e.stats().used;
    assert!(used >= (1..50u64).map(|i| i * 100_000).sum::<u64>());
    for h in hs {
        e.free(h);
    }
    assert_eq!(e.stats().used, 0);
    assert_eq!(e.reserved_high(), e.backing().mapped_high);

    let npu = soma::sim::Npu::builder().capacity(4 << 30).build().unwrap();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut api = SomaApi::new(&pool, &s);
    let h = api.alloc(3 * MIB).unwrap();
    assert_eq!(h.byte_len(), 3 * MIB);
    api.free(h);
    assert_eq!(api.reserved_high(), 4 * MIB);

    let mut d = DriverPath::new(&**dev.hal(), dev.info().granularity);
    let h = d.alloc(1).unwrap();
    let h2 = d.alloc(3 * MIB).unwrap();
    assert_eq!(d.reserved_high(), 6 * MIB);
    d.free(h);
    d.free(h2);
    assert_eq!(
        d.driver_calls(),
        DriverCalls { malloc: 2, free: 2, ..DriverCalls::default() },
        "one malloc per allocation, one free per free"
    );
}

#[test]
fn retain_variants_are_named_and_never_unmap_on_growth() {
    use crate::workload::{free_all, random_allocations, replay, SEED};
    let w = random_allocations(300, 4, 64, SEED);

    let mut e = SomaEngine::new(RANGE, 512);
    let mut r = SomaEngine::with_recycling(RANGE, 512, false);
    assert_eq!((e.name(), r.name()), ("soma-engine", "soma-engine-retain"));
    assert_eq!(SomaEngine::with_recycling(RANGE, 512, true).name(), "soma-engine-recycle");
    for _ in 0..3 {
        let h = replay(&mut r, &w.ops, w.slots);
        free_all(&mut r, h);
        let h = replay(&mut e, &w.ops, w.slots);
        free_all(&mut e, h);
    }
    let calls = r.driver_calls();
    assert!(calls.map > 0);
    assert_eq!((calls.unmap, calls.free_physical), (0, 0), "growth without recycling only maps");
    let st = e.stats();
    assert_eq!(e.driver_calls(), DriverCalls::segments(st.map_calls, st.unmap_calls));
    assert_eq!(e.driver_calls().map, e.backing().maps);

    let npu = soma::sim::Npu::builder().capacity(4 << 30).build().unwrap();
    let dev = npu.device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().recycle_on_growth(false).build(&dev).unwrap();
    let mut api = SomaApi::named(&pool, &s, "soma-retain");
    assert_eq!(api.name(), "soma-retain");
    for _ in 0..2 {
        let h = replay(&mut api, &w.ops, w.slots);
        free_all(&mut api, h);
    }
    let calls = api.driver_calls();
    assert!(calls.map > 0);
    assert_eq!(calls.unmap, 0, "growth without recycling only maps");
    assert_eq!(SomaApi::new(&pool, &s).name(), "soma");
}

#[test]
fn api_driver_calls_are_the_simulators() {
    use crate::workload::{free_all, random_allocations, replay, SEED};
    let w = random_allocations(2_000, 64, 16_000, SEED);
    let npu = soma::sim::Npu::builder().capacity(64 << 30).build().unwrap();
    let dev = npu.device(0).unwrap();
    let sim = npu.sim_device(0).unwrap();
    let s = dev.create_stream().unwrap();
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut api = SomaApi::new(&pool, &s);
    let before = (api.driver_calls(), DriverCalls::of_sim(&sim.stats().calls));
    for _ in 0..2 {
        let h = replay(&mut api, &w.ops, w.slots);
        free_all(&mut api, h);
    }
    let pool_calls = api.driver_calls() - before.0;
    assert!(pool_calls.map > 0);
    assert_eq!(pool_calls, DriverCalls::of_sim(&sim.stats().calls) - before.1);
}

#[test]
fn offset_allocators_are_charged_their_high_water_growth() {
    // Four 1 MiB allocations end at 1, 2, 3 and 4 MiB: growths to 2 and to 4 MiB.
    let expected = DriverCalls::growths(2);
    let mut t = Tlsf::new(RANGE);
    let mut o = OffsetAlloc::new(RANGE, 1024);
    let mut f = FirstFit::new(RANGE);
    for _ in 0..4 {
        t.alloc(MIB).unwrap();
        o.alloc(MIB).unwrap();
        f.alloc(MIB).unwrap();
    }
    assert_eq!(
        (t.driver_calls(), o.driver_calls(), f.driver_calls()),
        (expected, expected, expected)
    );
    assert_eq!(
        (t.reserved_high(), o.reserved_high(), f.reserved_high()),
        (4 * MIB, 4 * MIB, 4 * MIB)
    );
    // The SOMA replica rounds each request to 2 MiB: every allocation grows the mapping.
    let mut r = SomaReplica::new(RANGE);
    let h = r.alloc(MIB).unwrap();
    r.alloc(MIB).unwrap();
    r.free(h);
    r.alloc(MIB).unwrap();
    assert_eq!(r.driver_calls(), DriverCalls::growths(2), "the hole is reused, not mapped");
}

#[test]
fn streams_in_turn_replay_as_the_api_on_one_stream_and_hand_off_on_several() {
    use crate::workload::{free_all, random_allocations, replay, SEED};
    let w = random_allocations(1_000, 16, 16_000, SEED);
    let npu = soma::sim::Npu::builder().capacity(64 << 30).build().unwrap();
    let dev = npu.device(0).unwrap();
    let streams: Vec<_> = (0..4).map(|_| dev.create_stream().unwrap()).collect();
    let one = {
        let pool = MemPool::builder().build(&dev).unwrap();
        let mut a = SomaStreams::new(&pool, &streams[..1], "soma-1-stream");
        let h = replay(&mut a, &w.ops, w.slots);
        free_all(&mut a, h);
        (a.reserved_high(), a.driver_calls())
    };
    let api = {
        let pool = MemPool::builder().build(&dev).unwrap();
        let mut a = SomaApi::new(&pool, &streams[0]);
        let h = replay(&mut a, &w.ops, w.slots);
        free_all(&mut a, h);
        (a.reserved_high(), a.driver_calls())
    };
    assert_eq!(one, api, "one stream in turn is the API on that stream");
    let pool = MemPool::builder().build(&dev).unwrap();
    let mut four = SomaStreams::new(&pool, &streams, "soma-4-streams");
    let h = replay(&mut four, &w.ops, w.slots);
    free_all(&mut four, h);
    assert_eq!(four.name(), "soma-4-streams");
    assert!(four.reserved_high() >= w.stats.peak_live_bytes);
    let st = pool.stats();
    assert_eq!(st.allocations, w.stats.allocs);
    assert!(st.reuses.total() > 0);
    for s in &streams {
        s.synchronize().unwrap();
    }
}
