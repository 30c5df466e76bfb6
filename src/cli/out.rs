//! Printing for the subcommands: a report whose reader went away ends quietly.
//!
//! Rust ignores SIGPIPE, so `println!` panics when stdout is a pipe nobody reads any more
//! (`streamalloc replay ... | head -1`). Subcommands print their reports with [`outln!`]
//! instead, which hands back [`CliError::StdoutClosed`] for a closed pipe: the command
//! stops there, and `main` ends with status 0 and no message, as `cat` or `git log` end
//! for `head`. Other write errors (a full disk) are reported like any error. Diagnostics
//! go to stderr with [`errln!`], which drops what cannot be written: a closed stderr must
//! not change what a command does or its status.

use super::CliError;
use std::fmt;
use std::io::Write;

/// Writes `args` to stdout (flushed, so that a closed pipe shows at once).
pub(crate) fn write_out(args: fmt::Arguments<'_>) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(stdout_error)
}

/// Writes `args` to stderr, ignoring failure.
pub(crate) fn write_err(args: fmt::Arguments<'_>) {
    let _ = std::io::stderr().lock().write_fmt(args);
}

/// The error a failed write to stdout ends a command with.
pub(crate) fn stdout_error(err: std::io::Error) -> CliError {
    if err.kind() == std::io::ErrorKind::BrokenPipe {
        CliError::StdoutClosed
    } else {
        CliError::Message(format!("cannot write to stdout: {err}"))
    }
}

/// `println!` to stdout that returns `Result<(), CliError>` instead of panicking.
macro_rules! outln {
    () => {
        $crate::cli::out::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::out::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that never panics: a diagnostic that cannot be written is dropped.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::cli::out::write_err(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {errln, outln};
