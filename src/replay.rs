//! Loading traces for `streamalloc replay`: PyTorch memory snapshots (pickle, gzipped or
//! not) and our own JSON (a list of trace entries, our snapshot as `snapshot convert --to
//! json` writes it, or the engine's snapshot with its `trace` list), turned into the
//! engine's [`TraceEntry`] records that [`streamalloc_allocator::replay`] runs. Every
//! snapshot the project writes replays; a Perfetto trace (counters, no allocation events)
//! is refused with the keys it holds.
//!
//! The replay itself lives in the engine crate; this module only knows file formats, so
//! the CLI, the tests and the benchmark read traces the same way.

use serde::de::IgnoredAny;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use streamalloc_allocator::trace::{TraceAction, TraceEntry};
use streamalloc_allocator::{DevicePtr, StreamId};
use streamalloc_viz::model::{Action, DeviceSnapshot, Snapshot};
use streamalloc_viz::pytorch::{maybe_gunzip, parse_snapshot, TorchAction, TorchSnapshot};

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
    let raw = std::fs::read(path).map_err(|e| LoadError(format!("{}: {e}", path.display())))?;
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
    // The viewer's bounded gunzip, so replay has the same decompressed-size limits.
    let bytes = maybe_gunzip(path, raw).map_err(|e| LoadError(e.to_string()))?;
    if bytes.first() == Some(&0x80) {
        let snapshot = parse_snapshot(path, &bytes).map_err(|e| LoadError(e.to_string()))?;
        return from_torch(&file_name, path, &snapshot);
    }
    from_json(&file_name, path, &bytes)
}

/// One trace per device with events; an empty snapshot is an error (nothing to replay).
fn from_torch(
    file_name: &str,
    path: &Path,
    snapshot: &TorchSnapshot,
) -> Result<Vec<LoadedTrace>, LoadError> {
    let devices: Vec<(usize, &Vec<_>)> = snapshot
        .device_traces
        .iter()
        .enumerate()
        .filter(|(_, t)| !t.is_empty())
        .collect();
    if devices.is_empty() {
        return Err(LoadError(format!(
            "{}: the snapshot records no trace events (was it recorded with \
             torch.cuda.memory._record_memory_history()?)",
            path.display()
        )));
    }
    let several = devices.len() > 1;
    Ok(devices
        .into_iter()
        .map(|(device, trace)| LoadedTrace {
            name: if several {
                format!("{file_name}[device {device}]")
            } else {
                file_name.to_string()
            },
            entries: trace
                .iter()
                .filter_map(|e| {
                    let action = match e.action {
                        TorchAction::Alloc => TraceAction::Alloc,
                        TorchAction::FreeRequested => TraceAction::FreeRequested,
                        TorchAction::FreeCompleted => TraceAction::FreeCompleted,
                        TorchAction::SegmentAlloc => TraceAction::SegmentAlloc,
                        TorchAction::SegmentFree => TraceAction::SegmentFree,
                        TorchAction::SegmentMap => TraceAction::SegmentMap,
                        TorchAction::SegmentUnmap => TraceAction::SegmentUnmap,
                        TorchAction::Oom => TraceAction::Oom,
                        TorchAction::Snapshot | TorchAction::UserDefined => return None,
                    };
                    Some(TraceEntry {
                        action,
                        addr: DevicePtr(e.addr),
                        size: e.size,
                        stream: StreamId(e.stream),
                        time_ns: e.time_us.unwrap_or(0).saturating_mul(1000),
                    })
                })
                .collect(),
        })
        .collect())
}

/// Our JSON, told apart by its first character and, for an object, its keys: a list of
/// trace entries; an object with `"format"`, our snapshot (read by `viz`, one trace per
/// device with events); any other object with a `trace` list of entries (the engine's
/// snapshot). Anything else is refused, saying what the file holds instead.
fn from_json(file_name: &str, path: &Path, bytes: &[u8]) -> Result<Vec<LoadedTrace>, LoadError> {
    let not_json = |e: serde_json::Error| {
        LoadError(format!(
            "{}: neither a PyTorch snapshot pickle nor streamalloc JSON: {e}",
            path.display()
        ))
    };
    let bad_entry =
        |e: serde_json::Error| LoadError(format!("{}: bad trace entry: {e}", path.display()));
    let one = |entries| {
        Ok(vec![LoadedTrace {
            name: file_name.to_string(),
            entries,
        }])
    };
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => {
            // Checked as JSON first, so that broken syntax is not blamed on an entry.
            serde_json::from_slice::<IgnoredAny>(bytes).map_err(not_json)?;
            one(serde_json::from_slice(bytes).map_err(bad_entry)?)
        }
        Some(b'{') => {
            let keys: BTreeMap<String, IgnoredAny> =
                serde_json::from_slice(bytes).map_err(not_json)?;
            if keys.contains_key("format") {
                let snapshot = streamalloc_viz::model::parse_json(path, bytes)
                    .map_err(|e| LoadError(e.to_string()))?;
                from_model(file_name, path, &snapshot)
            } else if keys.contains_key("trace") {
                #[derive(serde::Deserialize)]
                struct WithTrace {
                    trace: Vec<TraceEntry>,
                }
                let with: WithTrace = serde_json::from_slice(bytes).map_err(bad_entry)?;
                one(with.trace)
            } else {
                Err(LoadError(format!(
                    "{}: a JSON object with keys [{}], not a snapshot with a trace",
                    path.display(),
                    key_list(keys.keys())
                )))
            }
        }
        _ => {
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

/// The first few `keys`, quoted and shortened, for an error message: the file may be
/// anyone's, so its keys may be many, long, or hold control characters.
fn key_list<'a>(keys: impl ExactSizeIterator<Item = &'a String>) -> String {
    const SHOWN: usize = 8;
    const LONGEST: usize = 40;
    let count = keys.len();
    let mut shown: Vec<String> = keys
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

/// One trace per device with events from our snapshot; PyTorch's markers (`snapshot`,
/// `user_defined`) are left out as in [`from_torch`], and a snapshot without events is an
/// error.
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
        return Err(LoadError(format!(
            "{}: the snapshot records no trace events",
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
                .filter_map(|e| {
                    let action = match e.action {
                        Action::Alloc => TraceAction::Alloc,
                        Action::FreeRequested => TraceAction::FreeRequested,
                        Action::FreeCompleted => TraceAction::FreeCompleted,
                        Action::SegmentAlloc => TraceAction::SegmentAlloc,
                        Action::SegmentFree => TraceAction::SegmentFree,
                        Action::SegmentMap => TraceAction::SegmentMap,
                        Action::SegmentUnmap => TraceAction::SegmentUnmap,
                        Action::Oom => TraceAction::Oom,
                        Action::CrossStreamWait => TraceAction::CrossStreamWait,
                        Action::StagingAcquire => TraceAction::StagingAcquire,
                        Action::StagingRelease => TraceAction::StagingRelease,
                        Action::EmptyCache => TraceAction::EmptyCache,
                        Action::Snapshot | Action::UserDefined => return None,
                    };
                    Some(TraceEntry {
                        action,
                        addr: DevicePtr(e.addr),
                        size: e.size,
                        stream: StreamId(e.stream),
                        time_ns: e.time_ns,
                    })
                })
                .collect(),
        })
        .collect())
}
