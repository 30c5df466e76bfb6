//! The data the viewer page fetches: one binary blob per (file, device).
//!
//! A million-event trace as JSON is ~80 MB that the browser must parse object by object;
//! as columns of typed arrays it is ~40 MB that the page maps with zero parsing
//! (`new Float64Array(buffer, offset, n)`), which is what makes opening it take well
//! under a second. The server pairs events into lifetimes ([`Timeline`]) so the page never
//! has to.
//!
//! # Layout
//! `u32` little-endian length `L`, then `L` bytes of JSON (the header), zero-padded to a
//! multiple of 8, then the columns, each starting at a multiple of 8. The header is
//! ```text
//! { "device": int, "source": str, "events": n, "allocs": m, "segments": k,
//!   "sleeping": z,                      // ranges sleeping memory pools gave back
//!   "t0_ns": int,                       // time of the first event; columns are relative
//!   "streams": ["0x0", ...],            // stream handles; columns hold indices into this
//!   "actions": ["alloc", ...],          // names of the action codes
//!   "frames": [["name", "file", line], ...],  // each distinct frame once
//!   "stacks": [[frame index, ...], ...],      // innermost first
//!   "peak": {"active": [i, bytes], "reserved": [i, bytes]},
//!   "trace_dropped": int, "config": {...}|null, "stats": {...}|null,
//!   "columns": {"name": {"type": "f64"|"i32"|"u32"|"u8", "offset": bytes, "len": count}} }
//! ```
//! Columns: `ev_time` (f64 ns since `t0_ns`), `ev_action` (u8), `ev_stream` (u32),
//! `ev_addr`, `ev_size` (f64); `al_start`, `al_fr`, `al_end` (i32 event index, -1 for
//! none), `al_addr`, `al_size` (f64), `al_stream`, `al_owner` (u32), `al_stack` (i32, -1
//! for none); `sg_start`, `sg_end` (i32), `sg_addr`, `sg_size` (f64), `sg_stream` (u32);
//! `sl_start`, `sl_end` (i32), `sl_addr`, `sl_size` (f64): ranges of sleeping memory pools.
//! Addresses travel as f64: exact below 2^53, which device addresses are. Stream indices
//! are u32, so a trace of more than 65,536 streams keeps every event on its own stream.

use crate::limits::{Budget, OverBudget};
use crate::model::{DeviceSnapshot, Snapshot, TraceAction};
use crate::timeline::{Counter, Timeline};
use serde::Serialize;
use serde_json::json;

/// What the budget calls building the blob.
const STAGE: &str = "building the viewer's data";

/// The columns of a blob, written straight into the blob after the header: their types,
/// lengths and where each starts.
struct Columns {
    body: Vec<u8>,
    /// Where the body starts in the blob (offsets in the directory are from there).
    base: usize,
    dir: serde_json::Map<String, serde_json::Value>,
}

impl Columns {
    /// Pads the body to where column `name` starts, as the directory says.
    fn start(&mut self, name: &str, ty: &str, len: usize) {
        let at = (self.body.len() - self.base).next_multiple_of(8);
        debug_assert_eq!(
            self.dir.get(name),
            Some(&json!({"type": ty, "offset": at, "len": len}))
        );
        self.body.resize(self.base + at, 0);
    }

    fn f64s(&mut self, name: &str, v: impl ExactSizeIterator<Item = f64>) {
        self.start(name, "f64", v.len());
        v.for_each(|x| self.body.extend_from_slice(&x.to_le_bytes()));
    }

    fn i32s(&mut self, name: &str, v: impl ExactSizeIterator<Item = i32>) {
        self.start(name, "i32", v.len());
        v.for_each(|x| self.body.extend_from_slice(&x.to_le_bytes()));
    }

    fn u32s(&mut self, name: &str, v: impl ExactSizeIterator<Item = u32>) {
        self.start(name, "u32", v.len());
        v.for_each(|x| self.body.extend_from_slice(&x.to_le_bytes()));
    }

    fn u8s(&mut self, name: &str, v: impl ExactSizeIterator<Item = u8>) {
        self.start(name, "u8", v.len());
        self.body.extend(v);
    }
}

/// Bytes of the columns of `events` events, `allocs` allocations, `segments` segments and
/// `sleeping` sleeping ranges, each column padded to 8 bytes.
fn columns_bytes(events: usize, allocs: usize, segments: usize, sleeping: usize) -> usize {
    let col = |n: usize, width: usize| (n * width).next_multiple_of(8);
    col(events, 8) * 3
        + col(events, 1)
        + col(events, 4)
        + col(allocs, 4) * 6
        + col(allocs, 8) * 2
        + col(segments, 4) * 3
        + col(segments, 8) * 2
        + col(sleeping, 4) * 2
        + col(sleeping, 8) * 2
}

