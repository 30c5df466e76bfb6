//! `streamalloc run`: puts streamalloc into a program the user did not write.
//!
//! ```text
//! streamalloc run [--conf KEY:VAL,...] [--snapshot PATH] [--stats] [--preload]
//!                 [--sleep-signals none|cpu] -- COMMAND...
//! ```
//!
//! The launcher checks everything it can before the program starts (the configuration
//! parses, the library and the Python boot folder exist, the snapshot folder exists), so
//! a mistake is one line on stderr and exit code 2 rather than a failure deep inside a
//! training job. Then it runs COMMAND with this environment:
//!
//! | variable | value |
//! | --- | --- |
//! | `PYTHONPATH` | `<python>/streamalloc/_boot:<python>` before the existing value (only `_boot` when installed from the wheel) |
//! | `STREAMALLOC_LIB` | the absolute path of `libstreamalloc.so` |
//! | `STREAMALLOC_CONF` | `--conf`, when given |
//! | `STREAMALLOC_SNAPSHOT` | `--snapshot`, made absolute |
//! | `STREAMALLOC_STATS_AT_EXIT` | `1` with `--stats` |
//! | `STREAMALLOC_SLEEP_SIGNALS` | `--sleep-signals`: SIGUSR1 sleeps the program's tags, SIGUSR2 wakes them |
//! | `LD_PRELOAD` | `libstreamalloc_preload.so` first, with `--preload` |
//!
//! Every Python process started below it (torchrun's workers included: they inherit the
//! environment) runs `_boot/sitecustomize.py` at start-up, which installs streamalloc as
//! PyTorch's allocator the moment `torch` is imported, before any CUDA work, and registers
//! the exit hook (`src/process.rs`).
//!
//! # Exit status and signals
//! The launcher waits for the child and exits with its status; a child killed by signal
//! `n` gives `128 + n`, as a shell reports it. SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to
//! the launcher are forwarded to the child, from before the child starts (one that arrives
//! while it is being started is delivered once it runs). SIGINT and SIGQUIT are ignored by
//! the launcher while the child runs: a terminal delivers them to the whole foreground
//! group, child included, and the launcher must outlive the child to report its status. If
//! the launcher dies anyway (SIGKILL), the kernel sends the child SIGTERM
//! (`PR_SET_PDEATHSIG`): no child outlives its launcher. A command that cannot be started
//! gives 127 (not found) or 126 (not executable), like a shell.

use super::CliError;
use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicI32, Ordering};
use streamalloc_allocator::config::ENV_VAR as CONF_ENV;
use streamalloc_allocator::{Config, ConfigError};

/// The shared library's file name.
pub(crate) const LIB_NAME: &str = "libstreamalloc.so";
/// The LD_PRELOAD interposer's file name (crate `preload/`).
pub(crate) const PRELOAD_NAME: &str = "libstreamalloc_preload.so";
/// Overrides where the library is found.
pub(crate) const LIB_ENV: &str = "STREAMALLOC_LIB";
/// Overrides where the preload interposer is found.
pub(crate) const PRELOAD_ENV: &str = "STREAMALLOC_PRELOAD_LIB";
/// Overrides where the Python package is found (the folder holding `streamalloc/`).
pub(crate) const PYTHON_ENV: &str = "STREAMALLOC_PYTHON";
/// The boot folder inside the Python package, put first on `PYTHONPATH`.
const BOOT: &str = "streamalloc/_boot";

/// Arguments of `streamalloc run`.
#[derive(clap::Args, Debug)]
pub(crate) struct RunArgs {
    /// Allocator configuration, as in STREAMALLOC_CONF (e.g. `reuse_policy:stream_wait,trace_capacity:65536`);
    /// checked before the program starts and passed to every process.
    #[arg(long, value_name = "KEY:VAL,...")]
    conf: Option<String>,
    /// Each process writes its snapshot here at exit; ranks (RANK / LOCAL_RANK) get
    /// `PATH.rankN.json`, and a process using several devices `.devD`.
    #[arg(long, value_name = "PATH")]
    snapshot: Option<PathBuf>,
    /// Each process prints its allocator counters on stderr at exit.
    #[arg(long)]
    stats: bool,
    /// Also LD_PRELOAD the cudaMalloc/cudaFree interposer, for programs that call the CUDA
    /// runtime's allocator themselves (CUDA C built with `-cudart shared`, CuPy without its
    /// pool). Do not use it for PyTorch with its caching allocator.
    #[arg(long)]
    preload: bool,
    /// SIGUSR1 puts every memory pool the program tagged (`streamalloc.torch.region`) to
    /// sleep, its GPU memory back to the driver (`cpu`: live tensors copied to host memory
    /// first; `none`: not); SIGUSR2 wakes them. Each Python process handles them in its main
    /// thread; signal the process while it is idle.
    #[arg(long, value_name = "BACKUP", value_parser = ["none", "cpu"])]
    sleep_signals: Option<String>,
    /// The program and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    command: Vec<OsString>,
}

