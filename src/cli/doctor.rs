//! `streamalloc doctor`: what a user needs to know before a run, one verdict per line.
//!
//! It checks, in order: the shared library (found where `streamalloc run` looks, loaded,
//! its version compared with this executable's), the LD_PRELOAD interposer, the Python
//! package, the effective configuration (`STREAMALLOC_CONF`), the CUDA driver and its GPUs,
//! NCCL, and the installed PyTorch with the native door's build cache. Each line starts
//! with a verdict: `ok`, `warn` (works, with a caveat), `none` (absent, and not needed for
//! everything: no GPU, no PyTorch) or `FAIL` (streamalloc cannot work). The exit status is
//! 1 when a line says `FAIL`, else 0: a machine without a GPU is not an error.

use super::out::outln;
use super::run::{exe_dir, find_file, find_python, LIB_ENV, LIB_NAME, PRELOAD_ENV, PRELOAD_NAME};
use super::CliError;
use std::ffi::{c_char, CStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use streamalloc_allocator::backend::cuda::driver::{self, LibraryError, Status};
use streamalloc_allocator::backend::cuda::sys;
use streamalloc_allocator::{Config, ConfigError};

/// Arguments of `streamalloc doctor`.
#[derive(clap::Args, Debug)]
pub(crate) struct DoctorArgs {
    /// The Python whose PyTorch to check (default: the one that started the `streamalloc`
    /// command of a wheel, else `python3` on PATH).
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
}

/// Runs every check and prints its verdict.
pub(crate) fn run(args: DoctorArgs) -> Result<ExitCode, CliError> {
    let mut report = Report::default();
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "?".into());
    outln!("streamalloc {} ({exe})", env!("CARGO_PKG_VERSION"))?;
    let exe_dir = exe_dir()?;

    let lib = match find_file(LIB_ENV, LIB_NAME, &exe_dir, "cargo build --release") {
        Ok(lib) => {
            match library_version(&lib) {
                Ok(v) if v == env!("CARGO_PKG_VERSION") => report.line(
                    Verdict::Ok,
                    "library",
                    format!("{} (version {v})", lib.display()),
                ),
                Ok(v) => report.line(
                    Verdict::Warn,
                    "library",
                    format!(
                        "{} is version {v}, this command {}: rebuild or reinstall both",
                        lib.display(),
                        env!("CARGO_PKG_VERSION")
                    ),
                ),
                Err(err) => report.line(Verdict::Fail, "library", err),
            }
            Some(lib)
        }
        Err(err) => {
            report.line(Verdict::Fail, "library", strip_run(err));
            None
        }
    };
    match find_file(PRELOAD_ENV, PRELOAD_NAME, &exe_dir, "cargo build --release") {
        Ok(path) => report.line(Verdict::Ok, "preload", path.display().to_string()),
        Err(err) => report.line(
            Verdict::Warn,
            "preload",
            format!(
                "{} (needed only for LD_PRELOAD and `run --preload`)",
                strip_run(err)
            ),
        ),
    }
    let python_dir = match find_python(&exe_dir) {
        Ok(dir) => {
            report.line(
                Verdict::Ok,
                "python package",
                dir.join("streamalloc").display().to_string(),
            );
            Some(dir)
        }
        Err(err) => {
            report.line(Verdict::Warn, "python package", strip_run(err));
            None
        }
    };
    report.written()?;
    configuration(&mut report);
    report.written()?;
    gpus(&mut report);
    report.written()?;
    pytorch(&mut report, &args, python_dir.as_deref(), lib.as_deref());
    report.written()?;

    Ok(if report.failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Ok,
    Warn,
    None,
    Fail,
}

#[derive(Default)]
struct Report {
    failed: bool,
    /// The first failed write to stdout: later lines are skipped, and [`Report::written`]
    /// hands it back between checks, so that `doctor | head -3` stops early and quietly.
    write_error: Option<CliError>,
}

impl Report {
    fn line(&mut self, verdict: Verdict, item: &str, detail: impl AsRef<str>) {
        let word = match verdict {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::None => "none",
            Verdict::Fail => "FAIL",
        };
        self.failed |= verdict == Verdict::Fail;
        self.print(format_args!("{word:<5} {item:<15} {}", detail.as_ref()));
    }

    /// A detail line under the previous item (a GPU of the list).
    fn detail(&mut self, text: impl AsRef<str>) {
        self.print(format_args!("{:<21} {}", "", text.as_ref()));
    }

    fn print(&mut self, line: std::fmt::Arguments<'_>) {
        if self.write_error.is_none() {
            self.write_error = outln!("{line}").err();
        }
    }

    /// Whether every line so far reached stdout.
    fn written(&mut self) -> Result<(), CliError> {
        self.write_error.take().map_or(Ok(()), Err)
    }
}

/// The launcher's errors start with `run: `; here the item name says what it is about.
fn strip_run(err: CliError) -> String {
    let text = err.to_string();
    text.strip_prefix("run: ").unwrap_or(&text).to_string()
}

// ---- The library ----

/// Loads `path` and asks it for `streamalloc_version`. The library is never unloaded: once
/// loaded it may have started threads and registered exit hooks, and unloading it under
/// those is undefined.
fn library_version(path: &Path) -> Result<String, String> {
    // SAFETY: loading runs the library's initialisers; libstreamalloc's (Rust statics, an
    // exit hook) have no preconditions.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|err| {
        // libloading keeps dlerror's text (what is wrong with the file) as the source.
        let why = std::error::Error::source(&err).map_or(err.to_string(), |s| s.to_string());
        format!("{} does not load: {why}", path.display())
    })?;
    let lib = Box::leak(Box::new(lib));
    // SAFETY: `streamalloc_version` has this signature in every version of the library.
    let version =
        unsafe { lib.get::<unsafe extern "C" fn() -> *const c_char>(b"streamalloc_version") }
            .map_err(|_| format!("{} lacks streamalloc_version", path.display()))?;
    // SAFETY: streamalloc_version takes nothing and returns a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(version()) };
    Ok(text.to_string_lossy().into_owned())
}

