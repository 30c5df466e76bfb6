//! A small deterministic random generator for simulated workloads.
//!
//! The `p2p-sim` command, the staging property tests and the
//! fragmentation tests all need the same seed to give every process and every run the same
//! tensors, without a dependency on a random-number crate; this generator is that one
//! source, public because the CLI's commands use it as well as the tests.

/// splitmix64: the small deterministic generator behind simulated workloads (`p2p-sim`,
/// the staging property tests), so that the same seed gives every process and every run
/// the same tensors, with no dependency.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// A number in `lo..hi` (`lo` when the range is empty or one wide).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % hi.saturating_sub(lo).max(1)
    }
}
