//! The one rule for every file streamalloc writes (converted snapshots, plots, exported
//! data, `streamalloc_dump_snapshot`, `run --snapshot`): regular files only, written whole
//! or not at all, never over the input.
//!
//! - **Regular files only.** A target that exists must be a regular file, or a symbolic
//!   link to one (the file it names is replaced, the link stays). A FIFO, a device, a
//!   directory, a socket or a link to any of them (`/dev/null`, `/proc/self/fd/1`) is
//!   refused in one line: replacing `/dev/null` with a file, or writing a snapshot into a
//!   pipe that expects something else, is never what was meant. `cp` writes into such
//!   targets and `sed -i` refuses them; we refuse.
//! - **Whole or not at all.** The output is written under a temporary name beside its
//!   target, flushed to disk, and renamed over the target only once complete; on any
//!   failure the temporary file is removed and the target is left as it was (a failed
//!   conversion must not destroy the user's only copy of a snapshot). An existing target
//!   keeps its permissions.
//! - **Never over the input.** An output that is the input, by any path (links, `..`, hard
//!   links: same device and inode), is refused before anything is read
//!   ([`check_distinct`]).

use crate::error::VizError;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What a non-regular file is, for the message refusing it.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "something else"
    }
}

/// Where an output for `path` is written: `path` itself when it does not exist or is a
/// regular file, the file a symbolic link names when it is a link to a regular file.
/// Anything else is refused in one line.
pub fn check_target(path: &Path) -> Result<PathBuf, VizError> {
    let refuse = |what: String| VizError::Write {
        path: path.into(),
        what: format!("{what}, not a regular file: outputs are written to regular files only"),
    };
    let link = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta.file_type().is_symlink(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(path.into()),
        Err(e) => return Err(VizError::io(path, e)),
    };
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() && !link => Ok(path.into()),
        Ok(meta) if meta.is_file() => std::fs::canonicalize(path)
            .map_err(|e| refuse(format!("is a link that cannot be followed ({e})"))),
        Ok(meta) if link => Err(refuse(format!("is a link to {}", kind_of(&meta)))),
        Ok(meta) => Err(refuse(format!("is {}", kind_of(&meta)))),
        Err(_) if link => Err(refuse("is a link to nothing".into())),
        Err(e) => Err(VizError::io(path, e)),
    }
}

/// Whether `a` and `b` name the same file (same device and inode), however they are
/// spelt (links, `..`, hard links). False when either does not exist.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// What a command that reads `input` and writes `output` checks before it reads anything:
/// the output may be written ([`check_target`]) and is not the input ([`check_distinct`]).
pub fn check_output(input: &Path, output: &Path) -> Result<(), VizError> {
    check_target(output)?;
    check_distinct(input, output)
}

/// Refuses to write `output` when it is `input`: the input would be destroyed.
pub fn check_distinct(input: &Path, output: &Path) -> Result<(), VizError> {
    if same_file(input, output) {
        return Err(VizError::Write {
            path: output.into(),
            what: format!(
                "is the input file {}: choose another output name",
                input.display()
            ),
        });
    }
    Ok(())
}

/// The temporary file written beside `target`.
fn temporary_beside(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map_or_else(|| "output".into(), |n| n.to_string_lossy().into_owned());
    target.with_file_name(format!(".{name}.{}.partial", std::process::id()))
}

/// Runs `write` on a buffered temporary file beside `path` (beside the file it names, for a
/// link), then renames it over the target. `path` must be a regular file or absent
/// ([`check_target`]). On any failure the temporary file is removed and the target is
/// left as it was. I/O errors of `write` name `path`.
pub fn write_whole(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<(), VizError>,
) -> Result<(), VizError> {
    let target = check_target(path)?;
    let temporary = temporary_beside(&target);
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
        .and_then(|()| {
            // A file replaced keeps its permissions.
            match std::fs::metadata(&target) {
                Ok(meta) => out
                    .get_ref()
                    .set_permissions(meta.permissions())
                    .map_err(io),
                Err(_) => Ok(()),
            }
        })
        .and_then(|()| out.get_ref().sync_all().map_err(io))
        .and_then(|()| {
            // The target may have changed kind since it was checked: check again just
            // before replacing it.
            check_target(&target)?;
            std::fs::rename(&temporary, &target).map_err(|e| VizError::Write {
                path: path.into(),
                what: format!("cannot rename {} over it: {e}", temporary.display()),
            })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}
