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
use crate::limits::{Budget, OverBudget};
use crate::model::{parse_json, write_json, Snapshot};
use crate::sniff::{sniff, Content};
use std::cell::RefCell;
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

pub use crate::output::{check_distinct, check_output, same_file};

/// Writes `snapshot` to `path` in `format`, gzip-compressed when the name ends in `.gz`.
/// The file appears whole or not at all ([`crate::output::write_whole`]): on failure `path`
/// is untouched. What writing builds (the timeline of a Perfetto trace, PyTorch's shape of
/// the snapshot) and the bytes written are charged to what is left of the snapshot's
/// budget ([`Snapshot::budget`]): a file that would write more is refused in one line.
/// Every error names `path`.
pub fn save(snapshot: &Snapshot, path: &Path, format: OutputFormat) -> Result<(), VizError> {
    let budget = RefCell::new(snapshot.budget.clone());
    crate::output::write_whole(path, |out| write_to(snapshot, out, path, format, &budget))
}

/// What the budget calls writing a file.
const WRITING: &str = "writing the output";

/// A writer that charges every byte written to a budget.
struct Charged<'a, W: Write> {
    out: W,
    budget: &'a RefCell<Budget>,
}

impl<W: Write> Write for Charged<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.budget
            .borrow_mut()
            .charge_for(WRITING, buf.len() as u64)
            .map_err(|over| std::io::Error::other(over.to_string()))?;
        self.out.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

fn write_to(
    snapshot: &Snapshot,
    out: &mut impl Write,
    path: &Path,
    format: OutputFormat,
    budget: &RefCell<Budget>,
) -> Result<(), VizError> {
    let over = |o: OverBudget| VizError::Limit {
        path: path.into(),
        what: o.to_string(),
    };
    let refused_before = budget.borrow().refused();
    let mut out = Charged { out, budget };
    // Errors of the writers name the format; the file is added here.
    let named = |e: VizError| match e {
        VizError::Unrepresentable { format, what } => VizError::Write {
            path: path.into(),
            what: format!("cannot write {format}: {what}"),
        },
        other => other,
    };
    let write = |w: &mut dyn Write| -> Result<(), VizError> {
        let mut w = w;
        match format {
            OutputFormat::Json => write_json(snapshot, &mut w),
            OutputFormat::Pickle => {
                let torch = crate::pytorch::to_torch_within(snapshot, &mut budget.borrow_mut())
                    .map_err(over)?;
                crate::pytorch::write_pickle(&torch, &mut w)
            }
            OutputFormat::Perfetto => {
                crate::perfetto::write_perfetto_within(snapshot, &mut w, budget)
            }
        }
    };
    let result = if path.extension().is_some_and(|e| e == "gz") {
        // The writers emit many tiny writes: buffer them before the compressor.
        let enc = flate2::write::GzEncoder::new(&mut out, flate2::Compression::default());
        let mut buffered = std::io::BufWriter::with_capacity(1 << 16, enc);
        write(&mut buffered).and_then(|()| {
            let enc = buffered
                .into_inner()
                .map_err(|e| VizError::io(path, e.into_error()))?;
            enc.finish().map(drop).map_err(|e| VizError::io(path, e))
        })
    } else {
        write(&mut out)
    };
    // A charge refused while writing (the bytes written, or what a writer builds) is the
    // budget's error, whatever error the writer turned it into.
    let refused = budget.borrow().refused();
    match (result, refused) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(o)) if Some(o) != refused_before => Err(over(o)),
        (Err(e), _) => Err(named(e)),
    }
}
