//! `streamalloc view FILE... [--port P]`: serves the bundled memory-timeline viewer for
//! the given snapshots on 127.0.0.1 and prints its URL.

use super::CliError;
use clap::Args;
use std::path::PathBuf;
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
}

pub(crate) fn run(args: ViewArgs) -> Result<ExitCode, CliError> {
    let mut files = Vec::new();
    // A file that cannot be read is reported and skipped: the others are still served.
    // Only when none can be read does the command fail, with the last file's error.
    let mut last_error = None;
    for path in &args.files {
        let snapshot = match files::load(path) {
            Ok(snapshot) => snapshot,
            Err(err) => {
                if let Some(earlier) = last_error.replace(err) {
                    eprintln!("streamalloc: {earlier}");
                }
                continue;
            }
        };
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        files.push((name, snapshot));
    }
    match last_error {
        Some(err) if files.is_empty() => return Err(err.into()),
        Some(err) => eprintln!("streamalloc: {err}"),
        None => {}
    }
    let viewer = Arc::new(server::Viewer::new(files));
    // Built now, within each file's memory budget: a file whose data would not fit is one
    // line and status 2, before anything is served.
    viewer.warm()?;
    let listener = server::bind(args.port)
        .map_err(|e| CliError::Message(format!("cannot listen on 127.0.0.1:{}: {e}", args.port)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::Message(format!("cannot read the listening address: {e}")))?;
    println!("streamalloc viewer: http://{addr}/  (Ctrl-C to stop)");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    server::serve(listener, viewer)
        .map_err(|e| CliError::Message(format!("viewer server failed: {e}")))?;
    Ok(ExitCode::SUCCESS)
}
