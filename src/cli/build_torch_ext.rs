//! `streamalloc build-torch-ext`: compiles the native PyTorch door ahead of its first use.
//!
//! `streamalloc.torch.install()` builds the door (`csrc/torch_door.cpp`, against the
//! installed PyTorch) the first time it runs and caches it; this command does the same
//! now, with each step shown, so that a training job does not pay the minute or fail on a
//! missing compiler. The work is Python's (`streamalloc._cli.build_torch_ext`), run with
//! the Python whose PyTorch the door is for.

use super::doctor::{python_command, python_exe};
use super::run::{exe_dir, find_file, find_python, LIB_ENV, LIB_NAME};
use super::CliError;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `streamalloc build-torch-ext`.
#[derive(clap::Args, Debug)]
pub(crate) struct BuildTorchExtArgs {
    /// The Python with the PyTorch to build for (default: the one that started the
    /// `streamalloc` command of a wheel, else `python3` on PATH).
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
    /// Rebuild even when a build for this PyTorch is cached.
    #[arg(long)]
    force: bool,
    /// Show the compiler's output.
    #[arg(long)]
    verbose: bool,
}

/// Builds the door; exit status 0 when built (or cached), 1 with one line naming what is
/// missing.
pub(crate) fn run(args: BuildTorchExtArgs) -> Result<ExitCode, CliError> {
    let exe_dir = exe_dir()?;
    let strip = |err: CliError| {
        let text = err.to_string();
        CliError::Message(format!(
            "build-torch-ext: {}",
            text.strip_prefix("run: ").unwrap_or(&text)
        ))
    };
    let lib = find_file(LIB_ENV, LIB_NAME, &exe_dir, "cargo build --release").map_err(strip)?;
    let python_dir = find_python(&exe_dir).map_err(strip)?;
    let python = python_exe(args.python.as_deref());
    let mut flags = Vec::new();
    if args.force {
        flags.push("--force");
    }
    if args.verbose {
        flags.push("--verbose");
    }
    let mut command = python_command(&python, &python_dir, "build-torch-ext", &flags);
    // The door links the library it is built against: the one `streamalloc run` uses.
    command.env(LIB_ENV, &lib);
    let status = command.status().map_err(|err| {
        CliError::Message(format!(
            "build-torch-ext: cannot start {}: {err} (pass --python)",
            python.to_string_lossy()
        ))
    })?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    })
}
