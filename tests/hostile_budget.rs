//! One memory budget for every input and everything built from it: bytes built per input
//! byte, counted through reading (JSON included), the timeline, the viewer's data, plots
//! and written files. A command over budget stops with one line and status 2, never an
//! abort, also when the process's address space is limited below the budget. `--replay`'s
//! replay is such a stage too.

mod cli;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

fn tmp(name: &str) -> PathBuf {
    cli::scratch_dir("files").join(name)
}

/// One line on stderr naming `what`, exit 2.
fn refused(out: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(what), "{what} not named: {err}");
    err
}

/// Our JSON snapshot whose free-form `config` is `[[0],[0],…]` (`n` of them): four bytes of
/// input, a hundred-odd bytes of JSON values each.
fn config_bomb(name: &str, n: usize) -> PathBuf {
    let path = tmp(name);
    let mut text = String::from(
        r#"{"format":"streamalloc-snapshot","version":1,"source":"x","devices":[],"config":["#,
    );
    text.push_str(&"[0],".repeat(n - 1));
    text.push_str("[0]]}");
    if name.ends_with(".gz") {
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).unwrap(),
            flate2::Compression::best(),
        );
        gz.write_all(text.as_bytes()).unwrap();
        gz.finish().unwrap();
    } else {
        std::fs::write(&path, text).unwrap();
    }
    path
}

/// Runs `streamalloc args...`.
fn run(args: &[&std::ffi::OsStr]) -> Output {
    cli::streamalloc().args(args).output().unwrap()
}

