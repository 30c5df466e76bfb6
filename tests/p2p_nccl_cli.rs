//! `streamalloc p2p-nccl` without a GPU (CI): a clean `SKIP` (or, on a machine with GPUs
//! and NCCL, an intact run), one-line errors for bad arguments, and a worker whose rank 0
//! never shows up failing with a timeout, quickly, instead of hanging.

use std::process::Command;
use std::time::{Duration, Instant};

fn p2p_nccl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .arg("p2p-nccl")
        .args(args)
        .output()
        .expect("run streamalloc")
}

#[test]
fn skips_cleanly_or_delivers_intact() {
    let out = p2p_nccl(&[
        "--ranks",
        "2",
        "--tensors",
        "50",
        "--budget-mib",
        "1",
        "--max-tensor-kib",
        "64",
        "--timeout-s",
        "30",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if let Some(why) = stdout.strip_prefix("SKIP: ") {
        assert!(out.status.success(), "SKIP must exit 0: {stderr}");
        assert!(!why.trim().is_empty());
        assert_eq!(stdout.lines().count(), 1, "{stdout}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    } else if stderr.contains("needs 2 GPUs") {
        // One GPU only: a one-line error.
        assert_eq!(out.status.code(), Some(2));
    } else {
        assert!(out.status.success(), "{stdout}\n{stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["intact"], true, "{v}");
        assert_eq!(v["transport"], "nccl", "{v}");
        assert!(v["peak_staging_bytes"].as_u64().unwrap() <= 1 << 20, "{v}");
    }
}

#[test]
fn bad_arguments_are_one_line_errors() {
    for args in [
        &["--ranks", "0"][..],
        &["--budget-mib", "0"][..],
        &["--timeout-s", "0"][..],
        &["--ranks", "2", "--mismatch-rank", "2"][..],
        &["--ranks", "1", "--mismatch-rank", "0"][..],
        &["--ranks", "2", "--absent-rank", "3"][..],
        &["--worker-rank", "0"][..],
        &[
            "--ranks",
            "2",
            "--worker-rank",
            "5",
            "--id-file",
            "/nonexistent",
        ][..],
    ] {
        let out = p2p_nccl(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("streamalloc: "), "{args:?}: {stderr}");
    }
}

#[test]
fn a_worker_whose_rank_0_never_writes_the_id_times_out() {
    let dir = std::env::temp_dir().join(format!("streamalloc-p2p-nccl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let id = dir.join("never-written");
    let start = Instant::now();
    let out = p2p_nccl(&[
        "--ranks",
        "2",
        "--tensors",
        "10",
        "--timeout-s",
        "0.3",
        "--worker-rank",
        "1",
        "--id-file",
        id.to_str().unwrap(),
    ]);
    let waited = start.elapsed();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(waited < Duration::from_secs(20), "{waited:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["rank"], 1);
    let error = v["error"].as_str().unwrap();
    assert!(
        error.contains("timed out") && error.contains("waiting for rank 0"),
        "{error}"
    );
}
