//! A reader that stops early ends every subcommand quietly: `streamalloc <sub> ... | head -1`
//! exits 0 (as `cat` or `git log` leave `head`'s caller nothing to worry about), with no
//! panic text on stderr. Each subcommand is run twice: with stdout a pipe whose reader is
//! already gone (so the very first write fails, whatever the timing) and through a real
//! `head -1` in `bash -o pipefail`. `view` and `run` are the exceptions the tests spell
//! out: the viewer serves until stopped once its URL is printed, and the launcher's status
//! is its program's.

mod cli;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A test trace of the repository.
fn trace(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/traces")
        .join(name)
}

/// A folder of this test's own, emptied.
fn scratch(name: &str) -> PathBuf {
    cli::scratch_dir(name)
}

/// A pipe whose reading end is already closed: the first write to it fails.
fn closed_pipe() -> std::io::PipeWriter {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer
}

/// `streamalloc args` with stdout a closed pipe (and stderr too, with `stderr_closed`).
fn with_closed_stdout(args: &[&str], stderr_closed: bool) -> Output {
    let mut command = cli::streamalloc();
    command.args(args).stdout(closed_pipe());
    if stderr_closed {
        command.stderr(closed_pipe());
    } else {
        command.stderr(Stdio::piped());
    }
    command.output().unwrap()
}

/// `streamalloc args | head -1` in `bash -o pipefail`: the pipeline's output (stdout is
/// `head`'s) and its status, which is streamalloc's unless that is 0.
fn through_head(args: &[&str]) -> Output {
    let mut command = Command::new("bash");
    command
        .args(["-o", "pipefail", "-c", r#""$@" | head -1"#, "bash"])
        .arg(env!("CARGO_BIN_EXE_streamalloc"))
        .args(args)
        .env("STREAMALLOC_LIB", cli::built_library())
        .env_remove("STREAMALLOC_CONF")
        .env_remove("PYTHONPATH");
    command.output().unwrap()
}

/// Quiet: status 0, and nothing on stderr says a panic or a broken pipe.
fn assert_quiet(what: &str, out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
        "{what}: {stderr}"
    );
    assert_eq!(out.status.code(), Some(0), "{what}: {stderr}");
}

/// Both ways of losing the reader: quiet either way, and `head` gets the first line.
fn check(args: &[&str], first_line: &str) {
    assert_quiet(
        &format!("{args:?} > closed pipe"),
        &with_closed_stdout(args, false),
    );
    let out = through_head(args);
    assert_quiet(&format!("{args:?} | head -1"), &out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with(first_line), "{args:?}: {stdout}");
}

#[test]
fn demo_ends_quietly() {
    check(&["demo"], "Simulated pipeline stage");
}

#[test]
fn demo_writing_the_sample_trace_ends_quietly_and_writes_it() {
    let dir = scratch("demo");
    let sample = dir.join("sample.pickle.gz");
    let path = sample.to_str().unwrap();
    check(&["demo", "--write-trace", path], path);
    assert!(std::fs::metadata(&sample).unwrap().len() > 100_000);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn replay_ends_quietly() {
    let trace = trace("tp_allreduce_0.pickle.gz");
    check(&["replay", trace.to_str().unwrap()], "configuration: ");
    check(
        &["replay", "--json", trace.to_str().unwrap()],
        r#"{"trace":"tp_allreduce_0.pickle.gz""#,
    );
}

#[test]
fn doctor_ends_quietly() {
    check(&["doctor"], "streamalloc ");
}

#[test]
fn p2p_sim_ends_quietly() {
    check(&["p2p-sim", "--ranks", "2", "--tensors", "20"], "2 ranks");
}

#[test]
fn help_and_version_end_quietly() {
    check(&["--help"], "A CUDA caching allocator");
    check(&["replay", "--help"], "Replay allocation traces");
    check(&["--version"], "streamalloc ");
}

/// `plot` writes its picture before its figures: a closed stdout loses the figures only.
#[test]
fn plot_ends_quietly_with_its_picture_written() {
    let dir = scratch("plot");
    let svg = dir.join("replay.svg");
    let trace = trace("tp_allreduce_0.pickle.gz");
    let args = [
        "plot",
        trace.to_str().unwrap(),
        "--replay",
        "-o",
        svg.to_str().unwrap(),
    ];
    check(&args, "tp_allreduce_0.pickle.gz cuda:0");
    std::fs::remove_file(&svg).unwrap();
    // Both stdout and stderr gone: the picture is still written, and the status is 0.
    assert_quiet("plot, both closed", &with_closed_stdout(&args, true));
    assert!(svg.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `snapshot convert` reports on stderr: with both streams closed it still converts.
#[test]
fn snapshot_convert_ends_quietly_with_its_output_written() {
    let dir = scratch("convert");
    let json = dir.join("out.json");
    let trace = trace("tp_allreduce_0.pickle.gz");
    let args = [
        "snapshot",
        "convert",
        trace.to_str().unwrap(),
        json.to_str().unwrap(),
        "--to",
        "json",
    ];
    assert_quiet("convert, both closed", &with_closed_stdout(&args, true));
    assert!(json.exists());
    let out = through_head(&args);
    assert_quiet("convert | head -1", &out);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The viewer cannot tell anyone its URL: it ends, quietly. (Through `head -1` it prints
/// the URL and serves on, as it should.)
#[test]
fn view_without_a_reader_for_its_url_ends_quietly() {
    let trace = trace("tp_allreduce_0.pickle.gz");
    let out = with_closed_stdout(&["view", trace.to_str().unwrap(), "--port", "0"], false);
    assert_quiet("view > closed pipe", &out);
    let out = with_closed_stdout(
        &["view", trace.to_str().unwrap(), "--port", "0", "--replay"],
        true,
    );
    assert_quiet("view --replay, both closed", &out);
}

/// The launcher writes nothing on stdout itself: the program's output reaches `head` and
/// the launcher's status is the program's.
#[test]
fn run_passes_its_programs_output_and_status() {
    let out = through_head(&["run", "--", "printf", "one\\ntwo\\n"]);
    assert_quiet("run -- printf | head -1", &out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "one\n");
}

/// `build-torch-ext` hands its work to Python; a closed stdout changes neither its status
/// (1 here without PyTorch, 0 where it builds) nor adds a panic.
#[test]
fn build_torch_ext_status_does_not_depend_on_stdout() {
    let open = cli::streamalloc().arg("build-torch-ext").output().unwrap();
    let closed = with_closed_stdout(&["build-torch-ext"], false);
    let stderr = String::from_utf8_lossy(&closed.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(closed.status.code(), open.status.code(), "{stderr}");
}
