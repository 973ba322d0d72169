//! Fixed programs that a plain `cargo test` runs deterministically: every rule once, an
//! internal dependency, and rule 2 after an internal dependency.

use super::program::{Case, Op, PoolCfg};
use super::run_case;

/// A fixed program covering every rule once, so that a plain `cargo test` exercises the
/// model deterministically too.
/// Run with one engine and with the pool split into 2 and 3 stream shards (every reuse then
/// crosses shards: stream slots 0, 1, 2 allocate in different ones).
#[test]
fn scripted_program_covers_every_rule() {
    for shards in 1..=3 {
        scripted_program_covers_every_rule_with(shards);
    }
}

fn scripted_program_covers_every_rule_with(shards: u8) {
    let all = PoolCfg {
        tight: false,
        alignment: 512,
        threshold_mib: 128,
        follow: true,
        opportunistic: true,
        internal: true,
        shards,
    };
    let none = PoolCfg { follow: false, opportunistic: false, internal: false, ..all.clone() };
    let case = Case {
        pools: vec![all, none],
        streams: 3,
        ops: vec![
            Op::Gate { stream: 0, steps: 6 },
            Op::Alloc { pool: 0, stream: 0, bytes: 4096 },
            Op::Free { which: 0, stream: 0 },
            Op::Record { stream: 0, event: 0 },
            Op::Wait { stream: 1, event: 0 },
            Op::Alloc { pool: 0, stream: 1, bytes: 4096 }, // event dependency
            Op::Alloc { pool: 0, stream: 0, bytes: 1 << 20 },
            Op::Free { which: 1, stream: 0 },
            Op::Alloc { pool: 0, stream: 2, bytes: 1 << 20 }, // growth, not reuse
            Op::SyncDevice,
            Op::Alloc { pool: 1, stream: 2, bytes: 8192 },
            Op::Free { which: 0, stream: 2 },
            Op::SyncStream { stream: 2 },
            Op::Alloc { pool: 1, stream: 1, bytes: 8192 }, // host observed
            Op::SyncTrimAll,
        ],
    };
    run_case(&case).unwrap();
}

/// A tight pool with only internal dependencies on: the second stream can only get memory
/// by waiting for the first one's frees (the pool must really order it after them) — with
/// one engine, and with two shards, where the frees are in the other stream's shard.
#[test]
fn scripted_internal_dependency() {
    for shards in 1..=2 {
        scripted_internal_dependency_with(shards);
    }
}

fn scripted_internal_dependency_with(shards: u8) {
    let tight = PoolCfg {
        tight: true,
        alignment: 512,
        threshold_mib: 128,
        follow: false,
        opportunistic: false,
        internal: true,
        shards,
    };
    let case = Case {
        pools: vec![tight.clone(), tight],
        streams: 2,
        ops: vec![
            Op::Gate { stream: 0, steps: 8 },
            Op::Alloc { pool: 0, stream: 0, bytes: 3 << 20 },
            Op::Alloc { pool: 0, stream: 0, bytes: 3 << 20 },
            Op::Free { which: 0, stream: 0 },
            Op::Free { which: 0, stream: 0 },
            Op::Alloc { pool: 0, stream: 1, bytes: 3 << 20 },
            Op::SyncDevice,
        ],
    };
    run_case(&case).unwrap();
}

/// A program of the property test (one in 5000 cases): after an internal dependency, the
/// requesting stream is ordered after the block's stream up to the inserted record, so a
/// later block freed there before that record is reusable by rule 2. The model must learn the
/// inserted wait even when it justified the first block by another rule.
#[test]
fn scripted_rule_two_after_an_internal_dependency() {
    let pool = PoolCfg {
        tight: false,
        alignment: 512,
        threshold_mib: 4,
        follow: true,
        opportunistic: false,
        internal: true,
        shards: 1,
    };
    let other = PoolCfg { threshold_mib: 0, follow: false, internal: false, ..pool.clone() };
    let case = Case {
        pools: vec![pool, other],
        streams: 3,
        ops: vec![
            Op::Alloc { pool: 0, stream: 0, bytes: 1 },
            Op::Free { which: 0, stream: 0 },
            Op::Alloc { pool: 0, stream: 0, bytes: 1048576 },
            Op::Free { which: 0, stream: 2 },
            Op::Record { stream: 2, event: 0 },
            Op::Alloc { pool: 0, stream: 0, bytes: 1045505 },
            Op::Free { which: 0, stream: 2 },
            Op::Alloc { pool: 2, stream: 0, bytes: 1048576 },
            Op::Alloc { pool: 0, stream: 0, bytes: 2561 },
        ],
    };
    run_case(&case).unwrap();
}
