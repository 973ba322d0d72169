//! Synthetic workloads as pre-generated [`Op`] sequences, and the replay loop that drives an
//! [`Allocator`] through them.
//!
//! Generating the sequence up front keeps the random number generator, the choice of the
//! allocation to free and the bookkeeping of live allocations out of the timed region: the
//! timed loop is one `match` and one allocator call per op.

use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

use crate::baselines::Allocator;
use crate::driver_cost::DriverCostModel;
use crate::trace::{Op, TraceStats};
use crate::MIB;

/// The fixed seed of every generated workload.
pub const SEED: u64 = 0x50_4d_41_2d_72_73; // "SOMA-rs"

/// A generated op sequence.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The ops, in order.
    pub ops: Vec<Op>,
    /// Number of slots (allocations).
    pub slots: usize,
    /// Statistics of the sequence.
    pub stats: TraceStats,
}

/// RAPIDS RMM's `random_allocations` benchmark (`benchmarks/random_allocations`), ported:
/// `2 × n` steps; at each step draw a size uniformly in `1 ..= max_size_mib MiB`, then
/// allocate with probability 73 % (always when nothing is live) provided fewer than `n`
/// allocations were made and live bytes plus the size stay below `max_usage_mib MiB`;
/// otherwise free a live allocation chosen uniformly (RMM erases it from its vector, keeping
/// the order; so does this port). Whatever is live at the end is freed, in allocation order,
/// as RMM's destructor does. RMM uses `std::default_random_engine`; this port uses a seeded
/// xorshift generator ([`SEED`]), so sequences are reproducible but not RMM's bit for bit.
pub fn random_allocations(n: usize, max_size_mib: u64, max_usage_mib: u64, seed: u64) -> Workload {
    let mut rng = XorShiftRng::seed_from_u64(seed);
    let max_usage = max_usage_mib * MIB;
    let max_size = max_size_mib * MIB;
    let mut ops = Vec::with_capacity(2 * n + n);
    let mut live: Vec<(u32, u64)> = Vec::new(); // (slot, size), in RMM's vector order
    let mut allocation_count = 0usize;
    let mut allocation_size = 0u64;
    for _ in 0..2 * n {
        let size = rng.random_range(1..=max_size);
        let mut do_alloc = true;
        if !live.is_empty() {
            let chance = rng.random_range(0..100u32);
            do_alloc = chance < 73 && allocation_count < n && allocation_size + size < max_usage;
        }
        if do_alloc {
            let slot = allocation_count as u32;
            ops.push(Op::Alloc { slot, bytes: size });
            live.push((slot, size));
            allocation_count += 1;
            allocation_size += size;
        } else if !live.is_empty() {
            let index = rng.random_range(0..n.max(1)) % live.len();
            let (slot, size) = live.remove(index);
            ops.push(Op::Free { slot });
            allocation_size -= size;
        }
    }
    for (slot, _) in live {
        ops.push(Op::Free { slot });
    }
    let stats = TraceStats::of(&ops);
    Workload { ops, slots: allocation_count, stats }
}

/// The hot-path background: `2 × n` blocks of `block` bytes allocated in a row, then every
/// other one freed, leaving `n` live blocks separated by `n` free holes (slots `2k + 1` stay
/// live). A free-list allocator has `n` holes to walk past; a segregated-fit one has one
/// size class holding them.
pub fn checkerboard(n: usize, block: u64) -> Workload {
    let mut ops = Vec::with_capacity(3 * n);
    for slot in 0..2 * n as u32 {
        ops.push(Op::Alloc { slot, bytes: block });
    }
    for slot in (0..2 * n as u32).step_by(2) {
        ops.push(Op::Free { slot });
    }
    let stats = TraceStats::of(&ops);
    Workload { ops, slots: 2 * n, stats }
}

/// Replays `ops` on `a`, returning the handle table (slot → handle still live). Panics when
/// an allocation fails: every workload here fits the allocators it is run on.
///
/// The caller frees what is left (see [`free_all`]) outside any timed region.
#[inline(never)]
pub fn replay<A: Allocator>(a: &mut A, ops: &[Op], slots: usize) -> Vec<Option<A::Handle>> {
    let mut handles: Vec<Option<A::Handle>> = Vec::with_capacity(slots);
    handles.resize_with(slots, || None);
    for op in ops {
        match *op {
            Op::Alloc { slot, bytes } => {
                let h = a.alloc(bytes);
                assert!(h.is_some(), "{}: allocation of {bytes} bytes failed", a.name());
                handles[slot as usize] = h;
            }
            Op::Free { slot } => {
                if let Some(h) = handles[slot as usize].take() {
                    a.free(h);
                }
            }
        }
    }
    handles
}

