//! `docs/design.md`'s module map matches the code: every Rust module of the crates is listed
//! with what it owns, and every listed module exists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const SOURCE_DIRS: &[&str] = &[
    "records/src",
    "allocator/src",
    "p2p/src",
    "src",
    "preload/src",
    "viz/src",
];

fn rust_files(dir: &Path, root: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display())) {
        let path: PathBuf = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, root, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            let relative = path.strip_prefix(root).unwrap();
            out.insert(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

#[test]
fn the_module_map_lists_every_module_and_only_those() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut modules = BTreeSet::new();
    for dir in SOURCE_DIRS {
        rust_files(&root.join(dir), root, &mut modules);
    }
    let design = std::fs::read_to_string(root.join("docs/design.md")).unwrap();
    let map = design
        .split("### Module map")
        .nth(1)
        .expect("docs/design.md has a \"### Module map\" section");
    let map = map.split("\n#").next().unwrap();
    let listed: BTreeSet<String> = map
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`'))
        .map(|(path, _)| path.to_string())
        .collect();
    let unlisted: Vec<_> = modules.difference(&listed).collect();
    let gone: Vec<_> = listed.difference(&modules).collect();
    assert!(
        unlisted.is_empty() && gone.is_empty(),
        "modules missing from the map: {unlisted:?}; listed but not in the code: {gone:?}"
    );
}

/// Sources stay short enough to read whole: a file past this many lines holds more than one
/// concept and is split along its seams (tests aside).
const MAX_SOURCE_LINES: usize = 600;

fn sources_with(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display())) {
        let path: PathBuf = entry.unwrap().path();
        if path.is_dir() {
            sources_with(&path, extensions, out);
        } else if path
            .extension()
            .is_some_and(|ext| extensions.iter().any(|e| ext == *e))
        {
            out.push(path);
        }
    }
}

#[test]
fn no_source_file_is_longer_than_the_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in SOURCE_DIRS {
        sources_with(&root.join(dir), &["rs"], &mut files);
    }
    sources_with(
        &root.join("python/streamalloc"),
        &["py", "cpp", "h"],
        &mut files,
    );
    let long: Vec<String> = files
        .iter()
        .filter(|path| path.file_name().is_some_and(|name| name != "tests.rs"))
        .filter_map(|path| {
            let lines = std::fs::read_to_string(path).ok()?.lines().count();
            (lines > MAX_SOURCE_LINES).then(|| {
                format!(
                    "{} ({lines} lines)",
                    path.strip_prefix(root).unwrap().display()
                )
            })
        })
        .collect();
    assert!(long.is_empty(), "over {MAX_SOURCE_LINES} lines: {long:?}");
}
