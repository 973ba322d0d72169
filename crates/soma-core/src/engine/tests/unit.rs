//! Unit tests, one behaviour each.

use super::*;
use crate::engine::*;

fn engine(range: u64) -> Engine {
    Engine::new(EngineConfig {
        range_size: range,
        granularity: G,
        alignment: 512,
        index_by_offset: true,
    })
    .unwrap()
}

fn tag(stream: StreamSlot, pos: u64) -> FreeTag {
    FreeTag { stream, pos }
}

#[test]
fn basic_alloc_free_reuse() {
    let mut e = engine(64 * MIB);
    let mut b = FakeBacking::new();
    let o = TestOrder::default();
    let a = e.alloc(1000, 512, 0, &o, &mut b).unwrap();
    assert_eq!(a.offset, 0);
    assert_eq!(a.size, 1024);
    assert_eq!(a.reuse, None);
    assert_eq!(e.reserved(), G);
    assert_eq!(e.used(), 1024);
    e.check_invariants().unwrap();
    e.free(a.block, tag(0, 1)).unwrap();
    e.check_invariants().unwrap();
    let a2 = e.alloc(1000, 512, 0, &o, &mut b).unwrap();
    assert_eq!(a2.offset, 0);
    assert_eq!(a2.reuse, Some(ReuseKind::SameStream));
    e.check_invariants().unwrap();
    assert_eq!(b.maps, 1);
}
