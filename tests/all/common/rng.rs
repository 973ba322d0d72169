//! The tests' deterministic pseudo-random numbers.

/// Marsaglia's xorshift64 generator (shifts 13, 7, 17): the random workloads of the tests.
///
/// A seed gives the same sequence on every run and machine, so that a failure names a
/// workload that can be run again; a test that loops over seeds covers as many workloads.
/// Good enough to vary sizes, streams and operations, not meant for statistics.
pub struct TestRng(u64);

impl TestRng {
    /// The generator of `seed`. Every seed gives a valid state (xorshift's state must not be
    /// zero): each seed is spread over the bits by the golden-ratio constant and made odd.
    pub fn new(seed: u64) -> TestRng {
        TestRng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    /// The next index into `len` elements (`len > 0`).
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }
}
