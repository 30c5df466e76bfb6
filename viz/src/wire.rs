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

use crate::model::{DeviceSnapshot, Snapshot, TraceAction};
use crate::timeline::{Counter, Timeline};
use serde_json::json;

/// Column bytes in the order written, with their JSON directory entries.
struct Columns {
    body: Vec<u8>,
    dir: serde_json::Map<String, serde_json::Value>,
}

impl Columns {
    fn push(&mut self, name: &str, ty: &str, len: usize, bytes: impl IntoIterator<Item = u8>) {
        self.body.resize(self.body.len().next_multiple_of(8), 0);
        let offset = self.body.len();
        self.body.extend(bytes);
        self.dir.insert(
            name.into(),
            json!({"type": ty, "offset": offset, "len": len}),
        );
    }

    fn f64s(&mut self, name: &str, v: impl ExactSizeIterator<Item = f64>) {
        let n = v.len();
        self.push(name, "f64", n, v.flat_map(f64::to_le_bytes));
    }

    fn i32s(&mut self, name: &str, v: impl ExactSizeIterator<Item = i32>) {
        let n = v.len();
        self.push(name, "i32", n, v.flat_map(i32::to_le_bytes));
    }

    fn u32s(&mut self, name: &str, v: impl ExactSizeIterator<Item = u32>) {
        let n = v.len();
        self.push(name, "u32", n, v.flat_map(u32::to_le_bytes));
    }
}

fn idx(v: Option<u32>) -> i32 {
    v.map_or(-1, |i| i as i32)
}

/// Encodes device `device` of `snapshot` for the viewer.
pub fn encode_device(snapshot: &Snapshot, device: &DeviceSnapshot) -> Vec<u8> {
    let t = Timeline::build(device);
    let trace = &device.trace;
    let t0 = trace.first().map_or(0, |e| e.time_ns);
    let mut stream_of = std::collections::HashMap::new();
    for (i, s) in t.streams.iter().enumerate() {
        stream_of.insert(*s, i as u32);
    }
    let mut streams = t.streams.clone();
    // Events on streams the timeline did not index (waits, staging) get indices too.
    let ev_stream: Vec<u32> = trace
        .iter()
        .map(|e| {
            *stream_of.entry(e.stream).or_insert_with(|| {
                streams.push(e.stream);
                (streams.len() - 1) as u32
            })
        })
        .collect();

    let mut c = Columns {
        body: Vec::new(),
        dir: serde_json::Map::new(),
    };
    c.f64s(
        "ev_time",
        trace.iter().map(|e| e.time_ns.saturating_sub(t0) as f64),
    );
    c.push(
        "ev_action",
        "u8",
        trace.len(),
        trace.iter().map(|e| e.action.code()),
    );
    c.u32s("ev_stream", ev_stream.into_iter());
    c.f64s("ev_addr", trace.iter().map(|e| e.addr as f64));
    c.f64s("ev_size", trace.iter().map(|e| e.size as f64));
    let a = &t.allocs;
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
    let s = &t.segments;
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

    let frames: Vec<serde_json::Value> = snapshot
        .stacks
        .frames()
        .iter()
        .map(|f| json!([f.name, f.filename, f.line]))
        .collect();
    let stacks: Vec<&[u32]> = (0..snapshot.stacks.len() as u32)
        .map(|i| snapshot.stacks.frame_ids(i))
        .collect();
    let peak = |k: Counter| t.peak(k).map(|(i, v)| json!([i, v]));
    let header = json!({
        "device": device.device,
        "source": snapshot.source,
        "events": trace.len(),
        "allocs": a.len(),
        "segments": s.len(),
        "sleeping": z.len(),
        "t0_ns": t0,
        "streams": streams.iter().map(|s| format!("{s:#x}")).collect::<Vec<_>>(),
        "actions": TraceAction::ALL.iter().map(|a| a.name()).collect::<Vec<_>>(),
        "frames": frames,
        "stacks": stacks,
        "peak": {"active": peak(Counter::Active), "reserved": peak(Counter::Reserved)},
        "trace_dropped": device.trace_dropped,
        "config": snapshot.config,
        "stats": snapshot.stats,
        "columns": c.dir,
    });
    let header = serde_json::to_vec(&header).unwrap_or_default();
    let mut out = Vec::with_capacity(8 + header.len() + c.body.len());
    out.extend((header.len() as u32).to_le_bytes());
    out.extend(&header);
    out.resize(out.len().next_multiple_of(8), b' ');
    out.extend(c.body);
    out
}