/// `streamalloc view FILE`: the line it printed, or its one-line refusal.
fn view(file: &Path) -> Output {
    let mut child = cli::streamalloc()
        .arg("view")
        .arg(file)
        .args(["--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    if line.contains("http://") {
        let _ = child.kill();
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_json_file_that_expands_is_refused_by_every_reader() {
    // 8 MB of JSON, 60 KB gzipped: about 400 MB of JSON values.
    for name in ["bomb.json", "bomb.json.gz"] {
        let bomb = config_bomb(name, 2_000_000);
        let out = tmp("never.out");
        for command in [
            vec!["replay".as_ref(), bomb.as_os_str()],
            vec![
                "plot".as_ref(),
                bomb.as_os_str(),
                "-o".as_ref(),
                out.as_os_str(),
            ],
            vec![
                "snapshot".as_ref(),
                "convert".as_ref(),
                bomb.as_os_str(),
                out.as_os_str(),
                "--to".as_ref(),
                "json".as_ref(),
            ],
        ] {
            let err = refused(&run(&command), name);
            assert!(
                err.contains("reading the JSON would build more than"),
                "{err}"
            );
        }
        let err = refused(&view(&bomb), name);
        assert!(
            err.contains("reading the JSON would build more than"),
            "{err}"
        );
        assert!(!out.exists());
    }
}

/// A pickle of one trace entry referred to `n` times through the memo (`LONG_BINGET`, five
/// bytes each): each reference becomes a 64-byte event, within the reader's budget for a
/// million of them, but the timeline, the viewer's data and the written files of a million
/// events do not fit what is left.
fn shared_entry_pickle(n: usize) -> PathBuf {
    let mut p = vec![0x80, 4, b'}', b'(', 0x8c, 8];
    p.extend(b"segments");
    p.push(b']');
    p.extend([0x8c, 13]);
    p.extend(b"device_traces");
    p.extend([b']', b'(', b']', b'(']);
    p.extend([b'}', 0x94, b'(', 0x8c, 6]);
    p.extend(b"action");
    p.extend([0x8c, 5]);
    p.extend(b"alloc");
    p.extend([b'u', b'0']);
    for _ in 0..n {
        p.push(b'j');
        p.extend(0u32.to_le_bytes());
    }
    p.extend([b'e', b'e', b'u', b'.']);
    let path = tmp("shared-entry.pickle");
    std::fs::write(&path, p).unwrap();
    path
}

#[test]
fn stages_after_the_reader_are_held_to_what_is_left_of_the_budget() {
    let input = shared_entry_pickle(1_000_000);
    let out = tmp("stage.out");
    let err = refused(&view(&input), "shared-entry.pickle");
    assert!(
        err.contains("building the timeline would build more than"),
        "{err}"
    );
    let plot = run(&[
        "plot".as_ref(),
        input.as_os_str(),
        "-o".as_ref(),
        tmp("p.svg").as_os_str(),
    ]);
    let err = refused(&plot, "shared-entry.pickle");
    assert!(err.contains("building the timeline"), "{err}");
    for (format, stage) in [
        ("perfetto", "building the timeline"),
        ("json", "writing the output"),
    ] {
        let convert = run(&[
            "snapshot".as_ref(),
            "convert".as_ref(),
            input.as_os_str(),
            out.as_os_str(),
            "--to".as_ref(),
            format.as_ref(),
        ]);
        let err = refused(&convert, "shared-entry.pickle");
        assert!(err.contains(stage), "{format}: {err}");
        assert!(!out.exists(), "{format}: a partial output was left");
    }
}

/// Under an address-space limit below the budget, the budget shrinks to what the limit
/// leaves: the command stops with its one line and status 2 instead of aborting when an
/// allocation fails; a file that fits still opens.
#[test]
fn under_an_address_space_limit_running_short_is_one_line_not_an_abort() {
    let bomb = config_bomb("limited.json", 16_000_000);
    let small = tmp("small.json");
    std::fs::write(
        &small,
        r#"{"format":"streamalloc-snapshot","version":1,"source":"x","devices":[{"device":0,
        "segments":[],"trace":[{"action":"alloc","addr":4096,"size":512,"stream":0,"time_ns":1}]}]}"#,
    )
    .unwrap();
    let limited = |file: &Path, image: &str| {
        let mut command = cli::streamalloc();
        command.arg("plot").arg(file).arg("-o").arg(tmp(image));
        // SAFETY: setrlimit is async-signal-safe and touches only the child's own limits;
        // the closure allocates nothing.
        unsafe {
            command.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: 400 << 20,
                    rlim_max: libc::RLIM_INFINITY,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command.output().unwrap()
    };
    let err = refused(&limited(&bomb, "limited.svg"), "limited.json");
    assert!(err.contains("address-space limit"), "{err}");
    let out = limited(&small, "small.svg");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--replay` replays the snapshot's allocations through the engine, whose records grow
/// with the blocks live at once and the pages reserved: a stage like the others, charged
/// to the file's budget. 200 allocations of 1 GiB are a file of a few kilobytes whose
/// replay maps 100,000 pages: under a budget the plot alone fits, `plot --replay` and
/// `view --replay` stop in one line naming the replay, before printing any figure or
/// writing the image; under a larger one the replay runs.
#[test]
fn the_replay_of_view_and_plot_is_held_to_the_files_budget() {
    let big = tmp("big-blocks.json");
    let trace: Vec<String> = (0..200u64)
        .map(|i| {
            format!(
                r#"{{"action":"alloc","addr":{},"size":{},"stream":0,"time_ns":{i}}}"#,
                (i + 1) << 31,
                1u64 << 30
            )
        })
        .collect();
    std::fs::write(
        &big,
        format!(
            r#"{{"format":"streamalloc-snapshot","version":1,"source":"x","devices":[{{"device":0,"segments":[],"trace":[{}]}}]}}"#,
            trace.join(",")
        ),
    )
    .unwrap();
    let image = tmp("big-blocks.svg");
    let with_budget = |budget: &str, args: &[&std::ffi::OsStr]| {
        cli::streamalloc()
            .args(args)
            .env("STREAMALLOC_MAX_BUILT", budget)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let plot: [&std::ffi::OsStr; 4] = [
        "plot".as_ref(),
        big.as_os_str(),
        "-o".as_ref(),
        image.as_os_str(),
    ];
    let alone = with_budget("16M", &plot);
    assert!(
        alone.status.success(),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
    std::fs::remove_file(&image).unwrap();
    let replay = [&plot[..], &["--replay".as_ref()]].concat();
    let out = with_budget("16M", &replay);
    let err = refused(&out, "big-blocks.json");
    assert!(
        err.contains("replaying the trace would build more than 16 MiB"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "figures printed before the refusal");
    assert!(!image.exists(), "the image was written");
    let view = with_budget(
        "16M",
        &[
            "view".as_ref(),
            big.as_os_str(),
            "--port".as_ref(),
            "0".as_ref(),
            "--replay".as_ref(),
        ],
    );
    let err = refused(&view, "big-blocks.json");
    assert!(err.contains("replaying the trace"), "{err}");
    assert!(view.stdout.is_empty(), "{:?}", view.stdout);
    let fits = with_budget("64M", &replay);
    assert!(
        fits.status.success(),
        "{}",
        String::from_utf8_lossy(&fits.stderr)
    );
    assert!(image.exists());
}
