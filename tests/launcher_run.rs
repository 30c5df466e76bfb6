//! `streamalloc run` without a GPU: the environment its child gets, exit statuses and
//! signals passed back, bad input refused in one line before anything runs, and the Python
//! boot module (chaining an existing `sitecustomize`, installing into a stand-in `torch`
//! the moment it is imported, refusing when CUDA was already initialised).
//!
//! Tests that need `python3` print why and pass when it is absent.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod cli;
use cli::streamalloc;

fn run(command: &mut Command) -> Output {
    command.output().expect("spawn streamalloc")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh folder under the target dir's tmp (removed first if a previous run left it).
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("launcher_{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn python3() -> Option<&'static str> {
    let ok = Command::new("python3")
        .arg("-c")
        .arg("pass")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: python3 is not available");
    }
    ok.then_some("python3")
}

fn assert_one_line(out: &Output, needle: &str) {
    let text = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {text}");
    assert_eq!(text.lines().count(), 1, "expected one line, got: {text:?}");
    assert!(text.starts_with("streamalloc: "), "{text}");
    assert!(text.contains(needle), "{needle:?} not in {text:?}");
}

#[test]
fn exit_status_is_the_childs() {
    for code in [0, 3, 42] {
        let out = run(streamalloc().args(["run", "--", "sh", "-c", &format!("exit {code}")]));
        assert_eq!(out.status.code(), Some(code), "{}", stderr(&out));
    }
}

#[test]
fn a_signal_becomes_128_plus_n() {
    let out = run(streamalloc().args(["run", "--", "sh", "-c", "kill -TERM $$"]));
    assert_eq!(out.status.code(), Some(128 + 15));
    let out = run(streamalloc().args(["run", "--", "sh", "-c", "kill -KILL $$"]));
    assert_eq!(out.status.code(), Some(128 + 9));
}

