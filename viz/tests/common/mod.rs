//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// The shared PyTorch traces: `shared/traces` beside the checkout (CI), or beside the
/// worktree folder (developers' worktrees live one level deeper).
#[allow(dead_code)]
pub fn shared_trace(name: &str) -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let candidates = [
        root.join("../shared/traces").join(name),
        root.join("../../shared/traces").join(name),
    ];
    let found = candidates.into_iter().find(|p| p.exists());
    if found.is_none() {
        eprintln!("skipping: shared trace {name} not found beside the checkout");
    }
    found
}
