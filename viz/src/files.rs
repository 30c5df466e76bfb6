//! Opening and saving snapshot files in any format this crate knows.
//!
//! This is the top of the format modules: it picks the reader by content ([`crate::input`],
//! [`crate::sniff`]) and the writer by the caller's choice, so the formats themselves
//! ([`crate::model`]'s JSON, [`crate::pytorch`], [`crate::perfetto`]) never depend on one
//! another. Saving never loses data ([`crate::output`]): a failed conversion leaves the
//! target as it was, and an output that is the input (under any name) is refused before
//! anything is read.

use crate::error::VizError;
use crate::input::{self, UNRECOGNISED};
use crate::model::{parse_json, write_json, Snapshot};
use crate::sniff::{sniff, Content};
use std::io::Write;
use std::path::Path;

/// Reads any snapshot this crate understands: our JSON, the engine's JSON, or a PyTorch
/// pickle; each optionally gzip-compressed. Recognised by content, not by name, and read
/// within the limits of [`crate::limits`].
pub fn load(path: &Path) -> Result<Snapshot, VizError> {
    let raw = input::read_file(path)?;
    from_bytes(path, raw)
}

/// [`load`] of a file's content already in memory: `raw` is what the file `path` holds
/// (`path` only names it in errors).
pub fn from_bytes(path: &Path, raw: Vec<u8>) -> Result<Snapshot, VizError> {
    if sniff(&raw) == Content::Gzip && input::peek_content(&raw) == Content::Pickle {
        // The usual large file: decompressed while it is decoded, never held whole.
        return crate::pytorch::read_model_gzip(path, &raw);
    }
    let (content, bytes) = input::open(path, raw)?;
    match content {
        Content::Pickle => crate::pytorch::read_model(path, &bytes),
        Content::JsonObject => parse_json(path, &bytes),
        Content::Empty => Err(VizError::format(path, "the file is empty")),
        Content::Gzip | Content::JsonArray | Content::Other => {
            Err(VizError::format(path, UNRECOGNISED))
        }
    }
}

/// A file format [`save`] can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// Our JSON ([`write_json`]).
    Json,
    /// A PyTorch-compatible pickle ([`crate::pytorch::write_pickle`]).
    Pickle,
    /// A Chrome JSON trace for Perfetto ([`crate::perfetto::write_perfetto`]).
    Perfetto,
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

/// Writes `snapshot` to `path` in `format`, gzip-compressed when the name ends in `.gz`.
/// The file appears whole or not at all ([`crate::output::write_whole`]): on failure `path`
/// is untouched. Every error names `path`.
pub fn save(snapshot: &Snapshot, path: &Path, format: OutputFormat) -> Result<(), VizError> {
    crate::output::write_whole(path, |out| write_to(snapshot, out, path, format))
}

fn write_to(
    snapshot: &Snapshot,
    out: &mut impl Write,
    path: &Path,
    format: OutputFormat,
) -> Result<(), VizError> {
    // Errors of the writers name the format; the file is added here.
    let named = |e: VizError| match e {
        VizError::Unrepresentable { format, what } => VizError::Write {
            path: path.into(),
            what: format!("cannot write {format}: {what}"),
        },
        other => other,
    };
    let io = |e: std::io::Error| VizError::io(path, e);
    let write = |w: &mut dyn Write| -> Result<(), VizError> {
        let mut w = w;
        match format {
            OutputFormat::Json => write_json(snapshot, &mut w),
            OutputFormat::Pickle => {
                crate::pytorch::write_pickle(&crate::pytorch::to_torch(snapshot), &mut w)
            }
            OutputFormat::Perfetto => crate::perfetto::write_perfetto(snapshot, &mut w),
        }
    };
    if path.extension().is_some_and(|e| e == "gz") {
        // The writers emit many tiny writes: buffer them before the compressor.
        let enc = flate2::write::GzEncoder::new(out, flate2::Compression::default());
        let mut buffered = std::io::BufWriter::with_capacity(1 << 16, enc);
        write(&mut buffered).map_err(named)?;
        let enc = buffered.into_inner().map_err(|e| io(e.into_error()))?;
        enc.finish().map_err(io)?;
    } else {
        write(out).map_err(named)?;
    }
    Ok(())
}