// ---- Configuration ----

fn configuration(report: &mut Report) {
    let source = match std::env::var_os(streamalloc_allocator::config::ENV_VAR) {
        Some(text) => format!("STREAMALLOC_CONF={}", text.to_string_lossy()),
        None => "STREAMALLOC_CONF unset, defaults".to_string(),
    };
    match Config::from_env() {
        Ok(config) => {
            report.line(Verdict::Ok, "configuration", &source);
            report.detail(format!(
                "PyTorch doors: {}",
                super::every_config_key(&config)
            ));
            // The interposer starts from whole segments: its programs may export our
            // pointers with cudaIpcGetMemHandle, which expandable segments cannot serve.
            let preload = Config {
                expandable_segments: false,
                ..Config::default()
            };
            if let Ok(config) = Config::from_env_over(preload) {
                report.detail(format!(
                    "LD_PRELOAD:    {}",
                    super::every_config_key(&config)
                ));
            }
        }
        Err(err) => report.line(Verdict::Fail, "configuration", config_error(&err)),
    }
}

fn config_error(err: &ConfigError) -> String {
    let text = err.to_string();
    match text.strip_prefix("STREAMALLOC_CONF: ") {
        Some(rest) => format!("bad STREAMALLOC_CONF: {rest}"),
        None => format!("bad STREAMALLOC_CONF: {text}"),
    }
}

// ---- The CUDA driver ----

