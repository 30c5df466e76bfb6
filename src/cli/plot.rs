//! `streamalloc plot FILE -o timeline.svg|png`: renders the active-memory timeline without
//! a browser.

use super::CliError;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use streamalloc_viz::{files, plot};

/// Arguments of `streamalloc plot`.
#[derive(Args, Debug)]
pub(crate) struct PlotArgs {
    /// Snapshot (our JSON, engine JSON or a PyTorch pickle, gzip or not).
    file: PathBuf,
    /// Output image: .svg or .png.
    #[arg(short, long)]
    output: PathBuf,
    /// Width in pixels.
    #[arg(long, default_value_t = 1200)]
    width: usize,
    /// Height in pixels.
    #[arg(long, default_value_t = 500)]
    height: usize,
}

pub(crate) fn run(args: PlotArgs) -> Result<ExitCode, CliError> {
    if !(100..=20_000).contains(&args.width) || !(100..=20_000).contains(&args.height) {
        return Err(CliError::Message(
            "--width and --height must be between 100 and 20000".into(),
        ));
    }
    if args.width * args.height > plot::MAX_PIXELS {
        return Err(CliError::Message(format!(
            "--width {} --height {}: {} pixels exceed the limit of {} (width times height)",
            args.width,
            args.height,
            args.width * args.height,
            plot::MAX_PIXELS
        )));
    }
    // Checked before reading: the image must be a regular file (or new) and not the input.
    files::check_output(&args.file, &args.output)?;
    let snapshot = files::load(&args.file)?;
    plot::plot(&snapshot, &args.output, args.width, args.height)
        .map_err(|e| e.naming_input(&args.file))?;
    eprintln!(
        "{}: timeline written to {}",
        args.file.display(),
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}
