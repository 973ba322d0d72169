//! Host bookkeeping per live allocation, measured with a counting global allocator.
//!
//! For `N` live allocations (contiguous, and as a checkerboard with `N` free holes between
//! them), the heap bytes the pool holds (allocated minus freed, including `Vec` capacity
//! slack) are divided by `N`. The caller's own storage (the `Vec` of handles) is reserved
//! before the first snapshot and excluded; the size of the handle itself (`PoolAlloc`,
//! which lives in the caller's storage) is reported separately. Writes
//! `<target>/soma-bench/bookkeeping.json`. Not a criterion bench: it measures bytes.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use soma::{MemPool, PoolAlloc};
use soma_tools::baselines::{Allocator, SomaApi, SomaEngine};
use soma_tools::trace::{Op, TraceStats};
use soma_tools::workload::{checkerboard, Workload};

struct Counting;

static LIVE_BYTES: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards every call to `System` unchanged and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn heap() -> i64 {
    LIVE_BYTES.load(Ordering::Relaxed)
}

const N: usize = 100_000;

/// Replays `w` and returns the pool's heap bytes per allocation live at the end (the
/// handle table is the caller's and allocated before the snapshot).
fn measure<A: Allocator>(a: &mut A, w: &Workload) -> f64 {
    let mut handles: Vec<Option<A::Handle>> = Vec::with_capacity(w.slots);
    handles.resize_with(w.slots, || None);
    let before = heap();
    for op in &w.ops {
        match *op {
            Op::Alloc { slot, bytes } => handles[slot as usize] = a.alloc(bytes),
            Op::Free { slot } => {
                if let Some(h) = handles[slot as usize].take() {
                    a.free(h);
                }
            }
        }
    }
    let per = (heap() - before) as f64 / w.stats.live_at_end as f64;
    for h in handles.into_iter().flatten() {
        a.free(h);
    }
    per
}

/// `n` allocations of `block` bytes, none freed.
fn contiguous(n: usize, block: u64) -> Workload {
    let ops: Vec<Op> = (0..n as u32).map(|slot| Op::Alloc { slot, bytes: block }).collect();
    Workload { stats: TraceStats::of(&ops), ops, slots: n }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let npu = common::npu();
    let dev = npu.device(0).expect("device");
    let s = dev.create_stream().expect("stream");
    let mut rows = Vec::new();
    for (layout, w) in
        [("contiguous", contiguous(N, 4096)), ("checkerboard", checkerboard(N, 4096))]
    {
        let pool = MemPool::builder().build(&dev).expect("pool");
        rows.push(("soma", layout, measure(&mut SomaApi::new(&pool, &s), &w)));
        rows.push(("soma-engine", layout, measure(&mut SomaEngine::new(common::RANGE, 512), &w)));
    }
    let handle = std::mem::size_of::<PoolAlloc<'_, u8>>();
    println!("{:<12} {:<13} {:>22}", "allocator", "layout", "heap bytes / live alloc");
    for (a, l, per) in &rows {
        println!("{a:<12} {l:<13} {per:>22.1}");
    }
    println!("size_of::<PoolAlloc<u8>>() = {handle} bytes (in the caller's storage)");
    let body: Vec<String> = rows
        .iter()
        .map(|(a, l, per)| {
            format!("{{\"allocator\":\"{a}\",\"layout\":\"{l}\",\"bytes_per_live\":{per:.1}}}")
        })
        .collect();
    common::write_json(
        "bookkeeping",
        &format!("{{\"n\":{N},\"pool_alloc_size\":{handle},\"rows\":[{}]}}\n", body.join(",")),
    );
}
