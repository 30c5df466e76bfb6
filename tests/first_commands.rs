//! What a newcomer's first commands print, and how they fail:
//! - `demo` says what each column means, and why stream_wait's device time can be longer;
//!   `demo --write-trace` writes the sample snapshot every README example can use;
//! - `replay` keeps its columns aligned whatever the names, prints every configuration
//!   key `doctor` lists, defines its counters in `--help`, and reports a bad file before
//!   printing anything;
//! - a busy viewer port suggests `--port 0`;
//! - `streamalloc.torch.install()` without PyTorch says, in one line, `pip install torch`.

mod cli;

use std::path::{Path, PathBuf};
use std::process::Command;

fn stdout_of(args: &[&str]) -> String {
    let out = cli::streamalloc().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    cli::scratch_dir(name)
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[test]
fn demo_says_what_its_columns_mean() {
    let out = stdout_of(&["demo"]);
    for column in [
        "peak reserved",
        "peak alloc",
        "dev waits",
        "queries",
        "device ms",
        "races",
    ] {
        assert!(out.contains(column), "{column}: {out}");
        let defined = out
            .lines()
            .any(|l| l.starts_with(column) && l.len() > column.len() + 5);
        assert!(
            defined,
            "{column} is not defined on a line of its own:\n{out}"
        );
    }
    assert!(
        out.contains("cuStreamWaitEvent") && out.contains("cuEventQuery"),
        "{out}"
    );
    // The toy makes stream_wait's device time longer; the demo says why, not just how much.
    let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("longer in this toy"), "{out}");
    assert!(
        flat.contains("overlaps them by holding a new block per send"),
        "{out}"
    );
    assert!(out.lines().all(|l| l.chars().count() <= 90), "{out}");
}

