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
    // Planted panics are expected (the harness injects them to check poisoning); keep their
    // reports off the output.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planted = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|m| m.starts_with("injected panic in"));
        if !planted {
            default_hook(info);
        }
    }));
    corpus::replay(&corpus_dir("c_abi"), |bytes| {
        if let Err(violation) = streamalloc::ffi::testing::run_bytes(bytes) {
            panic!("{violation}");
        }
    });
}
