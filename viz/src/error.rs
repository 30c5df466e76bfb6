//! The one error type of this crate. Every message names the file and what is wrong with
//! it in one line, because the CLI prints it as is (`streamalloc: <message>`).

use std::path::PathBuf;

/// Why a snapshot could not be read, converted or written.
#[derive(Debug, thiserror::Error)]
pub enum VizError {
    /// The file could not be opened, read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The file starts like a gzip stream but does not decompress (truncated or corrupt).
    #[error("{}: corrupt or truncated gzip data: {source}", path.display())]
    Gzip {
        /// The file concerned.
        path: PathBuf,
        /// What the decompressor said.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a pickle the reader can decode (truncated, corrupt, or a pickle
    /// of Python objects other than plain dicts, lists and scalars).
    #[error("{}: not a readable pickle: {message}", path.display())]
    Pickle {
        /// The file concerned.
        path: PathBuf,
        /// What the pickle decoder said.
        message: String,
    },
    /// The file decodes but is not a memory snapshot of the expected shape: `what` names
    /// the offending key or value (`device_traces[0][12].action: unknown action "foo"`).
    #[error("{}: not a memory snapshot: {what}", path.display())]
    Format {
        /// The file concerned.
        path: PathBuf,
        /// The offending key or value and what was expected of it.
        what: String,
    },
    /// Our JSON snapshot could not be parsed.
    #[error("{}: invalid streamalloc JSON snapshot: {source}", path.display())]
    Json {
        /// The file concerned.
        path: PathBuf,
        /// What the JSON parser said (line and column included).
        #[source]
        source: serde_json::Error,
    },
    /// The file exceeds one of the readers' limits (decompressed size, ...): `what` names
    /// the limit and how to raise it where it can be raised.
    #[error("{}: {what}", path.display())]
    Limit {
        /// The file concerned.
        path: PathBuf,
        /// The limit exceeded.
        what: String,
    },
    /// An output file could not be written: `what` says why (the file is the input, the
    /// target format cannot express the snapshot, the disk refused).
    #[error("{}: {what}", path.display())]
    Write {
        /// The output file.
        path: PathBuf,
        /// What went wrong.
        what: String,
    },
    /// The snapshot holds something the target format cannot express.
    #[error("cannot write {format}: {what}")]
    Unrepresentable {
        /// The target format.
        format: &'static str,
        /// What does not fit.
        what: String,
    },
}

impl VizError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        VizError::Io {
            path: path.into(),
            source,
        }
    }

    /// A budget error ([`VizError::Limit`]) of a stage that writes an output names the
    /// output; the budget is the input's, so the message names `input` instead.
    pub fn naming_input(self, input: &std::path::Path) -> Self {
        match self {
            VizError::Limit { what, .. } => VizError::Limit {
                path: input.into(),
                what,
            },
            other => other,
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, what: impl Into<String>) -> Self {
        VizError::Format {
            path: path.into(),
            what: what.into(),
        }
    }
}