/// Runs `args.command` under streamalloc; see the module docs.
pub(crate) fn run(args: RunArgs) -> Result<ExitCode, CliError> {
    let plan = Plan::new(&args)?;
    let (program, rest) = args.command.split_first().ok_or_else(|| {
        CliError::Message("run: no command given (usage: streamalloc run -- COMMAND...)".into())
    })?;
    let mut command = Command::new(program);
    command.args(rest);
    for (name, value) in &plan.env {
        command.env(name, value);
    }
    tracing::debug!(?plan, "streamalloc run");
    // Forwarding is in place before the child exists: a signal that arrives while it is
    // being started is held and delivered once it runs, never lost.
    let forwarding = SignalForwarding::install();
    end_with_launcher(&mut command);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            let code = match err.kind() {
                std::io::ErrorKind::NotFound => 127,
                _ => 126,
            };
            eprintln!(
                "streamalloc: run: cannot start `{}`: {err}",
                program.to_string_lossy()
            );
            return Ok(ExitCode::from(code));
        }
    };
    forwarding.attach(child.id());
    let status = child
        .wait()
        .map_err(|err| CliError::Message(format!("run: waiting for the program: {err}")))?;
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    };
    Ok(ExitCode::from(code as u8))
}

/// What the child gets: environment variables to set. Built and checked before anything
/// runs.
#[derive(Debug)]
struct Plan {
    env: Vec<(&'static str, OsString)>,
}

impl Plan {
    fn new(args: &RunArgs) -> Result<Self, CliError> {
        let mut env = Vec::new();
        // The configuration: --conf, else whatever STREAMALLOC_CONF the user already has;
        // either way it must be UTF-8 and parse, or every process would fail on its first
        // allocation.
        match &args.conf {
            Some(text) => {
                Config::parse(text).map_err(|err| {
                    CliError::Message(format!("run: bad {}", err.describe("--conf")))
                })?;
                env.push((CONF_ENV, OsString::from(text)));
            }
            None => {
                Config::from_env().map_err(|err| {
                    CliError::Message(match err {
                        ConfigError::NotUnicode => format!("run: {err}"),
                        _ => format!("run: bad {err}"),
                    })
                })?;
            }
        }
        let exe_dir = exe_dir()?;
        let lib = find_file(LIB_ENV, LIB_NAME, &exe_dir, "cargo build --release")?;
        env.push((LIB_ENV, lib.into_os_string()));

        let python = find_python(&exe_dir)?;
        // Installed from the wheel, the package lives in a site-packages its Python already
        // searches; putting that folder on PYTHONPATH would also put it before the standard
        // library, and before the site-packages of any other Python the program starts.
        let dirs = if python_is_installed(&exe_dir, &python) {
            vec![python.join(BOOT)]
        } else {
            vec![python.join(BOOT), python.clone()]
        };
        let mut path = std::env::join_paths(dirs).map_err(|err| {
            CliError::Message(format!("run: cannot use {}: {err}", python.display()))
        })?;
        if let Some(existing) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(existing);
        }
        env.push(("PYTHONPATH", path));

