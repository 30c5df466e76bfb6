//! Replays the `c_abi` fuzz corpus (`fuzz/corpus/c_abi/`) on stable Rust: every input the
//! fuzzer kept, and every failure it once found, once fixed, runs through the hostile C
//! caller of `streamalloc::ffi::testing` in each CI run.

use std::path::Path;

#[test]
fn every_c_abi_corpus_input_runs_clean() {
    // Planted panics are expected; keep their reports off the output.
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
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/c_abi");
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    inputs.sort();
    assert!(
        inputs.len() >= 8,
        "the corpus should hold seed inputs, found {}",
        inputs.len()
    );
    for input in inputs {
        let bytes = std::fs::read(&input).unwrap();
        if let Err(violation) = streamalloc::ffi::testing::run_bytes(&bytes) {
            panic!("{}: {violation}", input.display());
        }
    }
}
