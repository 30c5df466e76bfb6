//! Replays the engine's and the C ABI's fuzz corpora (`fuzz/corpus/engine/`,
//! `fuzz/corpus/c_abi/`) on stable Rust, so every input the fuzzer kept (and every crash it
//! once found, once fixed) is checked in each CI run, through the same harness the fuzz
//! targets run.

use std::path::{Path, PathBuf};

#[path = "../fuzz/checks/corpus.rs"]
mod corpus;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

#[test]
fn every_engine_corpus_input_keeps_the_invariants() {
    corpus::replay(&corpus_dir("engine"), |bytes| {
        if let Err(violation) = streamalloc_allocator::testing::run_bytes(bytes) {
            panic!("{violation}");
        }
    });
}

#[test]
fn every_c_abi_corpus_input_runs_clean() {
    // Panics planted to check poisoning are expected: keep their reports off the output.
    streamalloc::ffi::testing::pass_planted_panics();
    corpus::replay(&corpus_dir("c_abi"), |bytes| {
        if let Err(violation) = streamalloc::ffi::testing::run_bytes(bytes) {
            panic!("{violation}");
        }
    });
}