        if let Some(snapshot) = &args.snapshot {
            env.push((
                "STREAMALLOC_SNAPSHOT",
                absolute_snapshot(snapshot)?.into_os_string(),
            ));
        }
        if let Some(backup) = &args.sleep_signals {
            env.push(("STREAMALLOC_SLEEP_SIGNALS", OsString::from(backup)));
        }
        if args.stats {
            env.push(("STREAMALLOC_STATS_AT_EXIT", OsString::from("1")));
        }
        if args.preload {
            let preload = find_file(PRELOAD_ENV, PRELOAD_NAME, &exe_dir, "cargo build --release")?;
            let mut value = preload.into_os_string();
            if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
                value.push(":");
                value.push(existing);
            }
            env.push(("LD_PRELOAD", value));
        }
        Ok(Self { env })
    }
}

/// The folder of the running `streamalloc` executable (symbolic links resolved).
pub(crate) fn exe_dir() -> Result<PathBuf, CliError> {
    let exe = std::env::current_exe()
        .and_then(std::fs::canonicalize)
        .map_err(|err| {
            CliError::Message(format!(
                "run: cannot locate the streamalloc executable: {err}"
            ))
        })?;
    Ok(exe.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// `name` from the variable `env` (which must then name a file), else next to the
/// executable (a cargo build), in its parent (the wheel: the executable is
/// `streamalloc/bin/streamalloc` inside the Python package, the libraries are in
/// `streamalloc/`) or in `../lib`.
pub(crate) fn find_file(
    env: &str,
    name: &str,
    exe_dir: &Path,
    build: &str,
) -> Result<PathBuf, CliError> {
    if let Some(value) = std::env::var_os(env).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(&value);
        return match std::fs::canonicalize(&path) {
            Ok(path) if path.is_file() => Ok(path),
            _ => Err(CliError::Message(format!(
                "run: {env}={} is not a file",
                path.display()
            ))),
        };
    }
    let candidates = [
        exe_dir.join(name),
        exe_dir.join("..").join(name),
        exe_dir.join("../lib").join(name),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .and_then(|p| std::fs::canonicalize(p).ok())
        .ok_or_else(|| {
            CliError::Message(format!(
                "run: {name} not found (looked at {}); build it with `{build}` or set {env}",
                join_display(&candidates)
            ))
        })
}

/// The folder that holds the `streamalloc` Python package with its boot module:
/// `STREAMALLOC_PYTHON`, else the `site-packages` the executable is installed in (the
/// wheel's `streamalloc/bin/streamalloc`), `python/` next to the executable, in its
/// parent, in `../share/streamalloc/`, or in the source checkout it was built from.
pub(crate) fn find_python(exe_dir: &Path) -> Result<PathBuf, CliError> {
    let has_boot = |dir: &Path| dir.join(BOOT).join("sitecustomize.py").is_file();
    if let Some(value) = std::env::var_os(PYTHON_ENV).filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(&value);
        return match std::fs::canonicalize(&dir) {
            Ok(dir) if has_boot(&dir) => Ok(dir),
            _ => Err(CliError::Message(format!(
                "run: {PYTHON_ENV}={} does not hold {BOOT}/sitecustomize.py",
                dir.display()
            ))),
        };
    }
    let candidates = [
        exe_dir.join("../.."),
        exe_dir.join("python"),
        exe_dir.join("../python"),
        exe_dir.join("../share/streamalloc/python"),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("python"),
    ];
    candidates
        .iter()
        .find(|dir| has_boot(dir))
        .and_then(|dir| std::fs::canonicalize(dir).ok())
        .ok_or_else(|| {
            CliError::Message(format!(
                "run: the streamalloc Python package was not found (looked for {BOOT}/sitecustomize.py in {}); set {PYTHON_ENV}",
                join_display(&candidates)
            ))
        })
}

/// Whether `python` (from [`find_python`]) is the site-packages the wheel installed this
/// executable into, rather than a folder named by `STREAMALLOC_PYTHON` or a checkout.
pub(crate) fn python_is_installed(exe_dir: &Path, python: &Path) -> bool {
    std::env::var_os(PYTHON_ENV).is_none_or(|v| v.is_empty())
        && std::fs::canonicalize(exe_dir.join("../..")).is_ok_and(|dir| dir == python)
}

/// `--snapshot` made absolute (children may change folder), its folder checked to exist.
fn absolute_snapshot(path: &Path) -> Result<PathBuf, CliError> {
    let absolute = std::path::absolute(path).map_err(|err| {
        CliError::Message(format!("run: bad --snapshot {}: {err}", path.display()))
    })?;
    let parent = absolute.parent().unwrap_or(Path::new("/"));
    if !parent.is_dir() {
        return Err(CliError::Message(format!(
            "run: --snapshot {}: folder {} does not exist",
            path.display(),
            parent.display()
        )));
    }
    if absolute.file_name().is_none() || path.as_os_str().to_string_lossy().ends_with('/') {
        return Err(CliError::Message(format!(
            "run: --snapshot {} names a folder, not a file",
            path.display()
        )));
    }
    Ok(absolute)
}

fn join_display(paths: &[PathBuf]) -> String {
    let shown: Vec<_> = paths.iter().map(|p| p.display().to_string()).collect();
    shown.join(", ")
}

// ---- Signals ----

/// The child's pid for the signal handler (0: not started yet, or reaped).
static CHILD: AtomicI32 = AtomicI32::new(0);
/// A forwarded signal that arrived before the child was started (0: none).
static HELD: AtomicI32 = AtomicI32::new(0);

const FORWARDED: [libc::c_int; 4] = [libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1, libc::SIGUSR2];
const IGNORED: [libc::c_int; 2] = [libc::SIGINT, libc::SIGQUIT];

/// The signal the kernel sends the child when the launcher dies (even by SIGKILL): the
/// same the launcher forwards to end it, so the child can clean up as it would then.
const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGTERM;

extern "C" fn forward(signal: libc::c_int) {
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; the pid is our child's, which we have not
        // reaped yet (the guard clears CHILD after wait returns).
        unsafe { libc::kill(pid, signal) };
    } else {
        HELD.store(signal, Ordering::SeqCst);
    }
}