#[test]
fn sigterm_to_the_launcher_reaches_the_child() {
    let dir = scratch("sigterm");
    let marker = dir.join("got_term");
    let started = dir.join("started");
    let script = format!(
        "trap 'echo term > {}; exit 7' TERM; touch {}; while true; do sleep 0.05; done",
        marker.display(),
        started.display()
    );
    let mut child = streamalloc()
        .args(["run", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    // The shell has set its trap; the launcher installs its handlers right after spawning,
    // long before that (the extra pause only makes the test robust on a loaded machine).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !started.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the child never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(7));
    assert!(marker.is_file());
}

#[test]
fn a_command_that_does_not_exist_is_127() {
    let out = run(streamalloc().args(["run", "--", "/nonexistent/program-xyz"]));
    assert_eq!(out.status.code(), Some(127));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    assert!(stderr(&out).contains("cannot start `/nonexistent/program-xyz`"));
}

#[test]
fn bad_conf_is_one_line_and_nothing_runs() {
    let dir = scratch("bad_conf");
    let marker = dir.join("ran");
    let touch = format!("touch {}", marker.display());
    let out = run(streamalloc().args(["run", "--conf", "no_such_key:1", "--", "sh", "-c", &touch]));
    assert_one_line(&out, "bad --conf");
    assert!(!marker.exists(), "the program ran despite a bad --conf");

    let out = run(streamalloc()
        .env("STREAMALLOC_CONF", "reuse_policy:sideways")
        .args(["run", "--", "sh", "-c", &touch]));
    assert_one_line(&out, "bad STREAMALLOC_CONF");
    assert!(!marker.exists());
}

#[test]
fn a_conf_that_is_not_utf8_is_one_line_and_nothing_runs() {
    use std::os::unix::ffi::OsStrExt;
    let dir = scratch("conf_not_utf8");
    let marker = dir.join("ran");
    let touch = format!("touch {}", marker.display());
    let out = run(streamalloc()
        .env(
            "STREAMALLOC_CONF",
            std::ffi::OsStr::from_bytes(b"trace_capacity:\xff4096"),
        )
        .args(["run", "--", "sh", "-c", &touch]));
    assert_one_line(&out, "STREAMALLOC_CONF is not valid UTF-8");
    assert!(
        !marker.exists(),
        "the program ran with an unreadable STREAMALLOC_CONF"
    );
}

#[test]
fn missing_library_is_one_line() {
    let out = run(streamalloc()
        .env("STREAMALLOC_LIB", "/nonexistent/libstreamalloc.so")
        .args(["run", "--", "true"]));
    assert_one_line(
        &out,
        "STREAMALLOC_LIB=/nonexistent/libstreamalloc.so is not a file",
    );
}

#[test]
fn missing_python_package_and_bad_snapshot_folder_are_one_line() {
    let dir = scratch("no_python");
    let out = run(streamalloc()
        .env("STREAMALLOC_PYTHON", &dir)
        .args(["run", "--", "true"]));
    assert_one_line(&out, "does not hold streamalloc/_boot/sitecustomize.py");

    let out = run(streamalloc().args([
        "run",
        "--snapshot",
        "/nonexistent/dir/snap.json",
        "--",
        "true",
    ]));
    assert_one_line(&out, "folder /nonexistent/dir does not exist");
}

const PRINT_ENV: &str = r#"
import json, os, sys
keys = ["PYTHONPATH", "STREAMALLOC_LIB", "STREAMALLOC_CONF", "STREAMALLOC_SNAPSHOT",
        "STREAMALLOC_STATS_AT_EXIT", "CHAINED"]
import streamalloc
print(json.dumps({
    "env": {k: os.environ.get(k) for k in keys},
    "sitecustomize": sys.modules["sitecustomize"].__file__,
    "package": streamalloc.__file__,
    "torch_imported": "torch" in sys.modules,
}))
"#;

#[test]
fn the_child_gets_the_library_the_conf_and_the_boot_path() {
    let Some(python) = python3() else { return };
    let dir = scratch("env");
    let existing = dir.join("existing");
    std::fs::create_dir_all(&existing).unwrap();
    // A sitecustomize of the user's own: it must still run.
    std::fs::write(
        existing.join("sitecustomize.py"),
        "import os\nos.environ['CHAINED'] = 'yes'\n",
    )
    .unwrap();
    let out = run(streamalloc()
        .env("PYTHONPATH", &existing)
        .current_dir(&dir)
        .args([
            "run",
            "--conf",
            "trace_capacity:4096",
            "--snapshot",
            "snap.json",
            "--stats",
            "--",
            python,
            "-c",
            PRINT_ENV,
        ]));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let report: serde_json::Value = serde_json::from_str(text.trim()).expect("json");
    let env = &report["env"];

    let path: Vec<&str> = env["PYTHONPATH"].as_str().unwrap().split(':').collect();
    assert_eq!(path.len(), 3, "{path:?}");
    assert!(path[0].ends_with("python/streamalloc/_boot"), "{path:?}");
    assert_eq!(
        Path::new(path[0]),
        Path::new(path[1]).join("streamalloc/_boot")
    );
    assert_eq!(
        Path::new(path[2]),
        existing,
        "existing PYTHONPATH kept last"
    );

    let lib = Path::new(env["STREAMALLOC_LIB"].as_str().unwrap());
    assert!(lib.is_absolute() && lib.is_file(), "{lib:?}");
    assert_eq!(lib.file_name().unwrap(), "libstreamalloc.so");
    assert_eq!(env["STREAMALLOC_CONF"], "trace_capacity:4096");
    assert_eq!(
        Path::new(env["STREAMALLOC_SNAPSHOT"].as_str().unwrap()),
        std::fs::canonicalize(&dir).unwrap().join("snap.json")
    );
    assert_eq!(env["STREAMALLOC_STATS_AT_EXIT"], "1");

    // Our boot module ran first and chained to the user's.
    assert!(report["sitecustomize"]
        .as_str()
        .unwrap()
        .ends_with("streamalloc/_boot/sitecustomize.py"));
    assert_eq!(env["CHAINED"], "yes");
    assert!(report["package"]
        .as_str()
        .unwrap()
        .ends_with("python/streamalloc/__init__.py"));
    // A process that does not use torch does not import it.
    assert_eq!(report["torch_imported"], false);
}

#[test]
fn without_conf_the_users_conf_passes_through() {
    let Some(python) = python3() else { return };
    let out = run(streamalloc()
        .env("STREAMALLOC_CONF", "trace_capacity:4096")
        .args([
            "run",
            "--",
            python,
            "-c",
            "import os; print(os.environ['STREAMALLOC_CONF'])",
        ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "trace_capacity:4096");
}

/// A stand-in `torch` with just what `streamalloc.torch.install()` touches; it records
/// the calls so the test sees when and how install happened.
const FAKE_TORCH: &str = r#"
import os, types
__version__ = "0.0-fake"
CALLS = []
cuda = types.ModuleType("torch.cuda")
cuda.is_initialized = lambda: os.environ.get("FAKE_CUDA_INITIALIZED") == "1"
memory = types.ModuleType("torch.cuda.memory")
class _Raw:
    def set_record_stream_fn(self, p): CALLS.append(("record_stream", bool(p)))
    def set_reset_fn(self, p): CALLS.append(("reset", bool(p)))
    def set_memory_fraction_fn(self, p): CALLS.append(("memory_fraction", bool(p)))
class CUDAPluggableAllocator:
    def __init__(self, path, malloc, free):
        CALLS.append(("pluggable", path, malloc, free))
        self._raw = _Raw()
    def allocator(self): return self._raw
def change_current_allocator(a): CALLS.append(("change_current_allocator",))
memory.CUDAPluggableAllocator = CUDAPluggableAllocator
memory.change_current_allocator = change_current_allocator
cuda.memory = memory
CALLS.append(("torch imported",))
"#;

const USE_FAKE_TORCH: &str = r#"
import json, sys
import torch
import streamalloc.torch as st
print(json.dumps({"calls": torch.CALLS, "installed": st.installed()}))
"#;

#[test]
fn torch_gets_streamalloc_as_soon_as_it_is_imported() {
    let Some(python) = python3() else { return };
    let dir = scratch("fake_torch");
    std::fs::create_dir_all(dir.join("torch")).unwrap();
    std::fs::write(dir.join("torch/__init__.py"), FAKE_TORCH).unwrap();
    let out = run(streamalloc().env("PYTHONPATH", &dir).args([
        "run",
        "--stats",
        "--",
        python,
        "-c",
        USE_FAKE_TORCH,
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("json");
    assert_eq!(report["installed"], true);
    let calls = report["calls"].as_array().unwrap();
    let names: Vec<&str> = calls.iter().map(|c| c[0].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "torch imported",
            "pluggable",
            "record_stream",
            "reset",
            "memory_fraction",
            "change_current_allocator"
        ]
    );
    assert!(calls[1][1].as_str().unwrap().ends_with("libstreamalloc.so"));
    assert_eq!(calls[1][2], "streamalloc_malloc");
    assert!(calls[2][1].as_bool().unwrap(), "hook pointer is null");
    // The exit hook ran through the library (no GPU here: nothing was allocated).
    assert!(
        stderr(&out).contains("no CUDA memory was allocated through streamalloc"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn cuda_already_initialised_is_said_clearly() {
    let Some(python) = python3() else { return };
    let dir = scratch("fake_torch_initialised");
    std::fs::create_dir_all(dir.join("torch")).unwrap();
    std::fs::write(dir.join("torch/__init__.py"), FAKE_TORCH).unwrap();
    let out = run(streamalloc()
        .env("PYTHONPATH", &dir)
        .env("FAKE_CUDA_INITIALIZED", "1")
        .args(["run", "--", python, "-c", "import torch; print('ran on')"]));
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert_eq!(text.lines().count(), 1, "{text:?}");
    assert!(text.contains("NOT installed"), "{text}");
    assert!(text.contains("already initialised CUDA"), "{text}");
    assert!(!stdout(&out).contains("ran on"));
}

#[test]
fn a_failed_install_stops_the_program_in_one_line() {
    let Some(python) = python3() else { return };
    let dir = scratch("fake_torch_broken");
    std::fs::create_dir_all(dir.join("torch")).unwrap();
    // A torch whose pluggable allocator has no record_stream hook (too old).
    let broken = FAKE_TORCH.replace("def set_record_stream_fn", "def _no_record_stream_fn");
    std::fs::write(dir.join("torch/__init__.py"), broken).unwrap();
    let out = run(streamalloc().env("PYTHONPATH", &dir).args([
        "run",
        "--",
        python,
        "-c",
        "import torch; print('ran on')",
    ]));
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert_eq!(text.lines().count(), 1, "{text:?}");
    assert!(
        text.contains("InstallError") && text.contains("set_record_stream_fn"),
        "{text}"
    );
}

/// A virtual environment whose site-packages holds the stand-in torch and a `.pth` file
/// importing it, so torch is imported before `sitecustomize` runs. `None` (with a message)
/// when `python3 -m venv` is unavailable.
fn venv_importing_torch_at_startup(name: &str) -> Option<PathBuf> {
    let python = python3()?;
    let dir = scratch(name);
    let venv = dir.join("venv");
    let made = Command::new(python)
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .output()
        .is_ok_and(|o| o.status.success());
    if !made {
        eprintln!("skipped: python3 -m venv is not available");
        return None;
    }
    let bin = venv.join("bin/python");
    let out = Command::new(&bin)
        .args(["-c", "import site; print(site.getsitepackages()[0])"])
        .output()
        .unwrap();
    let site = PathBuf::from(stdout(&out).trim());
    std::fs::create_dir_all(site.join("torch")).unwrap();
    std::fs::write(site.join("torch/__init__.py"), FAKE_TORCH).unwrap();
    std::fs::write(site.join("zz_torch.pth"), "import torch\n").unwrap();
    Some(bin)
}

#[test]
fn torch_imported_during_start_up_is_installed_or_refused_in_one_line() {
    let Some(python) = venv_importing_torch_at_startup("pth_torch") else {
        return;
    };
    let out = run(streamalloc().args([
        "run".as_ref(),
        "--".as_ref(),
        python.as_os_str(),
        "-c".as_ref(),
        "import streamalloc.torch as st; print(st.installed())".as_ref(),
    ]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "True");

    let out = run(streamalloc().env("FAKE_CUDA_INITIALIZED", "1").args([
        "run".as_ref(),
        "--".as_ref(),
        python.as_os_str(),
        "-c".as_ref(),
        "print('ran on')".as_ref(),
    ]));
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert_eq!(text.lines().count(), 1, "{text:?}");
    assert!(text.contains("already initialised CUDA"), "{text}");
    assert!(!stdout(&out).contains("ran on"));
}

/// Processes whose command line is exactly `argv` (NUL-separated in /proc).
fn processes_running(argv: &[&str]) -> Vec<u32> {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want)
                && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                    s.rsplit(')')
                        .next()
                        .is_some_and(|r| r.trim_start().starts_with('Z'))
                })
        })
        .collect()
}

/// Waits up to `limit` for no process to run `argv`; returns those still running.
fn gone_within(argv: &[&str], limit: std::time::Duration) -> Vec<u32> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = processes_running(argv);
        if left.is_empty() || std::time::Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A launcher killed outright (SIGKILL, which it cannot forward) takes its child with it.
#[test]
fn the_child_does_not_outlive_a_killed_launcher() {
    let argv = ["sleep", "101.25"];
    let mut launcher = streamalloc()
        .arg("run")
        .arg("--")
        .args(argv)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while processes_running(&argv).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the child never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let left = gone_within(&argv, std::time::Duration::from_secs(5));
    for &pid in &left {
        // SAFETY: kill(2) of a process this test started; only cleans up after a failure.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    assert!(left.is_empty(), "orphaned children: {left:?}");
}

/// SIGTERM at any moment of start-up, before the child exists included, ends the child:
/// a signal the launcher receives while starting it is delivered once it runs.
#[test]
fn sigterm_early_in_start_up_leaves_no_child_behind() {
    let argv = ["sleep", "102.5"];
    for attempt in 0..50u64 {
        let launcher = streamalloc()
            .arg("run")
            .arg("--")
            .args(argv)
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_micros(attempt % 10 * 1000));
        // SAFETY: kill(2) of the launcher this test just started.
        unsafe { libc::kill(launcher.id() as i32, libc::SIGTERM) };
        let mut launcher = launcher;
        let status = launcher.wait().unwrap();
        let left = gone_within(&argv, std::time::Duration::from_secs(5));
        for &pid in &left {
            // SAFETY: as above, cleanup after a failure only.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        assert!(
            left.is_empty(),
            "attempt {attempt} ({status:?}): orphaned children {left:?}"
        );
    }
}
