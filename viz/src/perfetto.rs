//! Perfetto-loadable traces: the Chrome JSON trace format with counter tracks.
//!
//! Perfetto (ui.perfetto.dev) and `chrome://tracing` open this format directly, which lets
//! users line up allocator memory with their own profiler traces. One process per device;
//! counter tracks `allocated`, `active`, `reserved`, `pending` (bytes freed but awaiting
//! other streams' events), `staging`, and `cached <stream>` per stream; instant events for
//! cross-stream waits and out-of-memory. Timestamps are microseconds (the format's unit),
//! relative to the first event.

use crate::error::VizError;
use crate::model::{Action, Snapshot};
use crate::timeline::{Counter, Timeline};
use serde_json::json;
use std::io::Write;

/// Writes `snapshot` as a Chrome JSON trace.
pub fn write_perfetto(snapshot: &Snapshot, out: &mut impl Write) -> Result<(), VizError> {
    let mut events = Vec::new();
    for device in &snapshot.devices {
        let pid = device.device;
        events.push(json!({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": format!("cuda:{pid} memory")}}));
        let timeline = Timeline::build(device);
        let t0 = device.trace.first().map_or(0, |e| e.time_ns);
        let ts = |i: usize| (device.trace[i].time_ns.saturating_sub(t0)) as f64 / 1000.0;
        let counters = [
            Counter::Allocated,
            Counter::Active,
            Counter::Reserved,
            Counter::Pending,
            Counter::Staging,
        ];
        for c in counters {
            let mut last = None;
            let initial = timeline.initial[c as usize];
            if !device.trace.is_empty() {
                events.push(json!({"name": c.name(), "ph": "C", "ts": 0.0, "pid": pid,
                                   "args": {"bytes": initial}}));
                last = Some(initial);
            }
            for i in 0..timeline.len() {
                let v = timeline.value(c, i);
                if last != Some(v) {
                    events.push(json!({"name": c.name(), "ph": "C", "ts": ts(i), "pid": pid,
                                       "args": {"bytes": v}}));
                    last = Some(v);
                }
            }
        }
        for (s, changes) in timeline.cached_changes.iter().enumerate() {
            let name = format!("cached stream {:#x}", timeline.streams[s]);
            if !device.trace.is_empty() {
                events.push(json!({"name": name, "ph": "C", "ts": 0.0, "pid": pid,
                                   "args": {"bytes": timeline.cached_initial[s]}}));
            }
            for &(i, v) in changes {
                events.push(
                    json!({"name": name, "ph": "C", "ts": ts(i as usize), "pid": pid,
                                   "args": {"bytes": v}}),
                );
            }
        }
        for (i, e) in device.trace.iter().enumerate() {
            let name = match e.action {
                Action::CrossStreamWait => "cross_stream_wait",
                Action::Oom => "oom",
                _ => continue,
            };
            events.push(
                json!({"name": name, "ph": "i", "s": "p", "ts": ts(i), "pid": pid,
                               "args": {"addr": format!("{:#x}", e.addr), "size": e.size,
                                        "stream": format!("{:#x}", e.stream)}}),
            );
        }
    }
    let doc = json!({"traceEvents": events, "displayTimeUnit": "ns",
                     "otherData": {"source": snapshot.source, "generator": "streamalloc"}});
    serde_json::to_writer(out, &doc).map_err(|e| VizError::Unrepresentable {
        format: "Perfetto JSON",
        what: e.to_string(),
    })
}
