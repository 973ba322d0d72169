//! Shadow-model property test: random alloc / free / release / stream-order changes across
//! several streams, checked after every step against an independent model of what the
//! memory held (written here, sharing no code with the engine).
//!
//! The model remembers, for every byte range that was ever handed out and freed, the tag of
//! its last free ("freed intervals"), until it is handed out again or unmapped. From that it
//! checks that every reuse the engine reports is justified by the rule it names, that fresh
//! memory really was never used since it was mapped, and that nothing is unmapped while live
//! or while a free on it may still be in flight.

use proptest::prelude::*;

use super::*;
use crate::testing::StreamClocks;
use crate::*;

const STREAMS: usize = 4;
/// The range, in granules.
const GRANULES: u64 = 32;

/// Engine parameters a case runs with. Sizes and alignments in the ops are written for a
/// 2 MiB granule and scaled to `granularity`.
#[derive(Clone, Copy, Debug)]
struct Params {
    granularity: u64,
    alignment: u64,
    max_segment: u64,
    index_by_offset: bool,
    dependency_first: bool,
    /// Recycling on growth at the start (off by default; `Op::Recycle` switches it).
    recycle: bool,
}

fn params_strategy() -> impl Strategy<Value = Params> {
    (
        prop_oneof![3 => Just(G), 1 => Just(64 * 1024u64)],
        prop_oneof![1 => Just(32u64), 3 => Just(512), 1 => Just(4096)],
        any::<bool>(),
        prop_oneof![3 => Just(true), 1 => Just(false)],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(granularity, alignment, per_granule, index_by_offset, dependency_first, recycle)| {
                Params {
                    granularity,
                    alignment,
                    max_segment: if per_granule { granularity } else { 0 },
                    index_by_offset,
                    dependency_first,
                    recycle,
                }
            },
        )
}

#[derive(Clone, Debug)]
enum Op {
    Alloc { stream: u32, size: u64, align: u64 },
    Free { which: usize, stream: u32 },
    Work { stream: u32 },
    Complete { stream: u32 },
    HostSync { stream: u32 },
    EventWait { waiter: u32, on: u32 },
    Switches { follow: bool, opportunistic: bool, internal: bool },
    Release { keep: u64 },
    Relocate { which: usize, stream: u32 },
    FailNextMap { oom: bool },
    FailNextUnmap,
    Capacity { granules: Option<u64> },
    Recycle { on: bool },
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..4096,
        3 => 4096u64..(512 * 1024),
        2 => (512 * 1024u64)..(3 * G),
        1 => (3 * G)..(9 * G),
        1 => Just(G),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let s = 0..STREAMS as u32;
    prop_oneof![
        10 => (s.clone(), size_strategy(), prop_oneof![6 => Just(512u64), 1 => Just(4096), 1 => Just(65536), 1 => Just(G), 1 => Just(1)])
            .prop_map(|(stream, size, align)| Op::Alloc { stream, size, align }),
        8 => (any::<usize>(), s.clone()).prop_map(|(which, stream)| Op::Free { which, stream }),
        3 => s.clone().prop_map(|stream| Op::Work { stream }),
        2 => s.clone().prop_map(|stream| Op::Complete { stream }),
        1 => s.clone().prop_map(|stream| Op::HostSync { stream }),
        4 => (s.clone(), s.clone()).prop_map(|(waiter, on)| Op::EventWait { waiter, on }),
        3 => (any::<bool>(), any::<bool>(), any::<bool>())
            .prop_map(|(follow, opportunistic, internal)| Op::Switches { follow, opportunistic, internal }),
        1 => (0..GRANULES * G).prop_map(|keep| Op::Release { keep }),
        1 => (any::<usize>(), s.clone()).prop_map(|(which, stream)| Op::Relocate { which, stream }),
        1 => any::<bool>().prop_map(|oom| Op::FailNextMap { oom }),
        1 => Just(Op::FailNextUnmap),
        1 => prop_oneof![Just(None), (4u64..40).prop_map(Some)].prop_map(|granules| Op::Capacity { granules }),
        1 => any::<bool>().prop_map(|on| Op::Recycle { on }),
    ]
}

#[derive(Clone, Copy, Debug)]
struct Live {
    a: Allocation,
    align: u64,
}

#[derive(Clone, Copy, Debug)]
struct Freed {
    off: u64,
    end: u64,
    tag: FreeTag,
}

