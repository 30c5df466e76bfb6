//! Fuzz target: bytes → a hostile C caller of the C ABI on simulated devices (see
//! `streamalloc::ffi::testing`): null, foreign and double frees, absurd sizes, bad
//! devices, bogus streams, pool calls out of order, junk checkpoints, stats and snapshot
//! calls, and panics planted in the simulated driver. A crash is a panic that escaped or
//! was caught where none was planted, a broken engine invariant, a stale or missing last
//! error, or a call the model of live pointers contradicts.
//!
//! `cargo fuzz run c_abi` (needs cargo-fuzz and a nightly toolchain). Stable CI replays
//! `fuzz/corpus/c_abi/` through `tests/fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(init: streamalloc::ffi::testing::pass_planted_panics(), |data: &[u8]| {
    if let Err(violation) = streamalloc::ffi::testing::run_bytes(data) {
        panic!("{violation}");
    }
});