/// For profilers (`soma-hotpath random`, `soma-handles`): `replays` replays of RMM's
/// `random_allocations` (`n`, `max_mib`) on the same allocator, each timed and printed with
/// its driver calls, their modelled time ([`DriverCostModel::ascend_like`]) and the
/// allocator's reserved high-water mark. The first replay grows the allocator, later ones run
/// warm; the instructions of one warm replay are the difference of two runs with different
/// `replays`.
///
/// # Panics
///
/// If a replay leaves an allocation live (every replay frees what it allocated).
pub fn print_random_replays<A: Allocator>(mut a: A, n: usize, max_mib: u64, replays: usize) {
    let w = random_allocations(n, max_mib, 16_000, SEED);
    let model = DriverCostModel::ascend_like();
    for r in 0..replays {
        let before = a.driver_calls();
        let t = std::time::Instant::now();
        let h = replay(&mut a, &w.ops, w.slots);
        let ns = t.elapsed().as_nanos() as f64 / w.ops.len() as f64;
        let calls = a.driver_calls() - before;
        println!(
            "{}: random_allocations {n}x{max_mib} replay {r}: {} ops, {ns:.1} ns/op, \
             {} maps / {} unmaps / {} mallocs / {} frees, modelled driver {:.1} ns/op, \
             reserved high {:.1} MiB",
            a.name(),
            w.ops.len(),
            calls.map,
            calls.unmap,
            calls.malloc,
            calls.free,
            model.ns_per_op(&calls, w.ops.len() as u64),
            a.reserved_high() as f64 / MIB as f64
        );
        assert!(h.iter().all(Option::is_none), "every replay frees what it allocated");
    }
}

/// Frees every handle still in the table.
pub fn free_all<A: Allocator>(a: &mut A, handles: Vec<Option<A::Handle>>) {
    for h in handles.into_iter().flatten() {
        a.free(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::baselines::{FirstFit, SomaReplica, Tlsf};
    use crate::trace::validate;

    #[test]
    fn random_allocations_follows_rmm_rules() {
        let w = random_allocations(10_000, 4, 16_000, SEED);
        validate(&w.ops).unwrap();
        // 2n steps, plus frees of what is left at the end.
        assert!(w.ops.len() >= 20_000);
        assert_eq!(w.stats.live_at_end, 0);
        assert!(w.slots <= 10_000);
        assert!(w.stats.peak_live_bytes < 16_000 * MIB);
        // About 73 % allocations among the steps (minus the capped ones).
        assert!(w.stats.allocs > 6_000, "{}", w.stats.allocs);
        for op in &w.ops {
            if let Op::Alloc { bytes, .. } = *op {
                assert!((1..=4 * MIB).contains(&bytes));
            }
        }
        // Deterministic.
        assert_eq!(w.ops, random_allocations(10_000, 4, 16_000, SEED).ops);
        // The byte cap binds with large sizes.
        let big = random_allocations(1_000, 256, 16_000, SEED);
        assert!(big.stats.peak_live_bytes < 16_000 * MIB);
        assert!(big.stats.peak_live_bytes > 8_000 * MIB);
    }

    #[test]
    fn checkerboard_leaves_n_live() {
        let w = checkerboard(100, 512);
        validate(&w.ops).unwrap();
        assert_eq!(w.stats.live_at_end, 100);
        let mut s = FirstFit::new(1 << 30);
        let h = replay(&mut s, &w.ops, w.slots);
        assert_eq!(s.free_list().len(), 101);
        assert_eq!(h.iter().flatten().count(), 100);
        free_all(&mut s, h);
        assert_eq!(s.free_list().len(), 1);
    }

    #[test]
    fn replay_runs_every_baseline() {
        let w = random_allocations(2_000, 64, 16_000, SEED);
        let mut t = Tlsf::new(1 << 40);
        let h = replay(&mut t, &w.ops, w.slots);
        assert_eq!(h.iter().flatten().count(), 0);
        assert!(t.reserved_high() >= w.stats.peak_live_bytes);
        let mut r = SomaReplica::new(1 << 44);
        replay(&mut r, &w.ops, w.slots);
        assert!(r.reserved_high() >= t.reserved_high() / 2);
    }
}
