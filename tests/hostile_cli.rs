//! Hostile input to the commands that read snapshots and traces (`replay`, `plot`,
//! `view`, `snapshot convert`): each is refused with one line naming the file, exit 2,
//! quickly and within bounded memory, and never costs the user data.

mod cli;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

fn tmp(name: &str) -> PathBuf {
    cli::scratch_dir("files").join(name)
}

/// A small valid snapshot of ours, with one device of `device` holding a segment at
/// `segment_addr` and an allocation in it.
fn snapshot_json(devices: &[u32], segment_addr: u64) -> serde_json::Value {
    let device = |d: u32| {
        serde_json::json!({
            "device": d, "trace_dropped": 0,
            "segments": [{"addr": segment_addr, "size": 0, "pool": "large", "stream": 0,
                          "blocks": []}],
            "trace": [
                {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_ns": 1},
                {"action": "free_requested", "addr": 4096, "size": 512, "stream": 0, "time_ns": 2},
                {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "time_ns": 3},
            ],
        })
    };
    serde_json::json!({
        "format": "streamalloc-snapshot", "version": 1, "source": "streamalloc",
        "devices": devices.iter().map(|&d| device(d)).collect::<Vec<_>>(),
    })
}

fn write_json(name: &str, value: &serde_json::Value) -> PathBuf {
    let path = tmp(name);
    std::fs::write(&path, serde_json::to_vec(value).unwrap()).unwrap();
    path
}

fn run(args: &[&std::ffi::OsStr]) -> Output {
    cli::streamalloc().args(args).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// One line on stderr naming `what`, exit 2.
fn refused(out: &Output, what: &str) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(what), "{what} not named: {err}");
    err
}

#[test]
fn endless_devices_are_refused_at_once_by_every_reader() {
    for device in ["/dev/zero", "/dev/urandom"] {
        for command in [
            vec!["replay", device],
            vec!["plot", device, "-o", "never.svg"],
            vec!["view", device, "--port", "0"],
            vec!["snapshot", "convert", device, "never.json", "--to", "json"],
        ] {
            let started = Instant::now();
            let args: Vec<&std::ffi::OsStr> = command.iter().map(|a| a.as_ref()).collect();
            let out = run(&args);
            refused(&out, device);
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{command:?} took {:?}",
                started.elapsed()
            );
        }
    }
}

#[test]
fn a_file_past_the_size_limit_is_refused_by_every_reader() {
    let path = write_json("large.json", &snapshot_json(&[0], 0x10000));
    for command in [vec!["replay"], vec!["plot", "-o", "never.svg"]] {
        let out = cli::streamalloc()
            .args(&command)
            .arg(&path)
            .env("STREAMALLOC_MAX_DECOMPRESSED", "100")
            .output()
            .unwrap();
        let err = refused(&out, "large.json");
        assert!(err.contains("more than 100 bytes"), "{err}");
    }
}

/// The output is written beside its target and renamed over it only when whole.
#[test]
fn a_failed_conversion_leaves_the_output_as_it_was() {
    // A segment at 2^63 is within the readers' limits but not representable in a pickle.
    let input = write_json("unpicklable.json", &snapshot_json(&[0], 1 << 63));
    let output = tmp("existing.pickle");
    std::fs::write(&output, b"precious").unwrap();
    let out = run(&[
        "snapshot".as_ref(),
        "convert".as_ref(),
        input.as_os_str(),
        output.as_os_str(),
        "--to".as_ref(),
        "pickle".as_ref(),
    ]);
    let err = refused(&out, "existing.pickle");
    assert!(err.contains("segment address"), "{err}");
    assert_eq!(std::fs::read(&output).unwrap(), b"precious");
    let leftovers: Vec<_> = std::fs::read_dir(output.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("existing.pickle") && n != "existing.pickle")
        .collect();
    assert!(leftovers.is_empty(), "partial files left: {leftovers:?}");

    // With a new output name, no file appears at all.
    let fresh = tmp("fresh.pickle");
    let out = run(&[
        "snapshot".as_ref(),
        "convert".as_ref(),
        input.as_os_str(),
        fresh.as_os_str(),
        "--to".as_ref(),
        "pickle".as_ref(),
    ]);
    refused(&out, "fresh.pickle");
    assert!(!fresh.exists());
}

#[test]
fn converting_a_file_onto_itself_is_refused_under_any_name() {
    let input = write_json("self.json", &snapshot_json(&[0], 1 << 63));
    let before = std::fs::read(&input).unwrap();
    let dir = input.parent().unwrap();
    let link = tmp("self-link.json");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&input, &link).unwrap();
    let dotted: PathBuf = dir.join(".").join("self.json");
    for output in [input.clone(), dotted, link] {
        let out = run(&[
            "snapshot".as_ref(),
            "convert".as_ref(),
            input.as_os_str(),
            output.as_os_str(),
            "--to".as_ref(),
            "pickle".as_ref(),
        ]);
        let err = refused(&out, "is the input file");
        assert!(err.contains(&*output.to_string_lossy()), "{err}");
        assert_eq!(std::fs::read(&input).unwrap(), before, "input untouched");
    }
}

