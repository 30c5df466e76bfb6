//! Fuzz target: bytes → the viewer's load path for any snapshot file
//! (`streamalloc_viz::files::from_bytes`: bounded gunzip, sniffing, the PyTorch reader that
//! reads straight from the pickle decoder's arena with interned stacks, our JSON with its
//! interned stacks), then every consumer of an accepted snapshot (see
//! `fuzz/checks/readers.rs`). Any input must give a value or an error: a panic, a failed
//! check, a stack overflow, a timeout or running out of memory is a crash.
//!
//! `cargo fuzz run snapshot fuzz/corpus/snapshot`; stable CI replays the corpus through
//! `tests/fuzz_corpus_readers.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../checks/readers.rs"]
mod readers;

fuzz_target!(|data: &[u8]| readers::snapshot(data));
