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
//! the launcher are forwarded to the child. SIGINT and SIGQUIT are ignored by the launcher
//! while the child runs: a terminal delivers them to the whole foreground group, child
//! included, and the launcher must outlive the child to report its status. While the child
//! is being started, all six are blocked in the launcher and in the child until the child
//! has its default dispositions back; one that arrives then reaches the child exactly once,
//! never swallowed. If the launcher dies anyway (SIGKILL), the kernel kills the child
//! with SIGKILL (`PR_SET_PDEATHSIG`, which a child cannot ignore): no child outlives its
//! launcher. A command that cannot be started gives 127 (not found) or 126 (not
//! executable), like a shell.

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
    // The start-up window, from before the child exists until it runs with its own signal
    // dispositions: signals are held (blocked) in the launcher, the child inherits the block
    // and lifts it once its dispositions are the defaults, and whatever arrived meanwhile
    // reaches the child exactly once (see `StartupSignals`).
    let startup = StartupSignals::hold()
        .map_err(|err| CliError::Message(format!("run: cannot set up signals: {err}")))?;
    end_with_launcher(&mut command, &startup);
    let spawned = command.spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(err) => {
            // No child: what arrived meanwhile is the launcher's own.
            startup.release_without_child();
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
    let _forwarding = startup.hand_over(child.id());
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

const FORWARDED: [libc::c_int; 4] = [libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1, libc::SIGUSR2];
const IGNORED: [libc::c_int; 2] = [libc::SIGINT, libc::SIGQUIT];
/// Every signal the launcher handles, in the order of the child's report (bit `i` is
/// `STARTUP[i]`).
const STARTUP: [libc::c_int; 6] = [
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGINT,
    libc::SIGQUIT,
];

/// The signal the kernel sends the child when the launcher dies, even by SIGKILL: SIGKILL,
/// which no child can ignore or handle, so that none outlives its launcher.
const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGKILL;

extern "C" fn forward(signal: libc::c_int) {
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; the pid is our child's, which we have not
        // reaped yet (the guard clears CHILD after wait returns).
        unsafe { libc::kill(pid, signal) };
    }
}

/// The launcher's SIGINT and SIGQUIT: nothing to do, the child gets them from the terminal.
extern "C" fn ignore(_: libc::c_int) {}

