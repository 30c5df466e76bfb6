//! `streamalloc view FILE... [--port P] [--replay]`: serves the bundled memory-timeline
//! viewer for the given snapshots on 127.0.0.1 and prints its URL; with `--replay`, every
//! device's timeline carries streamalloc's replayed reserved memory (see
//! [`super::overlay`]).

use super::out::{errln, outln};
use super::overlay::{print_figures, replay_device, ReplayOverlayArgs};
use super::CliError;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use streamalloc_viz::{files, server};

/// Arguments of `streamalloc view`.
#[derive(Args, Debug)]
pub(crate) struct ViewArgs {
    /// Snapshots to show (our JSON, engine JSON or PyTorch pickles, gzip or not).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Port on 127.0.0.1 (0: any free port).
    #[arg(long, default_value_t = 8765)]
    port: u16,
    #[command(flatten)]
    replay: ReplayOverlayArgs,
}

/// The name a file is shown under: its file name.
pub(crate) fn display_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

pub(crate) fn run(args: ViewArgs) -> Result<ExitCode, CliError> {
    let config = args.replay.config()?;
    let mut files = Vec::new();
    // A file that cannot be read is reported and skipped: the others are still served.
    // Only when none can be read does the command fail, with the last file's error.
    let mut last_error = None;
    for path in &args.files {
        let snapshot = match files::load(path) {
            Ok(snapshot) => snapshot,
            Err(err) => {
                if let Some(earlier) = last_error.replace(err) {
                    errln!("streamalloc: {earlier}");
                }
                continue;
            }
        };
        files.push((display_name(path), snapshot));
    }
    match last_error {
        Some(err) if files.is_empty() => return Err(err.into()),
        Some(err) => errln!("streamalloc: {err}"),
        None => {}
    }
    let mut overlays = Vec::new();
    if let Some(config) = &config {
        for (f, (name, snapshot)) in files.iter_mut().enumerate() {
            // The replay is charged to the file's budget, as the viewer's data is next.
            let mut budget = snapshot.budget.clone();
            for (d, device) in snapshot.devices.iter().enumerate() {
                if !device.trace.is_empty() {
                    let overlay = replay_device(name, snapshot, device, config, &mut budget)?;
                    print_figures(name, device.device, &overlay)?;
                    overlays.push((f, d, overlay));
                }
            }
            snapshot.budget = budget;
        }
    }
    if config.is_some() && overlays.is_empty() {
        errln!("streamalloc: no snapshot has trace events to replay; serving without --replay");
    }
    let mut viewer = server::Viewer::new(files);
    for (f, d, overlay) in &overlays {
        viewer.set_replay(*f, *d, overlay)?;
    }
    let viewer = Arc::new(viewer);
    // Built now, within each file's memory budget: a file whose data would not fit is one
    // line and status 2, before anything is served.
    viewer.warm()?;
    let listener = server::bind(args.port).map_err(|e| bind_error(args.port, &e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::Message(format!("cannot read the listening address: {e}")))?;
    outln!("streamalloc viewer: http://{addr}/  (Ctrl-C to stop)")?;
    server::serve(listener, viewer)
        .map_err(|e| CliError::Message(format!("viewer server failed: {e}")))?;
    Ok(ExitCode::SUCCESS)
}

/// Why the viewer cannot listen on `port`, saying what to do about a busy port.
fn bind_error(port: u16, err: &std::io::Error) -> CliError {
    let hint = match err.kind() {
        std::io::ErrorKind::AddrInUse => {
            " (another program, perhaps another viewer, uses it): pass --port 0 for any free \
             port, or another port"
        }
        _ => "",
    };
    CliError::Message(format!("cannot listen on 127.0.0.1:{port}: {err}{hint}"))
}
