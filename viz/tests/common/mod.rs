//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// A PyTorch trace from the repository's `tests/data/traces`; a missing one fails the
/// test rather than skipping it.
#[allow(dead_code)]
pub fn shared_trace(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/traces")
        .join(name);
    assert!(path.exists(), "test trace {} is missing", path.display());
    path
}

pub mod engine;
