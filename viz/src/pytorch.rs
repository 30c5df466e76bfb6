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
//! Decoding goes through [`crate::pickle`], a bounded decoder of plain pickled data into
//! `serde-pickle`'s generic [`serde_pickle::Value`] (memo and shared references, frames,
//! integers up to 64 bits), and is then checked key by key, so a truncated, corrupt,
//! hostile or foreign file gives one [`VizError`] naming the file and the offending byte
//! or key, never a panic. Call stacks repeat across entries, so identical stacks are shared
//! ([`Stack`]), which keeps a million-entry trace small in memory.
//!
//! Actions and block states are the shared records of `streamalloc-records`
//! ([`TraceAction`], [`BlockState`], re-exported here), whose names are PyTorch's; only
//! PyTorch's actions are read from or belong in these files
//! ([`TraceAction::from_pytorch_name`]).
//!
//! [`write_pickle`] writes the same shape back with only the opcodes PyTorch's own
//! JavaScript viewer (`MemoryViz.js`) decodes: protocol 4, dicts, lists, tuples, strings
//! (memoised with `BINPUT`/`BINGET`, as Python does), integers of at most 8 bytes, floats,
//! booleans and `None`.
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
use crate::sniff::{sniff, Content};
use serde_pickle::{HashableValue, Value};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
pub use streamalloc_records::{BlockState, TraceAction};

// ---- Types ----

/// One Python frame of a call stack, as PyTorch records it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Frame {
    /// Function name.
    pub name: String,
    /// Source file.
    pub filename: String,
    /// Line number.
    pub line: i64,
}

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
    let raw = std::fs::read(path).map_err(|e| VizError::io(path, e))?;
    let bytes = maybe_gunzip(path, raw)?;
    parse_snapshot(path, &bytes)
}

/// The most bytes a gzip file may decompress to, whatever its ratio.
pub const GUNZIP_MAX_BYTES: u64 = 1 << 30;
/// The most a gzip file may expand by (real snapshots expand about 40 times), above
/// [`GUNZIP_RATIO_FLOOR`]: a 2 MB bomb must not become 2 GB in memory.
pub const GUNZIP_MAX_RATIO: u64 = 200;
/// Decompressed sizes up to this are allowed whatever the ratio, so small but very regular
/// files are not refused.
pub const GUNZIP_RATIO_FLOOR: u64 = 64 << 20;
/// Environment variable that replaces both limits by one byte count (e.g. `4G`).
pub const GUNZIP_LIMIT_ENV: &str = "STREAMALLOC_MAX_DECOMPRESSED";

/// The decompressed-size limit for a gzip file of `compressed` bytes, and how it was set.
fn gunzip_limit(path: &Path, compressed: usize) -> Result<(u64, String), VizError> {
    if let Some(text) = std::env::var_os(GUNZIP_LIMIT_ENV) {
        let text = text.to_string_lossy();
        let bytes = parse_byte_count(&text).ok_or_else(|| VizError::Limit {
            path: path.into(),
            what: format!("{GUNZIP_LIMIT_ENV}={text:?} is not a byte count (e.g. 4G)"),
        })?;
        return Ok((bytes, format!("{GUNZIP_LIMIT_ENV}={text}")));
    }
    let by_ratio = (compressed as u64)
        .saturating_mul(GUNZIP_MAX_RATIO)
        .max(GUNZIP_RATIO_FLOOR);
    Ok((
        by_ratio.min(GUNZIP_MAX_BYTES),
        format!(
            "{GUNZIP_MAX_RATIO}x the compressed size, at most {} MiB; set {GUNZIP_LIMIT_ENV} \
             to raise it",
            GUNZIP_MAX_BYTES >> 20
        ),
    ))
}

