//! `streamalloc snapshot convert IN OUT --to json|pickle|perfetto`: converts between our
//! JSON snapshots, PyTorch's memory-snapshot pickles and Perfetto traces. The output is
//! written whole or not at all, and never over the input.

use super::out::errln;
use super::CliError;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use streamalloc_viz::files::{self, OutputFormat};

/// Arguments of `streamalloc snapshot`.
#[derive(Args, Debug)]
pub(crate) struct SnapshotArgs {
    #[command(subcommand)]
    command: SnapshotCommand,
}

#[derive(Subcommand, Debug)]
enum SnapshotCommand {
    /// Convert a snapshot (our JSON, an engine JSON or a PyTorch pickle, gzip or not).
    Convert(ConvertArgs),
}

#[derive(Args, Debug)]
struct ConvertArgs {
    /// Input file.
    input: PathBuf,
    /// Output file (gzip-compressed when it ends in .gz).
    output: PathBuf,
    /// Output format.
    #[arg(long, value_enum)]
    to: Target,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Target {
    /// streamalloc's versioned JSON snapshot.
    Json,
    /// PyTorch-compatible pickle (opens in torch.cuda._memory_viz and pytorch.org/memory_viz).
    Pickle,
    /// Chrome JSON trace with counter tracks (ui.perfetto.dev).
    Perfetto,
}

pub(crate) fn run(args: SnapshotArgs) -> Result<ExitCode, CliError> {
    match args.command {
        SnapshotCommand::Convert(c) => {
            // Checked before reading: the output must be a regular file (or new) and not
            // the input, which it would replace.
            files::check_output(&c.input, &c.output)?;
            let snapshot = files::load(&c.input)?;
            let format = match c.to {
                Target::Json => OutputFormat::Json,
                Target::Pickle => OutputFormat::Pickle,
                Target::Perfetto => OutputFormat::Perfetto,
            };
            files::save(&snapshot, &c.output, format).map_err(|e| e.naming_input(&c.input))?;
            errln!(
                "{}: {} events on {} device(s) written to {}",
                c.input.display(),
                snapshot.event_count(),
                snapshot.devices.len(),
                c.output.display()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
