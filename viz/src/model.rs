//! The snapshot model every format converts through, and our versioned JSON schema.
//!
//! Three sources feed the viewer: the engine's [`streamalloc_allocator::Snapshot`], PyTorch's
//! pickles ([`crate::pytorch`]) and our own JSON files. Rather than convert each into each,
//! all of them become one [`Snapshot`], which is also exactly what our JSON holds.
//!
//! # JSON schema, version 1
//! ```text
//! {
//!   "format": "streamalloc-snapshot",   // constant, identifies the file
//!   "version": 1,                       // SCHEMA_VERSION; readers refuse newer versions
//!   "source": "streamalloc" | "pytorch",
//!   "config": {...} | null,             // allocator configuration, as the engine writes it
//!   "stats": {...} | null,              // counters at the instant of the snapshot
//!   "stacks": [[{"name": str, "filename": str, "line": int}, ...], ...],
//!                                       // call stacks, innermost first, shared by index
//!   "devices": [{
//!     "device": int,                    // CUDA device index
//!     "time_ns": int | null,            // clock when the snapshot was taken
//!     "trace_dropped": int,             // trace entries lost before the first one kept
//!     "segments": [{                    // in address order
//!       "addr": int, "size": int, "pool": "small" | "large", "stream": int,
//!       "expandable": bool,
//!       "blocks": [{                    // in address order; sizes add up to the segment's
//!         "addr": int, "size": int, "requested": int,
//!         "state": "active_allocated" | "active_pending_free" | "inactive",
//!         "stream": int, "pending_events": int, "stack": int?   // index into "stacks"
//!       }]
//!     }],
//!     "trace": [{                       // oldest first
//!       "action": "alloc" | "free_requested" | "free_completed" | "segment_alloc"
//!               | "segment_free" | "segment_map" | "segment_unmap" | "oom" | "snapshot"
//!               | "user_defined" | "cross_stream_wait" | "staging_acquire"
//!               | "staging_release" | "empty_cache",
//!       "addr": int, "size": int, "stream": int,
//!       "time_ns": int,                 // nanoseconds, one clock per file
//!       "stack": int?,                  // index into "stacks"
//!       "device_free": int?             // oom only: bytes the device had free
//!     }]
//!   }]
//! }
//! ```
//! Streams are `cudaStream_t` handles as integers (0: the legacy default stream).
//! Keys marked `?` may be absent. PyTorch traces without `time_us` get the entry's index as
//! its time.

use crate::error::VizError;
use crate::pytorch::{Frame, Stack, TorchBlock, TorchSegment, TorchSnapshot, TorchTraceEntry};
use crate::sniff::Content;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use streamalloc_allocator::PoolKind;
pub use streamalloc_records::{BlockState, TraceAction};

/// The value of the `format` key.
pub const FORMAT: &str = "streamalloc-snapshot";
/// The schema version this crate writes and the newest it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// The largest device index a snapshot may name. Writers allocate one entry per index up to
/// the largest (PyTorch's `device_traces` is a list indexed by device), so an unchecked
/// index of 2^31 in a 5 KB file would ask for tens of GB.
pub const MAX_DEVICE_INDEX: u32 = 1023;

/// Where an address range (`addr + size`) must end by. Real virtual addresses stay below
/// 2^57; refusing anything past 2^63 keeps every range's end, and the timeline's sums of a
/// few of them, representable, so a size of 2^64 - 1 is an error rather than a wrap.
pub const MAX_ADDRESS_END: u64 = 1 << 63;

// ---- Types ----

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// First byte.
    pub addr: u64,
    /// Bytes reserved.
    pub size: u64,
    /// Bytes asked for (0 for free blocks of our engine).
    pub requested: u64,
    /// Allocated, pending or free.
    pub state: BlockState,
    /// Owning stream.
    pub stream: u64,
    /// Events pending on it (0 where unknown).
    #[serde(default)]
    pub pending_events: u32,
    /// Index into [`Snapshot::stacks`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack: Option<u32>,
}