/// The signal set of `signals`.
fn set_of(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set it is given; sigaddset of valid signals.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &signal in signals {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// The launcher's signals through the start-up window. [`StartupSignals::hold`] blocks
/// [`STARTUP`] (so none is handled, ignored or lost while the child does not run yet) and
/// installs the handlers for afterwards; the child inherits the block and, between fork and
/// exec, restores the default dispositions, reports which of them are pending for it, and
/// lifts the block ([`end_with_launcher`]). [`StartupSignals::hand_over`] then takes each
/// signal still pending in the launcher: one the child did not get (sent before it
/// existed) is sent to it; then the block is lifted. A Ctrl-C or a SIGTERM in the window
/// thus ends the child once, and is never swallowed by a handler or an ignored
/// disposition the child inherited.
#[derive(Debug)]
struct StartupSignals {
    /// The launcher's mask before [`StartupSignals::hold`], restored in both processes.
    previous: libc::sigset_t,
    /// The pipe the child reports its pending signals on (read end, write end).
    report: (libc::c_int, libc::c_int),
}

impl StartupSignals {
    fn hold() -> std::io::Result<Self> {
        let startup = set_of(&STARTUP);
        // SAFETY: sigset_t is plain data, filled in by pthread_sigmask.
        let mut previous: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: blocking signals in this thread, the only one that spawns.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &startup, &mut previous) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        CHILD.store(0, Ordering::SeqCst);
        let handler = forward as extern "C" fn(libc::c_int) as libc::sighandler_t;
        for signal in FORWARDED {
            // SAFETY: installing a handler that only does an atomic load and kill(2).
            unsafe { libc::signal(signal, handler) };
        }
        let ignore = ignore as extern "C" fn(libc::c_int) as libc::sighandler_t;
        for signal in IGNORED {
            // SAFETY: a handler that does nothing: the launcher ignores them while the
            // child runs (a terminal sends them to the whole group). Not SIG_IGN, which
            // would discard one already pending; the child restores the default before
            // exec.
            unsafe { libc::signal(signal, ignore) };
        }
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills the two descriptors; close-on-exec keeps them out of the
        // program.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            let err = std::io::Error::last_os_error();
            Self::unblock(&previous);
            return Err(err);
        }
        Ok(StartupSignals {
            previous,
            report: (fds[0], fds[1]),
        })
    }

    fn unblock(previous: &libc::sigset_t) {
        // SAFETY: restoring this thread's earlier mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, previous, std::ptr::null_mut()) };
    }

    /// Closes the pipe and returns which [`STARTUP`] signals the child reported pending
    /// (none if it did not report: it never ran, or failed before).
    fn child_report(&self) -> u8 {
        let mut bits = 0u8;
        // SAFETY: our own descriptors; the write end is closed first so that the read
        // ends at the child's exec (close-on-exec) or exit.
        unsafe {
            libc::close(self.report.1);
            if libc::read(self.report.0, (&mut bits as *mut u8).cast(), 1) != 1 {
                bits = 0;
            }
            libc::close(self.report.0);
        }
        bits
    }

    /// The spawn failed: the signals that arrived meanwhile act on the launcher, as they
    /// would have without a child (default dispositions: most end it).
    fn release_without_child(self) {
        let _ = self.child_report();
        for signal in STARTUP {
            // SAFETY: restoring the default disposition.
            unsafe { libc::signal(signal, libc::SIG_DFL) };
        }
        Self::unblock(&self.previous);
    }

    /// The child `pid` runs: signals pending in the launcher that the child did not get
    /// are sent to it, then the block is lifted and forwarding goes on until the returned
    /// guard is dropped.
    fn hand_over(self, pid: u32) -> SignalForwarding {
        let pid = pid as i32;
        CHILD.store(pid, Ordering::SeqCst);
        let reported = self.child_report();
        let startup = set_of(&STARTUP);
        // SAFETY: zero timeout: sigtimedwait takes a pending signal of the set, or fails
        // at once; the signals are blocked, so none is handled meanwhile.
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        loop {
            // SAFETY: see above; `info` may be null.
            let signal = unsafe { libc::sigtimedwait(&startup, std::ptr::null_mut(), &zero) };
            if signal <= 0 {
                break;
            }
            let bit = STARTUP.iter().position(|&s| s == signal).unwrap_or(0);
            if reported & (1 << bit) == 0 {
                // Sent before the child existed: it is the child's now.
                // SAFETY: kill(2) of our own, not yet reaped, child.
                unsafe { libc::kill(pid, signal) };
            }
        }
        Self::unblock(&self.previous);
        SignalForwarding
    }
}

/// Has the kernel end the child when the launcher dies, whatever kills it, and ends the
/// start-up window in the child. Between fork and exec the child asks for
/// [`PARENT_DEATH_SIGNAL`] on its parent's death, then checks that its parent is still the
/// launcher (had it died before the request, the request would never fire, so the child
/// gives up instead of running orphaned); it restores the default disposition of every
/// signal the launcher handles, reports which are pending for it, and lifts the block it
/// inherited, so that those are delivered to it now, with their default action.
fn end_with_launcher(command: &mut Command, startup: &StartupSignals) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is always safe to call.
    let launcher = unsafe { libc::getpid() };
    let previous = startup.previous;
    let report = startup.report.1;
    let setup = move || -> std::io::Result<()> {
        // SAFETY: prctl, getppid, signal, sigpending, sigismember, write and
        // pthread_sigmask are async-signal-safe; between fork and exec this closure touches
        // no memory but its captured values and its stack.
        unsafe {
            if libc::prctl(libc::PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            for signal in STARTUP {
                libc::signal(signal, libc::SIG_DFL);
            }
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut pending);
            libc::sigpending(&mut pending);
            let mut bits = 0u8;
            for (i, &signal) in STARTUP.iter().enumerate() {
                if libc::sigismember(&pending, signal) == 1 {
                    bits |= 1 << i;
                }
            }
            libc::write(report, (&bits as *const u8).cast(), 1);
            libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
        }
        Ok(())
    };
    // SAFETY: the closure only makes async-signal-safe calls (see above).
    unsafe { command.pre_exec(setup) };
}

/// Forwards signals to the child while alive; restores the defaults when dropped.
#[derive(Debug)]
struct SignalForwarding;

impl Drop for SignalForwarding {
    fn drop(&mut self) {
        CHILD.store(0, Ordering::SeqCst);
        for signal in STARTUP {
            // SAFETY: restoring the default disposition.
            unsafe { libc::signal(signal, libc::SIG_DFL) };
        }
    }
}
