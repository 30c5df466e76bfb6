//! Fuzz target: bytes → our JSON snapshot reader (`streamalloc_viz::model::parse_json`) and
//! the trace reader of `streamalloc replay` (`streamalloc::replay::traces_from_bytes`),
//! then every consumer of an accepted snapshot (see `fuzz/checks/readers.rs`). Any input
//! must give a value or an error: a panic, a failed check, a stack overflow, a timeout or
//! running out of memory is a crash.
//!
//! `cargo fuzz run json` (needs cargo-fuzz and a nightly-capable toolchain); the seeds are
//! snapshots the project writes and small hand-made ones. Stable CI replays
//! `fuzz/corpus/json/` through `tests/fuzz_corpus_readers.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The gzip target's check shares the file.
#[allow(dead_code)]
#[path = "../checks/readers.rs"]
mod readers;

fuzz_target!(|data: &[u8]| readers::json(data));
