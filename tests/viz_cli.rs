//! `streamalloc snapshot convert`, `plot` and `view` as a user runs them.

mod cli;

use std::path::PathBuf;
use std::process::Command;

/// A PyTorch trace from `tests/data/traces`; a missing one fails the test.
fn shared_trace(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/traces")
        .join(name);
    assert!(path.exists(), "test trace {} is missing", path.display());
    path
}

fn tmp(name: &str) -> PathBuf {
    cli::scratch_dir("files").join(name)
}

#[test]
fn convert_between_all_formats() {
    let input = shared_trace("tp_allreduce_0.pickle.gz");
    let json = tmp("a.json");
    let pickle = tmp("a.pickle.gz");
    let json2 = tmp("b.json");
    let perfetto = tmp("a.perfetto.json");
    for (from, to, fmt) in [
        (&input, &json, "json"),
        (&json, &pickle, "pickle"),
        (&pickle, &json2, "json"),
        (&json2, &perfetto, "perfetto"),
    ] {
        cli::convert(from, to, fmt);
    }
    // pickle -> ours -> pickle -> ours: the same JSON.
    let a: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let b: serde_json::Value = serde_json::from_slice(&std::fs::read(&json2).unwrap()).unwrap();
    assert!(a["config"].is_object(), "PyTorch's allocator_settings kept");
    assert_eq!(a, b);
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&perfetto).unwrap()).unwrap();
    assert!(!p["traceEvents"].as_array().unwrap().is_empty());
}

