//! Fuzz target: bytes → a configuration and a program of allocator operations, run on the
//! simulated device with every invariant checked after every step (see
//! `streamalloc_allocator::testing`). Any violation is a crash with its description.
//!
//! `cargo fuzz run engine` (needs cargo-fuzz and a nightly-capable toolchain). Stable CI
//! replays `fuzz/corpus/engine/` through `tests/fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(violation) = streamalloc_allocator::testing::run_bytes(data) {
        panic!("{violation}");
    }
});
