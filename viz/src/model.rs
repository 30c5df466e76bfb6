//! The snapshot model every format converts through, and our versioned JSON schema.
//!
//! Three sources feed the viewer: the engine's snapshot ([`EngineSnapshot`]), PyTorch's
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
//!       "tag": str?, "asleep": bool?,     // streamalloc: its memory pool's tag; asleep:
//!                                       // the memory went back, addresses and blocks kept
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
//!               | "staging_release" | "empty_cache" | "stitch" | "unstitch"
//!               | "sleep" | "wake",
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
use crate::limits::{range_within, Budget, OverBudget};
pub use crate::limits::{MAX_ADDRESS_END, MAX_DEVICE_INDEX};
pub use crate::stacks::{Frame, Stacks};
use serde::{Deserialize, Serialize};
use std::path::Path;
use streamalloc_records::PoolKind;
pub use streamalloc_records::{BlockState, TraceAction};

/// The engine's snapshot as the formats read it: its configuration and counters kept as
/// the JSON they were written as.
pub type EngineSnapshot = streamalloc_records::Snapshot<serde_json::Value, serde_json::Value>;

/// The value of the `format` key.
pub const FORMAT: &str = "streamalloc-snapshot";
/// The schema version this crate writes and the newest it reads.
pub const SCHEMA_VERSION: u32 = 1;

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
    /// For pages lent to a stitched range (streamalloc's engine): the range's address,
    /// where the trace records the allocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lent_to: Option<u64>,
}

/// One segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// `"small"` or `"large"`.
    #[serde(deserialize_with = "crate::json::string")]
    pub pool: String,
    /// The stream whose request created it.
    pub stream: u64,
    /// Expandable (mapped piecewise) or not.
    #[serde(default)]
    pub expandable: bool,
    /// The tag of its memory pool (streamalloc's engine), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Its memory pool is asleep (streamalloc's engine): the memory went back to the
    /// device, addresses and blocks kept; it counts as no reserved memory.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub asleep: bool,
    /// Its blocks in address order.
    #[serde(deserialize_with = "crate::json::vec")]
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
    #[serde(deserialize_with = "crate::json::vec")]
    pub segments: Vec<Segment>,
    /// The event trace, oldest first.
    #[serde(deserialize_with = "crate::json::vec")]
    pub trace: Vec<Event>,
}

/// A snapshot in our model; serialised, it is our JSON format.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Snapshot {
    /// Always [`FORMAT`].
    pub format: String,
    /// Schema version, [`SCHEMA_VERSION`] when written by this crate.
    pub version: u32,
    /// `"streamalloc"` or `"pytorch"`: who recorded it.
    pub source: String,
    /// Allocator configuration.
    #[serde(default, deserialize_with = "crate::json::value")]
    pub config: Option<serde_json::Value>,
    /// Counters at the instant of the snapshot.
    #[serde(default, deserialize_with = "crate::json::value")]
    pub stats: Option<serde_json::Value>,
    /// Shared call stacks, innermost frame first.
    #[serde(default)]
    pub stacks: Stacks,
    /// Per-device segments and traces.
    #[serde(deserialize_with = "crate::json::vec")]
    pub devices: Vec<DeviceSnapshot>,
    /// The memory budget of the file this was read from, charged with what the snapshot
    /// holds: what is left of it is what later stages (the timeline, the viewer's data,
    /// plots, writers) may still build from it ([`crate::limits`]). Unlimited for a
    /// snapshot built in code; not part of any file, nor of equality.
    #[serde(skip)]
    pub budget: Budget,
}

