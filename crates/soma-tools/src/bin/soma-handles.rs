//! `soma-handles`: RMM's `random_allocations` replays (as `soma-hotpath random`) on the engine
//! alone with handles as large as the public API's `PoolAlloc`, to separate what the caller's
//! array of handles costs (allocations write it in order, frees read it at random) from what
//! the pool adds on top of the engine:
//!
//! ```text
//! soma-handles N MAX_MIB [REPLAYS]
//! valgrind --tool=cachegrind soma-handles 100000 1 3     # against soma-hotpath random soma-engine
//! ```
//!
//! A binary of its own: a third caller of the engine in `soma-hotpath` changed what the
//! compiler inlines there, and with it that binary's instruction counts.

use std::hint::black_box;

use soma::PoolAlloc;
use soma_tools::baselines::{Allocator, DriverCalls, SomaEngine};
use soma_tools::workload::print_random_replays;

/// Words of padding that make the engine's handle (`BlockId`, one word) as large as a
/// `PoolAlloc`.
const PAD_WORDS: usize = std::mem::size_of::<PoolAlloc<'static, u8>>() / 8 - 1;

/// An allocator whose handles carry [`PAD_WORDS`] more words, written at allocation and read
/// at free, as a `PoolAlloc`'s fields are.
struct Wide<A>(A);

impl<A: Allocator> Allocator for Wide<A> {
    type Handle = (A::Handle, [u64; PAD_WORDS]);
    fn name(&self) -> &'static str {
        "soma-engine-wide"
    }
    fn alloc(&mut self, bytes: u64) -> Option<Self::Handle> {
        self.0.alloc(bytes).map(|h| (h, [bytes; PAD_WORDS]))
    }
    fn free(&mut self, (handle, pad): Self::Handle) {
        black_box(pad);
        self.0.free(handle);
    }
    fn reserved_high(&self) -> u64 {
        self.0.reserved_high()
    }
    fn driver_calls(&self) -> DriverCalls {
        self.0.driver_calls()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [n, max] => Some((n, max, "1")),
        [n, max, replays] => Some((n, max, replays.as_str())),
        _ => None,
    }
    .and_then(|(n, max, r)| Some((n.parse().ok()?, max.parse().ok()?, r.parse().ok()?)));
    let Some((n, max, replays)) = parsed else {
        eprintln!("usage: soma-handles N MAX_MIB [REPLAYS]");
        std::process::exit(2);
    };
    print_random_replays(Wide(SomaEngine::new(1 << 40, 512)), n, max, replays);
}
