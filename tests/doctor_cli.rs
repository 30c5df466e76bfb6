//! `streamalloc doctor`, `--version` and `build-torch-ext` on a machine without a GPU (CI):
//! the doctor runs, says there is no GPU and exits 0; a bad configuration is its one
//! failing verdict; the command's and the Python package's versions agree (one source,
//! Cargo's workspace version); building the door without PyTorch is one line naming it.
//!
//! Tests that need `python3` print why and pass when it is absent.

use std::path::Path;
use std::process::{Command, Output};

mod cli;
use cli::streamalloc;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn has_python() -> bool {
    let found = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("python3 not found: skipped");
    }
    found
}

/// A GPU driver on this machine changes what the doctor says (and is never in CI).
fn has_gpu_driver() -> bool {
    Path::new("/dev/nvidiactl").exists()
}

#[test]
fn doctor_without_gpu_says_so_and_exits_0() {
    let out: Output = streamalloc().arg("doctor").output().unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.starts_with(&format!("streamalloc {}", env!("CARGO_PKG_VERSION"))),
        "{stdout}"
    );
    for item in ["library", "preload", "configuration", "gpu", "pytorch"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.get(6..).is_some_and(|rest| rest.starts_with(item))),
            "no `{item}` line:\n{stdout}"
        );
    }
    assert!(stdout.contains("ok    library"), "{stdout}");
    // The effective configuration names every key, defaults included.
    let doors = stdout
        .lines()
        .find(|l| l.contains("PyTorch doors:"))
        .unwrap_or_else(|| panic!("no configuration of the PyTorch doors:\n{stdout}"));
    for key in [
        "reuse_policy:stream_wait",
        "memory_limit:none",
        "memory_fraction:none",
        "max_split_size:none",
        "trace_capacity:65536",
        "event_batch:64",
        "expandable_segments:true",
        "reclaim:true",
        "graph_pools:true",
    ] {
        assert!(doors.contains(key), "no `{key}` in {doors}");
    }
    if !has_gpu_driver() {
        assert!(stdout.contains("none  gpu             no GPU"), "{stdout}");
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
}

#[test]
fn doctor_fails_on_a_bad_configuration() {
    let out = streamalloc()
        .arg("doctor")
        .env("STREAMALLOC_CONF", "memory_limit:lots")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("FAIL  configuration"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("memory_limit"), "{line}");
}

#[test]
fn versions_agree() {
    let out = streamalloc().arg("--version").output().unwrap();
    assert!(out.status.success());
    let version = concat!("streamalloc ", env!("CARGO_PKG_VERSION"));
    assert_eq!(text(&out.stdout).trim(), version);
    if !has_python() {
        return;
    }
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let out = Command::new("python3")
        .args(["-c", "import streamalloc; print(streamalloc.__version__)"])
        .env("PYTHONPATH", python)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        format!("streamalloc {}", text(&out.stdout).trim()),
        version,
        "the Python package's version is not Cargo's"
    );
}

#[test]
fn build_torch_ext_without_torch_is_one_line() {
    if !has_python() {
        return;
    }
    let torch = Command::new("python3")
        .args(["-c", "import torch"])
        .output()
        .unwrap();
    if torch.status.success() {
        eprintln!("PyTorch is installed: skipped");
        return;
    }
    let out = streamalloc()
        .args(["build-torch-ext", "--python", "python3"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("PyTorch is not importable"), "{stderr}");
}

#[test]
fn build_torch_ext_with_a_missing_python_is_one_line() {
    let out = streamalloc()
        .args(["build-torch-ext", "--python", "/nonexistent/python3"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cannot start /nonexistent/python3"),
        "{stderr}"
    );
}