/// One segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// `"small"` or `"large"`.
    pub pool: String,
    /// The stream whose request created it.
    pub stream: u64,
    /// Expandable (mapped piecewise) or not.
    #[serde(default)]
    pub expandable: bool,
    /// Its blocks in address order.
    pub blocks: Vec<Block>,
}

/// One trace event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// What happened.
    pub action: TraceAction,
    /// Block or segment address (0 where none applies).
    pub addr: u64,
    /// Bytes concerned.
    pub size: u64,
    /// Stream concerned.
    pub stream: u64,
    /// Nanoseconds, on one clock per file.
    pub time_ns: u64,
    /// Index into [`Snapshot::stacks`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack: Option<u32>,
    /// For `oom`: bytes the device had free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
}

/// Everything known about one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSnapshot {
    /// CUDA device index.
    pub device: u32,
    /// Clock when the snapshot was taken, if known.
    #[serde(default)]
    pub time_ns: Option<u64>,
    /// Trace entries lost before the first one kept.
    #[serde(default)]
    pub trace_dropped: u64,
    /// Segments at the instant of the snapshot, in address order.
    pub segments: Vec<Segment>,
    /// The event trace, oldest first.
    pub trace: Vec<Event>,
}

/// A snapshot in our model; serialised, it is our JSON format.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Always [`FORMAT`].
    pub format: String,
    /// Schema version, [`SCHEMA_VERSION`] when written by this crate.
    pub version: u32,
    /// `"streamalloc"` or `"pytorch"`: who recorded it.
    pub source: String,
    /// Allocator configuration.
    #[serde(default)]
    pub config: Option<serde_json::Value>,
    /// Counters at the instant of the snapshot.
    #[serde(default)]
    pub stats: Option<serde_json::Value>,
    /// Shared call stacks, innermost frame first.
    #[serde(default)]
    pub stacks: Vec<Vec<Frame>>,
    /// Per-device segments and traces.
    pub devices: Vec<DeviceSnapshot>,
}

impl Snapshot {
    /// An empty snapshot from `source`.
    pub fn new(source: &str) -> Self {
        Snapshot {
            format: FORMAT.into(),
            version: SCHEMA_VERSION,
            source: source.into(),
            config: None,
            stats: None,
            stacks: Vec::new(),
            devices: Vec::new(),
        }
    }

    /// Number of trace events over all devices.
    pub fn event_count(&self) -> usize {
        self.devices.iter().map(|d| d.trace.len()).sum()
    }