#[test]
fn a_device_listed_twice_is_refused_not_merged() {
    let input = write_json("twice.json", &snapshot_json(&[0, 0], 0x10000));
    let output = tmp("twice.pickle");
    let out = run(&[
        "snapshot".as_ref(),
        "convert".as_ref(),
        input.as_os_str(),
        output.as_os_str(),
        "--to".as_ref(),
        "pickle".as_ref(),
    ]);
    let err = refused(&out, "twice.json");
    assert!(err.contains("device 0 appears twice"), "{err}");
    assert!(!output.exists());
}

/// `replay` applies the limits `plot` and `convert` apply.
#[test]
fn replay_refuses_what_the_other_readers_refuse() {
    let mut big_device = snapshot_json(&[0], 0x10000);
    big_device["devices"][0]["device"] = 2000.into();
    let mut past_end = snapshot_json(&[0], 0x10000);
    past_end["devices"][0]["trace"][0]["addr"] = (1u64 << 63).into();
    let list_past_end = serde_json::json!([
        {"action": "alloc", "addr": u64::MAX - 10, "size": 512, "stream": 0, "time_ns": 0}
    ]);
    for (name, value, what) in [
        ("replay-dev.json", big_device, "device index 2000"),
        ("replay-end.json", past_end, "address limit"),
        ("replay-list-end.json", list_past_end, "address limit"),
    ] {
        let path = write_json(name, &value);
        for command in ["replay", "plot"] {
            if command == "plot" && name == "replay-list-end.json" {
                continue; // a bare list of entries is a replay format only
            }
            let mut cmd = cli::streamalloc();
            cmd.arg(command).arg(&path);
            if command == "plot" {
                cmd.args(["-o", "never.svg"]);
            }
            let out = cmd.output().unwrap();
            let err = refused(&out, name);
            assert!(err.contains(what), "{command} {name}: {err}");
        }
    }
}

#[test]
fn an_image_too_large_to_render_is_refused_before_reading() {
    let input = write_json("plot-size.json", &snapshot_json(&[0], 0x10000));
    let output = tmp("huge.png");
    let out = cli::streamalloc()
        .arg("plot")
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .args(["--width", "20000", "--height", "20000"])
        .output()
        .unwrap();
    let err = refused(&out, "pixels");
    assert!(err.contains("16000000"), "{err}");
    assert!(!output.exists());
}

#[test]
fn a_long_bad_conf_is_quoted_shortened() {
    let input = write_json("conf.json", &snapshot_json(&[0], 0x10000));
    let long = format!("reuse_policy:{}", "x".repeat(100_000));
    let out = cli::streamalloc()
        .arg("replay")
        .arg(&input)
        .arg("--conf")
        .arg(&long)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.len() < 1000, "{} bytes of error", err.len());
    assert!(err.contains("reuse_policy"), "{err}");
}

/// The page's data for each loaded file, from a running `streamalloc view`.
fn view_files(files: &[&Path]) -> (serde_json::Value, String) {
    let mut child = cli::streamalloc()
        .arg("view")
        .args(files)
        .args(["--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
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
    write!(s, "GET /api/files HTTP/1.1\r\nHost: {hostport}\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    (serde_json::from_str(body).unwrap(), err)
}

/// A memo bomb beside a good file: the bomb is reported, the good file is served.
#[test]
fn a_memory_bomb_does_not_take_the_other_files_down() {
    let good = write_json("good.json", &snapshot_json(&[0], 0x10000));
    // One trace entry referred to 8 million times through the memo: 16 MB of pickle.
    let mut bomb = vec![0x80, 4, b'}', b'('];
    bomb.extend([0x8c, 8]);
    bomb.extend(b"segments");
    bomb.push(b']');
    bomb.extend([0x8c, 13]);
    bomb.extend(b"device_traces");
    bomb.extend([b']', b'(', b']', b'(']);
    bomb.extend([b'}', 0x94, b'(', 0x8c, 6]);
    bomb.extend(b"action");
    bomb.extend([0x8c, 5]);
    bomb.extend(b"alloc");
    bomb.push(b'u');
    for _ in 0..8_000_000 {
        bomb.extend([b'h', 0]);
    }
    bomb.extend([b'e', b'e', b'u', b'.']);
    let bad = tmp("bomb.pickle.gz");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&bad).unwrap(),
        flate2::Compression::best(),
    );
    gz.write_all(&bomb).unwrap();
    gz.finish().unwrap();
    let started = Instant::now();
    let (files, err) = view_files(&[&good, &bad]);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert!(
        err.contains("bomb.pickle.gz") && err.contains("MiB in memory"),
        "{err}"
    );
    let names: Vec<&str> = files
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["good.json"]);
}