impl PartialEq for Snapshot {
    fn eq(&self, other: &Self) -> bool {
        self.format == other.format
            && self.version == other.version
            && self.source == other.source
            && self.config == other.config
            && self.stats == other.stats
            && self.stacks == other.stacks
            && self.devices == other.devices
    }
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
            stacks: Stacks::default(),
            devices: Vec::new(),
            budget: Budget::default(),
        }
    }

    /// Number of trace events over all devices.
    pub fn event_count(&self) -> usize {
        self.devices.iter().map(|d| d.trace.len()).sum()
    }

    /// Bytes of memory the snapshot's records take (events, segments, blocks, stacks).
    pub fn held_bytes(&self) -> u64 {
        let frames: usize = (0..self.stacks.len() as u32)
            .map(|i| self.stacks.frame_ids(i).len())
            .sum();
        let per_device: usize = self
            .devices
            .iter()
            .map(|d| {
                d.trace.len() * size_of::<Event>()
                    + d.segments.len() * size_of::<Segment>()
                    + d.segments.iter().map(|s| s.blocks.len()).sum::<usize>() * size_of::<Block>()
            })
            .sum();
        (per_device + 4 * frames + 32 * self.stacks.len() + 100 * self.stacks.frames().len()) as u64
    }

    /// Checks what serde cannot: stack indices in range, device indices within
    /// [`MAX_DEVICE_INDEX`], no address range past [`MAX_ADDRESS_END`]. `path` names the file in errors.
    pub fn validate(&self, path: &Path) -> Result<(), VizError> {
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
    /// Device indices within [`MAX_DEVICE_INDEX`] and each named once (a writer keeps one
    /// entry per device, so a second would be lost), and every `addr + size` (segments,
    /// blocks, events) within [`MAX_ADDRESS_END`], so the timeline and the writers can add
    /// without overflowing. `path` names the file in errors.
    pub fn check_limits(&self, path: &Path) -> Result<(), VizError> {
        let bad = |what: String| Err(VizError::format(path, what));
        let past_end = |addr: u64, size: u64| !range_within(addr, size);
        let mut seen = std::collections::HashSet::new();
        for d in &self.devices {
            if d.device > MAX_DEVICE_INDEX {
                return bad(format!(
                    "device index {} exceeds the limit of {MAX_DEVICE_INDEX}",
                    d.device
                ));
            }
            if !seen.insert(d.device) {
                return bad(format!(
                    "device {} appears twice in \"devices\" (each device must be listed once)",
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
    let over = |o: OverBudget| VizError::Limit {
        path: path.into(),
        what: o.to_string(),
    };
    match (probe.format.as_deref(), probe.version) {
        (Some(FORMAT), Some(v)) if v <= SCHEMA_VERSION => {
            let (mut snap, budget) =
                crate::json::parse_within::<Snapshot>(bytes, Budget::for_input(bytes.len()))
                    .map_err(|e| match e {
                        crate::json::ParseError::Json(e) => json_err(e),
                        crate::json::ParseError::Over(o) => over(o),
                    })?;
            snap.budget = budget;
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
            let engine: EngineSnapshot = serde_json::from_slice(bytes).map_err(|_| {
                VizError::format(
                    path,
                    "JSON without \"format\": neither a streamalloc snapshot nor an engine \
                         snapshot",
                )
            })?;
            // The engine's records are of fixed size and at least 40 bytes of JSON each,
            // so reading them builds less than the budget allows; the model made from
            // them is what the budget keeps.
            let mut snap = from_engine(&engine);
            drop(engine);
            let mut budget = Budget::for_input(bytes.len());
            budget
                .charge_for("reading the JSON", snap.held_bytes())
                .map_err(over)?;
            snap.budget = budget;
            snap.validate(path)?;
            Ok(snap)
        }
    }
}

// ---- Conversions ----

/// Our model of the engine's snapshot (device 0), whatever its configuration and counters
/// are read as (the engine's own types, or JSON values: [`EngineSnapshot`]).
pub fn from_engine<Config: Serialize, Stats: Serialize>(
    s: &streamalloc_records::Snapshot<Config, Stats>,
) -> Snapshot {
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
    out.stats = serde_json::to_value(&s.stats).ok();
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
            expandable: seg.expandable
                || mapped
                    .iter()
                    .any(|&a| a.checked_sub(seg.addr.0).is_some_and(|off| off < seg.size)),
            tag: seg.tag.clone(),
            asleep: seg.asleep,
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
                    lent_to: b.lent_to.map(|p| p.0),
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
