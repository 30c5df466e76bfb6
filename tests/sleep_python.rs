//! The Python API of sleep and wake without a GPU or PyTorch
//! (`benches/gpu/sleep/api_check.py`): its own checks refuse bad tags and backups with one
//! line, uninstalled use says what to do, the library's failures come back as `SleepError`
//! with the library's message, and the signal handlers of `streamalloc run
//! --sleep-signals` report failures without raising. Passes, saying why, without `python3`.

use std::path::Path;

mod cli;

#[test]
fn the_python_api_refuses_misuse_with_one_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if !cli::python3_available() {
        return;
    }
    let out = cli::python3(root.join("python"))
        .arg(root.join("benches/gpu/sleep/api_check.py"))
        .output()
        .expect("spawn python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("api_check: ok"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Signals itself as an orchestrator would, then says which handler SIGUSR1 has.
const SIGNALLED: &str = r#"
import os, signal, time
import torch
os.kill(os.getpid(), signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.05)
print(signal.getsignal(signal.SIGUSR1).__name__, signal.getsignal(signal.SIGUSR2).__name__)
"#;

#[test]
fn run_with_sleep_signals_makes_sigusr1_and_sigusr2_sleep_and_wake_the_programs_tags() {
    if !cli::python3_available() {
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sleep_signals");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("torch")).unwrap();
    std::fs::write(dir.join("torch/__init__.py"), cli::PLUGGABLE_TORCH).unwrap();
    let out = cli::streamalloc()
        .env("PYTHONPATH", &dir)
        .env("STREAMALLOC_DOOR", "pluggable")
        .args([
            "run",
            "--sleep-signals",
            "cpu",
            "--",
            "python3",
            "-c",
            SIGNALLED,
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "on_sleep on_wake");
    // No region was made: each handler says there was nothing to do, in one line.
    assert!(
        stderr.contains("streamalloc: sleep: no awake tag in this process\n")
            && stderr.contains("streamalloc: wake: no sleeping tag in this process\n"),
        "{stderr}"
    );
    let bad = cli::streamalloc()
        .args(["run", "--sleep-signals", "gpu", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("[possible values: none, cpu]"));
}
