//! Loading traces for `streamalloc replay`: PyTorch memory snapshots (pickle, gzipped or
//! not) and our own JSON (a list of trace entries, our snapshot as `snapshot convert --to
//! json` writes it, or the engine's snapshot with its `trace` list), turned into the
//! engine's [`TraceEntry`] records that [`super::run`] replays. Every snapshot the project
//! writes replays; a Perfetto trace (counters, no allocation events) is refused with the
//! keys it holds. This module only knows file formats, so the CLI, the tests and the
//! benchmark read traces the same way.

use serde::de::IgnoredAny;
use std::path::{Path, PathBuf};
use streamalloc_allocator::trace::{TraceAction, TraceEntry};
use streamalloc_allocator::{DevicePtr, StreamId};
use streamalloc_viz::limits::Budget;
use streamalloc_viz::limits::{range_within, MAX_ADDRESS_END};
use streamalloc_viz::model::{DeviceSnapshot, Snapshot};
use streamalloc_viz::sniff::Content;
use streamalloc_viz::{files, input, json};

/// Where the test PyTorch traces are for a checkout at `workspace_root`: `tests/data/traces`
/// in the repository, so a clone runs the same tests and benchmark without anything beside it.
pub fn shared_traces_dir(workspace_root: &Path) -> PathBuf {
    workspace_root.join("tests/data/traces")
}

/// One trace to replay: a name for the report and its entries.
#[derive(Debug, Clone)]
pub struct LoadedTrace {
    /// The file name, with `[device N]` appended when the file holds several devices.
    pub name: String,
    /// The entries, oldest first.
    pub entries: Vec<TraceEntry>,
}

/// Why a trace file could not be loaded: one line naming the file and the problem.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LoadError(pub String);

/// Reads `path`: a PyTorch snapshot pickle (`.pickle`, `.pickle.gz`, recognised by content)
/// or our JSON. A snapshot (PyTorch's or ours) gives one trace per device that recorded any
/// event.
pub fn load_traces(path: &Path) -> Result<Vec<LoadedTrace>, LoadError> {
    // The viewer's reader, so replay has the same size limits.
    let raw = input::read_file(path).map_err(|e| LoadError(e.to_string()))?;
    traces_from_bytes(path, raw)
}

/// [`load_traces`] of a file's content already in memory: `raw` is what the file `path`
/// holds (`path` names the traces and the errors). Any of the formats, gzip-compressed or
/// not: a PyTorch snapshot pickle, a list of trace entries, our JSON snapshot (what
/// `streamalloc snapshot convert --to json` writes), or the engine's snapshot.
pub fn traces_from_bytes(path: &Path, raw: Vec<u8>) -> Result<Vec<LoadedTrace>, LoadError> {
    let file_name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    // The viewer's bounded gunzip, sniffing and snapshot readers, so replay has the same
    // limits (sizes, memory, devices, addresses) and tells formats apart the same way.
    if input::peek_content(&raw) == Content::Pickle {
        // A gzip-compressed pickle is decompressed while it is decoded, never held whole.
        let snapshot = files::from_bytes(path, raw).map_err(|e| LoadError(e.to_string()))?;
        return from_model(&file_name, path, &snapshot);
    }
    let (content, bytes) = input::open(path, raw).map_err(|e| LoadError(e.to_string()))?;
    from_json(&file_name, path, content, &bytes)
}

/// The engine's record of one event of a file.
fn entry(action: TraceAction, addr: u64, size: u64, stream: u64, time_ns: u64) -> TraceEntry {
    TraceEntry {
        action,
        addr: DevicePtr(addr),
        size,
        stream: StreamId(stream),
        time_ns,
    }
}

/// Every entry's `addr + size` within [`MAX_ADDRESS_END`], as the snapshot readers
/// require of theirs, so the replay's sums cannot wrap.
fn check_ranges(path: &Path, entries: &[TraceEntry]) -> Result<(), LoadError> {
    match entries.iter().position(|e| !range_within(e.addr.0, e.size)) {
        None => Ok(()),
        Some(i) => Err(LoadError(format!(
            "{}: entry {i}: {:#x} of size {} ends past the address limit {MAX_ADDRESS_END:#x}",
            path.display(),
            entries[i].addr.0,
            entries[i].size
        ))),
    }
}

