//! Fuzz target: bytes → the bounded pickle decoder, then the PyTorch snapshot reader. Any
//! input must give a value or an error: a panic, a stack overflow, a timeout or running out
//! of memory is a crash.
//!
//! `cargo fuzz run pickle fuzz/corpus/pickle` (needs cargo-fuzz and a nightly-capable
//! toolchain); the seeds are real PyTorch snapshots and small hand-made pickles.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let _ = streamalloc_viz::pickle::decode(data);
    let _ = streamalloc_viz::pytorch::parse_snapshot(Path::new("fuzz.pickle"), data);
});
