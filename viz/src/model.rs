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
use crate::limits::range_within;
pub use crate::limits::{MAX_ADDRESS_END, MAX_DEVICE_INDEX};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
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

/// One frame of a call stack. Its strings are shared by every frame that names the same
/// function or file.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    /// Function name.
    pub name: Arc<str>,
    /// Source file.
    pub filename: Arc<str>,
    /// Line number.
    pub line: i64,
}

/// The call stacks of a snapshot, innermost frame first. Each distinct frame is stored
/// once and stacks hold frame indices: traces repeat a few hundred frames in millions of
/// stacks, so a stack costs four bytes a frame, not a copy of each. Serialised, it is the
/// schema's `stacks` (a list of lists of frame objects).
#[derive(Clone, Debug, Default)]
pub struct Stacks {
    frames: Vec<Frame>,
    stacks: Vec<Box<[u32]>>,
    /// Index of each frame in `frames`.
    frame_ids: HashMap<Frame, u32>,
    /// Each distinct string of `frames`, shared.
    strings: std::collections::HashSet<Arc<str>>,
}

impl PartialEq for Stacks {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len()
            && (0..self.len() as u32).all(|i| self.frames_of(i).eq(other.frames_of(i)))
    }
}

impl Stacks {
    /// Number of stacks.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    /// Whether there are no stacks.
    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Every distinct frame; [`Stacks::frame_ids`] index it.
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }

    /// The frame indices of stack `i` (empty if there is no such stack).
    pub fn frame_ids(&self, i: u32) -> &[u32] {
        self.stacks.get(i as usize).map_or(&[], |s| s)
    }

    /// The frames of stack `i`, innermost first (none if there is no such stack).
    pub fn frames_of(&self, i: u32) -> impl ExactSizeIterator<Item = &Frame> + '_ {
        self.frame_ids(i).iter().map(|&f| &self.frames[f as usize])
    }

    /// `text`, shared with every equal string already in these stacks.
    pub fn string(&mut self, text: &str) -> Arc<str> {
        if let Some(s) = self.strings.get(text) {
            return s.clone();
        }
        let s: Arc<str> = Arc::from(text);
        self.strings.insert(s.clone());
        s
    }

    /// The index of `frame`, added if new.
    pub fn frame(&mut self, frame: Frame) -> u32 {
        if let Some(&i) = self.frame_ids.get(&frame) {
            return i;
        }
        let frame = Frame {
            name: self.string(&frame.name),
            filename: self.string(&frame.filename),
            line: frame.line,
        };
        let i = self.frames.len() as u32;
        self.frames.push(frame.clone());
        self.frame_ids.insert(frame, i);
        i
    }

    /// Adds a stack of the frames at `ids` (indices from [`Stacks::frame`]) and returns
    /// its index.
    pub fn push_ids(&mut self, ids: Box<[u32]>) -> u32 {
        debug_assert!(ids.iter().all(|&f| (f as usize) < self.frames.len()));
        self.stacks.push(ids);
        (self.stacks.len() - 1) as u32
    }

    /// Adds a stack of `frames`, innermost first, and returns its index.
    pub fn push(&mut self, frames: impl IntoIterator<Item = Frame>) -> u32 {
        let ids: Box<[u32]> = frames.into_iter().map(|f| self.frame(f)).collect();
        self.push_ids(ids)
    }
}

impl Serialize for Stacks {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        struct One<'a>(&'a Stacks, u32);
        impl Serialize for One<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_seq(self.0.frames_of(self.1))
            }
        }
        let mut seq = serializer.serialize_seq(Some(self.len()))?;
        for i in 0..self.len() as u32 {
            seq.serialize_element(&One(self, i))?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Stacks {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Reads the stacks one frame at a time into the tables, so equal frames and
        /// strings are kept once while reading.
        struct StacksVisitor;
        struct StackSeed<'a>(&'a mut Stacks);
        impl<'de> serde::de::DeserializeSeed<'de> for StackSeed<'_> {
            type Value = ();
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_seq(self)
            }
        }
        impl<'de> serde::de::Visitor<'de> for StackSeed<'_> {
            type Value = ();
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of frames")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
                let mut ids = Vec::new();
                while let Some(frame) = seq.next_element::<Frame>()? {
                    ids.push(self.0.frame(frame));
                }
                self.0.push_ids(ids.into());
                Ok(())
            }
        }
        impl<'de> serde::de::Visitor<'de> for StacksVisitor {
            type Value = Stacks;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of call stacks")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Stacks, A::Error> {
                let mut stacks = Stacks::default();
                while seq.next_element_seed(StackSeed(&mut stacks))?.is_some() {}
                Ok(stacks)
            }
        }
        deserializer.deserialize_seq(StacksVisitor)
    }
}

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
    pub stacks: Stacks,
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
            stacks: Stacks::default(),
            devices: Vec::new(),
        }
    }

    /// Number of trace events over all devices.
    pub fn event_count(&self) -> usize {
        self.devices.iter().map(|d| d.trace.len()).sum()
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
            let engine: EngineSnapshot = serde_json::from_slice(bytes).map_err(|_| {
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
