//! Fuzz target: bytes → the JSON readers (our snapshot reader and the trace reader of
//! `streamalloc replay`) under a small memory budget, with the heap counted: what they
//! build must stay within the budget whatever the input (see `fuzz/checks/budget.rs`). A
//! panic, a failed check, a timeout or running out of memory is a crash.
//!
//! `cargo fuzz run json_budget` (needs cargo-fuzz and a nightly-capable toolchain); its
//! seeds are hand-made inputs that expand (nested lists, many keys, long strings), and the
//! `json` target's corpus suits it too. Stable CI replays both through
//! `tests/fuzz_corpus_budget.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../checks/budget.rs"]
mod budget;

#[global_allocator]
static HEAP: budget::Counting = budget::Counting;

fuzz_target!(|data: &[u8]| {
    std::env::set_var(streamalloc_viz::limits::BUDGET_ENV, budget::BUDGET);
    budget::json_budget(data)
});
