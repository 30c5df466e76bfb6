//! Format round trips (ours ↔ PyTorch pickle ↔ ours), the engine's snapshot, the timeline
//! counters against the reference numbers, Perfetto output, and unreadable input.

mod common;

use streamalloc_viz::model::{self, Snapshot, TraceAction};
use streamalloc_viz::pytorch::{self, parse_snapshot, write_pickle};
use streamalloc_viz::timeline::{Counter, Timeline};
use streamalloc_viz::{files, VizError};

fn json_round_trip(s: &Snapshot) -> Snapshot {
    let mut bytes = Vec::new();
    model::write_json(s, &mut bytes).unwrap();
    model::parse_json("mem.json".as_ref(), &bytes).unwrap()
}

fn pickle_round_trip(s: &Snapshot) -> Snapshot {
    let mut bytes = Vec::new();
    write_pickle(&pytorch::to_torch(s), &mut bytes).unwrap();
    pytorch::from_torch(&parse_snapshot("mem.pickle".as_ref(), &bytes).unwrap())
}

#[test]
fn pytorch_trace_round_trips_through_json_and_pickle() {
    let path = common::shared_trace("tp_allreduce_0.pickle.gz");
    let ours = files::load(&path).unwrap();
    assert_eq!(ours.source, "pytorch");
    assert_eq!(ours.devices.len(), 1);
    assert_eq!(ours.devices[0].trace.len(), 123);
    assert!(!ours.stacks.is_empty());
    assert_eq!(json_round_trip(&ours), ours);
    assert!(ours.config.is_some(), "allocator_settings read");
    assert_eq!(pickle_round_trip(&ours), ours);
}

#[test]
fn engine_snapshot_round_trips() {
    let engine = common::engine::engine_snapshot();
    let ours = model::from_engine(&engine);
    assert_eq!(ours.source, "streamalloc");
    let d = &ours.devices[0];
    assert!(
        d.trace
            .iter()
            .any(|e| e.action == TraceAction::CrossStreamWait)
            || d.trace
                .iter()
                .any(|e| e.action == TraceAction::FreeRequested)
    );
    assert_eq!(json_round_trip(&ours), ours);
    // Segments whose pages the trace maps are marked expandable.
    if d.trace.iter().any(|e| e.action == TraceAction::SegmentMap) {
        assert!(d.segments.iter().any(|s| s.expandable));
    }

    // The engine's own serde JSON is accepted too.
    let raw = serde_json::to_vec(&engine).unwrap();
    assert_eq!(
        model::parse_json("engine.json".as_ref(), &raw).unwrap(),
        ours
    );

    // Through PyTorch's format: what PyTorch can express survives.
    let back = pickle_round_trip(&ours);
    let bd = &back.devices[0];
    let kept: Vec<_> = d
        .trace
        .iter()
        .filter(|e| e.action.is_pytorch())
        .map(|e| (e.action, e.addr, e.size, e.stream, e.time_ns / 1000))
        .collect();
    let got: Vec<_> = bd
        .trace
        .iter()
        .map(|e| (e.action, e.addr, e.size, e.stream, e.time_ns / 1000))
        .collect();
    assert_eq!(got, kept);
    assert_eq!(bd.segments.len(), d.segments.len());
    for (a, b) in d.segments.iter().zip(&bd.segments) {
        assert_eq!(
            (a.addr, a.size, a.stream, &a.pool),
            (b.addr, b.size, b.stream, &b.pool)
        );
        let states = |s: &model::Segment| {
            s.blocks
                .iter()
                .map(|b| (b.addr, b.size, b.state))
                .collect::<Vec<_>>()
        };
        assert_eq!(states(a), states(b));
    }
}

#[test]
fn engine_timeline_matches_engine_stats() {
    // Without stitching: pages a freed stitched range gives back pending on other streams'
    // events are traced complete where they lie, at addresses the trace never allocated,
    // and the timeline counts them as allocated from its start (a known gap: the
    // allocated peak then reads 42.7 MiB against the engine's 36 MiB on this scenario).
    let engine = common::engine::engine_snapshot_with(
        streamalloc_allocator::Config::parse("stitch:false").unwrap(),
    );
    assert_eq!(engine.trace_dropped, 0);
    let ours = model::from_engine(&engine);
    let t = Timeline::build(&ours.devices[0]);
    let last = t.len() - 1;
    assert_eq!(
        t.value(Counter::Reserved, last),
        engine.stats.reserved_bytes.current
    );
    assert_eq!(
        t.value(Counter::Allocated, last),
        engine.stats.allocated_bytes.current
    );
    assert_eq!(
        t.peak(Counter::Reserved).unwrap().1,
        engine.stats.reserved_bytes.peak
    );
    assert_eq!(
        t.peak(Counter::Allocated).unwrap().1,
        engine.stats.allocated_bytes.peak
    );
    // Per-stream cached bytes add up to reserved minus active at the end.
    let cached: u64 = t
        .cached_changes
        .iter()
        .zip(&t.cached_initial)
        .map(|(c, &init)| c.last().map_or(init, |&(_, v)| v))
        .sum();
    assert_eq!(
        cached,
        t.value(Counter::Reserved, last) - t.value(Counter::Active, last)
    );
}