struct Model {
    p: Params,
    range: u64,
    e: Engine,
    b: FakeBacking,
    clock: StreamClocks,
    live: Vec<Live>,
    freed: Vec<Freed>,
    /// Per stream: the host-observed bound at the last settle (frees below it may have been
    /// settled).
    settled_below: [u64; STREAMS],
    /// Per stream: the highest bound `Engine::settle_completed` may have settled below (the
    /// host-observed bound, or the completed one under the opportunistic rule) at a reuse by
    /// another stream under rule 3 or as host-synchronized, where the engine settles when
    /// the block is another stream's border block.
    completion_settled_below: [u64; STREAMS],
}

impl Model {
    fn new(p: Params) -> Model {
        let range = GRANULES * p.granularity;
        let mut e = Engine::new(EngineConfig {
            range_size: range,
            granularity: p.granularity,
            alignment: p.alignment,
            index_by_offset: p.index_by_offset,
        })
        .unwrap();
        e.set_max_segment(p.max_segment);
        e.set_dependency_before_growth(p.dependency_first);
        e.set_recycle_on_growth(p.recycle);
        Model {
            p,
            range,
            e,
            b: FakeBacking::checked(p.granularity).within(range),
            clock: StreamClocks::new(STREAMS),
            live: Vec::new(),
            freed: Vec::new(),
            settled_below: [0; STREAMS],
            completion_settled_below: [0; STREAMS],
        }
    }

    fn overlapping(&self, off: u64, end: u64) -> Vec<Freed> {
        self.freed.iter().copied().filter(|f| f.off < end && off < f.end).collect()
    }

    /// Removes `[off, end)` from the freed intervals.
    fn forget(&mut self, off: u64, end: u64) {
        let mut out = Vec::with_capacity(self.freed.len() + 1);
        for f in self.freed.drain(..) {
            if f.end <= off || end <= f.off {
                out.push(f);
                continue;
            }
            if f.off < off {
                out.push(Freed { end: off, ..f });
            }
            if end < f.end {
                out.push(Freed { off: end, ..f });
            }
        }
        self.freed = out;
    }

    /// Checks the unmaps the backing saw during the last operation.
    fn drain_unmaps(&mut self) {
        let log = std::mem::take(&mut self.b.unmap_log);
        for (off, len) in log {
            let end = off + len;
            for l in &self.live {
                assert!(
                    l.a.offset + l.a.size <= off || end <= l.a.offset,
                    "unmapped [{off}, {end}) under live block {:?}",
                    l.a
                );
            }
            for f in self.overlapping(off, end) {
                assert!(
                    f.tag.pos < self.clock.complete_bound(f.tag.stream as usize),
                    "unmapped [{off}, {end}) while the free {:?} may be in flight",
                    f.tag
                );
            }
            self.forget(off, end);
        }
    }

    /// After an allocation, served or not: the engine may have settled what completed
    /// (while several streams free, the requesting stream's frees too; taking another
    /// stream's border block, or before growing, the other streams').
    fn may_have_settled(&mut self) {
        let c = &self.clock;
        for (s, bound) in self.completion_settled_below.iter_mut().enumerate() {
            let completed = if c.opportunistic { c.complete_bound(s) } else { 0 };
            *bound = (*bound).max(completed.max(c.host_bound(s)));
        }
    }

    /// Checks that allocation `a` for `stream` is justified, then records it.
    fn check_alloc(&mut self, a: Allocation, stream: u32, requested: u64, align: u64) {
        let min = self.p.alignment;
        assert!(a.size >= requested);
        assert_eq!(a.size % min, 0);
        assert_eq!(a.offset % align.max(min), 0, "misaligned {a:?}");
        assert_eq!(a.size % align.max(min), 0, "size not a multiple of the alignment");
        let end = a.offset + a.size;
        assert!(end <= self.range);
        for l in &self.live {
            assert!(
                l.a.offset + l.a.size <= a.offset || end <= l.a.offset,
                "{a:?} overlaps live {:?}",
                l.a
            );
        }
        // Mapped?
        let mut at = a.offset;
        while at < end {
            let (o, s) =
                self.b.mapping_containing(at).unwrap_or_else(|| panic!("{a:?} not mapped at {at}"));
            at = o + s;
        }
        let prior = self.overlapping(a.offset, end);
        let c = &self.clock;
        let t = stream as usize;
        assert_eq!(a.dependency.is_some(), a.reuse == Some(ReuseKind::InternalDependency));
        match a.reuse {
            None => assert!(prior.is_empty(), "{a:?} reported fresh over {prior:?}"),
            Some(kind) => {
                // (A reuse may cover never-used memory too: untagged memory that merged
                // into a tagged block takes the tag — conservative, never wrong. So may a
                // free that was settled, host-observed at a settle or completed at an
                // opportunistic reuse: it merges into the tagged blocks beside it, and any
                // stream may use it.)
                for f in &prior {
                    let s = f.tag.stream as usize;
                    let settled = f.tag.pos < self.settled_below[s]
                        || f.tag.pos < self.completion_settled_below[s];
                    let ok = settled
                        || match kind {
                            ReuseKind::SameStream => s == t,
                            ReuseKind::HostSynchronized => f.tag.pos < c.host_bound(s),
                            ReuseKind::EventDependency => c.follow && f.tag.pos < c.vc[t][s],
                            ReuseKind::Opportunistic => {
                                c.opportunistic && f.tag.pos < c.complete_bound(s)
                            }
                            ReuseKind::InternalDependency => {
                                let d = a.dependency.unwrap();
                                c.internal && d.stream as usize == s && f.tag.pos <= d.pos
                            }
                        };
                    assert!(ok, "{a:?} on stream {t}: {kind:?} does not justify {f:?}");
                }
            }
        }
        self.may_have_settled();
        self.forget(a.offset, end);
        self.live.push(Live { a, align });
    }

