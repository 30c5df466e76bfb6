//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`), read and written.
//!
//! PyTorch users already have these files, and the trace replayer and the viewer both start
//! from them, so this module reads them exactly as PyTorch writes them: a pickle (protocol
//! 2 to 5, optionally gzip-compressed) of a dict with
//!
//! - `segments`: one dict per segment (`device`, `address`, `total_size`, `stream`,
//!   `segment_type`, `blocks`: dicts with `size`, `requested_size`, `state`, `frames`), and
//! - `device_traces`: one list per device of trace entries, dicts with `action`, `addr`,
//!   `size`, `stream`, `time_us`, `frames` (and `device_free` for `oom`).
//!
//! Decoding runs the bounded decoder of [`crate::pickle`] into its arena, where everything
//! the pickle shares through its memo is held once, and reads the records straight from
//! it, checking key by key, so a truncated, corrupt, hostile or foreign file gives one
//! [`VizError`] naming the file and the offending byte or key, never a panic. Call stacks
//! are interned as they are read ([`crate::model::Stacks`]): a stack list the pickle
//! shares is read once, equal frames and strings are kept once, and a stack costs four
//! bytes a frame. Everything built is charged to the [`Budget`] of the input, so memory
//! stays proportional to the file.
//!
//! [`read_model`] gives our model directly (what the viewer, the plotter, the converter and
//! the replayer use); [`read_snapshot`] gives PyTorch's own shape ([`TorchSnapshot`]).
//!
//! Actions and block states are the shared records of `streamalloc-records`
//! ([`TraceAction`], [`BlockState`], re-exported here), whose names are PyTorch's; only
//! PyTorch's actions are read from or belong in these files
//! ([`TraceAction::from_pytorch_name`]).
//!
//! [`write_pickle`] writes the same shape back with only the opcodes PyTorch's own
//! JavaScript viewer (`MemoryViz.js`) decodes: protocol 4, dicts, lists, tuples, strings
//! (memoised with `BINPUT`/`BINGET`, as Python does, and so are call stacks), integers of
//! at most 8 bytes, floats, booleans and `None`.
//!
//! # Example
//! ```no_run
//! use streamalloc_viz::pytorch::{read_snapshot, TraceAction};
//!
//! let snapshot = read_snapshot("gpt2.pickle.gz".as_ref())?;
//! for (device, trace) in snapshot.device_traces.iter().enumerate() {
//!     let allocs = trace.iter().filter(|e| e.action == TraceAction::Alloc).count();
//!     println!("device {device}: {allocs} allocations");
//! }
//! # Ok::<(), streamalloc_viz::VizError>(())
//! ```

use crate::error::VizError;
pub use crate::input::{gunzip_within, maybe_gunzip};
use crate::input::{SliceSource, Source};
use crate::limits::{Budget, OverBudget};
pub use crate::limits::{
    GUNZIP_MAX_BYTES, GUNZIP_MAX_RATIO, GUNZIP_RATIO_FLOOR, LIMIT_ENV as GUNZIP_LIMIT_ENV,
};
pub use crate::model::Frame;
use crate::model::{Block, DeviceSnapshot, Event, Segment, Snapshot};
use crate::sniff::{sniff, Content};
use read::{read_records, RawEntry, Sink};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
pub use streamalloc_records::{BlockState, TraceAction};
pub use write::write_pickle;

mod read;
mod write;

/// What the budget calls reading a snapshot's records.
const READING: &str = "reading the snapshot";

// ---- Types ----

/// A call stack, innermost frame first. Shared between the entries that have the same one.
pub type Stack = Arc<[Frame]>;

/// One entry of a device trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TorchTraceEntry {
    /// What happened: one of PyTorch's actions ([`TraceAction::PYTORCH`]); the reader
    /// gives no others, and [`crate::model::to_torch`] leaves streamalloc's own out.
    pub action: TraceAction,
    /// Block or segment address (0 for `oom`, `snapshot`).
    pub addr: u64,
    /// Bytes: the rounded block size for `alloc`/`free_*`, the segment size for
    /// `segment_*`, the requested size for `oom`.
    pub size: u64,
    /// The `cudaStream_t` as an integer (0: the legacy default stream).
    pub stream: u64,
    /// Host wall clock in microseconds, when the snapshot recorded it (PyTorch ≥ 2.1).
    pub time_us: Option<u64>,
    /// Where it was called from; empty when stacks were not recorded.
    pub frames: Stack,
    /// For `oom`: bytes the device still had free.
    pub device_free: Option<u64>,
}