/// The driver symbols the doctor calls, probed before any call.
const DOCTOR_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// What `libcuda` says: loaded or not, driver version, each GPU. The driver is loaded the
/// way the backend loads it ([`driver::probe_library`]), so that a machine without it is
/// an answer, not a panic, and the doctor finds the library the allocator would.
fn gpus(report: &mut Report) {
    match driver::probe_library(
        driver::CUDA_DRIVER,
        sys::is_culib_present,
        sys::culib,
        DOCTOR_SYMBOLS,
    ) {
        Ok(()) => {}
        Err(err @ LibraryError::NotFound { .. }) => {
            report.line(
                Verdict::None,
                "gpu",
                format!(
                    "no GPU: {err}; `demo`, `replay`, `snapshot`, `view` and `plot` work without one"
                ),
            );
            return;
        }
        Err(err) => {
            report.line(Verdict::Warn, "gpu", err.to_string());
            return;
        }
    }
    let probe = || -> Result<(i32, Vec<String>), String> {
        let mut version = 0;
        // SAFETY: the symbol exists (probed above); a valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut version) };
        // SAFETY: cuInit(0) has no preconditions.
        let code = unsafe { sys::cuInit(0) };
        if code == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            return Ok((version, Vec::new()));
        }
        code.check().map_err(|code| {
            format!(
                "driver {} loaded, but cuInit failed: {}",
                driver_text(version),
                code.describe()
            )
        })?;
        let mut n = 0;
        // SAFETY: a valid out-pointer, after cuInit succeeded.
        unsafe { sys::cuDeviceGetCount(&mut n) };
        let mut devices = Vec::new();
        for ordinal in 0..n {
            let mut device = 0;
            // SAFETY: a valid out-pointer and an ordinal below the count.
            if unsafe { sys::cuDeviceGet(&mut device, ordinal) }
                .check()
                .is_err()
            {
                continue;
            }
            let mut buf = [0 as c_char; 256];
            // SAFETY: cuDeviceGetName writes at most `buf.len()` bytes, NUL-terminated.
            unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, device) };
            // SAFETY: the buffer is NUL-terminated (zeroed, and the driver terminates it).
            let label = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
            let mut bytes = 0usize;
            // SAFETY: a valid out-pointer and device.
            unsafe { sys::cuDeviceTotalMem_v2(&mut bytes, device) };
            let (mut major, mut minor) = (0, 0);
            use sys::CUdevice_attribute::{
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
            };
            // SAFETY: valid out-pointers, a known attribute and device.
            unsafe { sys::cuDeviceGetAttribute(&mut major, MAJOR, device) };
            // SAFETY: as above.
            unsafe { sys::cuDeviceGetAttribute(&mut minor, MINOR, device) };
            devices.push(format!(
                "GPU {ordinal}: {label}, {}, compute capability {major}.{minor}",
                streamalloc_allocator::config::format_bytes(bytes as u64)
            ));
        }
        Ok((version, devices))
    };
    match probe() {
        Ok((version, devices)) if devices.is_empty() => report.line(
            Verdict::None,
            "gpu",
            format!(
                "no GPU: driver {} loaded, but it sees no device (CUDA_VISIBLE_DEVICES={})",
                driver_text(version),
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
            ),
        ),
        Ok((version, devices)) => {
            report.line(
                Verdict::Ok,
                "gpu",
                format!(
                    "driver {} (CUDA {}), {} GPU{}",
                    driver_text(version),
                    cuda_text(version),
                    devices.len(),
                    if devices.len() == 1 { "" } else { "s" }
                ),
            );
            for device in devices {
                report.detail(device);
            }
        }
        Err(err) => report.line(Verdict::Warn, "gpu", err),
    }
}

/// The driver's own version string from `/proc`, else the CUDA version it supports.
fn driver_text(version: i32) -> String {
    std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|text| {
            let line = text.lines().next()?.to_string();
            // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu ..."
            line.split_whitespace()
                .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
                .map(str::to_string)
        })
        .unwrap_or_else(|| format!("for CUDA {}", cuda_text(version)))
}