    fn check_all(&self) {
        self.e.check_invariants().unwrap();
        let s = self.e.stats();
        let used: u64 = self.live.iter().map(|l| l.a.size).sum();
        assert_eq!(s.used, used);
        assert_eq!(s.live_blocks, self.live.len() as u64);
        assert!(s.reserved >= s.used);
        assert!(s.used_high >= s.used && s.reserved_high >= s.reserved);
        assert_eq!(self.b.total(), s.reserved, "backing disagrees with reserved");
        let mut spans: Vec<(u64, u64)> = self.live.iter().map(|l| (l.a.offset, l.a.size)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "live blocks overlap");
        }
        for l in &self.live {
            let info = self.e.block(l.a.block).expect("live block known");
            let found = self.e.lookup(l.a.offset);
            if self.p.index_by_offset {
                assert_eq!(found, Some((l.a.block, l.a.size)));
            } else {
                assert_eq!(found, None);
            }
            assert_eq!(
                info,
                BlockInfo { offset: l.a.offset, size: l.a.size, state: BlockState::Live }
            );
        }
        let blocks: Vec<_> = self.e.blocks().collect();
        assert_eq!(blocks.first().unwrap().offset, 0);
        assert_eq!(blocks.iter().map(|b| b.size).sum::<u64>(), self.range);
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Alloc { stream, size, align } => {
                // scale from a 2 MiB granule to this case's
                let g = self.p.granularity;
                let size = if size <= 4096 { size } else { (size / (G / g)).max(1) };
                let align = align.min(g);
                let order = self.clock.order(stream);
                let before = self.e.blocks().collect::<Vec<_>>();
                let r = self.e.alloc(size, align, stream, &order, &mut self.b);
                self.drain_unmaps();
                match r {
                    Ok(a) => self.check_alloc(a, stream, size, align),
                    Err(AllocError::OutOfMemory(info)) => {
                        assert_eq!(info.requested, size);
                        assert_eq!(info.used, self.e.used());
                        assert_eq!(info.reserved, self.e.reserved());
                        assert_eq!(info.max, self.range);
                        assert_eq!(
                            info.pending_bytes,
                            info.pending.iter().map(|p| p.bytes).sum::<u64>()
                        );
                        for p in &info.pending {
                            assert_ne!(p.stream, stream);
                        }
                        same_live_blocks(&before, &self.e.blocks().collect::<Vec<_>>());
                        self.may_have_settled();
                    }
                    Err(AllocError::Backing(_)) => {
                        same_live_blocks(&before, &self.e.blocks().collect::<Vec<_>>());
                        self.may_have_settled();
                    }
                    Err(e) => {
                        // only for inputs the strategy cannot produce validly
                        assert!(
                            matches!(e, AllocError::InvalidSize(_)) && size > self.range,
                            "unexpected {e:?}"
                        );
                    }
                }
                self.b.fail_next_map = None;
            }
            Op::Free { which, stream } => {
                if self.live.is_empty() {
                    return;
                }
                let l = self.live.swap_remove(which % self.live.len());
                let s = stream as usize;
                let tag = self.clock.free_tag(s);
                self.e.free(l.a.block, tag).unwrap();
                assert_eq!(self.e.free(l.a.block, tag).unwrap_err(), {
                    if self.e.block(l.a.block).is_some() {
                        FreeError::NotLive
                    } else {
                        FreeError::UnknownBlock
                    }
                });
                assert_eq!(self.e.lookup(l.a.offset), None);
                self.forget(l.a.offset, l.a.offset + l.a.size);
                self.freed.push(Freed { off: l.a.offset, end: l.a.offset + l.a.size, tag });
            }
            Op::Work { stream } => self.clock.work(stream as usize),
            Op::Complete { stream } => self.clock.complete(stream as usize),
            Op::HostSync { stream } => {
                self.clock.host_sync(stream as usize);
                // As the pool after every host synchronisation.
                self.e.settle(&self.clock.no_requester());
                for (t, bound) in self.settled_below.iter_mut().enumerate() {
                    *bound = self.clock.host_bound(t);
                }
            }
            Op::EventWait { waiter, on } => self.clock.event_wait(waiter as usize, on as usize),
            Op::Switches { follow, opportunistic, internal } => {
                self.clock.follow = follow;
                self.clock.opportunistic = opportunistic;
                self.clock.internal = internal;
            }
            Op::Release { keep } => {
                let keep = keep / (G / self.p.granularity);
                let reserved = self.e.reserved();
                // The remap of a cut segment fails when told to, or when the capacity was
                // lowered below what is mapped.
                let remap_may_fail =
                    self.b.fail_next_map.is_some() || self.b.capacity.is_some_and(|c| c < reserved);
                let r = self.e.release(keep, &self.clock.no_requester(), &mut self.b);
                self.drain_unmaps();
                self.b.fail_next_unmap = false;
                if let Ok(n) = r {
                    assert_eq!(self.e.reserved(), reserved - n);
                    // never below the target rounded down to a granule (a segment larger
                    // than what is left to release is cut, not unmapped whole)
                    let g = self.p.granularity;
                    let floor = (keep.max(self.e.used()) / g * g).min(reserved);
                    if !remap_may_fail {
                        assert!(
                            self.e.reserved() >= floor,
                            "release to {keep} went below it: {reserved} -> {}",
                            self.e.reserved()
                        );
                    }
                    // either the target is met or nothing more can go
                    if self.e.reserved() > keep.max(self.e.used()) {
                        let order = self.clock.no_requester();
                        let again = self.e.release(keep, &order, &mut self.b).unwrap();
                        self.drain_unmaps();
                        assert_eq!(again, 0, "release ended before its target");
                    }
                }
            }
            Op::Relocate { which, stream } => {
                if self.live.is_empty() {
                    return;
                }
                let l = self.live[which % self.live.len()];
                let order = self.clock.order(stream);
                if let Some(a) = self.e.relocate_lower(l.a.block, stream, &order) {
                    assert_eq!(a.size, l.a.size);
                    assert!(a.offset + a.size <= l.a.offset, "relocation not lower");
                    assert_eq!(a.dependency, None);
                    self.check_alloc(a, stream, l.a.size, l.align);
                }
            }
            Op::FailNextMap { oom } => {
                self.b.fail_next_map = Some(if oom {
                    BackingError::OutOfMemory
                } else {
                    BackingError::Driver(Injected)
                });
            }
            Op::FailNextUnmap => {
                self.b.fail_next_unmap = true;
            }
            Op::Capacity { granules } => {
                self.b.capacity = granules.map(|n| n * self.p.granularity);
            }
            Op::Recycle { on } => self.e.set_recycle_on_growth(on),
        }
        self.b.fail_next_unmap = false;
        self.check_all();
    }

    /// Frees everything, waits for all streams and tears down.
    fn finish(&mut self) {
        if std::env::var_os("MODEL_STATS").is_some() {
            let s = self.e.stats();
            eprintln!(
                "allocs {} fresh {} reuses {:?} ooms {} maps {} unmaps {}",
                s.allocs, s.fresh_allocs, s.reuses, s.ooms, s.map_calls, s.unmap_calls
            );
        }
        for l in std::mem::take(&mut self.live) {
            self.e.free(l.a.block, FreeTag { stream: 0, pos: self.clock.pos[0] }).unwrap();
        }
        self.e.check_invariants().unwrap();
        self.e.teardown(&mut self.b).unwrap();
        self.e.check_invariants().unwrap();
        assert_eq!(self.b.total(), 0);
        assert_eq!(self.e.reserved(), 0);
    }
}

/// Live blocks are identical (free and unmapped ones may differ: recycling may unmap).
fn same_live_blocks(a: &[BlockInfo], b: &[BlockInfo]) {
    let live = |v: &[BlockInfo]| -> Vec<BlockInfo> {
        v.iter().copied().filter(|i| i.state == BlockState::Live).collect()
    };
    assert_eq!(live(a), live(b), "a failed allocation changed live blocks");
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(96),
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_matches_shadow_model(
        p in params_strategy(),
        ops in proptest::collection::vec(op_strategy(), 1..160),
    ) {
        let mut m = Model::new(p);
        for op in &ops {
            m.step(op);
        }
        m.finish();
    }
}