/// `123`, `64K`, `512M`, `4G` (binary multiples).
fn parse_byte_count(text: &str) -> Option<u64> {
    let t = text.trim();
    let (digits, shift) = match t.char_indices().last()? {
        (i, 'k' | 'K') => (&t[..i], 10),
        (i, 'm' | 'M') => (&t[..i], 20),
        (i, 'g' | 'G') => (&t[..i], 30),
        _ => (t, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// Decompresses `raw` if it starts with the gzip magic, else returns it unchanged. The
/// output is capped (see [`GUNZIP_MAX_BYTES`], [`GUNZIP_MAX_RATIO`], [`GUNZIP_LIMIT_ENV`]):
/// past the cap the file is refused with one line naming it and the limit.
pub fn maybe_gunzip(path: &Path, raw: Vec<u8>) -> Result<Vec<u8>, VizError> {
    if sniff(&raw) != Content::Gzip {
        return Ok(raw);
    }
    let (limit, how) = gunzip_limit(path, raw.len())?;
    gunzip_within(path, &raw, limit, &how)
}

/// Decompresses the gzip stream `raw` (every member, as `gzip -d` does) into at most
/// `limit` bytes: a stream that would give more is refused with [`VizError::Limit`], whose
/// message says `how` the limit was set. Corrupt or truncated data is [`VizError::Gzip`].
/// `path` only names the source in errors. [`maybe_gunzip`] is this with the limit of
/// [`GUNZIP_LIMIT_ENV`] or the ratio.
pub fn gunzip_within(path: &Path, raw: &[u8], limit: u64, how: &str) -> Result<Vec<u8>, VizError> {
    let capacity = (raw.len() as u64).saturating_mul(8).min(limit) as usize;
    let mut out = Vec::with_capacity(capacity);
    // One byte past the limit tells "exactly at the limit" from "over it".
    flate2::read::MultiGzDecoder::new(raw)
        .take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|source| VizError::Gzip {
            path: path.into(),
            source,
        })?;
    if out.len() as u64 > limit {
        return Err(VizError::Limit {
            path: path.into(),
            what: format!("decompresses to more than {limit} bytes (limit: {how})"),
        });
    }
    Ok(out)
}

/// Decodes a snapshot from uncompressed pickle bytes. `path` only names the source in
/// errors.
pub fn parse_snapshot(path: &Path, bytes: &[u8]) -> Result<TorchSnapshot, VizError> {
    if sniff(bytes) != Content::Pickle {
        return Err(VizError::Pickle {
            path: path.into(),
            message: "no pickle protocol header (expected a PyTorch memory snapshot, \
                      protocol 2 or later)"
                .into(),
        });
    }
    let value = crate::pickle::decode(bytes).map_err(|e| VizError::Pickle {
        path: path.into(),
        message: e.to_string(),
    })?;
    Converter {
        path,
        stacks: HashMap::new(),
        empty: Arc::from(Vec::new()),
    }
    .snapshot(value)
}

/// Turns the generic pickle value into typed records, checking every key it uses.
struct Converter<'a> {
    /// The file, for error messages.
    path: &'a Path,
    /// Every distinct call stack seen, so that equal stacks share one allocation.
    stacks: HashMap<Vec<Frame>, Stack>,
    /// The shared empty stack.
    empty: Stack,
}

/// The name of a pickle value's type, for error messages.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::I64(_) | Value::Int(_) => "int",
        Value::F64(_) => "float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "str",
        Value::List(_) => "list",
        Value::Tuple(_) => "tuple",
        Value::Set(_) | Value::FrozenSet(_) => "set",
        Value::Dict(_) => "dict",
    }
}