    /// Checks what serde cannot: stack indices in range, device indices within
    /// [`MAX_DEVICE_INDEX`], no address range past [`MAX_ADDRESS_END`]. `path` names the file in errors.
    fn validate(&self, path: &Path) -> Result<(), VizError> {
        self.check_limits(path)?;
        let n = self.stacks.len();
        let bad = |what: String| Err(VizError::format(path, what));
        for d in &self.devices {
            for (i, e) in d.trace.iter().enumerate() {
                if e.stack.is_some_and(|s| s as usize >= n) {
                    return bad(format!(
                        "devices[{}].trace[{i}].stack: index out of range ({n} stacks)",
                        d.device
                    ));
                }
            }
            for s in &d.segments {
                for b in &s.blocks {
                    if b.stack.is_some_and(|s| s as usize >= n) {
                        return bad(format!(
                            "devices[{}]: block {:#x}: stack index out of range",
                            d.device, b.addr
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

impl Snapshot {
    /// Device indices within [`MAX_DEVICE_INDEX`] and every `addr + size` (segments,
    /// blocks, events) within [`MAX_ADDRESS_END`], so the timeline and the writers can add without
    /// overflowing. `path` names the file in errors.
    pub fn check_limits(&self, path: &Path) -> Result<(), VizError> {
        let bad = |what: String| Err(VizError::format(path, what));
        let past_end = |addr: u64, size: u64| {
            addr.checked_add(size)
                .is_none_or(|end| end > MAX_ADDRESS_END)
        };
        for d in &self.devices {
            if d.device > MAX_DEVICE_INDEX {
                return bad(format!(
                    "device index {} exceeds the limit of {MAX_DEVICE_INDEX}",
                    d.device
                ));
            }
            for s in &d.segments {
                if past_end(s.addr, s.size) {
                    return bad(format!(
                        "devices[{}]: segment {:#x} of size {} ends past the address limit 2^63",
                        d.device, s.addr, s.size
                    ));
                }
                for b in &s.blocks {
                    if past_end(b.addr, b.size) || past_end(b.addr, b.requested) {
                        return bad(format!(
                            "devices[{}]: block {:#x} of size {} ends past the address limit 2^63",
                            d.device, b.addr, b.size
                        ));
                    }
                }
            }
            for (i, e) in d.trace.iter().enumerate() {
                if past_end(e.addr, e.size) {
                    return bad(format!(
                        "devices[{}].trace[{i}]: {:#x} of size {} ends past the address limit 2^63",
                        d.device, e.addr, e.size
                    ));
                }
            }
        }
        Ok(())
    }
}

// ---- JSON ----

/// Writes `snapshot` as our JSON (compact).
pub fn write_json(snapshot: &Snapshot, out: &mut impl std::io::Write) -> Result<(), VizError> {
    serde_json::to_writer(out, snapshot).map_err(|e| VizError::Unrepresentable {
        format: "streamalloc JSON",
        what: e.to_string(),
    })
}

/// Parses our JSON (or the engine's `Snapshot` serialised with serde). `path` names the
/// source in errors.
pub fn parse_json(path: &Path, bytes: &[u8]) -> Result<Snapshot, VizError> {
    #[derive(Deserialize)]
    struct Probe {
        format: Option<String>,
        version: Option<u32>,
    }
    let json_err = |source| VizError::Json {
        path: path.into(),
        source,
    };
    let probe: Probe = serde_json::from_slice(bytes).map_err(json_err)?;
    match (probe.format.as_deref(), probe.version) {
        (Some(FORMAT), Some(v)) if v <= SCHEMA_VERSION => {
            let snap: Snapshot = serde_json::from_slice(bytes).map_err(json_err)?;
            snap.validate(path)?;
            Ok(snap)
        }
        (Some(FORMAT), v) => Err(VizError::format(
            path,
            format!(
                "schema version {v:?} is not supported (this build reads up to {SCHEMA_VERSION})"
            ),
        )),
        (Some(other), _) => Err(VizError::format(
            path,
            format!("\"format\" is {other:?}, expected {FORMAT:?}"),
        )),
        (None, _) => {
            // Perhaps the engine's own snapshot, serialised as is.
            let engine: streamalloc_allocator::Snapshot =
                serde_json::from_slice(bytes).map_err(|_| {
                    VizError::format(
                        path,
                        "JSON without \"format\": neither a streamalloc snapshot nor an engine \
                         snapshot",
                    )
                })?;
            let snap = from_engine(&engine);
            snap.validate(path)?;
            Ok(snap)
        }
    }
}

// ---- Conversions ----

/// Our model of the engine's snapshot (device 0).
pub fn from_engine(s: &streamalloc_allocator::Snapshot) -> Snapshot {
    let mut out = Snapshot::new("streamalloc");
    // The engine's segment records do not say whether a segment is expandable; one whose
    // pages the trace shows being mapped is.
    let mapped: Vec<u64> = s
        .trace
        .iter()
        .filter(|e| e.action == TraceAction::SegmentMap)
        .map(|e| e.addr.0)
        .collect();
    out.config = serde_json::to_value(&s.config).ok();
    out.stats = serde_json::to_value(s.stats).ok();
    let segments = s
        .segments
        .iter()
        .map(|seg| Segment {
            addr: seg.addr.0,
            size: seg.size,
            pool: match seg.pool {
                PoolKind::Small => "small".into(),
                PoolKind::Large => "large".into(),
            },
            stream: seg.stream.0,
            expandable: mapped
                .iter()
                .any(|&a| a.checked_sub(seg.addr.0).is_some_and(|off| off < seg.size)),
            blocks: seg
                .blocks
                .iter()
                .map(|b| Block {
                    addr: b.addr.0,
                    size: b.size,
                    requested: b.requested,
                    state: b.state,
                    stream: b.stream.0,
                    pending_events: b.pending_events,
                    stack: None,
                })
                .collect(),
        })
        .collect();
    let trace = s
        .trace
        .iter()
        .map(|e| Event {
            action: e.action,
            addr: e.addr.0,
            size: e.size,
            stream: e.stream.0,
            time_ns: e.time_ns,
            stack: None,
            device_free: None,
        })
        .collect();
    out.devices.push(DeviceSnapshot {
        device: 0,
        time_ns: Some(s.time_ns),
        trace_dropped: s.trace_dropped,
        segments,
        trace,
    });
    out
}

/// Interns stacks into [`Snapshot::stacks`].
struct StackTable<'a> {
    stacks: &'a mut Vec<Vec<Frame>>,
    /// By the shared allocation's address: PyTorch snapshots share equal stacks already.
    by_ptr: HashMap<*const Frame, u32>,
}

impl StackTable<'_> {
    fn intern(&mut self, stack: &Stack) -> Option<u32> {
        if stack.is_empty() {
            return None;
        }
        let key = stack.as_ptr();
        if let Some(&i) = self.by_ptr.get(&key) {
            return Some(i);
        }
        let i = self.stacks.len() as u32;
        self.stacks.push(stack.to_vec());
        self.by_ptr.insert(key, i);
        Some(i)
    }
}

/// Our model of a PyTorch snapshot.
pub fn from_torch(t: &TorchSnapshot) -> Snapshot {
    let mut out = Snapshot::new("pytorch");
    out.config = t.allocator_settings.clone();
    let mut table = StackTable {
        stacks: &mut out.stacks,
        by_ptr: HashMap::new(),
    };
    let device_count = t
        .segments
        .iter()
        .map(|s| s.device as usize + 1)
        .max()
        .unwrap_or(0)
        .max(t.device_traces.len());
    let mut devices = Vec::new();
    for d in 0..device_count {
        let trace = t.device_traces.get(d).map(Vec::as_slice).unwrap_or(&[]);
        let segs: Vec<&TorchSegment> = t
            .segments
            .iter()
            .filter(|s| s.device as usize == d)
            .collect();
        if trace.is_empty() && segs.is_empty() {
            continue;
        }
        let mut segments: Vec<Segment> = segs
            .iter()
            .map(|s| Segment {
                addr: s.address,
                size: s.total_size,
                pool: s.segment_type.clone(),
                stream: s.stream,
                expandable: s.is_expandable,
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| Block {
                        addr: b.address,
                        size: b.size,
                        requested: b.requested_size,
                        state: b.state,
                        stream: s.stream,
                        pending_events: 0,
                        stack: table.intern(&b.frames),
                    })
                    .collect(),
            })
            .collect();
        segments.sort_by_key(|s| s.addr);
        let events = trace
            .iter()
            .enumerate()
            .map(|(i, e)| Event {
                action: e.action,
                addr: e.addr,
                size: e.size,
                stream: e.stream,
                time_ns: e.time_us.map_or(i as u64, |us| us.saturating_mul(1000)),
                stack: table.intern(&e.frames),
                device_free: e.device_free,
            })
            .collect();
        devices.push(DeviceSnapshot {
            device: d as u32,
            time_ns: None,
            trace_dropped: 0,
            segments,
            trace: events,
        });
    }
    out.devices = devices;
    out
}

/// PyTorch's model of our snapshot. streamalloc's own actions (cross-stream waits,
/// staging, empty_cache) have no PyTorch name and are left out.
pub fn to_torch(s: &Snapshot) -> TorchSnapshot {
    let stacks: Vec<Stack> = s.stacks.iter().map(|f| Arc::from(f.as_slice())).collect();
    let empty: Stack = Arc::from(Vec::new());
    let stack = |i: Option<u32>| {
        i.and_then(|i| stacks.get(i as usize).cloned())
            .unwrap_or_else(|| empty.clone())
    };
    let mut out = TorchSnapshot {
        // PyTorch's settings go back where they came from; ours are not PyTorch's.
        allocator_settings: if s.source == "pytorch" {
            s.config.clone()
        } else {
            None
        },
        ..TorchSnapshot::default()
    };
    for d in &s.devices {
        for seg in &d.segments {
            out.segments.push(TorchSegment {
                device: d.device,
                address: seg.addr,
                total_size: seg.size,
                stream: seg.stream,
                segment_type: seg.pool.clone(),
                is_expandable: seg.expandable,
                blocks: seg
                    .blocks
                    .iter()
                    .map(|b| TorchBlock {
                        address: b.addr,
                        size: b.size,
                        requested_size: b.requested,
                        state: b.state,
                        frames: stack(b.stack),
                    })
                    .collect(),
            });
        }
        let idx = d.device as usize;
        if out.device_traces.len() <= idx {
            out.device_traces.resize_with(idx + 1, Vec::new);
        }
        out.device_traces[idx] = d
            .trace
            .iter()
            .filter(|e| e.action.is_pytorch())
            .map(|e| TorchTraceEntry {
                action: e.action,
                addr: e.addr,
                size: e.size,
                stream: e.stream,
                time_us: Some(e.time_ns / 1000),
                frames: stack(e.stack),
                device_free: e.device_free,
            })
            .collect();
    }
    out
}

// ---- Loading any format ----

/// Reads any snapshot this crate understands: our JSON, the engine's JSON, or a PyTorch
/// pickle; each optionally gzip-compressed. Recognised by content, not by name.
pub fn load(path: &Path) -> Result<Snapshot, VizError> {
    let raw = std::fs::read(path).map_err(|e| VizError::io(path, e))?;
    from_bytes(path, raw)
}

/// [`load`] of a file's content already in memory: `raw` is what the file `path` holds
/// (`path` only names it in errors).
pub fn from_bytes(path: &Path, raw: Vec<u8>) -> Result<Snapshot, VizError> {
    let (content, bytes) = crate::sniff::open(path, raw)?;
    match content {
        Content::Pickle => {
            let snapshot = from_torch(&crate::pytorch::parse_snapshot(path, &bytes)?);
            snapshot.check_limits(path)?;
            Ok(snapshot)
        }
        Content::JsonObject => parse_json(path, &bytes),
        Content::Empty => Err(VizError::format(path, "the file is empty")),
        Content::Gzip | Content::JsonArray | Content::Other => Err(VizError::format(
            path,
            "unrecognised content (expected a streamalloc JSON snapshot or a PyTorch memory \
             snapshot pickle, optionally gzip-compressed)",
        )),
    }
}

// ---- Saving any format ----

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

/// Writes `snapshot` to `path` in `format`, gzip-compressed when the name ends in `.gz`.
pub fn save(snapshot: &Snapshot, path: &Path, format: OutputFormat) -> Result<(), VizError> {
    let file = std::fs::File::create(path).map_err(|e| VizError::io(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    let gz = path.extension().is_some_and(|e| e == "gz");
    let write = |w: &mut dyn std::io::Write| -> Result<(), VizError> {
        let mut w = w;
        match format {
            OutputFormat::Json => write_json(snapshot, &mut w),
            OutputFormat::Pickle => crate::pytorch::write_pickle(&to_torch(snapshot), &mut w),
            OutputFormat::Perfetto => crate::perfetto::write_perfetto(snapshot, &mut w),
        }
    };
    if gz {
        // The writers emit many tiny writes: buffer them before the compressor.
        let enc = flate2::write::GzEncoder::new(&mut out, flate2::Compression::default());
        let mut buffered = std::io::BufWriter::with_capacity(1 << 16, enc);
        write(&mut buffered)?;
        let enc = buffered
            .into_inner()
            .map_err(|e| VizError::io(path, e.into_error()))?;
        enc.finish().map_err(|e| VizError::io(path, e))?;
    } else {
        write(&mut out)?;
    }
    std::io::Write::flush(&mut out).map_err(|e| VizError::io(path, e))
}
