//! Replays the `json`, `gzip` and `snapshot` fuzz targets' corpora (`fuzz/corpus/json/`,
//! `fuzz/corpus/gzip/`, `fuzz/corpus/snapshot/`) through the checks the targets run
//! (`fuzz/checks/readers.rs`):
//! every input is read or refused by the snapshot and replay readers, the gzip limit
//! refuses exactly what decompresses past it, and every accepted snapshot converts to
//! each format and reads back.

use std::path::{Path, PathBuf};

#[path = "../fuzz/checks/corpus.rs"]
mod corpus;
#[path = "../fuzz/checks/readers.rs"]
mod readers;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

#[test]
fn every_json_corpus_input_is_read_or_refused() {
    corpus::replay(&corpus_dir("json"), readers::json);
}

#[test]
fn every_gzip_corpus_input_is_read_or_refused_within_the_limit() {
    corpus::replay(&corpus_dir("gzip"), readers::gzip);
}

#[test]
fn every_snapshot_corpus_input_is_read_or_refused_by_the_viewers_load_path() {
    corpus::replay(&corpus_dir("snapshot"), readers::snapshot);
}
