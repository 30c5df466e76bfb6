//! Loading traces for `streamalloc replay`: PyTorch memory snapshots (pickle, gzipped or
//! not) and our own JSON (a list of trace entries, or a snapshot with a `trace` list),
//! turned into the engine's [`TraceEntry`] records that
//! [`streamalloc_allocator::replay`] runs.
//!
//! The replay itself lives in the engine crate; this module only knows file formats, so
//! the CLI, the tests and the benchmark read traces the same way.

use std::path::{Path, PathBuf};
use streamalloc_allocator::trace::{TraceAction, TraceEntry};
use streamalloc_allocator::{DevicePtr, StreamId};
use streamalloc_viz::pytorch::{parse_snapshot, TorchAction, TorchSnapshot};

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
/// or our JSON. A PyTorch snapshot gives one trace per device that recorded any event.
pub fn load_traces(path: &Path) -> Result<Vec<LoadedTrace>, LoadError> {
    let file_name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let raw = std::fs::read(path).map_err(|e| LoadError(format!("{}: {e}", path.display())))?;
    let is_gzip = raw.starts_with(&[0x1f, 0x8b]);
    let is_pickle = raw.first() == Some(&0x80);
    if is_gzip || is_pickle {
        let bytes = if is_gzip { gunzip(path, raw)? } else { raw };
        if bytes.first() == Some(&0x80) {
            let snapshot = parse_snapshot(path, &bytes).map_err(|e| LoadError(e.to_string()))?;
            return from_torch(&file_name, path, &snapshot);
        }
        let entries = from_json(path, &bytes)?;
        return Ok(vec![LoadedTrace {
            name: file_name,
            entries,
        }]);
    }
    let entries = from_json(path, &raw)?;
    Ok(vec![LoadedTrace {
        name: file_name,
        entries,
    }])
}

/// The viewer's bounded gunzip, so replay has the same decompressed-size limits.
fn gunzip(path: &Path, raw: Vec<u8>) -> Result<Vec<u8>, LoadError> {
    streamalloc_viz::pytorch::maybe_gunzip(path, raw).map_err(|e| LoadError(e.to_string()))
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

/// Our JSON: a list of trace entries, or an object (a snapshot) with a `trace` list.
fn from_json(path: &Path, bytes: &[u8]) -> Result<Vec<TraceEntry>, LoadError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        LoadError(format!(
            "{}: neither a PyTorch snapshot pickle nor streamalloc JSON: {e}",
            path.display()
        ))
    })?;
    let list = match value {
        serde_json::Value::Array(_) => value,
        serde_json::Value::Object(mut map) => map.remove("trace").ok_or_else(|| {
            LoadError(format!(
                "{}: JSON object without a `trace` list of entries",
                path.display()
            ))
        })?,
        _ => {
            return Err(LoadError(format!(
                "{}: JSON is neither a list of trace entries nor a snapshot",
                path.display()
            )))
        }
    };
    serde_json::from_value(list)
        .map_err(|e| LoadError(format!("{}: bad trace entry: {e}", path.display())))
}
