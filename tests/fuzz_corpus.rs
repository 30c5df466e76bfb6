//! Replays the fuzz corpus (`fuzz/corpus/engine/`) on stable Rust, so every input the
//! fuzzer kept — and every crash it once found, once fixed — is checked in each CI run.

use std::path::Path;

#[test]
fn every_corpus_input_runs_clean() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/engine");
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
        if let Err(violation) = streamalloc_allocator::testing::run_bytes(&bytes) {
            panic!("{}: {violation}", input.display());
        }
    }
}
