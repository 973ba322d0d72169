//! The programs the state machine runs: their steps, pool configurations and proptest
//! strategies.

use std::fmt;

use proptest::prelude::*;

use super::{EVENTS, STREAM_SLOTS};

/// One step of a program. Indices are taken modulo what exists, so that shrinking never
/// produces an invalid program.
#[derive(Clone, Debug)]
#[rustfmt::skip]
pub(super) enum Op {
    CreateStream { slot: u8 },
    DestroyStream { slot: u8 },
    Alloc { pool: u8, stream: u8, bytes: u32 },
    Free { which: u8, stream: u8 },
    Record { stream: u8, event: u8 },
    Wait { stream: u8, event: u8 },
    /// `waiter.wait_stream(on)`: an event recorded on `on` and waited on by `waiter`.
    WaitStream { waiter: u8, on: u8 },
    SyncStream { stream: u8 },
    SyncEvent { event: u8 },
    SyncDevice,
    QueryStream { stream: u8 },
    QueryEvent { event: u8 },
    Trim { pool: u8, mib: u8 },
    SyncTrimAll,
    SetReuse { pool: u8, follow: bool, opportunistic: bool, internal: bool },
    SetThreshold { pool: u8, mib: u8 },
    ResetHighs { pool: u8 },
    Sleep { stream: u8, ms: u8 },
    Gate { stream: u8, steps: u8 },
}

#[derive(Clone, Debug)]
pub(super) struct PoolCfg {
    pub(super) tight: bool,
    pub(super) alignment: u64,
    pub(super) threshold_mib: u8,
    pub(super) follow: bool,
    pub(super) opportunistic: bool,
    pub(super) internal: bool,
    /// `MemPoolBuilder::stream_shards`: 1 (one engine) or 2–3 shards by stream slot.
    pub(super) shards: u8,
}

/// A generated program: pool configurations, initial streams and steps. Its `Debug` prints
/// one step per line, so that a shrunk failure reads as a script.
#[derive(Clone)]
pub(super) struct Case {
    pub(super) pools: Vec<PoolCfg>,
    pub(super) streams: u8,
    pub(super) ops: Vec<Op>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Case {{ streams: {},", self.streams)?;
        for (i, p) in self.pools.iter().enumerate() {
            writeln!(f, "  pool {i}: {p:?}")?;
        }
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  {i:>2}: {op:?}")?;
        }
        write!(f, "}}")
    }
}

/// Sizes: small ones share granules; granule-sized ones exhaust the untagged memory, so
/// that requests reach the cross-stream rules (which come after own and never-used blocks).
fn bytes_strategy() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => 1u32..4096,
        2 => 4096u32..(256 << 10),
        2 => (256u32 << 10)..(3 << 20),
        3 => prop_oneof![Just(1 << 20), Just(2 << 20), Just(3 << 20)],
    ]
}

/// Streams: mostly the first three slots, so that streams meet each other's frees.
fn slot_strategy() -> impl Strategy<Value = u8> + Clone {
    prop_oneof![3 => 0..3u8, 1 => 0..STREAM_SLOTS]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let s = slot_strategy();
    let e = 0..EVENTS;
    let p = 0u8..3;
    prop_oneof![
        2 => s.clone().prop_map(|slot| Op::CreateStream { slot }),
        1 => s.clone().prop_map(|slot| Op::DestroyStream { slot }),
        12 => (p.clone(), s.clone(), bytes_strategy())
            .prop_map(|(pool, stream, bytes)| Op::Alloc { pool, stream, bytes }),
        9 => (any::<u8>(), s.clone()).prop_map(|(which, stream)| Op::Free { which, stream }),
        4 => (s.clone(), e.clone()).prop_map(|(stream, event)| Op::Record { stream, event }),
        4 => (s.clone(), e.clone()).prop_map(|(stream, event)| Op::Wait { stream, event }),
        3 => (s.clone(), s.clone()).prop_map(|(waiter, on)| Op::WaitStream { waiter, on }),
        1 => s.clone().prop_map(|stream| Op::SyncStream { stream }),
        1 => e.clone().prop_map(|event| Op::SyncEvent { event }),
        1 => Just(Op::SyncDevice),
        1 => s.clone().prop_map(|stream| Op::QueryStream { stream }),
        1 => e.clone().prop_map(|event| Op::QueryEvent { event }),
        1 => (p.clone(), 0u8..160).prop_map(|(pool, mib)| Op::Trim { pool, mib }),
        1 => Just(Op::SyncTrimAll),
        2 => (p.clone(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(pool, follow, opportunistic, internal)| Op::SetReuse {
                pool,
                follow,
                opportunistic,
                internal
            }
        ),
        1 => (p.clone(), 0u8..160).prop_map(|(pool, mib)| Op::SetThreshold { pool, mib }),
        1 => p.clone().prop_map(|pool| Op::ResetHighs { pool }),
        2 => (s.clone(), 0u8..3).prop_map(|(stream, ms)| Op::Sleep { stream, ms }),
        6 => (s, 2u8..12).prop_map(|(stream, steps)| Op::Gate { stream, steps }),
    ]
}

fn pool_strategy() -> impl Strategy<Value = PoolCfg> {
    (
        any::<bool>(),
        prop_oneof![4 => Just(512u64), 1 => Just(256), 1 => Just(4096)],
        prop_oneof![Just(0u8), Just(4), Just(128)],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![2 => Just(1u8), 1 => Just(2), 1 => Just(3)],
    )
        .prop_map(
            |(tight, alignment, threshold_mib, follow, opportunistic, internal, shards)| PoolCfg {
                tight,
                alignment,
                threshold_mib,
                follow,
                opportunistic,
                internal,
                shards,
            },
        )
}

pub(super) fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(pool_strategy(), 2..=3),
        1u8..=STREAM_SLOTS,
        prop::collection::vec(op_strategy(), 1..=40),
    )
        .prop_map(|(pools, streams, ops)| Case { pools, streams, ops })
}