fn cuda_text(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

// ---- PyTorch and the native door ----

fn pytorch(report: &mut Report, args: &DoctorArgs, python_dir: Option<&Path>, lib: Option<&Path>) {
    let Some(python_dir) = python_dir else {
        report.line(
            Verdict::None,
            "pytorch",
            "not checked: the streamalloc Python package was not found",
        );
        return;
    };
    let python = python_exe(args.python.as_deref());
    let mut command = python_command(&python, python_dir, "probe", &[]);
    if let Some(lib) = lib {
        command.env(LIB_ENV, lib);
    }
    let output = match command.output() {
        Ok(output) => output,
        Err(err) => {
            report.line(
                Verdict::None,
                "pytorch",
                format!(
                    "not checked: cannot start {}: {err}",
                    python.to_string_lossy()
                ),
            );
            return;
        }
    };
    let probe: serde_json::Value = match serde_json::from_slice(&output.stdout) {
        Ok(value) => value,
        Err(_) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
            report.line(
                Verdict::Warn,
                "pytorch",
                format!(
                    "not checked: {} could not run the probe: {}",
                    python.to_string_lossy(),
                    last.unwrap_or("no output")
                ),
            );
            return;
        }
    };
    let text = |key: &str| probe.get(key).and_then(|v| v.as_str()).map(str::to_string);
    let exe = text("python").unwrap_or_else(|| python.to_string_lossy().into_owned());
    let Some(torch) = text("torch") else {
        report.line(
            Verdict::None,
            "pytorch",
            format!(
                "not installed for {exe} ({}); `pip install torch` to use streamalloc with PyTorch",
                text("torch_error").unwrap_or_default()
            ),
        );
        return;
    };
    let cuda = text("torch_cuda").unwrap_or_else(|| "none: a CPU-only build".into());
    let verdict = if text("torch_cuda").is_some() {
        Verdict::Ok
    } else {
        Verdict::Warn
    };
    report.line(
        verdict,
        "pytorch",
        format!("{torch} (CUDA {cuda}) in {exe}"),
    );
    match (
        probe.get("door_built").and_then(|v| v.as_bool()),
        text("door"),
    ) {
        (Some(true), Some(path)) => {
            report.line(Verdict::Ok, "native door", format!("built: {path}"))
        }
        (Some(false), Some(path)) => report.line(
            Verdict::Warn,
            "native door",
            format!(
                "not built yet: compiles once on first use (~1 min), or now with \
                 `streamalloc build-torch-ext` (cache: {path})"
            ),
        ),
        _ => report.line(
            Verdict::Warn,
            "native door",
            format!(
                "cannot tell: {}",
                text("door_error").unwrap_or_else(|| "no answer".into())
            ),
        ),
    }
}

/// The Python to ask: `--python`, else the one that ran the wheel's `streamalloc` script
/// (it passes `STREAMALLOC_PYTHON_EXE`), else `python3`.
pub(crate) fn python_exe(explicit: Option<&Path>) -> OsString {
    if let Some(path) = explicit {
        return path.as_os_str().to_owned();
    }
    std::env::var_os("STREAMALLOC_PYTHON_EXE")
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| OsString::from("python3"))
}

/// `python -c` running `streamalloc._cli.<verb>` from the package in `python_dir`. The
/// folder goes on `sys.path` only when it is not there already: a site-packages must not
/// move before the standard library.
pub(crate) fn python_command(
    python: &OsString,
    python_dir: &Path,
    verb: &str,
    args: &[&str],
) -> Command {
    let script = "import sys\n\
                  d = sys.argv[1]\n\
                  sys.path.insert(0, d) if d not in sys.path else None\n\
                  from streamalloc import _cli\n\
                  sys.exit(_cli.tool(sys.argv[2:]))\n";
    let mut command = Command::new(python);
    command
        .arg("-c")
        .arg(script)
        .arg(python_dir)
        .arg(verb)
        .args(args);
    command
}
