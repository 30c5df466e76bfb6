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
use crate::limits::{Budget, MAX_DEVICE_INDEX};
pub use crate::limits::{
    GUNZIP_MAX_BYTES, GUNZIP_MAX_RATIO, GUNZIP_RATIO_FLOOR, LIMIT_ENV as GUNZIP_LIMIT_ENV,
};
pub use crate::model::Frame;
use crate::model::{Block, DeviceSnapshot, Event, Segment, Snapshot, Stacks};
use crate::pickle::{Arena, Kind, Slot};
use crate::sniff::{sniff, Content};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
pub use streamalloc_records::{BlockState, TraceAction};

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
/// names the source in errors.
pub fn parse_snapshot(path: &Path, bytes: &[u8]) -> Result<TorchSnapshot, VizError> {
    let mut device_traces: Vec<Vec<TorchTraceEntry>> = Vec::new();
    struct Collect(Vec<(usize, RawEntry)>);
    impl Sink for Collect {
        fn device(&mut self, _: usize, entries: usize) {
            self.0.reserve_exact(entries);
        }
        fn entry(&mut self, d: usize, _: usize, e: RawEntry) {
            self.0.push((d, e));
        }
    }
    let mut collect = Collect(Vec::new());
    let raw = read_records(path, bytes, &mut collect)?;
    let records = collect.0;
    let shared: Vec<Stack> = (0..raw.stacks.len() as u32)
        .map(|i| raw.stacks.frames_of(i).cloned().collect())
        .collect();
    let empty: Stack = Arc::from(Vec::new());
    let stack = |s: Option<u32>| s.map_or_else(|| empty.clone(), |i| shared[i as usize].clone());
    device_traces.resize_with(raw.device_traces, Vec::new);
    for (d, e) in records {
        device_traces[d].push(TorchTraceEntry {
            action: e.action,
            addr: e.addr,
            size: e.size,
            stream: e.stream,
            time_us: e.time_us,
            frames: stack(e.stack),
            device_free: e.device_free,
        });
    }
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
    /// Each device's events, built as the entries are read.
    struct Events(Vec<Vec<Event>>);
    impl Sink for Events {
        fn device(&mut self, d: usize, entries: usize) {
            if self.0.len() <= d {
                self.0.resize_with(d + 1, Vec::new);
            }
            self.0[d].reserve_exact(entries);
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
    let raw = read_records(path, bytes, &mut events)?;
    let mut traces = events.0;
    let mut out = Snapshot::new("pytorch");
    out.config = raw.settings;
    out.stacks = raw.stacks;
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

/// A trace entry as read, its stack an index into [`Records::stacks`].
struct RawEntry {
    action: TraceAction,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: Option<u64>,
    stack: Option<u32>,
    device_free: Option<u64>,
}

struct RawBlock {
    address: u64,
    size: u64,
    requested_size: u64,
    state: BlockState,
    stack: Option<u32>,
}

struct RawSegment {
    device: u32,
    address: u64,
    total_size: u64,
    stream: u64,
    segment_type: String,
    is_expandable: bool,
    blocks: Vec<RawBlock>,
}

/// What a snapshot holds besides its trace entries, which [`read_records`] hands over one
/// at a time.
struct Records {
    segments: Vec<RawSegment>,
    /// Length of `device_traces`.
    device_traces: usize,
    stacks: Stacks,
    settings: Option<serde_json::Value>,
}

/// In-memory bytes of what the readers build per record, charged to the budget.
const EVENT_BYTES: u64 = std::mem::size_of::<Event>() as u64;
const BLOCK_BYTES: u64 = std::mem::size_of::<Block>() as u64;
const SEGMENT_BYTES: u64 = std::mem::size_of::<Segment>() as u64;
const FRAME_BYTES: u64 = std::mem::size_of::<Frame>() as u64 + 64;
const JSON_BYTES: u64 = std::mem::size_of::<serde_json::Value>() as u64 + 16;

/// Where [`read_records`] puts trace entries as it reads them.
trait Sink {
    /// Device `d`'s trace holds `entries` entries (each already charged to the budget).
    fn device(&mut self, d: usize, entries: usize);
    /// Entry `i` of device `d`'s trace.
    fn entry(&mut self, d: usize, i: usize, entry: RawEntry);
}

/// Decodes `bytes` and reads its records: segments and stacks into the result, each trace
/// entry into `sink` as it is read.
fn read_records(path: &Path, bytes: &[u8], sink: &mut dyn Sink) -> Result<Records, VizError> {
    if sniff(bytes) != Content::Pickle {
        return Err(VizError::Pickle {
            path: path.into(),
            message: "no pickle protocol header (expected a PyTorch memory snapshot, \
                      protocol 2 or later)"
                .into(),
        });
    }
    let mut arena =
        crate::pickle::decode_arena(bytes, Budget::for_input(bytes.len())).map_err(|e| {
            VizError::Pickle {
                path: path.into(),
                message: e.to_string(),
            }
        })?;
    let budget = std::mem::replace(&mut arena.budget, Budget::new(0));
    let mut reader = Reader {
        path,
        arena: &arena,
        budget,
        stacks: Stacks::default(),
        stack_of_node: HashMap::new(),
        stack_of_frames: HashMap::new(),
        frame_of_node: HashMap::new(),
    };
    reader.snapshot(sink)
}

/// A pickle value as the reader sees it.
enum Item<'a> {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
    Container(Kind, &'a [Slot]),
}

/// Reads typed records from the arena, checking every key it uses.
struct Reader<'a> {
    /// The file, for error messages.
    path: &'a Path,
    arena: &'a Arena,
    budget: Budget,
    stacks: Stacks,
    /// The stack read from each shared frames list, by the list's container.
    stack_of_node: HashMap<u32, Option<u32>>,
    /// Each distinct stack, by its frame indices.
    stack_of_frames: HashMap<Box<[u32]>, u32>,
    /// The frame read from each frame dict, by its container.
    frame_of_node: HashMap<u32, u32>,
}

/// The name of a pickle value's type, for error messages.
fn type_name(v: &Item<'_>) -> &'static str {
    match v {
        Item::None => "None",
        Item::Bool(_) => "bool",
        Item::Int(_) => "int",
        Item::Float(_) => "float",
        Item::Bytes(_) => "bytes",
        Item::Str(_) => "str",
        Item::Container(Kind::List, ..) => "list",
        Item::Container(Kind::Tuple, ..) => "tuple",
        Item::Container(Kind::Set | Kind::FrozenSet, ..) => "set",
        Item::Container(Kind::Dict, ..) => "dict",
    }
}

type At<'b> = &'b dyn Fn() -> String;

impl<'a> Reader<'a> {
    fn err(&self, what: String) -> VizError {
        VizError::format(self.path, what)
    }

    fn charge(&mut self, bytes: u64) -> Result<(), VizError> {
        self.budget.charge(bytes).map_err(|over| VizError::Limit {
            path: self.path.into(),
            what: over.to_string(),
        })
    }

    fn item(&self, slot: &Slot) -> Item<'a> {
        let arena: &'a Arena = self.arena;
        match slot {
            Slot::None => Item::None,
            Slot::Bool(b) => Item::Bool(*b),
            Slot::Int(i) => Item::Int(*i),
            Slot::Float(f) => Item::Float(*f),
            Slot::Str(id) => Item::Str(&arena.strings[*id as usize]),
            Slot::Bytes(id) => Item::Bytes(&arena.blobs[*id as usize]),
            Slot::Node(id) => {
                let node = &arena.nodes[*id as usize];
                Item::Container(node.kind, &node.items)
            }
        }
    }

    /// The entries of a dict whose keys are all strings, in the order set (a key set twice
    /// keeps its last value, as in Python).
    fn dict(&self, slot: &Slot, at: At<'_>) -> Result<Vec<(&'a str, &'a Slot)>, VizError> {
        match self.item(slot) {
            Item::Container(Kind::Dict, items) => items
                .chunks_exact(2)
                .map(|kv| match self.item(&kv[0]) {
                    Item::Str(k) => Ok((k, &kv[1])),
                    other => Err(self.err(format!(
                        "{}: dict key of type {} is not a string",
                        at(),
                        type_name(&other)
                    ))),
                })
                .collect(),
            other => Err(self.err(format!(
                "{}: expected a dict, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    fn list(&self, slot: &Slot, at: At<'_>) -> Result<&'a [Slot], VizError> {
        match self.item(slot) {
            Item::Container(Kind::List | Kind::Tuple, items) => Ok(items),
            other => Err(self.err(format!(
                "{}: expected a list, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    fn int(&self, slot: &Slot, at: At<'_>) -> Result<i64, VizError> {
        match self.item(slot) {
            Item::Int(i) => Ok(i),
            Item::Bool(b) => Ok(i64::from(b)),
            other => Err(self.err(format!(
                "{}: expected an int, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    fn uint(&self, slot: &Slot, at: At<'_>) -> Result<u64, VizError> {
        let i = self.int(slot, at)?;
        u64::try_from(i).map_err(|_| self.err(format!("{}: negative value {i}", at())))
    }

    /// Stream handles are pointers: keep their bit pattern even if printed negative.
    fn stream(&self, slot: &Slot, at: At<'_>) -> Result<u64, VizError> {
        Ok(self.int(slot, at)? as u64)
    }

    fn string(&self, slot: &Slot, at: At<'_>) -> Result<&'a str, VizError> {
        match self.item(slot) {
            Item::Str(s) => Ok(s),
            other => Err(self.err(format!(
                "{}: expected a str, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    /// The stack a `frames` list names, `None` when empty. A list the pickle shares is read
    /// once; equal stacks get one index.
    fn frames(&mut self, slot: &Slot, at: At<'_>) -> Result<Option<u32>, VizError> {
        let node = match slot {
            Slot::Node(id) => Some(*id),
            _ => None,
        };
        if let Some(known) = node.and_then(|id| self.stack_of_node.get(&id)) {
            return Ok(*known);
        }
        let items = self.list(slot, at)?;
        let stack = if items.is_empty() {
            None
        } else {
            let mut ids = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                ids.push(self.frame(item, &|| format!("{}[{i}]", at()))?);
            }
            let ids: Box<[u32]> = ids.into();
            match self.stack_of_frames.get(&ids) {
                Some(&s) => Some(s),
                None => {
                    // The stack, and its key in the map.
                    self.charge(2 * (4 * ids.len() as u64 + 32))?;
                    let s = self.stacks.push_ids(ids.clone());
                    self.stack_of_frames.insert(ids, s);
                    Some(s)
                }
            }
        };
        if let Some(id) = node {
            self.charge(16)?;
            self.stack_of_node.insert(id, stack);
        }
        Ok(stack)
    }

    fn frame(&mut self, slot: &Slot, at: At<'_>) -> Result<u32, VizError> {
        let node = match slot {
            Slot::Node(id) => Some(*id),
            _ => None,
        };
        if let Some(&known) = node.and_then(|id| self.frame_of_node.get(&id)) {
            return Ok(known);
        }
        let (mut name, mut filename, mut line) = ("", "", 0);
        for (k, v) in self.dict(slot, at)? {
            match k {
                "name" => name = self.string(v, &|| format!("{}.name", at()))?,
                "filename" => filename = self.string(v, &|| format!("{}.filename", at()))?,
                "line" => line = self.int(v, &|| format!("{}.line", at()))?,
                _ => {}
            }
        }
        let before = self.stacks.frames().len();
        let frame = Frame {
            name: self.stacks.string(name),
            filename: self.stacks.string(filename),
            line,
        };
        let id = self.stacks.frame(frame);
        if self.stacks.frames().len() > before {
            self.charge(FRAME_BYTES + name.len() as u64 + filename.len() as u64)?;
        }
        if let Some(n) = node {
            self.charge(16)?;
            self.frame_of_node.insert(n, id);
        }
        Ok(id)
    }

    fn snapshot(&mut self, sink: &mut dyn Sink) -> Result<Records, VizError> {
        let (mut segments, mut traces, mut settings) = (None, None, None);
        let root = self.arena.root.clone();
        for (k, v) in self.dict(&root, &|| "top level".into())? {
            match k {
                "segments" => segments = Some(v),
                "device_traces" => traces = Some(v),
                "allocator_settings" => settings = Some(v),
                _ => {}
            }
        }
        let (Some(segments), Some(traces)) = (segments, traces) else {
            return Err(self.err(
                "top level: missing key \"segments\" or \"device_traces\" \
                 (not a torch.cuda.memory._dump_snapshot file)"
                    .into(),
            ));
        };
        let settings = match settings {
            Some(v) => Some(self.settings_json(v)?),
            None => None,
        };
        let mut read_segments = Vec::new();
        for (i, s) in self
            .list(segments, &|| "segments".into())?
            .iter()
            .enumerate()
        {
            let seg = self.segment(s, i)?;
            read_segments.push(seg);
        }
        let traces = self.list(traces, &|| "device_traces".into())?;
        self.charge(24 * traces.len() as u64)?;
        // Entries of devices past the limit would become devices past the limit.
        let with_entries = traces
            .iter()
            .rposition(|t| !matches!(self.item(t), Item::Container(_, items) if items.is_empty()))
            .map_or(0, |d| d + 1);
        if with_entries > MAX_DEVICE_INDEX as usize + 1 {
            return Err(self.err(format!(
                "device_traces: entries for device {} exceed the device index limit of \
                 {MAX_DEVICE_INDEX}",
                with_entries - 1
            )));
        }
        for (d, trace) in traces.iter().enumerate() {
            let entries = self.list(trace, &|| format!("device_traces[{d}]"))?;
            // Charged before anything is built, so a trace the budget cannot hold is
            // refused at once.
            self.charge(EVENT_BYTES.saturating_mul(entries.len() as u64))?;
            sink.device(d, entries.len());
            for (i, e) in entries.iter().enumerate() {
                let read = self.entry(e, d, i)?;
                sink.entry(d, i, read);
            }
        }
        Ok(Records {
            segments: read_segments,
            device_traces: traces.len(),
            stacks: std::mem::take(&mut self.stacks),
            settings,
        })
    }

    fn segment(&mut self, v: &Slot, i: usize) -> Result<RawSegment, VizError> {
        let at = || format!("segments[{i}]");
        self.charge(SEGMENT_BYTES)?;
        let mut seg = RawSegment {
            device: 0,
            address: 0,
            total_size: 0,
            stream: 0,
            segment_type: "large".into(),
            is_expandable: false,
            blocks: Vec::new(),
        };
        let (mut have_address, mut have_size) = (false, false);
        let mut blocks: &[Slot] = &[];
        for (k, v) in self.dict(v, &at)? {
            let key_at = || format!("{}.{k}", at());
            match k {
                "device" => {
                    // Bounded here, before the per-device loops see it.
                    let max = MAX_DEVICE_INDEX;
                    seg.device = u32::try_from(self.uint(v, &key_at)?)
                        .ok()
                        .filter(|&d| d <= max)
                        .ok_or_else(|| {
                            self.err(format!(
                                "{}: device index exceeds the limit of {max}",
                                key_at()
                            ))
                        })?
                }
                "address" => {
                    seg.address = self.uint(v, &key_at)?;
                    have_address = true;
                }
                "total_size" => {
                    seg.total_size = self.uint(v, &key_at)?;
                    have_size = true;
                }
                "stream" => seg.stream = self.stream(v, &key_at)?,
                "segment_type" => {
                    let t = self.string(v, &key_at)?;
                    self.charge(t.len() as u64)?;
                    seg.segment_type = t.to_string();
                }
                "is_expandable" => seg.is_expandable = matches!(v, Slot::Bool(true)),
                "blocks" => blocks = self.list(v, &key_at)?,
                _ => {}
            }
        }
        if !have_address || !have_size {
            return Err(self.err(format!("{}: missing \"address\" or \"total_size\"", at())));
        }
        let mut addr = seg.address;
        for (j, b) in blocks.iter().enumerate() {
            let at = || format!("segments[{i}].blocks[{j}]");
            self.charge(BLOCK_BYTES)?;
            let mut block = RawBlock {
                address: addr,
                size: 0,
                requested_size: 0,
                state: BlockState::Inactive,
                stack: None,
            };
            let (mut have_size, mut have_state, mut have_requested) = (false, false, false);
            for (k, v) in self.dict(b, &at)? {
                let key_at = || format!("{}.{k}", at());
                match k {
                    "address" => block.address = self.uint(v, &key_at)?,
                    "size" => {
                        block.size = self.uint(v, &key_at)?;
                        have_size = true;
                    }
                    "requested_size" => {
                        block.requested_size = self.uint(v, &key_at)?;
                        have_requested = true;
                    }
                    "state" => {
                        let name = self.string(v, &key_at)?;
                        block.state = BlockState::from_name(name).ok_or_else(|| {
                            self.err(format!("{}: unknown block state {name:?}", key_at()))
                        })?;
                        have_state = true;
                    }
                    "frames" => block.stack = self.frames(v, &key_at)?,
                    _ => {}
                }
            }
            if !have_size || !have_state {
                return Err(self.err(format!("{}: missing \"size\" or \"state\"", at())));
            }
            if !have_requested {
                block.requested_size = block.size;
            }
            addr = block.address.wrapping_add(block.size);
            seg.blocks.push(block);
        }
        Ok(seg)
    }

    fn entry(&mut self, v: &Slot, d: usize, i: usize) -> Result<RawEntry, VizError> {
        let at = || format!("device_traces[{d}][{i}]");
        let mut entry = RawEntry {
            action: TraceAction::Alloc,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: None,
            stack: None,
            device_free: None,
        };
        let mut have_action = false;
        for (k, v) in self.dict(v, &at)? {
            let key_at = || format!("{}.{k}", at());
            match k {
                "action" => {
                    let name = self.string(v, &key_at)?;
                    entry.action = TraceAction::from_pytorch_name(name).ok_or_else(|| {
                        self.err(format!("{}: unknown action {name:?}", key_at()))
                    })?;
                    have_action = true;
                }
                "addr" => entry.addr = self.uint(v, &key_at)?,
                "size" => entry.size = self.uint(v, &key_at)?,
                "stream" => entry.stream = self.stream(v, &key_at)?,
                "time_us" => entry.time_us = Some(self.uint(v, &key_at)?),
                "frames" => entry.stack = self.frames(v, &key_at)?,
                "device_free" => entry.device_free = Some(self.uint(v, &key_at)?),
                _ => {}
            }
        }
        if !have_action {
            return Err(self.err(format!("{}: missing \"action\"", at())));
        }
        Ok(entry)
    }

    /// A pickle value as JSON (for settings we carry but do not interpret). Shared
    /// containers are copied out, charged to the budget; a container inside itself, or
    /// nesting deeper than the pickle decoder allows, is refused.
    fn settings_json(&mut self, slot: &Slot) -> Result<serde_json::Value, VizError> {
        self.json_at(slot, 0)
    }

    fn json_at(&mut self, slot: &Slot, depth: usize) -> Result<serde_json::Value, VizError> {
        use serde_json::Value as J;
        if depth > crate::pickle::MAX_DEPTH {
            return Err(self.err(format!(
                "allocator_settings: nested more than {} deep",
                crate::pickle::MAX_DEPTH
            )));
        }
        self.charge(JSON_BYTES)?;
        Ok(match self.item(slot) {
            Item::None => J::Null,
            Item::Bool(b) => J::Bool(b),
            Item::Int(i) => J::from(i),
            Item::Float(f) => serde_json::Number::from_f64(f).map_or(J::Null, J::Number),
            Item::Bytes(b) => {
                self.charge(b.len() as u64)?;
                J::String(String::from_utf8_lossy(b).into_owned())
            }
            Item::Str(s) => {
                self.charge(s.len() as u64)?;
                J::String(s.to_string())
            }
            Item::Container(Kind::Dict, items) => {
                let mut map = serde_json::Map::new();
                for kv in items.chunks_exact(2) {
                    let key = match self.item(&kv[0]) {
                        Item::Str(s) => s.to_string(),
                        Item::Int(i) => i.to_string(),
                        other => type_name(&other).to_string(),
                    };
                    self.charge(key.len() as u64)?;
                    let value = self.json_at(&kv[1], depth + 1)?;
                    map.insert(key, value);
                }
                J::Object(map)
            }
            Item::Container(_, items) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    out.push(self.json_at(item, depth + 1)?);
                }
                J::Array(out)
            }
        })
    }
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

// ---- Writing ----

/// Integers must fit in a signed 64-bit integer: `MemoryViz.js` turns a `LONG1` of more
/// than 8 bytes into a `BigInt`, which breaks its arithmetic.
fn as_i64(v: u64, what: &str) -> Result<i64, VizError> {
    i64::try_from(v).map_err(|_| VizError::Unrepresentable {
        format: "PyTorch pickle",
        what: format!("{what} {v:#x} exceeds a signed 64-bit integer"),
    })
}

/// A pickle emitter limited to what PyTorch's viewers read: protocol 4 (unframed); dicts, lists,
/// 2-tuples, strings, integers of at most 8 bytes, floats, booleans, `None`. Strings are memoised
/// (`BINPUT`/`BINGET`, as Python's own pickler does), so the keys and call-stack strings
/// repeated in every trace entry are written once: files shrink several times over. Call
/// stacks are memoised too, by their shared allocation: an entry whose stack was written
/// before refers to it, as in the pickles PyTorch writes.
struct PickleWriter<W: Write> {
    out: W,
    /// Memo index of every string written so far.
    memo: HashMap<String, u32>,
    /// Memo index of every call stack written so far, by its shared allocation: a stack is
    /// written once and referred to from every other entry with it, as PyTorch's own
    /// snapshots do.
    stacks: HashMap<*const Frame, u32>,
}

/// Strings longer than this are not memoised (they rarely repeat).
const MEMO_MAX_LEN: usize = 256;
/// Bound on memo entries, so the memo stays small whatever the input.
const MEMO_MAX_ENTRIES: usize = 1 << 20;

impl<W: Write> PickleWriter<W> {
    fn raw(&mut self, bytes: &[u8]) -> Result<(), VizError> {
        self.out.write_all(bytes).map_err(pickle_io)
    }

    fn op(&mut self, op: u8) -> Result<(), VizError> {
        self.raw(&[op])
    }

    fn int(&mut self, v: i64) -> Result<(), VizError> {
        match v {
            0..=0xff => self.raw(&[b'K', v as u8]),
            0x100..=0xffff => {
                self.op(b'M')?;
                self.raw(&(v as u16).to_le_bytes())
            }
            _ if i32::try_from(v).is_ok() => {
                self.op(b'J')?;
                self.raw(&(v as i32).to_le_bytes())
            }
            _ => {
                // LONG1: little-endian two's complement, here always 8 bytes.
                self.raw(&[0x8a, 8])?;
                self.raw(&v.to_le_bytes())
            }
        }
    }

    fn bool(&mut self, v: bool) -> Result<(), VizError> {
        self.op(if v { 0x88 } else { 0x89 })
    }

    fn str(&mut self, v: &str) -> Result<(), VizError> {
        if let Some(&id) = self.memo.get(v) {
            return self.memo_get(id);
        }
        let bytes = v.as_bytes();
        if bytes.len() < 256 {
            self.raw(&[0x8c, bytes.len() as u8])?;
        } else {
            self.op(b'X')?;
            self.raw(&(bytes.len() as u32).to_le_bytes())?;
        }
        self.raw(bytes)?;
        if bytes.len() <= MEMO_MAX_LEN {
            if let Some(id) = self.memoise()? {
                self.memo.insert(v.to_owned(), id);
            }
        }
        Ok(())
    }

    /// Stores the object on top of the stack under the next memo index (`BINPUT`), and
    /// returns it; `None` once the memo holds [`MEMO_MAX_ENTRIES`].
    fn memoise(&mut self) -> Result<Option<u32>, VizError> {
        let id = self.memo.len() + self.stacks.len();
        if id >= MEMO_MAX_ENTRIES {
            return Ok(None);
        }
        let id = id as u32;
        if id < 256 {
            self.raw(&[b'q', id as u8])?;
        } else {
            self.op(b'r')?;
            self.raw(&id.to_le_bytes())?;
        }
        Ok(Some(id))
    }

    /// Pushes memo entry `id` (`BINGET`).
    fn memo_get(&mut self, id: u32) -> Result<(), VizError> {
        if id < 256 {
            self.raw(&[b'h', id as u8])
        } else {
            self.op(b'j')?;
            self.raw(&id.to_le_bytes())
        }
    }

    /// A list of `n` items written by `item(self, i)`, appended in batches of 1000.
    fn list(
        &mut self,
        n: usize,
        mut item: impl FnMut(&mut Self, usize) -> Result<(), VizError>,
    ) -> Result<(), VizError> {
        self.op(b']')?;
        for start in (0..n).step_by(1000) {
            self.op(b'(')?;
            for i in start..n.min(start + 1000) {
                item(self, i)?;
            }
            self.op(b'e')?;
        }
        Ok(())
    }

    /// A JSON value as the equivalent Python value (dict keys as strings).
    fn json(&mut self, v: &serde_json::Value) -> Result<(), VizError> {
        use serde_json::Value as J;
        match v {
            J::Null => self.op(b'N'),
            J::Bool(b) => self.bool(*b),
            J::Number(n) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => self.int(i),
                (None, Some(f)) => {
                    self.op(b'G')?;
                    self.raw(&f.to_be_bytes())
                }
                (None, None) => self.op(b'N'),
            },
            J::String(s) => self.str(s),
            J::Array(items) => self.list(items.len(), |w, i| w.json(&items[i])),
            J::Object(map) => {
                self.op(b'}')?;
                if !map.is_empty() {
                    self.op(b'(')?;
                    for (k, v) in map {
                        self.str(k)?;
                        self.json(v)?;
                    }
                    self.op(b'u')?;
                }
                Ok(())
            }
        }
    }

    /// A call stack: written in full the first time, then referred to through the memo.
    fn frames(&mut self, stack: &Stack) -> Result<(), VizError> {
        if stack.is_empty() {
            return self.op(b']');
        }
        if let Some(&id) = self.stacks.get(&stack.as_ptr()) {
            return self.memo_get(id);
        }
        self.list(stack.len(), |w, i| {
            let f = &stack[i];
            w.op(b'}')?;
            w.op(b'(')?;
            w.str("name")?;
            w.str(&f.name)?;
            w.str("filename")?;
            w.str(&f.filename)?;
            w.str("line")?;
            w.int(f.line)?;
            w.op(b'u')
        })?;
        if let Some(id) = self.memoise()? {
            self.stacks.insert(stack.as_ptr(), id);
        }
        Ok(())
    }

    fn block(&mut self, b: &TorchBlock) -> Result<(), VizError> {
        self.op(b'}')?;
        self.op(b'(')?;
        self.str("address")?;
        self.int(as_i64(b.address, "block address")?)?;
        self.str("size")?;
        self.int(as_i64(b.size, "block size")?)?;
        self.str("requested_size")?;
        self.int(as_i64(b.requested_size, "requested size")?)?;
        self.str("state")?;
        self.str(b.state.name())?;
        self.str("frames")?;
        self.frames(&b.frames)?;
        self.op(b'u')
    }

    fn segment(&mut self, s: &TorchSegment) -> Result<(), VizError> {
        let (mut allocated, mut active, mut requested) = (0u64, 0u64, 0u64);
        for b in &s.blocks {
            if b.state != BlockState::Inactive {
                active += b.size;
            }
            if b.state == BlockState::ActiveAllocated {
                allocated += b.size;
                requested += b.requested_size;
            }
        }
        self.op(b'}')?;
        self.op(b'(')?;
        self.str("device")?;
        self.int(i64::from(s.device))?;
        self.str("address")?;
        self.int(as_i64(s.address, "segment address")?)?;
        self.str("total_size")?;
        self.int(as_i64(s.total_size, "segment size")?)?;
        self.str("allocated_size")?;
        self.int(as_i64(allocated, "allocated size")?)?;
        self.str("active_size")?;
        self.int(as_i64(active, "active size")?)?;
        self.str("requested_size")?;
        self.int(as_i64(requested, "requested size")?)?;
        self.str("stream")?;
        self.int(s.stream as i64)?;
        self.str("segment_type")?;
        self.str(&s.segment_type)?;
        self.str("segment_pool_id")?;
        self.int(0)?;
        self.int(0)?;
        self.op(0x86)?; // TUPLE2
        self.str("is_expandable")?;
        self.bool(s.is_expandable)?;
        self.str("frames")?;
        self.op(b']')?;
        self.str("blocks")?;
        self.list(s.blocks.len(), |w, i| w.block(&s.blocks[i]))?;
        self.op(b'u')
    }

    fn entry(&mut self, e: &TorchTraceEntry) -> Result<(), VizError> {
        self.op(b'}')?;
        self.op(b'(')?;
        self.str("action")?;
        self.str(e.action.name())?;
        self.str("addr")?;
        self.int(as_i64(e.addr, "address")?)?;
        self.str("size")?;
        self.int(as_i64(e.size, "size")?)?;
        self.str("stream")?;
        self.int(e.stream as i64)?;
        if let Some(t) = e.time_us {
            self.str("time_us")?;
            self.int(as_i64(t, "time")?)?;
        }
        if let Some(f) = e.device_free {
            self.str("device_free")?;
            self.int(as_i64(f, "device_free")?)?;
        }
        self.str("frames")?;
        self.frames(&e.frames)?;
        self.op(b'u')
    }
}

fn pickle_io(e: std::io::Error) -> VizError {
    VizError::Unrepresentable {
        format: "PyTorch pickle",
        what: e.to_string(),
    }
}

/// Writes `snapshot` as an uncompressed PyTorch-compatible pickle (protocol 4). Pass a
/// buffered writer: the pickle is written in many small pieces.
pub fn write_pickle(snapshot: &TorchSnapshot, out: &mut impl Write) -> Result<(), VizError> {
    let mut w = PickleWriter {
        out,
        memo: HashMap::new(),
        stacks: HashMap::new(),
    };
    w.raw(&[0x80, 4])?;
    w.op(b'}')?;
    w.op(b'(')?;
    w.str("segments")?;
    w.list(snapshot.segments.len(), |w, i| {
        w.segment(&snapshot.segments[i])
    })?;
    w.str("device_traces")?;
    w.list(snapshot.device_traces.len(), |w, d| {
        let trace = &snapshot.device_traces[d];
        w.list(trace.len(), |w, i| w.entry(&trace[i]))
    })?;
    if let Some(settings) = &snapshot.allocator_settings {
        w.str("allocator_settings")?;
        w.json(settings)?;
    }
    w.op(b'u')?;
    w.op(b'.')?;
    Ok(())
}