#[test]
fn unreadable_input_is_one_line_and_fails() {
    let bad = tmp("bad.pickle");
    std::fs::write(&bad, b"\x80\x04garbage").unwrap();
    let out = cli::streamalloc()
        .args(["snapshot", "convert"])
        .arg(&bad)
        .arg(tmp("out.json"))
        .args(["--to", "json"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("bad.pickle") && err.contains("not a readable pickle"),
        "{err}"
    );
}

#[test]
fn plot_writes_svg_and_png() {
    let input = shared_trace("tp_allreduce_0.pickle.gz");
    let svg = tmp("t.svg");
    let png = tmp("t.png");
    for out in [&svg, &png] {
        let o = cli::streamalloc()
            .arg("plot")
            .arg(&input)
            .arg("-o")
            .arg(out)
            .args(["--width", "400", "--height", "200"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.ends_with("</svg>"));
    assert!(text.matches("<rect").count() > 50, "the timeline has bands");
    assert!(text.contains("peak active"));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    // IHDR: width and height, big-endian, at bytes 16..24.
    assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 400);
    assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 200);

    let o = cli::streamalloc()
        .arg("plot")
        .arg(&input)
        .arg("-o")
        .arg(tmp("t.gif"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains(".svg or .png"));
}

/// The reference script (tests/data/trace_stats.py: plain pickle, as PyTorch's tooling
/// reads snapshots) reads a pickle we wrote and finds the same numbers as in the original
/// trace.
#[test]
fn trace_stats_reads_our_pickle_like_the_original() {
    let input = shared_trace("tp_allreduce_0.pickle.gz");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/trace_stats.py");
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipping: python3 not found");
        return;
    }
    let json = tmp("stats.json");
    let pickle = tmp("stats.pickle");
    for (from, to, fmt) in [(&input, &json, "json"), (&json, &pickle, "pickle")] {
        let o = cli::streamalloc()
            .args(["snapshot", "convert"])
            .arg(from)
            .arg(to)
            .args(["--to", fmt])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let stats = |p: &PathBuf| {
        let o = Command::new("python3")
            .arg(&script)
            .arg(p)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let line = String::from_utf8(o.stdout).unwrap();
        // Drop the file name, keep the numbers.
        line.split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (ours, theirs) = (stats(&pickle), stats(&input));
    assert!(ours.contains("allocs="), "{ours}");
    assert_eq!(ours, theirs);
}

/// `streamalloc view` prints a 127.0.0.1 URL and serves the page there.
#[test]
fn view_prints_a_loopback_url_and_serves_the_page() {
    use std::io::{BufRead, BufReader, Read, Write};
    let input = shared_trace("tp_allreduce_0.pickle.gz");
    let mut child = cli::streamalloc()
        .arg("view")
        .arg(&input)
        .args(["--port", "0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://127.0.0.1:"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_string();
    let hostport = url.trim_start_matches("http://").trim_end_matches('/');
    let mut s = std::net::TcpStream::connect(hostport).unwrap();
    write!(s, "GET / HTTP/1.1\r\nHost: {hostport}\r\n\r\n").unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("streamalloc memory viewer"));
}

#[test]
fn view_refuses_an_unreadable_file_before_serving() {
    let bad = tmp("bad-view.json");
    std::fs::write(&bad, b"{\"format\": \"nope\"}").unwrap();
    let out = cli::streamalloc().arg("view").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad-view.json"));
}

/// Hostile snapshots: a device index that would make the writers allocate one entry per
/// index up to it, and ranges ending past 2^63. Each is one line naming the file and the
/// limit, exit 2, for convert and plot alike; nothing is written.
#[test]
fn device_indices_and_sizes_past_the_limits_are_one_line_errors() {
    let good = tmp("limits-good.json");
    let out = cli::streamalloc()
        .args(["snapshot", "convert"])
        .arg(shared_trace("tp_allreduce_0.pickle.gz"))
        .arg(&good)
        .args(["--to", "json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let base: serde_json::Value = serde_json::from_slice(&std::fs::read(&good).unwrap()).unwrap();
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit); 5] = [
        ("dev-big.json", |v| {
            v["devices"][0]["device"] = 2147483648u64.into()
        }),
        ("dev-100m.json", |v| {
            v["devices"][0]["device"] = 100000000.into()
        }),
        ("seg-max.json", |v| {
            v["devices"][0]["segments"][0]["size"] = u64::MAX.into()
        }),
        ("block-max.json", |v| {
            v["devices"][0]["segments"][0]["blocks"][0]["size"] = u64::MAX.into()
        }),
        ("event-max.json", |v| {
            v["devices"][0]["trace"][0]["size"] = u64::MAX.into()
        }),
    ];
    for (name, edit) in cases {
        let mut v = base.clone();
        edit(&mut v);
        let input = tmp(name);
        std::fs::write(&input, serde_json::to_vec(&v).unwrap()).unwrap();
        let written = tmp(&format!("{name}.out"));
        for args in [
            vec!["snapshot", "convert", "--to", "pickle"],
            vec!["plot", "-o"],
        ] {
            let mut cmd = cli::streamalloc();
            cmd.args(&args);
            if args[0] == "plot" {
                cmd.arg(&written).arg(&input);
            } else {
                cmd.arg(&input).arg(&written);
            }
            let out = cmd.output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{name} {args:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{name}: {err}");
            assert!(err.contains(name) && err.contains("limit"), "{name}: {err}");
            assert!(!written.exists(), "{name}: nothing written");
        }
    }
}

/// `view` reports each unreadable file on its own line and goes on with the others; with
/// none readable it exits 2 without serving.
#[test]
fn view_reports_each_bad_file_and_fails_when_none_is_readable() {
    let a = tmp("view-bad-a.json");
    let b = tmp("view-bad-b.json");
    std::fs::write(&a, br#"{"format":"streamalloc-snapshot","version":1,"source":"x","devices":[{"device":2147483648,"segments":[],"trace":[]}]}"#).unwrap();
    std::fs::write(&b, b"not a snapshot").unwrap();
    let out = cli::streamalloc()
        .arg("view")
        .arg(&a)
        .arg(&b)
        .args(["--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.trim_end().lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].contains("view-bad-a.json") && lines[0].contains("limit"),
        "{err}"
    );
    assert!(lines[1].contains("view-bad-b.json"), "{err}");
}
