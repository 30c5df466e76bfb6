//! Fuzz target: bytes → the allocator's configuration parser (`Config::parse_over` over
//! two bases, `parse_bytes`); a parsed configuration must write back (`to_conf_string`) as
//! text that parses to it, and byte counts must be exact or refused (see
//! `fuzz/checks/config.rs`). A panic, an arithmetic overflow or a failed check is a crash.
//!
//! `cargo fuzz run config` (needs cargo-fuzz and a nightly-capable toolchain); the seeds
//! are configuration strings from the documentation. Stable CI replays
//! `fuzz/corpus/config/` through `allocator/tests/fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../checks/config.rs"]
mod config;

fuzz_target!(|data: &[u8]| config::config(data));
