//! Replays a fuzz target's corpus on stable Rust, so every input the fuzzer kept (and
//! every crash it once found, once fixed) is checked in each `cargo test`. The tests that
//! include this file pass each input to the check its fuzz target runs.

use std::path::Path;

/// Fewer inputs than this means the corpus is missing its seeds.
const MIN_INPUTS: usize = 8;

/// Runs `check` on every file in `dir`; fails naming each input whose check panicked, or
/// when `dir` is missing or holds fewer than [`MIN_INPUTS`] files.
pub fn replay(dir: &Path, check: fn(&[u8])) {
    let mut inputs: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    inputs.sort();
    assert!(
        inputs.len() >= MIN_INPUTS,
        "{} should hold the seed inputs, found {}",
        dir.display(),
        inputs.len()
    );
    let failed: Vec<String> = inputs
        .iter()
        .filter(|input| {
            let bytes = std::fs::read(input).unwrap();
            std::panic::catch_unwind(|| check(&bytes)).is_err()
        })
        .map(|input| input.display().to_string())
        .collect();
    assert!(failed.is_empty(), "failed on {failed:#?}");
}
