//! Fuzz target: bytes → the bounded gunzip every reader decompresses with
//! (`streamalloc_viz::pytorch::maybe_gunzip`, and `gunzip_within` with a small limit: it
//! must refuse exactly the streams that decompress past it), then the viewer's and the
//! replayer's readers of the result (see `fuzz/checks/readers.rs`). Any input must give a
//! value or an error: a panic, a failed check, a stack overflow, a timeout or running out
//! of memory is a crash.
//!
//! `cargo fuzz run gzip` (needs cargo-fuzz and a nightly-capable toolchain); the seeds are
//! gzip-compressed snapshots and traces, several members, truncated and bomb-like streams.
//! Stable CI replays `fuzz/corpus/gzip/` through `tests/fuzz_corpus_readers.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The json target's check shares the file.
#[allow(dead_code)]
#[path = "../checks/readers.rs"]
mod readers;

fuzz_target!(|data: &[u8]| readers::gzip(data));