/// One block of a segment at the instant of the snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct TorchBlock {
    /// First byte (computed from the segment and the preceding blocks when the file does
    /// not say, as PyTorch's viewer does).
    pub address: u64,
    /// Bytes reserved.
    pub size: u64,
    /// Bytes the caller asked for (equal to `size` when the file does not say).
    pub requested_size: u64,
    /// Allocated, pending or free.
    pub state: BlockState,
    /// Where it was allocated; empty when unknown.
    pub frames: Stack,
}

/// One segment at the instant of the snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct TorchSegment {
    /// CUDA device index.
    pub device: u32,
    /// First byte.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// The stream whose request created it.
    pub stream: u64,
    /// `"large"` or `"small"` pool.
    pub segment_type: String,
    /// True for an expandable segment.
    pub is_expandable: bool,
    /// Its blocks in address order.
    pub blocks: Vec<TorchBlock>,
}

/// A whole PyTorch memory snapshot.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TorchSnapshot {
    /// Segments alive at the instant of the snapshot.
    pub segments: Vec<TorchSegment>,
    /// One trace per device index, oldest entry first (empty for unused devices).
    pub device_traces: Vec<Vec<TorchTraceEntry>>,
    /// `allocator_settings`, as JSON, when present.
    pub allocator_settings: Option<serde_json::Value>,
}

impl TorchSnapshot {
    /// Number of `alloc` entries over all devices.
    pub fn alloc_count(&self) -> usize {
        self.device_traces
            .iter()
            .flatten()
            .filter(|e| e.action == TraceAction::Alloc)
            .count()
    }
}

// ---- Reading ----

/// Reads a PyTorch snapshot from `path`: a pickle, gzip-compressed or not (recognised by
/// its content, not its name).
pub fn read_snapshot(path: &Path) -> Result<TorchSnapshot, VizError> {
    let raw = crate::input::read_file(path)?;
    let bytes = maybe_gunzip(path, raw)?;
    parse_snapshot(path, &bytes)
}

