//! Writing an output file whole or not at all.
//!
//! A conversion or a plot that fails half way must not leave half a file, and above all
//! must not destroy what was there (the user's only copy of a snapshot, perhaps): every
//! writer of this crate writes under a temporary name beside its target and renames it over
//! the target only once complete and flushed to disk. Errors name the target.

use crate::error::VizError;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The temporary file written beside `path`.
fn temporary_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "output".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.{}.partial", std::process::id()))
}

/// Runs `write` on a buffered temporary file beside `path`, then renames it to `path`. On
/// any failure the temporary file is removed and `path` is left as it was. I/O errors of
/// `write` name `path`.
pub fn write_whole(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<(), VizError>,
) -> Result<(), VizError> {
    let temporary = temporary_beside(path);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temporary)
        .map_err(|e| VizError::Write {
            path: path.into(),
            what: format!("cannot create {}: {e}", temporary.display()),
        })?;
    let io = |e: std::io::Error| VizError::io(path, e);
    let mut out = std::io::BufWriter::new(file);
    let written = write(&mut out)
        .and_then(|()| out.flush().map_err(io))
        .and_then(|()| out.get_ref().sync_all().map_err(io))
        .and_then(|()| {
            std::fs::rename(&temporary, path).map_err(|e| VizError::Write {
                path: path.into(),
                what: format!("cannot rename {} over it: {e}", temporary.display()),
            })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}
