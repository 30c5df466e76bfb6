//! The one rule for every file the commands write (`snapshot convert`, `plot`,
//! `streamalloc_dump_snapshot`, `run --snapshot`): regular files only, written beside and
//! renamed, anything else refused in one line with status 2 and left as it was, and never
//! the input.

mod cli;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Output;

/// Each test's own directory: the tests run at once, and one test's files written beside
/// and renamed must not be counted as another's leftovers.
fn dir(test: &str) -> PathBuf {
    cli::scratch_dir(&format!("files-{test}"))
}

/// A small valid snapshot of ours in `dir`.
fn snapshot(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let value = serde_json::json!({
        "format": "streamalloc-snapshot", "version": 1, "source": "streamalloc",
        "devices": [{"device": 0, "segments": [], "trace": [
            {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_ns": 1},
            {"action": "free_requested", "addr": 4096, "size": 512, "stream": 0, "time_ns": 2},
            {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "time_ns": 3},
        ]}],
    });
    std::fs::write(&path, serde_json::to_vec(&value).unwrap()).unwrap();
    path
}

fn convert(input: &Path, output: &Path) -> Output {
    cli::streamalloc()
        .args(["snapshot", "convert"])
        .args([input, output])
        .args(["--to", "json"])
        .output()
        .unwrap()
}

fn plot(input: &Path, output: &Path) -> Output {
    cli::streamalloc()
        .arg("plot")
        .arg(input)
        .arg("-o")
        .arg(output)
        .output()
        .unwrap()
}

/// One line on stderr naming `what`, exit 2.
fn refused(out: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(what), "{what} not named: {err}");
    err
}

/// What a path is, without following a link.
fn kind(path: &Path) -> String {
    let meta = std::fs::symlink_metadata(path).unwrap();
    let t = meta.file_type();
    if t.is_symlink() {
        format!("link to {}", std::fs::read_link(path).unwrap().display())
    } else if t.is_fifo() {
        "fifo".into()
    } else if t.is_dir() {
        "dir".into()
    } else if t.is_socket() {
        "socket".into()
    } else {
        "file".into()
    }
}

#[test]
fn outputs_that_are_not_regular_files_are_refused_and_left_as_they_were() {
    let d = dir("refused");
    let input = snapshot(&d, "in.json");
    let fifo = d.join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let to_null = d.join("to-null");
    std::os::unix::fs::symlink("/dev/null", &to_null).unwrap();
    let to_fifo = d.join("to-fifo");
    std::os::unix::fs::symlink(&fifo, &to_fifo).unwrap();
    let dangling = d.join("dangling");
    std::os::unix::fs::symlink(d.join("nothing-here"), &dangling).unwrap();
    let socket = d.join("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let directory = d.join("a-directory");
    std::fs::create_dir_all(&directory).unwrap();
    for (target, what) in [
        (&fifo, "is a FIFO"),
        (&to_null, "is a link to a character device"),
        (&to_fifo, "is a link to a FIFO"),
        (&dangling, "is a link to nothing"),
        (&socket, "is a socket"),
        (&directory, "is a directory"),
    ] {
        let before = kind(target);
        for out in [convert(&input, target), plot(&input, target)] {
            let err = refused(&out, &target.display().to_string());
            assert!(
                err.contains(what) && err.contains("regular files only"),
                "{err}"
            );
        }
        assert_eq!(kind(target), before, "{} changed", target.display());
    }
    // Nothing was left beside them.
    let partial: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial"))
        .collect();
    assert!(partial.is_empty(), "{partial:?}");
}

/// A link to a regular file is written through: the file it names is replaced, the link
/// stays; a file replaced keeps its permissions.
#[test]
fn a_link_to_a_regular_file_is_written_through_and_permissions_are_kept() {
    let d = dir("through");
    let input = snapshot(&d, "in2.json");
    let real = d.join("real.json");
    std::fs::write(&real, b"old").unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = d.join("link.json");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let out = convert(&input, &link);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(kind(&link), format!("link to {}", real.display()));
    let written = std::fs::read_to_string(&real).unwrap();
    assert!(written.contains("streamalloc-snapshot"), "{written}");
    let mode = std::fs::metadata(&real).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

/// `plot IN -o IN`, under any name, is refused before anything is read; the input stays.
#[test]
fn plotting_a_file_onto_itself_is_refused() {
    let d = dir("itself");
    let input = snapshot(&d, "s.svg");
    let original = std::fs::read(&input).unwrap();
    let hard = d.join("hard.svg");
    let _ = std::fs::remove_file(&hard);
    std::fs::hard_link(&input, &hard).unwrap();
    for output in [input.clone(), hard.clone(), d.join(".").join("s.svg")] {
        let out = plot(&input, &output);
        let err = refused(&out, "is the input file");
        assert!(err.contains("choose another output name"), "{err}");
    }
    assert_eq!(std::fs::read(&input).unwrap(), original);
}
