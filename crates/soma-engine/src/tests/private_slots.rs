//! Private slots: their frees merge only among themselves and serve no other slot, under
//! any rule, until they settle like any other once their bound passes them.

use super::*;
use crate::*;

/// The first private slot of these tests.
const PRIVATE: StreamSlot = 100;

#[test]
fn a_private_slots_free_merges_with_its_own_frees_only() {
    let mut e = engine(8 * G);
    e.set_private_slots(PRIVATE);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 4096, PRIVATE);
    let y = alloc(&mut e, &mut b, &o, 4096, PRIVATE);
    // Beside the fresh rest of the granule: an ordinary free would take it over.
    e.free_private(y.block, tag(PRIVATE, 1)).unwrap();
    e.check_invariants().unwrap();
    assert_eq!(
        free_blocks_below(&e, G),
        [(4096, 4096, Some(tag(PRIVATE, 1))), (8192, G - 8192, None)]
    );
    e.free_private(x.block, tag(PRIVATE, 2)).unwrap();
    e.check_invariants().unwrap();
    assert_eq!(
        free_blocks_below(&e, G),
        [(0, 8192, Some(tag(PRIVATE, 2))), (8192, G - 8192, None)]
    );
    assert_eq!(e.cached_bytes(PRIVATE), 8192);
    // The fresh rest serves another stream; the private memory does not.
    let z = alloc(&mut e, &mut b, &o, 8192, 0);
    assert_eq!(z.offset, 8192);
    // Settled (its bound passed it), it merges with the untagged memory around it.
    free(&mut e, &z, 0, 1);
    let settle = TestOrder {
        host_observed: [(PRIVATE, u64::MAX), (0, 2)].into_iter().collect(),
        ..TestOrder::default()
    };
    e.settle(&settle);
    e.check_invariants().unwrap();
    assert_eq!(e.cached_bytes(PRIVATE), 0);
    assert_eq!(free_blocks_below(&e, G), [(0, G, None)]);
}

#[test]
fn an_ordinary_free_does_not_merge_with_private_memory() {
    let mut e = engine(8 * G);
    e.set_private_slots(PRIVATE);
    let mut b = backing();
    let o = TestOrder::default();
    let x = alloc(&mut e, &mut b, &o, 4096, 0);
    let y = alloc(&mut e, &mut b, &o, 4096, PRIVATE);
    let rest = alloc(&mut e, &mut b, &o, G - 8192, 0);
    e.free_private(y.block, tag(PRIVATE, 1)).unwrap();
    free(&mut e, &x, 0, 1);
    free(&mut e, &rest, 0, 2);
    assert_eq!(
        free_blocks_below(&e, G),
        [
            (0, 4096, Some(tag(0, 1))),
            (4096, 4096, Some(tag(PRIVATE, 1))),
            (8192, G - 8192, Some(tag(0, 2)))
        ]
    );
}

#[test]
fn a_private_slots_blocks_serve_no_other_slot_until_settled() {
    let mut e = engine(G);
    e.set_private_slots(PRIVATE);
    let mut b = backing();
    // Every rule would allow it, rule 4 included: a private slot's block is still its own.
    let o = TestOrder {
        host_observed: [(PRIVATE, u64::MAX)].into_iter().collect(),
        internal: true,
        ..TestOrder::default()
    };
    let x = e.alloc(G / 2, 512, PRIVATE, &o, &mut b).unwrap();
    let y = e.alloc(G / 2, 512, 1, &o, &mut b).unwrap();
    e.free_private(x.block, tag(PRIVATE, 1)).unwrap();
    assert!(e.pending_frees(0, &o).is_empty(), "no wait makes it reusable");
    // The range is full: only a dependency on stream 1 could serve stream 0.
    assert!(matches!(e.alloc(G / 2, 512, 0, &o, &mut b), Err(AllocError::OutOfMemory(_))));
    e.free(y.block, tag(1, 1)).unwrap();
    let z = e.alloc(G / 2, 512, 0, &o, &mut b).unwrap();
    assert_eq!((z.offset, z.dependency), (G / 2, Some(tag(1, 1))));
    // The private slot's own requests take it back; once settled, anyone may.
    let again = e.alloc(G / 2, 512, PRIVATE, &o, &mut b).unwrap();
    assert_eq!((again.offset, again.reuse), (0, Some(ReuseKind::SameStream)));
    e.free_private(again.block, tag(PRIVATE, 2)).unwrap();
    e.settle(&o);
    let w = e.alloc(G / 2, 512, 0, &o, &mut b).unwrap();
    assert_eq!((w.offset, w.reuse), (0, Some(ReuseKind::HostSynchronized)));
    e.check_invariants().unwrap();
}

/// A private slot's free at the top of the mapped memory is the border block, and serves no
/// other stream under any rule either: another stream maps a new run above it.
#[test]
fn a_private_slots_border_block_serves_no_other_stream() {
    let mut e = engine(8 * G);
    e.set_private_slots(PRIVATE);
    let mut b = backing();
    let x = alloc(&mut e, &mut b, &TestOrder::default(), G, PRIVATE);
    e.free_private(x.block, tag(PRIVATE, 1)).unwrap();
    e.check_invariants().unwrap();
    assert_eq!(free_blocks_below(&e, 8 * G), [(0, G, Some(tag(PRIVATE, 1)))]);
    assert_eq!(e.cached_bytes(PRIVATE), G, "the border block's bytes count");
    // Every rule would allow it for an ordinary stream's free.
    let all = TestOrder {
        event: [(PRIVATE, 2)].into_iter().collect(),
        completed: [(PRIVATE, 2)].into_iter().collect(),
        internal: true,
        ..TestOrder::default()
    };
    let y = alloc(&mut e, &mut b, &all, G, 0);
    assert_eq!((y.offset, y.reuse), (G, None), "a new run above the private block");
    e.check_invariants().unwrap();
    assert_eq!(free_blocks_below(&e, G), [(0, G, Some(tag(PRIVATE, 1)))]);
    assert_eq!(e.cached_bytes(PRIVATE), G);
}