/// Decodes a snapshot from uncompressed pickle bytes into PyTorch's shape. `path` only
/// names the source in errors. What it builds is charged to the input's budget, each
/// distinct stack's frames once (entries share them).
pub fn parse_snapshot(path: &Path, bytes: &[u8]) -> Result<TorchSnapshot, VizError> {
    /// Each device's entries, their frames filled in once every stack is known, from
    /// the stack index kept beside each entry.
    #[derive(Default)]
    struct Collect(Vec<Vec<TorchTraceEntry>>, Vec<Vec<u32>>);
    impl Sink for Collect {
        fn device(&mut self, d: usize, n: usize, budget: &mut Budget) -> Result<(), OverBudget> {
            self.0.resize_with(d + 1, Vec::new);
            self.1.resize_with(d + 1, Vec::new);
            budget.reserve(READING, &mut self.0[d], n)?;
            budget.reserve(READING, &mut self.1[d], n)
        }
        fn entry(&mut self, d: usize, _: usize, e: RawEntry) {
            self.0[d].push(TorchTraceEntry {
                action: e.action,
                addr: e.addr,
                size: e.size,
                stream: e.stream,
                time_us: e.time_us,
                frames: Stack::from([]),
                device_free: e.device_free,
            });
            self.1[d].push(e.stack.map_or(u32::MAX, |s| s));
        }
    }
    let mut collect = Collect::default();
    let mut raw = read_records(path, &mut sniffed(path, bytes)?, &mut collect)?;
    let over = |o: OverBudget| VizError::Limit {
        path: path.into(),
        what: o.to_string(),
    };
    let frames: usize = (0..raw.stacks.len() as u32)
        .map(|i| raw.stacks.frame_ids(i).len())
        .sum();
    raw.budget
        .charge_for(
            READING,
            (frames * size_of::<Frame>() + raw.stacks.len() * 32) as u64,
        )
        .map_err(over)?;
    let shared: Vec<Stack> = (0..raw.stacks.len() as u32)
        .map(|i| raw.stacks.frames_of(i).cloned().collect())
        .collect();
    let empty: Stack = Arc::from(Vec::new());
    let stack = |s: Option<u32>| s.map_or_else(|| empty.clone(), |i| shared[i as usize].clone());
    let Collect(mut device_traces, stacks_of) = collect;
    device_traces.resize_with(raw.device_traces.max(device_traces.len()), Vec::new);
    for (trace, stacks) in device_traces.iter_mut().zip(stacks_of) {
        for (e, s) in trace.iter_mut().zip(stacks) {
            e.frames = stack((s != u32::MAX).then_some(s));
        }
    }
    device_traces.truncate(raw.device_traces);
    let segments = raw
        .segments
        .into_iter()
        .map(|s| TorchSegment {
            device: s.device,
            address: s.address,
            total_size: s.total_size,
            stream: s.stream,
            segment_type: s.segment_type,
            is_expandable: s.is_expandable,
            blocks: s
                .blocks
                .into_iter()
                .map(|b| TorchBlock {
                    address: b.address,
                    size: b.size,
                    requested_size: b.requested_size,
                    state: b.state,
                    frames: stack(b.stack),
                })
                .collect(),
        })
        .collect();
    Ok(TorchSnapshot {
        segments,
        device_traces,
        allocator_settings: raw.settings,
    })
}

/// Decodes a snapshot from uncompressed pickle bytes straight into our model (stacks
/// shared by index, events built as they are read), within limits
/// ([`Snapshot::check_limits`]). `path` only names the source in errors. Entries without
/// `time_us` get their index as their time.
pub fn read_model(path: &Path, bytes: &[u8]) -> Result<Snapshot, VizError> {
    read_model_from(path, &mut sniffed(path, bytes)?)
}

/// [`read_model`] of the gzip-compressed pickle `raw`, decompressed on a second thread as
/// it is read ([`crate::input::with_gzip_source`]): the decompressed file is never held
/// whole, and decompressing and decoding take their time side by side. The caller has
/// checked that the stream holds a pickle ([`crate::input::peek_content`]).
pub fn read_model_gzip(path: &Path, raw: &[u8]) -> Result<Snapshot, VizError> {
    crate::input::with_gzip_source(path, raw, |source| {
        read_model_from(path, source).map_err(|err| source.error().unwrap_or(err))
    })?
}

/// `bytes` as a source, if they hold a pickle.
fn sniffed<'a>(path: &Path, bytes: &'a [u8]) -> Result<SliceSource<'a>, VizError> {
    if sniff(bytes) != Content::Pickle {
        return Err(VizError::Pickle {
            path: path.into(),
            message: "no pickle protocol header (expected a PyTorch memory snapshot, \
                      protocol 2 or later)"
                .into(),
        });
    }
    Ok(SliceSource::new(bytes))
}

