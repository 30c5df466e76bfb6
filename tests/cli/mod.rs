//! The `streamalloc` command as the CLI tests run it: with the library this test run built
//! and none of the caller's streamalloc, Python or launcher settings. Each test file uses
//! the part it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The `libstreamalloc.so` this test run built. `cargo build` puts it next to the launcher,
/// where the launcher looks; `cargo test` alone leaves it in `deps/` (and a copy up there
/// from an earlier build may be stale): the newer of the two.
pub fn built_library() -> PathBuf {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_streamalloc"))
        .parent()
        .unwrap();
    [
        bin_dir.join("libstreamalloc.so"),
        bin_dir.join("deps/libstreamalloc.so"),
    ]
    .into_iter()
    .filter_map(|path| Some((path.metadata().ok()?.modified().ok()?, path)))
    .max()
    .map(|(_, path)| path)
    .expect("libstreamalloc.so is built beside the test")
}

/// `streamalloc` with the built library and a clean environment.
pub fn streamalloc() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_streamalloc"));
    command.env("STREAMALLOC_LIB", built_library());
    for name in [
        "STREAMALLOC_CONF",
        "STREAMALLOC_PYTHON",
        "STREAMALLOC_PYTHON_EXE",
        "STREAMALLOC_SNAPSHOT",
        "STREAMALLOC_STATS_AT_EXIT",
        "PYTHONPATH",
        "RANK",
        "LOCAL_RANK",
    ] {
        command.env_remove(name);
    }
    command
}

/// `streamalloc snapshot convert input output --to format`, which must succeed.
pub fn convert(input: &Path, output: &Path, format: &str) {
    let out = streamalloc()
        .args(["snapshot", "convert"])
        .args([input, output])
        .args(["--to", format])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A directory of this test process's own, `name` inside a root made by `mkdtemp`: nothing
/// a former run left (CI machines reuse `/tmp`, and pids) is ever found in it. Kept after
/// the run, to look at a failure.
pub fn scratch_dir(name: &str) -> PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    let root = ROOT.get_or_init(|| {
        tempfile::Builder::new()
            .prefix("streamalloc-test-")
            .tempdir()
            .expect("a temporary directory")
            .keep()
    });
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A stand-in `torch` package with what `streamalloc.torch.install(door="pluggable")`
/// touches, for Python tests without PyTorch; a test appends what else it needs.
pub const PLUGGABLE_TORCH: &str = r#"
import types
__version__ = "0.0-fake"
cuda = types.ModuleType("torch.cuda")
cuda.is_initialized = lambda: False
memory = types.ModuleType("torch.cuda.memory")
class _Raw:
    def set_record_stream_fn(self, p): pass
    def set_reset_fn(self, p): pass
    def set_memory_fraction_fn(self, p): pass
class CUDAPluggableAllocator:
    def __init__(self, path, malloc, free): self._raw = _Raw()
    def allocator(self): return self._raw
memory.CUDAPluggableAllocator = CUDAPluggableAllocator
memory.change_current_allocator = lambda a: None
cuda.memory = memory
"#;

/// `python3` importing from `pythonpath` (the checkout's `python/` first), loading the
/// built library, with no configuration from the environment.
pub fn python3(pythonpath: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut command = Command::new("python3");
    command
        .env("PYTHONPATH", pythonpath)
        .env("STREAMALLOC_LIB", built_library())
        .env_remove("STREAMALLOC_CONF");
    command
}

/// True if `python3` runs; the Python tests pass, saying why, without it.
pub fn python3_available() -> bool {
    let ran = Command::new("python3").arg("-c").arg("pass").output();
    let available = ran.is_ok_and(|out| out.status.success());
    if !available {
        eprintln!("skipped: python3 is not available");
    }
    available
}