/// Our JSON, told apart by its first character and, for an object, its keys: a list of
/// trace entries; an object with `"format"`, our snapshot (read by `viz`, one trace per
/// device with events); any other object with a `trace` list of entries (the engine's
/// snapshot). Anything else is refused, saying what the file holds instead.
fn from_json(
    file_name: &str,
    path: &Path,
    content: Content,
    bytes: &[u8],
) -> Result<Vec<LoadedTrace>, LoadError> {
    let not_json = |e: serde_json::Error| {
        LoadError(format!(
            "{}: neither a PyTorch snapshot pickle nor streamalloc JSON: {e}",
            path.display()
        ))
    };
    let bad_entry =
        |e: serde_json::Error| LoadError(format!("{}: bad trace entry: {e}", path.display()));
    // PyTorch's markers are left out here too, as from every format.
    let one = |mut entries: Vec<TraceEntry>| {
        check_ranges(path, &entries)?;
        entries.retain(|e| !e.action.is_marker());
        Ok(vec![LoadedTrace {
            name: file_name.to_string(),
            entries,
        }])
    };
    // The entries are read within the input's memory budget, as every reader's are.
    let within = |e: json::ParseError| match e {
        json::ParseError::Json(e) => bad_entry(e),
        json::ParseError::Over(over) => LoadError(format!("{}: {over}", path.display())),
    };
    match content {
        Content::JsonArray => {
            // Checked as JSON first, so that broken syntax is not blamed on an entry.
            serde_json::from_slice::<IgnoredAny>(bytes).map_err(not_json)?;
            #[derive(serde::Deserialize)]
            #[serde(transparent)]
            struct Entries(#[serde(deserialize_with = "json::vec")] Vec<TraceEntry>);
            let (Entries(entries), _) =
                json::parse_within(bytes, Budget::for_input(bytes.len())).map_err(within)?;
            one(entries)
        }
        Content::JsonObject => {
            let keys = json::ObjectKeys::of(bytes).map_err(not_json)?;
            if keys.format {
                let snapshot = streamalloc_viz::model::parse_json(path, bytes)
                    .map_err(|e| LoadError(e.to_string()))?;
                from_model(file_name, path, &snapshot)
            } else if keys.trace {
                #[derive(serde::Deserialize)]
                struct WithTrace {
                    #[serde(deserialize_with = "json::vec")]
                    trace: Vec<TraceEntry>,
                }
                let (with, _): (WithTrace, _) =
                    json::parse_within(bytes, Budget::for_input(bytes.len())).map_err(within)?;
                one(with.trace)
            } else {
                Err(LoadError(format!(
                    "{}: a JSON object with keys [{}], not a snapshot with a trace",
                    path.display(),
                    key_list(&keys)
                )))
            }
        }
        Content::Gzip | Content::Pickle | Content::Empty | Content::Other => {
            let value: serde_json::Value = serde_json::from_slice(bytes).map_err(not_json)?;
            let kind = match value {
                serde_json::Value::String(_) => "a JSON string",
                serde_json::Value::Number(_) => "a JSON number",
                serde_json::Value::Bool(_) => "a JSON boolean",
                _ => "JSON null",
            };
            Err(LoadError(format!(
                "{}: {kind}, neither a list of trace entries nor a snapshot",
                path.display()
            )))
        }
    }
}

/// The first few keys, quoted and shortened, for an error message: the file may be
/// anyone's, so its keys may be many, long, or hold control characters.
fn key_list(keys: &json::ObjectKeys) -> String {
    const SHOWN: usize = json::ObjectKeys::SHOWN;
    const LONGEST: usize = 40;
    let count = keys.count;
    let mut sorted = keys.first.clone();
    sorted.sort();
    let mut shown: Vec<String> = sorted
        .iter()
        .take(SHOWN)
        .map(|key| {
            let short: String = key.chars().take(LONGEST).collect();
            let ellipsis = if short.len() < key.len() { "…" } else { "" };
            format!("{short:?}{ellipsis}")
        })
        .collect();
    if count > SHOWN {
        shown.push(format!("… {} more", count - SHOWN));
    }
    shown.join(", ")
}

/// One trace per device with events from our snapshot (read from our JSON or from a
/// PyTorch pickle); PyTorch's markers (`snapshot`, `user_defined`) are left out, and a
/// snapshot without events is an error.
fn from_model(
    file_name: &str,
    path: &Path,
    snapshot: &Snapshot,
) -> Result<Vec<LoadedTrace>, LoadError> {
    let devices: Vec<&DeviceSnapshot> = snapshot
        .devices
        .iter()
        .filter(|d| !d.trace.is_empty())
        .collect();
    if devices.is_empty() {
        let hint = if snapshot.source == "pytorch" {
            " (was it recorded with torch.cuda.memory._record_memory_history()?)"
        } else {
            ""
        };
        return Err(LoadError(format!(
            "{}: the snapshot records no trace events{hint}",
            path.display()
        )));
    }
    let several = devices.len() > 1;
    Ok(devices
        .into_iter()
        .map(|d| LoadedTrace {
            name: if several {
                format!("{file_name}[device {}]", d.device)
            } else {
                file_name.to_string()
            },
            entries: d
                .trace
                .iter()
                .filter(|e| !e.action.is_marker())
                .map(|e| entry(e.action, e.addr, e.size, e.stream, e.time_ns))
                .collect(),
        })
        .collect())
}
