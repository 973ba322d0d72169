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

use clap::Parser;
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

/// Replays RMM's random_allocations sequence on the engine alone with handles as large as a
/// `PoolAlloc`, to separate what the caller's array of handles costs from what the pool adds
/// on top of the engine (compare with `soma-hotpath random soma-engine`).
#[derive(Debug, Parser)]
#[command(name = "soma-handles")]
struct Cli {
    /// Allocations in the sequence.
    n: usize,
    /// Largest allocation, in MiB.
    max_mib: u64,
    /// Replays of the sequence on the same allocator (the first grows it, later ones run
    /// warm).
    #[arg(default_value_t = 1)]
    replays: usize,
}

fn main() {
    let Cli { n, max_mib, replays } = Cli::parse();
    print_random_replays(Wide(SomaEngine::new(1 << 40, 512)), n, max_mib, replays);
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("soma-handles").chain(args.iter().copied()))
    }

    #[test]
    fn parses_n_max_mib_and_optional_replays() {
        let Cli { n, max_mib, replays } = parse(&["100000", "1"]).unwrap();
        assert_eq!((n, max_mib, replays), (100_000, 1, 1));
        assert_eq!(parse(&["10", "2", "3"]).unwrap().replays, 3);
        assert!(parse(&["10"]).is_err());
        assert!(parse(&["10", "x"]).is_err());
        assert!(parse(&["10", "1", "2", "3"]).is_err());
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