/// Has the kernel end the child when the launcher dies, whatever kills it: between fork and
/// exec, the child asks for [`PARENT_DEATH_SIGNAL`] on its parent's death, then checks that
/// its parent is still the launcher (had it died before the request, the request would
/// never fire, so the child gives up instead of running orphaned). The child also gets the
/// default disposition of the signals the launcher ignores.
fn end_with_launcher(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is always safe to call.
    let launcher = unsafe { libc::getpid() };
    let setup = move || -> std::io::Result<()> {
        // SAFETY: prctl, getppid and signal are async-signal-safe; between fork and exec
        // this closure touches no memory but its captured pid.
        unsafe {
            if libc::prctl(libc::PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            for signal in IGNORED {
                libc::signal(signal, libc::SIG_DFL);
            }
        }
        Ok(())
    };
    // SAFETY: the closure only makes async-signal-safe calls (see above).
    unsafe { command.pre_exec(setup) };
}

/// Forwards signals to the child while alive; restores the defaults when dropped.
#[derive(Debug)]
struct SignalForwarding;

impl SignalForwarding {
    /// Installs the handlers; signals that arrive before [`SignalForwarding::attach`] are
    /// held for the child.
    fn install() -> Self {
        CHILD.store(0, Ordering::SeqCst);
        HELD.store(0, Ordering::SeqCst);
        let handler = forward as extern "C" fn(libc::c_int) as libc::sighandler_t;
        for signal in FORWARDED {
            // SAFETY: installing a handler that only does atomic loads and stores and
            // kill(2).
            unsafe { libc::signal(signal, handler) };
        }
        for signal in IGNORED {
            // SAFETY: ignoring a signal in this process; the child restores the default
            // before exec (`end_with_launcher`).
            unsafe { libc::signal(signal, libc::SIG_IGN) };
        }
        Self
    }

    /// From now on signals go to `pid`; one held meanwhile is delivered now.
    fn attach(&self, pid: u32) {
        let pid = pid as i32;
        CHILD.store(pid, Ordering::SeqCst);
        let held = HELD.swap(0, Ordering::SeqCst);
        if held != 0 {
            // SAFETY: kill(2) of our own, not yet reaped, child.
            unsafe { libc::kill(pid, held) };
        }
    }
}

impl Drop for SignalForwarding {
    fn drop(&mut self) {
        CHILD.store(0, Ordering::SeqCst);
        for signal in FORWARDED.into_iter().chain(IGNORED) {
            // SAFETY: restoring the default disposition.
            unsafe { libc::signal(signal, libc::SIG_DFL) };
        }
    }
}
