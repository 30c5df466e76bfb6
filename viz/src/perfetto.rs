//! Perfetto-loadable traces: the Chrome JSON trace format with counter tracks.
//!
//! Perfetto (ui.perfetto.dev) and `chrome://tracing` open this format directly, which lets
//! users line up allocator memory with their own profiler traces. One process per device;
//! counter tracks `allocated`, `active`, `reserved`, `pending` (bytes freed but awaiting
//! other streams' events), `staging`, and `cached <stream>` per stream; instant events for
//! cross-stream waits and out-of-memory. Timestamps are microseconds (the format's unit),
//! relative to the first event. Counters are written only when they change.
//!
//! The output is streamed event by event (a million-event trace gives a few million
//! counter samples; building them as JSON values first would take gigabytes), so pass a
//! buffered writer.

use crate::error::VizError;
use crate::limits::Budget;
use crate::model::{Snapshot, TraceAction};
use crate::timeline::{Counter, Timeline};
use std::cell::RefCell;
use std::io::Write;

/// Writes one trace event per call, with the commas between them.
struct Out<'a, W: Write> {
    w: &'a mut W,
    first: bool,
}

impl<W: Write> Out<'_, W> {
    fn event(&mut self, body: std::fmt::Arguments<'_>) -> std::io::Result<()> {
        if !self.first {
            self.w.write_all(b",\n")?;
        }
        self.first = false;
        self.w.write_fmt(body)
    }

    fn counter(&mut self, name: &str, pid: u32, ts: f64, bytes: u64) -> std::io::Result<()> {
        self.event(format_args!(
            r#"{{"name":"{name}","ph":"C","ts":{ts:.3},"pid":{pid},"args":{{"bytes":{bytes}}}}}"#
        ))
    }
}

/// Writes `snapshot` as a Chrome JSON trace.
pub fn write_perfetto(snapshot: &Snapshot, out: &mut impl Write) -> Result<(), VizError> {
    write_perfetto_within(snapshot, out, &RefCell::new(Budget::default()))
}

/// [`write_perfetto`], each device's timeline charged to `budget` while it is written.
pub fn write_perfetto_within(
    snapshot: &Snapshot,
    out: &mut impl Write,
    budget: &RefCell<Budget>,
) -> Result<(), VizError> {
    write_inner(snapshot, out, budget).map_err(|e| VizError::Unrepresentable {
        format: "Perfetto JSON",
        what: e.to_string(),
    })
}

fn write_inner(
    snapshot: &Snapshot,
    w: &mut impl Write,
    budget: &RefCell<Budget>,
) -> std::io::Result<()> {
    w.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")?;
    let mut out = Out { w, first: true };
    for device in &snapshot.devices {
        let pid = device.device;
        out.event(format_args!(
            r#"{{"name":"process_name","ph":"M","pid":{pid},"args":{{"name":"cuda:{pid} memory"}}}}"#
        ))?;
        if device.trace.is_empty() {
            continue;
        }
        let (timeline, bytes) = {
            let mut budget = budget.borrow_mut();
            let before = budget.used();
            let timeline = Timeline::build_within(device, &mut budget)
                .map_err(|over| std::io::Error::other(over.to_string()))?;
            (timeline, budget.used() - before)
        };
        let t0 = device.trace[0].time_ns;
        let ts = |i: usize| device.trace[i].time_ns.saturating_sub(t0) as f64 / 1000.0;
        for c in [
            Counter::Allocated,
            Counter::Active,
            Counter::Reserved,
            Counter::Pending,
            Counter::Staging,
        ] {
            let mut last = timeline.initial[c as usize];
            out.counter(c.name(), pid, 0.0, last)?;
            for i in 0..timeline.len() {
                let v = timeline.value(c, i);
                if v != last {
                    out.counter(c.name(), pid, ts(i), v)?;
                    last = v;
                }
            }
        }
        for (s, changes) in timeline.cached_changes.iter().enumerate() {
            let name = format!("cached stream {:#x}", timeline.streams[s]);
            out.counter(&name, pid, 0.0, timeline.cached_initial[s])?;
            for &(i, v) in changes {
                out.counter(&name, pid, ts(i as usize), v)?;
            }
        }
        for (i, e) in device.trace.iter().enumerate() {
            let name = match e.action {
                TraceAction::CrossStreamWait => "cross_stream_wait",
                TraceAction::Oom => "oom",
                _ => continue,
            };
            out.event(format_args!(
                r#"{{"name":"{name}","ph":"i","s":"p","ts":{:.3},"pid":{pid},"args":{{"addr":"{:#x}","size":{},"stream":"{:#x}"}}}}"#,
                ts(i),
                e.addr,
                e.size,
                e.stream
            ))?;
        }
        drop(timeline);
        budget.borrow_mut().release(bytes);
    }
    let source = serde_json::to_string(&snapshot.source).unwrap_or_else(|_| "\"\"".into());
    write!(
        out.w,
        "\n],\"otherData\":{{\"source\":{source},\"generator\":\"streamalloc\"}}}}"
    )
}