fn read_model_from<S: Source>(path: &Path, source: &mut S) -> Result<Snapshot, VizError> {
    /// Each device's events, built as the entries are read.
    struct Events(Vec<Vec<Event>>);
    impl Sink for Events {
        fn device(&mut self, d: usize, n: usize, budget: &mut Budget) -> Result<(), OverBudget> {
            if self.0.len() <= d {
                self.0.resize_with(d + 1, Vec::new);
            }
            budget.reserve(READING, &mut self.0[d], n)
        }
        fn entry(&mut self, d: usize, i: usize, e: RawEntry) {
            self.0[d].push(Event {
                action: e.action,
                addr: e.addr,
                size: e.size,
                stream: e.stream,
                time_ns: e.time_us.map_or(i as u64, |us| us.saturating_mul(1000)),
                stack: e.stack,
                device_free: e.device_free,
            });
        }
    }
    let mut events = Events(Vec::new());
    let raw = read_records(path, source, &mut events)?;
    let mut traces = events.0;
    let mut out = Snapshot::new("pytorch");
    out.config = raw.settings;
    out.stacks = raw.stacks;
    out.budget = raw.budget;
    let device_count = raw
        .segments
        .iter()
        .map(|s| s.device as usize + 1)
        .max()
        .unwrap_or(0)
        .max(traces.len());
    let mut segments_of: Vec<Vec<Segment>> = (0..device_count).map(|_| Vec::new()).collect();
    for s in raw.segments {
        segments_of[s.device as usize].push(Segment {
            addr: s.address,
            size: s.total_size,
            pool: s.segment_type,
            stream: s.stream,
            expandable: s.is_expandable,
            tag: None,
            asleep: false,
            blocks: s
                .blocks
                .into_iter()
                .map(|b| Block {
                    addr: b.address,
                    size: b.size,
                    requested: b.requested_size,
                    state: b.state,
                    stream: s.stream,
                    pending_events: 0,
                    stack: b.stack,
                    lent_to: None,
                })
                .collect(),
        });
    }
    traces.resize_with(device_count, Vec::new);
    for (d, (mut segments, trace)) in segments_of.into_iter().zip(traces).enumerate() {
        if trace.is_empty() && segments.is_empty() {
            continue;
        }
        segments.sort_by_key(|s| s.addr);
        out.devices.push(DeviceSnapshot {
            device: d as u32,
            time_ns: None,
            trace_dropped: 0,
            segments,
            trace,
        });
    }
    out.check_limits(path)?;
    Ok(out)
}

// ---- Conversions ----

/// Our model of a PyTorch snapshot.
pub fn from_torch(t: &TorchSnapshot) -> Snapshot {
    let mut out = Snapshot::new("pytorch");
    out.config = t.allocator_settings.clone();
    let mut by_ptr: HashMap<*const Frame, u32> = HashMap::new();
    let stacks = &mut out.stacks;
    let mut intern = |stack: &Stack| -> Option<u32> {
        if stack.is_empty() {
            return None;
        }
        Some(
            *by_ptr
                .entry(stack.as_ptr())
                .or_insert_with(|| stacks.push(stack.iter().cloned())),
        )
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
                tag: None,
                asleep: false,
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
                        stack: intern(&b.frames),
                        lent_to: None,
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
                stack: intern(&e.frames),
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

/// [`to_torch`], what it builds charged to `budget` first: an entry per event, each
/// distinct stack's frames once, the segments and their blocks.
pub fn to_torch_within(s: &Snapshot, budget: &mut Budget) -> Result<TorchSnapshot, OverBudget> {
    let frames: usize = (0..s.stacks.len() as u32)
        .map(|i| s.stacks.frame_ids(i).len())
        .sum();
    let segments: usize = s.devices.iter().map(|d| d.segments.len()).sum();
    let blocks: usize = s
        .devices
        .iter()
        .flat_map(|d| &d.segments)
        .map(|seg| seg.blocks.len())
        .sum();
    let bytes = s.event_count() * size_of::<TorchTraceEntry>()
        + frames * size_of::<Frame>()
        + s.stacks.len() * 32
        + segments * size_of::<TorchSegment>()
        + blocks * size_of::<TorchBlock>();
    budget.charge_for("converting to PyTorch's shape", bytes as u64)?;
    Ok(to_torch(s))
}

/// PyTorch's model of our snapshot. streamalloc's own actions (cross-stream waits,
/// staging, empty_cache) have no PyTorch name and are left out. Each stack becomes one
/// shared [`Stack`].
pub fn to_torch(s: &Snapshot) -> TorchSnapshot {
    let stacks: Vec<Stack> = (0..s.stacks.len() as u32)
        .map(|i| s.stacks.frames_of(i).cloned().collect())
        .collect();
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
        // A sleeping pool's segments hold no memory; PyTorch's segments are reserved memory.
        for seg in d.segments.iter().filter(|seg| !seg.asleep) {
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
