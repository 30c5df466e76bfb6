//! The README's commands, run as a newcomer types them.
//!
//! Every fenced block of `README.md` says what it needs in its info string: `sh` runs
//! without a GPU, `sh gpu` needs one, `sh build` builds or installs from a checkout (what
//! `.ci/run` does itself). This test runs every line of every `sh` block with `bash`, in an
//! empty folder outside the checkout (so no example may lean on the checkout's files), with
//! this build's `streamalloc` first on `PATH`. Each command must exit 0. A command whose
//! comment says it serves `until Ctrl-C` must print its URL and answer a request there; it
//! is then stopped.
//!
//! With `STREAMALLOC_README_INSTALLED=DIR` (a folder holding an installed `streamalloc`,
//! such as a virtual environment's `bin`), the commands run with that `streamalloc` first
//! on `PATH` and nothing of this build: `.ci/run` checks the wheel this way.
//!
//! A shell block with any other info string fails the test, so a new block must say which
//! kind it is.

mod cli;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a fenced block of the README needs, from its info string.
#[derive(Debug, PartialEq)]
enum Needs {
    /// `sh`: nothing but the checkout and `streamalloc`; this test runs it.
    Nothing,
    /// `sh gpu`: a CUDA GPU (and, for most, PyTorch).
    Gpu,
    /// `sh build`: a Rust toolchain or pip, from a checkout.
    Build,
    /// Not a shell block (`python`, `text`, ...).
    NotShell,
}

fn needs(info: &str) -> Result<Needs, String> {
    let mut words = info.split_whitespace();
    let language = words.next().unwrap_or("");
    if !["sh", "bash", "shell", "console"].contains(&language) {
        return Ok(Needs::NotShell);
    }
    match (language, words.next(), words.next()) {
        ("sh", None, None) => Ok(Needs::Nothing),
        ("sh", Some("gpu"), None) => Ok(Needs::Gpu),
        ("sh", Some("build"), None) => Ok(Needs::Build),
        _ => Err(format!(
            "README block ```{info}: a shell block is `sh`, `sh gpu` or `sh build`"
        )),
    }
}

/// The README's fenced blocks: (info string, body lines).
fn blocks(readme: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut open: Option<(String, Vec<String>)> = None;
    for line in readme.lines() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => open = Some((info.trim().to_string(), Vec::new())),
            (Some(_), Some(_)) => out.push(open.take().unwrap()),
            (Some((_, body)), None) => body.push(line.to_string()),
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "README.md has an unclosed ``` block");
    out
}

/// The commands of a block: lines joined at trailing backslashes, blank and comment-only
/// lines dropped.
fn commands(body: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in body {
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        pending.push_str(line);
        let command = std::mem::take(&mut pending);
        let trimmed = command.trim();
        if !trimmed.is_empty() && !trimmed.starts_with('#') {
            out.push(trimmed.to_string());
        }
    }
    out
}

/// An empty folder of this test's own, outside the checkout.
fn empty_folder() -> PathBuf {
    cli::scratch_dir("readme")
}

/// The folder of an installed `streamalloc` to run the commands with, if one was named.
fn installed() -> Option<PathBuf> {
    std::env::var_os("STREAMALLOC_README_INSTALLED").map(PathBuf::from)
}

fn shell(command: &str, dir: &Path) -> Command {
    let bin_dir = match installed() {
        Some(dir) => dir,
        None => Path::new(env!("CARGO_BIN_EXE_streamalloc"))
            .parent()
            .unwrap()
            .to_path_buf(),
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin_dir];
    paths.extend(std::env::split_paths(&path));
    let mut shell = Command::new("bash");
    shell
        .args(["-euo", "pipefail", "-c", command])
        .current_dir(dir)
        .env("PATH", std::env::join_paths(paths).unwrap());
    for name in [
        "STREAMALLOC_CONF",
        "STREAMALLOC_SNAPSHOT",
        "STREAMALLOC_STATS_AT_EXIT",
        "STREAMALLOC_LIB",
        "STREAMALLOC_PRELOAD_LIB",
        "STREAMALLOC_PYTHON",
        "PYTHONPATH",
    ] {
        shell.env_remove(name);
    }
    if installed().is_none() {
        shell.env("STREAMALLOC_LIB", cli::built_library());
    }
    shell
}

/// Runs `command` to its end; it must succeed.
fn run_to_end(command: &str, dir: &Path) {
    let out = shell(command, dir).output().unwrap();
    assert!(
        out.status.success(),
        "README command failed ({}): {command}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts a server `command`, which must print its URL and answer `GET /` there.
fn run_server(command: &str, dir: &Path) {
    let mut child = shell(&format!("exec {command}"), dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut url = None;
    let mut printed = String::new();
    while url.is_none() && Instant::now() < deadline {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap() == 0 {
            break;
        }
        printed.push_str(&line);
        url = line
            .split_whitespace()
            .find(|word| word.starts_with("http://"))
            .map(str::to_string);
    }
    let answer = url.as_deref().map(get_root);
    let _ = child.kill();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
    let url = url.unwrap_or_else(|| {
        panic!("README command printed no URL ({status}): {command}\n{printed}\n{stderr}")
    });
    let answer = answer.unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "{url} answered {answer:?}: {command}\n{stderr}"
    );
}

/// The status line a `GET /` to `url` (`http://host:port/`) is answered with.
fn get_root(url: &str) -> String {
    let host = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let mut stream = TcpStream::connect(&host).unwrap_or_else(|err| panic!("{url}: {err}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut status = String::new();
    BufReader::new(stream).read_line(&mut status).unwrap();
    status.trim_end().to_string()
}

#[test]
fn every_readme_command_that_needs_no_gpu_runs_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let dir = empty_folder();
    let mut ran = 0;
    for (info, body) in blocks(&readme) {
        if needs(&info).unwrap_or_else(|err| panic!("{err}")) != Needs::Nothing {
            continue;
        }
        for command in commands(&body) {
            if command.contains("until Ctrl-C") {
                run_server(&command, &dir);
            } else {
                run_to_end(&command, &dir);
            }
            ran += 1;
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        ran >= 10,
        "only {ran} README commands ran: are the blocks marked `sh`?"
    );
}

#[test]
fn block_kinds_are_read_from_the_info_string() {
    assert_eq!(needs("sh"), Ok(Needs::Nothing));
    assert_eq!(needs("sh gpu"), Ok(Needs::Gpu));
    assert_eq!(needs("sh build"), Ok(Needs::Build));
    assert_eq!(needs("python"), Ok(Needs::NotShell));
    assert_eq!(needs(""), Ok(Needs::NotShell));
    assert!(needs("bash").is_err());
    assert!(needs("sh cuda").is_err());
    let body: Vec<String> = ["# a comment", "a \\", "  b   # c", "", "d"]
        .map(String::from)
        .to_vec();
    assert_eq!(commands(&body), ["a   b   # c", "d"]);
}

/// The bundled training traces hold no segment events: replay says why it has no figure
/// for the recording allocator rather than printing a zero.
#[test]
fn replay_of_a_trace_without_segment_events_says_why_native_is_missing() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/gpu/traces/resnet50_native_steps2-4.pickle.gz");
    let out = cli::streamalloc()
        .arg("replay")
        .arg(&trace)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let row = stdout
        .lines()
        .find(|line| line.starts_with("resnet50_native_steps2-4"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(row.matches("n/a").count(), 2, "{row}");
    assert!(!row.contains("0.000"), "{row}");
    assert!(
        stdout.contains("native: n/a (the trace has no segment events of the recording allocator)"),
        "{stdout}"
    );
}