fn idx(v: Option<u32>) -> i32 {
    v.map_or(-1, |i| i as i32)
}

/// The header, serialised as it is written (the stacks can be millions of frame indices:
/// no JSON value tree is built for them).
#[derive(Serialize)]
struct Header<'a> {
    device: u32,
    source: &'a str,
    events: usize,
    allocs: usize,
    segments: usize,
    sleeping: usize,
    t0_ns: u64,
    streams: Vec<String>,
    actions: Vec<&'static str>,
    frames: Vec<(&'a str, &'a str, i64)>,
    stacks: Vec<&'a [u32]>,
    peak: serde_json::Value,
    trace_dropped: u64,
    config: &'a Option<serde_json::Value>,
    stats: &'a Option<serde_json::Value>,
    columns: &'a serde_json::Map<String, serde_json::Value>,
}

/// Encodes device `device` of `snapshot` for the viewer.
pub fn encode_device(snapshot: &Snapshot, device: &DeviceSnapshot) -> Vec<u8> {
    match encode_device_within(snapshot, device, &mut Budget::default()) {
        Ok(blob) => blob,
        Err(_) => unreachable!("an unlimited budget never runs out"),
    }
}

/// [`encode_device`], charging the timeline it builds and the blob to `budget` (the blob is
/// kept; the timeline is given back once the blob is written).
pub fn encode_device_within(
    snapshot: &Snapshot,
    device: &DeviceSnapshot,
    budget: &mut Budget,
) -> Result<Vec<u8>, OverBudget> {
    let before = budget.used();
    let t = Timeline::build_within(device, budget)?;
    let timeline_bytes = budget.used() - before;
    let trace = &device.trace;
    let t0 = trace.first().map_or(0, |e| e.time_ns);
    let mut stream_of = std::collections::HashMap::new();
    for (i, s) in t.streams.iter().enumerate() {
        stream_of.insert(*s, i as u32);
    }
    let mut streams = t.streams.clone();
    // Events on streams the timeline did not index (waits, staging) get indices too.
    budget.charge_for(STAGE, (4 * trace.len()) as u64)?;
    let ev_stream: Vec<u32> = trace
        .iter()
        .map(|e| {
            *stream_of.entry(e.stream).or_insert_with(|| {
                streams.push(e.stream);
                (streams.len() - 1) as u32
            })
        })
        .collect();
    let (a, s) = (&t.allocs, &t.segments);
    let mut columns = Columns {
        body: Vec::new(),
        base: 0,
        dir: serde_json::Map::new(),
    };
    // The directory first (offsets only depend on lengths), so that the header can be
    // written before the columns, straight into the blob.
    let lengths = [
        ("ev_time", "f64", trace.len()),
        ("ev_action", "u8", trace.len()),
        ("ev_stream", "u32", trace.len()),
        ("ev_addr", "f64", trace.len()),
        ("ev_size", "f64", trace.len()),
        ("al_start", "i32", a.len()),
        ("al_fr", "i32", a.len()),
        ("al_end", "i32", a.len()),
        ("al_addr", "f64", a.len()),
        ("al_size", "f64", a.len()),
        ("al_stream", "u32", a.len()),
        ("al_owner", "u32", a.len()),
        ("al_stack", "i32", a.len()),
        ("sg_start", "i32", s.len()),
        ("sg_end", "i32", s.len()),
        ("sg_addr", "f64", s.len()),
        ("sg_size", "f64", s.len()),
        ("sg_stream", "u32", s.len()),
        ("sl_start", "i32", t.sleeping.len()),
        ("sl_end", "i32", t.sleeping.len()),
        ("sl_addr", "f64", t.sleeping.len()),
        ("sl_size", "f64", t.sleeping.len()),
    ];
    let mut at = 0usize;
    for (name, ty, len) in lengths {
        let width = if ty == "f64" {
            8
        } else if ty == "u8" {
            1
        } else {
            4
        };
        columns
            .dir
            .insert(name.into(), json!({"type": ty, "offset": at, "len": len}));
        at = (at + len * width).next_multiple_of(8);
    }
    let body_bytes = columns_bytes(trace.len(), a.len(), s.len(), t.sleeping.len());
    debug_assert_eq!(at, body_bytes);
    let stacks = &snapshot.stacks;
    let peak = |k: Counter| t.peak(k).map(|(i, v)| json!([i, v]));
    let header = Header {
        device: device.device,
        source: &snapshot.source,
        events: trace.len(),
        allocs: a.len(),
        segments: s.len(),
        sleeping: t.sleeping.len(),
        t0_ns: t0,
        streams: streams.iter().map(|s| format!("{s:#x}")).collect(),
        actions: TraceAction::ALL.iter().map(|a| a.name()).collect(),
        frames: stacks
            .frames()
            .iter()
            .map(|f| (&*f.name, &*f.filename, f.line))
            .collect(),
        stacks: (0..stacks.len() as u32)
            .map(|i| stacks.frame_ids(i))
            .collect(),
        peak: json!({"active": peak(Counter::Active), "reserved": peak(Counter::Reserved)}),
        trace_dropped: device.trace_dropped,
        config: &snapshot.config,
        stats: &snapshot.stats,
        columns: &columns.dir,
    };
    // The header's text: charged at an upper bound before it is written (each frame
    // index is at most 11 characters, each stream 20, each frame its strings plus 40).
    let frame_ids: usize = (0..stacks.len() as u32)
        .map(|i| stacks.frame_ids(i).len())
        .sum();
    let frames_text: usize = stacks
        .frames()
        .iter()
        .map(|f| 2 * (f.name.len() + f.filename.len()) + 40)
        .sum();
    let json_text = |v: &Option<serde_json::Value>| v.as_ref().map_or(0, |v| v.to_string().len());
    let header_bound = 4096
        + 11 * frame_ids
        + 4 * stacks.len()
        + 24 * streams.len()
        + frames_text
        + json_text(&snapshot.config)
        + json_text(&snapshot.stats);
    budget.charge_for(STAGE, (header_bound + body_bytes + 16) as u64)?;
    let mut out = Vec::with_capacity(header_bound + body_bytes + 16);
    out.extend([0u8; 4]);
    if serde_json::to_writer(&mut out, &header).is_err() {
        out.truncate(4);
        out.extend(b"{}");
    }
    drop(header);
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out.resize(out.len().next_multiple_of(8), b' ');
    columns.base = out.len();
    columns.body = out;
    let c = &mut columns;
    c.f64s(
        "ev_time",
        trace.iter().map(|e| e.time_ns.saturating_sub(t0) as f64),
    );
    c.u8s("ev_action", trace.iter().map(|e| e.action.code()));
    c.u32s("ev_stream", ev_stream.into_iter());
    c.f64s("ev_addr", trace.iter().map(|e| e.addr as f64));
    c.f64s("ev_size", trace.iter().map(|e| e.size as f64));
    c.i32s("al_start", a.iter().map(|x| idx(x.start)));
    c.i32s("al_fr", a.iter().map(|x| idx(x.free_requested)));
    c.i32s("al_end", a.iter().map(|x| idx(x.end)));
    c.f64s("al_addr", a.iter().map(|x| x.addr as f64));
    c.f64s("al_size", a.iter().map(|x| x.size as f64));
    c.u32s("al_stream", a.iter().map(|x| x.stream));
    c.u32s("al_owner", a.iter().map(|x| x.owner));
    c.i32s(
        "al_stack",
        a.iter().map(|x| x.stack.map_or(-1, |s| s as i32)),
    );
    c.i32s("sg_start", s.iter().map(|x| idx(x.start)));
    c.i32s("sg_end", s.iter().map(|x| idx(x.end)));
    c.f64s("sg_addr", s.iter().map(|x| x.addr as f64));
    c.f64s("sg_size", s.iter().map(|x| x.size as f64));
    c.u32s("sg_stream", s.iter().map(|x| x.stream));
    let z = &t.sleeping;
    c.i32s("sl_start", z.iter().map(|x| idx(x.start)));
    c.i32s("sl_end", z.iter().map(|x| idx(x.end)));
    c.f64s("sl_addr", z.iter().map(|x| x.addr as f64));
    c.f64s("sl_size", z.iter().map(|x| x.size as f64));
    let mut out = std::mem::take(&mut columns.body);
    out.resize(
        (out.len() - columns.base).next_multiple_of(8) + columns.base,
        0,
    );
    // What was charged and not used, the timeline and the streams' column go back.
    let unused = (header_bound + body_bytes + 16).saturating_sub(out.len());
    out.shrink_to_fit();
    budget.release(unused as u64 + timeline_bytes + (4 * trace.len()) as u64);
    Ok(out)
}