#[test]
fn gpt2_timeline_peaks_match_trace_stats() {
    let path = common::shared_trace("gpt2.pickle.gz");
    let ours = files::load(&path).unwrap();
    let t = Timeline::build(&ours.devices[0]);
    let mib = |v: u64| format!("{:.1}", v as f64 / (1u64 << 20) as f64);
    // The trace's reference figures (tests/data/trace_stats.py): peak live 15044.8 MiB,
    // native peak reserved 15754.0 MiB.
    assert_eq!(mib(t.peak(Counter::Active).unwrap().1), "15044.8");
    assert_eq!(mib(t.peak(Counter::Reserved).unwrap().1), "15754.0");
    assert_eq!(t.allocs.iter().filter(|a| a.start.is_some()).count(), 4716);
}

#[test]
fn perfetto_has_counter_tracks() {
    let ours = model::from_engine(&common::engine::engine_snapshot());
    let mut bytes = Vec::new();
    streamalloc_viz::perfetto::write_perfetto(&ours, &mut bytes).unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    for name in ["allocated", "reserved", "pending", "staging", "active"] {
        assert!(
            events.iter().any(|e| e["ph"] == "C" && e["name"] == name),
            "no counter track {name}"
        );
    }
    assert!(events
        .iter()
        .any(|e| e["ph"] == "C" && e["name"].as_str().unwrap().starts_with("cached stream")));
    // Reserved comes back to the engine's final value.
    let last = events.iter().rfind(|e| e["name"] == "reserved").unwrap();
    assert_eq!(
        last["args"]["bytes"],
        ours.stats.as_ref().unwrap()["reserved_bytes"]["current"]
    );
}

fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sa-viz-formats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn unreadable_inputs_are_named_errors() {
    let cases: [(&str, &[u8], &str); 5] = [
        ("empty.json", b"", "empty"),
        ("text.txt", b"hello", "unrecognised content"),
        (
            "wrong.json",
            br#"{"format": "other", "version": 1}"#,
            "\"format\" is \"other\"",
        ),
        (
            "new.json",
            br#"{"format": "streamalloc-snapshot", "version": 99}"#,
            "schema version",
        ),
        (
            "broken.json",
            br#"{"format": "streamalloc-snapshot", "version": 1, "dev"#,
            "invalid",
        ),
    ];
    for (name, bytes, expect) in cases {
        let err = files::load(&temp(name, bytes)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(expect) && msg.contains(name), "{name}: {msg}");
        assert!(!msg.contains('\n'), "one line: {msg}");
    }
    // A stack index out of range.
    let mut s = Snapshot::new("streamalloc");
    s.devices.push(model::DeviceSnapshot {
        device: 0,
        time_ns: None,
        trace_dropped: 0,
        segments: vec![],
        trace: vec![model::Event {
            action: TraceAction::Alloc,
            addr: 1,
            size: 1,
            stream: 0,
            time_ns: 0,
            stack: Some(3),
            device_free: None,
        }],
    });
    let mut bytes = Vec::new();
    model::write_json(&s, &mut bytes).unwrap();
    let err = files::load(&temp("stack.json", &bytes)).unwrap_err();
    assert!(matches!(err, VizError::Format { .. }), "{err}");
    let _ = pytorch::TraceAction::PYTORCH;
}

/// A pickle naming a device past the limit, or a segment ending past 2^63, is refused
/// with the file and the limit named, before any per-device table is built.
#[test]
fn pickles_past_the_device_and_address_limits_are_refused() {
    use streamalloc_viz::pytorch::{TorchSegment, TorchSnapshot};
    let segment = |device: u32, total_size: u64| TorchSegment {
        device,
        address: 1 << 20,
        total_size,
        stream: 0,
        segment_type: "large".into(),
        is_expandable: false,
        blocks: Vec::new(),
    };
    let dir = std::env::temp_dir().join(format!("sa-viz-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, seg) in [
        ("dev.pickle", segment(u32::MAX, 4096)),
        ("dev1024.pickle", segment(model::MAX_DEVICE_INDEX + 1, 4096)),
        ("size.pickle", segment(0, i64::MAX as u64)),
    ] {
        let snap = TorchSnapshot {
            segments: vec![seg],
            ..TorchSnapshot::default()
        };
        let mut bytes = Vec::new();
        write_pickle(&snap, &mut bytes).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, &bytes).unwrap();
        let err = files::load(&path).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains("limit"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }
    // The largest index allowed still loads.
    let ok = TorchSnapshot {
        segments: vec![segment(model::MAX_DEVICE_INDEX, 4096)],
        ..TorchSnapshot::default()
    };
    let mut bytes = Vec::new();
    write_pickle(&ok, &mut bytes).unwrap();
    let path = dir.join("ok.pickle");
    std::fs::write(&path, &bytes).unwrap();
    files::load(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

/// The engine's own snapshot JSON (no `"format"` key) is held to the same limits as ours:
/// a segment ending past 2^63, with a page mapped in it, is refused with the limit named,
/// not converted with a sum that wraps.
#[test]
fn engine_json_past_the_address_limit_is_refused() {
    use streamalloc_allocator::trace::{TraceAction, TraceEntry};
    use streamalloc_allocator::{DevicePtr, StreamId};
    let mut engine = common::engine::engine_snapshot();
    let top = u64::MAX - (1 << 20);
    engine.segments[0].addr = DevicePtr(top);
    engine.trace.push(TraceEntry {
        action: TraceAction::SegmentMap,
        addr: DevicePtr(u64::MAX - 1),
        size: 1 << 20,
        stream: StreamId(0),
        time_ns: 0,
    });
    // The conversion itself takes any address.
    let converted = model::from_engine(&engine);
    assert!(converted.devices[0].segments.iter().any(|s| s.expandable));
    let bytes = serde_json::to_vec(&engine).unwrap();
    let err = model::parse_json("engine.json".as_ref(), &bytes)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("engine.json") && err.contains("address limit"),
        "{err}"
    );
}
