//! `streamalloc plot FILE -o timeline.svg|png [--replay]`: renders the active-memory
//! timeline without a browser, titled, with a legend and axis titles; with `--replay`,
//! streamalloc's replayed reserved memory drawn over it (see [`super::overlay`]).

use super::out::errln;
use super::overlay::{print_figures, replay_device, ReplayOverlayArgs};
use super::CliError;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use streamalloc_viz::plot::PlotOptions;
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
    #[command(flatten)]
    replay: ReplayOverlayArgs,
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
    let config = args.replay.config()?;
    // Checked before reading: the image must be a regular file (or new) and not the input.
    files::check_output(&args.file, &args.output)?;
    let mut snapshot = files::load(&args.file)?;
    let name = super::view::display_name(&args.file);
    // The replay is charged to the file's budget, and the drawing to what it leaves.
    let mut budget = snapshot.budget.clone();
    let overlay = match (&config, plot::shown_device(&snapshot)) {
        (Some(config), Some(device)) if !device.trace.is_empty() => Some(
            replay_device(&name, &snapshot, device, config, &mut budget)
                .map_err(|e| name_input(e, &args.file))?,
        ),
        (Some(_), _) => {
            errln!("streamalloc: {name}: no trace events to replay; plotting without --replay");
            None
        }
        (None, _) => None,
    };
    snapshot.budget = budget;
    let options = PlotOptions {
        name: Some(&name),
        overlay: overlay.as_ref(),
    };
    plot::plot_with(&snapshot, &args.output, args.width, args.height, &options)
        .map_err(|e| e.naming_input(&args.file))?;
    errln!(
        "{}: timeline written to {}",
        args.file.display(),
        args.output.display()
    );
    // After the picture, which is what was asked for: a closed stdout loses only these.
    if let (Some(overlay), Some(device)) = (&overlay, plot::shown_device(&snapshot)) {
        print_figures(&name, device.device, overlay)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A budget error of the replay names the input file as given, like the other stages'.
fn name_input(err: CliError, input: &std::path::Path) -> CliError {
    match err {
        CliError::Viz(err) => CliError::Viz(err.naming_input(input)),
        other => other,
    }
}
