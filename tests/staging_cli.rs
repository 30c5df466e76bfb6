//! `streamalloc p2p-sim` end to end: the JSON keys, a plan every rank agrees on that carries
//! every byte within the budget, and one-line errors for bad arguments.

use std::process::Command;

fn p2p_sim(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .arg("p2p-sim")
        .args(args)
        .output()
        .expect("run streamalloc")
}

#[test]
fn json_report_has_the_documented_keys_and_a_plan_that_carries_every_byte() {
    let out = p2p_sim(&[
        "--ranks",
        "3",
        "--tensors",
        "150",
        "--budget-mib",
        "1",
        "--seed",
        "5",
        "--max-tensor-kib",
        "64",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "rounds",
        "max_ops_per_group",
        "peak_staging_bytes",
        "budget_bytes",
        "bytes_moved",
        "agreed",
        "covered",
    ] {
        assert!(v.get(key).is_some(), "missing {key}: {v}");
    }
    assert_eq!(v["agreed"], true);
    assert_eq!(v["covered"], true);
    assert_eq!(v["budget_bytes"], 1 << 20);
    assert!(v["peak_staging_bytes"].as_u64().unwrap() <= 1 << 20);
    assert!(v["peak_staging_bytes"].as_u64().unwrap() > 0);
    assert!(v["max_ops_per_group"].as_u64().unwrap() <= 2);
    assert!(v["bytes_moved"].as_u64().unwrap() > 0);
    assert!(v["rounds"].as_u64().unwrap() > 1);
}

#[test]
fn bad_arguments_are_one_line_errors() {
    for args in [
        &["--ranks", "0"][..],
        &["--ranks", "1"][..],
        &["--ranks", "257"][..],
        &["--budget-mib", "0"][..],
        &["--tensors", "100000000"][..],
    ] {
        let out = p2p_sim(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("streamalloc: ") && err.trim_end().lines().count() == 1,
            "{err}"
        );
        if args[0] == "--ranks" {
            assert!(err.contains("--ranks"), "{err}");
            assert!(out.stdout.is_empty(), "nothing reported as moved: {args:?}");
        }
    }
}
