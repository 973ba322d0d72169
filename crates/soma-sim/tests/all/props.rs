//! Property test: random reserve / release / malloc / free against a shadow model.

use proptest::prelude::*;
use soma_sim::hal::{DeviceHal, DevicePtr, DriverError};
use soma_sim::Npu;

const G: u64 = 2 << 20;
const CAPACITY: u64 = 32 * G;
const SPACE: u64 = 96 * G;

#[derive(Clone, Debug)]
enum Op {
    Reserve(u64),
    Release(usize),
    Malloc(u64),
    Free(usize),
    FreeInterior(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u64..=24).prop_map(Op::Reserve),
        any::<usize>().prop_map(Op::Release),
        (1u64..=6 * G).prop_map(Op::Malloc),
        any::<usize>().prop_map(Op::Free),
        any::<usize>().prop_map(Op::FreeInterior),
    ]
}

#[derive(Clone, Copy, Debug)]
struct Live {
    ptr: DevicePtr,
    len: u64,
    malloc: bool,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn address_space_and_capacity_follow_the_model(ops in proptest::collection::vec(op(), 1..80)) {
        let dev = Npu::builder().capacity(CAPACITY).address_space(SPACE).build().unwrap()
            .device(0).unwrap();
        let mut live: Vec<Live> = Vec::new();
        let used = |live: &[Live]| live.iter().filter(|l| l.malloc).map(|l| l.len).sum::<u64>();
        for op in ops {
            match op {
                Op::Reserve(k) => match dev.reserve(k * G) {
                    Ok(ptr) => live.push(Live { ptr, len: k * G, malloc: false }),
                    // Fragmented or exhausted address space: not a capacity error.
                    Err(e) => prop_assert!(matches!(e, DriverError::InvalidValue(_)), "{e:?}"),
                },
                Op::Malloc(n) => {
                    let len = n.div_ceil(G) * G;
                    match dev.malloc(n) {
                        Ok(ptr) => {
                            prop_assert!(used(&live) + len <= CAPACITY);
                            dev.memset_sync(ptr, 0xEE, n).unwrap();
                            live.push(Live { ptr, len, malloc: true });
                        }
                        Err(DriverError::OutOfMemory { .. }) => {
                            prop_assert!(used(&live) + len > CAPACITY)
                        }
                        Err(_) => {} // address space exhausted
                    }
                }
                Op::Release(i) | Op::Free(i) if !live.is_empty() => {
                    let l = live.remove(i % live.len());
                    if l.malloc {
                        prop_assert!(dev.release(l.ptr).is_err());
                        dev.free(l.ptr).unwrap();
                    } else {
                        prop_assert!(dev.free(l.ptr).is_err());
                        dev.release(l.ptr).unwrap();
                    }
                }
                Op::FreeInterior(i) if !live.is_empty() => {
                    let l = live[i % live.len()];
                    prop_assert!(dev.free(l.ptr.checked_add(l.len / 2 + 1).unwrap()).is_err());
                }
                _ => {}
            }
            // Invariants: aligned, disjoint, capacity accounted.
            for (i, a) in live.iter().enumerate() {
                prop_assert_eq!(a.ptr.addr() % G, 0);
                for b in &live[i + 1..] {
                    let disjoint = a.ptr.addr() + a.len <= b.ptr.addr()
                        || b.ptr.addr() + b.len <= a.ptr.addr();
                    prop_assert!(disjoint, "{:?} overlaps {:?}", a, b);
                }
            }
            prop_assert_eq!(dev.mem_info().unwrap().free, CAPACITY - used(&live));
            prop_assert_eq!(dev.stats().malloc_bytes, used(&live));
        }
        for l in live.drain(..) {
            if l.malloc { dev.free(l.ptr).unwrap() } else { dev.release(l.ptr).unwrap() }
        }
        // Everything coalesced back into one hole.
        let all = dev.reserve(SPACE).unwrap();
        dev.release(all).unwrap();
    }
}