impl Converter<'_> {
    fn err(&self, what: String) -> VizError {
        VizError::format(self.path, what)
    }

    /// The entries of a dict whose keys are all strings.
    fn dict(&self, v: Value, at: &dyn Fn() -> String) -> Result<Vec<(String, Value)>, VizError> {
        match v {
            Value::Dict(map) => map
                .into_iter()
                .map(|(k, v)| match k {
                    HashableValue::String(s) => Ok((s, v)),
                    other => Err(self.err(format!(
                        "{}: dict key {:?} is not a string",
                        at(),
                        other.into_value()
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

    fn list(&self, v: Value, at: &dyn Fn() -> String) -> Result<Vec<Value>, VizError> {
        match v {
            Value::List(l) | Value::Tuple(l) => Ok(l),
            other => Err(self.err(format!(
                "{}: expected a list, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    fn int(&self, v: &Value, at: &dyn Fn() -> String) -> Result<i64, VizError> {
        match v {
            Value::I64(i) => Ok(*i),
            Value::Bool(b) => Ok(i64::from(*b)),
            Value::Int(_) => Err(self.err(format!("{}: integer does not fit in 64 bits", at()))),
            other => Err(self.err(format!(
                "{}: expected an int, found {}",
                at(),
                type_name(other)
            ))),
        }
    }

    fn uint(&self, v: &Value, at: &dyn Fn() -> String) -> Result<u64, VizError> {
        let i = self.int(v, at)?;
        u64::try_from(i).map_err(|_| self.err(format!("{}: negative value {i}", at())))
    }

    /// Stream handles are pointers: keep their bit pattern even if printed negative.
    fn stream(&self, v: &Value, at: &dyn Fn() -> String) -> Result<u64, VizError> {
        Ok(self.int(v, at)? as u64)
    }

    fn string(&self, v: Value, at: &dyn Fn() -> String) -> Result<String, VizError> {
        match v {
            Value::String(s) => Ok(s),
            other => Err(self.err(format!(
                "{}: expected a str, found {}",
                at(),
                type_name(&other)
            ))),
        }
    }

    fn frames(&mut self, v: Value, at: &dyn Fn() -> String) -> Result<Stack, VizError> {
        let items = self.list(v, at)?;
        if items.is_empty() {
            return Ok(self.empty.clone());
        }
        let mut frames = Vec::with_capacity(items.len());
        for (i, item) in items.into_iter().enumerate() {
            let at = || format!("{}[{i}]", at());
            let (mut name, mut filename, mut line) = (String::new(), String::new(), 0);
            for (k, v) in self.dict(item, &at)? {
                match k.as_str() {
                    "name" => name = self.string(v, &|| format!("{}.name", at()))?,
                    "filename" => filename = self.string(v, &|| format!("{}.filename", at()))?,
                    "line" => line = self.int(&v, &|| format!("{}.line", at()))?,
                    _ => {}
                }
            }
            frames.push(Frame {
                name,
                filename,
                line,
            });
        }
        if let Some(stack) = self.stacks.get(&frames) {
            return Ok(stack.clone());
        }
        let stack: Stack = Arc::from(frames.clone());
        self.stacks.insert(frames, stack.clone());
        Ok(stack)
    }

    fn snapshot(mut self, v: Value) -> Result<TorchSnapshot, VizError> {
        let mut segments = None;
        let mut traces = None;
        let mut settings = None;
        for (k, v) in self.dict(v, &|| "top level".into())? {
            match k.as_str() {
                "segments" => segments = Some(v),
                "device_traces" => traces = Some(v),
                "allocator_settings" => settings = Some(to_json(v)),
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
        let segments = self
            .list(segments, &|| "segments".into())?
            .into_iter()
            .enumerate()
            .map(|(i, s)| self.segment(s, i))
            .collect::<Result<Vec<_>, _>>()?;
        let device_traces = self
            .list(traces, &|| "device_traces".into())?
            .into_iter()
            .enumerate()
            .map(|(d, trace)| {
                let entries = self.list(trace, &|| format!("device_traces[{d}]"))?;
                entries
                    .into_iter()
                    .enumerate()
                    .map(|(i, e)| self.entry(e, d, i))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(TorchSnapshot {
            segments,
            device_traces,
            allocator_settings: settings,
        })
    }

    fn segment(&mut self, v: Value, i: usize) -> Result<TorchSegment, VizError> {
        let at = || format!("segments[{i}]");
        let mut seg = TorchSegment {
            device: 0,
            address: 0,
            total_size: 0,
            stream: 0,
            segment_type: "large".into(),
            is_expandable: false,
            blocks: Vec::new(),
        };
        let (mut have_address, mut have_size) = (false, false);
        let mut blocks = Vec::new();
        for (k, v) in self.dict(v, &at)? {
            let key_at = || format!("{}.{k}", at());
            match k.as_str() {
                "device" => {
                    // Bounded here, before the model's per-device loop sees it.
                    let max = crate::model::MAX_DEVICE_INDEX;
                    seg.device = u32::try_from(self.uint(&v, &key_at)?)
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
                    seg.address = self.uint(&v, &key_at)?;
                    have_address = true;
                }
                "total_size" => {
                    seg.total_size = self.uint(&v, &key_at)?;
                    have_size = true;
                }
                "stream" => seg.stream = self.stream(&v, &key_at)?,
                "segment_type" => seg.segment_type = self.string(v, &key_at)?,
                "is_expandable" => seg.is_expandable = matches!(v, Value::Bool(true)),
                "blocks" => blocks = self.list(v, &key_at)?,
                _ => {}
            }
        }
        if !have_address || !have_size {
            return Err(self.err(format!("{}: missing \"address\" or \"total_size\"", at())));
        }
        let mut addr = seg.address;
        for (j, b) in blocks.into_iter().enumerate() {
            let at = || format!("segments[{i}].blocks[{j}]");
            let mut block = TorchBlock {
                address: addr,
                size: 0,
                requested_size: 0,
                state: BlockState::Inactive,
                frames: self.empty.clone(),
            };
            let (mut have_size, mut have_state, mut have_requested) = (false, false, false);
            for (k, v) in self.dict(b, &at)? {
                let key_at = || format!("{}.{k}", at());
                match k.as_str() {
                    "address" => block.address = self.uint(&v, &key_at)?,
                    "size" => {
                        block.size = self.uint(&v, &key_at)?;
                        have_size = true;
                    }
                    "requested_size" => {
                        block.requested_size = self.uint(&v, &key_at)?;
                        have_requested = true;
                    }
                    "state" => {
                        let name = self.string(v, &key_at)?;
                        block.state = BlockState::from_name(&name).ok_or_else(|| {
                            self.err(format!("{}: unknown block state {name:?}", key_at()))
                        })?;
                        have_state = true;
                    }
                    "frames" => block.frames = self.frames(v, &key_at)?,
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

    fn entry(&mut self, v: Value, d: usize, i: usize) -> Result<TorchTraceEntry, VizError> {
        let at = || format!("device_traces[{d}][{i}]");
        let mut entry = TorchTraceEntry {
            action: TraceAction::Alloc,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: None,
            frames: self.empty.clone(),
            device_free: None,
        };
        let mut have_action = false;
        for (k, v) in self.dict(v, &at)? {
            let key_at = || format!("{}.{k}", at());
            match k.as_str() {
                "action" => {
                    let name = self.string(v, &key_at)?;
                    entry.action = TraceAction::from_pytorch_name(&name).ok_or_else(|| {
                        self.err(format!("{}: unknown action {name:?}", key_at()))
                    })?;
                    have_action = true;
                }
                "addr" => entry.addr = self.uint(&v, &key_at)?,
                "size" => entry.size = self.uint(&v, &key_at)?,
                "stream" => entry.stream = self.stream(&v, &key_at)?,
                "time_us" => entry.time_us = Some(self.uint(&v, &key_at)?),
                "frames" => entry.frames = self.frames(v, &key_at)?,
                "device_free" => entry.device_free = Some(self.uint(&v, &key_at)?),
                _ => {}
            }
        }
        if !have_action {
            return Err(self.err(format!("{}: missing \"action\"", at())));
        }
        Ok(entry)
    }
}

/// A pickle value as JSON (for settings we carry but do not interpret).
fn to_json(v: Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(b),
        Value::I64(i) => J::from(i),
        Value::Int(i) => J::String(i.to_string()),
        Value::F64(f) => serde_json::Number::from_f64(f).map_or(J::Null, J::Number),
        Value::Bytes(b) => J::String(String::from_utf8_lossy(&b).into_owned()),
        Value::String(s) => J::String(s),
        Value::List(l) | Value::Tuple(l) => J::Array(l.into_iter().map(to_json).collect()),
        Value::Set(s) | Value::FrozenSet(s) => {
            J::Array(s.into_iter().map(|h| to_json(h.into_value())).collect())
        }
        Value::Dict(d) => J::Object(
            d.into_iter()
                .map(|(k, v)| {
                    let key = match k.into_value() {
                        Value::String(s) => s,
                        other => format!("{other:?}"),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
    }
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
/// repeated in every trace entry are written once: files shrink several times over.
struct PickleWriter<W: Write> {
    out: W,
    /// Memo index of every string written so far.
    memo: HashMap<String, u32>,
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
            return if id < 256 {
                self.raw(&[b'h', id as u8])
            } else {
                self.op(b'j')?;
                self.raw(&id.to_le_bytes())
            };
        }
        let bytes = v.as_bytes();
        if bytes.len() < 256 {
            self.raw(&[0x8c, bytes.len() as u8])?;
        } else {
            self.op(b'X')?;
            self.raw(&(bytes.len() as u32).to_le_bytes())?;
        }
        self.raw(bytes)?;
        if bytes.len() <= MEMO_MAX_LEN && self.memo.len() < MEMO_MAX_ENTRIES {
            let id = self.memo.len() as u32;
            if id < 256 {
                self.raw(&[b'q', id as u8])?;
            } else {
                self.op(b'r')?;
                self.raw(&id.to_le_bytes())?;
            }
            self.memo.insert(v.to_owned(), id);
        }
        Ok(())
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

    fn frames(&mut self, stack: &[Frame]) -> Result<(), VizError> {
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
        })
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
