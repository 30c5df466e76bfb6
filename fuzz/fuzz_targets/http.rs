//! Fuzz target: bytes → the viewer's request parser (`streamalloc_viz::server::
//! parse_request`: request line, headers, the `Host` check, the size cap) under three
//! caps; its answer must agree with the cap and must not change once given when more bytes
//! arrive (see `fuzz/checks/http.rs`). A panic, a failed check or a timeout is a crash.
//!
//! `cargo fuzz run http` (needs cargo-fuzz and a nightly-capable toolchain); the seeds are
//! real browser and curl requests and hostile ones. Stable CI replays `fuzz/corpus/http/`
//! through `viz/tests/fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../checks/http.rs"]
mod http;

fuzz_target!(|data: &[u8]| http::http(data));