#[test]
fn demo_writes_the_sample_trace() {
    let dir = scratch("sample");
    let path = dir.join("sample.pickle.gz");
    let out = stdout_of(&["demo", "--write-trace", path.to_str().unwrap()]);
    assert!(out.contains("PyTorch memory snapshot"), "{out}");
    assert!(out.contains("--replay"), "{out}");
    let written = std::fs::read(&path).unwrap();
    assert_eq!(
        written,
        std::fs::read(repo("tests/data/traces/bert_varlen.pickle.gz")).unwrap()
    );
    let replayed = stdout_of(&["replay", path.to_str().unwrap()]);
    assert!(replayed.contains("sample.pickle.gz"), "{replayed}");
    // Again: the sample is there already, fine. Over another file: refused, file kept.
    stdout_of(&["demo", "--write-trace", path.to_str().unwrap()]);
    let mine = dir.join("my_run.pickle");
    std::fs::write(&mine, b"my own snapshot").unwrap();
    let out = cli::streamalloc()
        .args(["demo", "--write-trace", mine.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("already there"), "{stderr}");
    assert_eq!(std::fs::read(&mine).unwrap(), b"my own snapshot");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The table of `replay`: its header and rows, the lines that start at column 0 after the
/// configuration line.
fn table(out: &str) -> Vec<&str> {
    out.lines()
        .skip(1)
        .filter(|l| !l.starts_with(' '))
        .collect()
}

#[test]
fn replay_columns_stay_aligned_for_long_names() {
    let dir = scratch("names");
    let long = dir.join(format!(
        "{}.pickle.gz",
        "a_rather_long_trace_name_".repeat(3)
    ));
    let short = dir.join("t.pickle.gz");
    for path in [&long, &short] {
        std::fs::copy(repo("tests/data/traces/tp_allreduce_0.pickle.gz"), path).unwrap();
    }
    let out = stdout_of(&[
        "replay",
        short.to_str().unwrap(),
        long.to_str().unwrap(),
        repo("benches/gpu/traces/gpt2_native_steps2-3.pickle.gz")
            .to_str()
            .unwrap(),
    ]);
    let rows = table(&out);
    assert_eq!(rows.len(), 4, "{out}");
    let width = rows[0].chars().count();
    for row in &rows {
        assert_eq!(row.chars().count(), width, "not aligned:\n{out}");
    }
    assert!(rows[0].starts_with("trace "));
    assert!(rows[2].starts_with(long.file_name().unwrap().to_str().unwrap()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn replay_prints_every_configuration_key_doctor_lists() {
    let doctor = stdout_of(&["doctor"]);
    let doors = doctor
        .lines()
        .find_map(|l| l.trim().strip_prefix("PyTorch doors: "))
        .unwrap_or_else(|| panic!("{doctor}"));
    let trace = repo("tests/data/traces/tp_allreduce_0.pickle.gz");
    let out = stdout_of(&["replay", trace.to_str().unwrap()]);
    let first = out.lines().next().unwrap();
    assert_eq!(first, format!("configuration: {doors}"));
    let keys = |text: &str| -> Vec<String> {
        text.split(',')
            .map(|kv| kv.split(':').next().unwrap().to_string())
            .collect()
    };
    assert_eq!(keys(doors).len(), 12, "{doors}");
    assert!(keys(doors).contains(&"stitch".to_string()));
    assert!(keys(doors).contains(&"trace_clock".to_string()));
    assert!(keys(doors).contains(&"reclaim".to_string()));
}

#[test]
fn replay_help_defines_every_column_and_counter() {
    let help = stdout_of(&["replay", "--help"]);
    for term in [
        "allocs",
        "peak live",
        "ours",
        "native",
        "ours/live",
        "native/live",
        "ns/op",
        "page maps",
        "device syncs",
        "segment allocs/frees",
        "stitched ranges made",
        "reused",
        "last of N steps",
    ] {
        let defined = help
            .lines()
            .any(|l| l.trim_start().starts_with(term) && l.len() > term.len() + 8);
        assert!(defined, "{term} is not defined:\n{help}");
    }
    // The counters the rows print are the words the help defines.
    let trace = repo("tests/data/traces/gpt2.pickle.gz");
    let out = stdout_of(&["replay", trace.to_str().unwrap()]);
    assert!(
        out.contains("stitched ranges made") && out.contains(" reused"),
        "{out}"
    );
}

#[test]
fn replay_reports_a_bad_file_before_printing_anything() {
    let trace = repo("tests/data/traces/tp_allreduce_0.pickle.gz");
    // stdout and stderr in one pipe, in the order they were written.
    let out = Command::new("bash")
        .args(["-c", r#""$@" 2>&1"#, "bash"])
        .arg(env!("CARGO_BIN_EXE_streamalloc"))
        .args(["replay", trace.to_str().unwrap(), "/no/such/trace.pickle"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{text}");
    let first = text.lines().next().unwrap();
    assert!(
        first.starts_with("streamalloc replay: /no/such/trace.pickle"),
        "{text}"
    );
    assert!(
        text.contains("tp_allreduce_0.pickle.gz"),
        "the good one still ran"
    );
    // Only bad files: nothing at all on stdout.
    let out = cli::streamalloc()
        .args(["replay", "/no/such/trace.pickle"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_busy_viewer_port_suggests_port_0() {
    let busy = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let trace = repo("tests/data/traces/tp_allreduce_0.pickle.gz");
    let out = cli::streamalloc()
        .args(["view", trace.to_str().unwrap(), "--port", &port])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{port}")) && stderr.contains("--port 0"),
        "{stderr}"
    );
}

/// Run only where the `python3` on PATH has no PyTorch (CI's does not).
#[test]
fn installing_without_pytorch_names_pip_install_torch() {
    let python = Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; print(u.find_spec('torch') is None)",
        ])
        .output();
    let Ok(python) = python else {
        eprintln!("skipped: no python3");
        return;
    };
    if String::from_utf8_lossy(&python.stdout).trim() != "True" {
        eprintln!("skipped: this python3 has PyTorch");
        return;
    }
    let script = "import streamalloc.torch as t\n\
                  try:\n    t.install()\n\
                  except ImportError as err:\n    print(type(err).__name__, str(err), sep='|')\n";
    let out = Command::new("python3")
        .args(["-c", script])
        .env("PYTHONPATH", repo("python"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (kind, message) = stdout.trim_end().split_once('|').unwrap();
    assert_eq!(kind, "TorchNotFound");
    assert!(!message.contains('\n'), "{message}");
    assert!(message.ends_with("pip install torch"), "{message}");
    // Uncaught, the traceback ends with that line and shows no ModuleNotFoundError.
    let out = Command::new("python3")
        .args(["-c", "import streamalloc.torch as t; t.install()"])
        .env("PYTHONPATH", repo("python"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!stderr.contains("ModuleNotFoundError"), "{stderr}");
    assert!(
        stderr
            .trim_end()
            .lines()
            .last()
            .unwrap()
            .ends_with(": pip install torch"),
        "{stderr}"
    );
}
