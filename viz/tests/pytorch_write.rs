//! The PyTorch pickle writer: what it writes reads back identically, loads in Python, and
//! uses only the opcodes PyTorch's JavaScript viewer decodes.

mod common;

use std::process::Command;
use streamalloc_viz::model;
use streamalloc_viz::pytorch::{self, parse_snapshot, read_snapshot, write_pickle};

#[test]
fn written_pickle_reads_back_identically() {
    let path = common::shared_trace("tp_allreduce_0.pickle.gz");
    let snap = read_snapshot(&path).unwrap();
    let mut bytes = Vec::new();
    write_pickle(&snap, &mut bytes).unwrap();
    let again = parse_snapshot("written".as_ref(), &bytes).unwrap();
    assert!(snap.allocator_settings.is_some());
    assert_eq!(again, snap);
}

/// The opcodes `MemoryViz.js`'s `unpickle` accepts.
const VIEWER_OPCODES: &str = "PROTO APPEND APPENDS LIST TUPLE NEWFALSE NEWTRUE NONE BINGET \
    BININT BININT1 BININT2 EMPTY_DICT EMPTY_LIST FRAME LONG1 LONG_BINGET MARK MEMOIZE BINPUT \
    LONG_BINPUT SETITEMS SETITEM DICT SHORT_BINUNICODE BINUNICODE STOP EMPTY_TUPLE TUPLE1 \
    TUPLE2 TUPLE3 BINFLOAT";

/// Loads `bytes` in Python's `pickle` and checks PyTorch's keys and the viewer's opcodes;
/// returns the script's output (`entries allocs`), or `None` without python3.
fn python_check(bytes: &[u8], tag: &str) -> Option<String> {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipping: python3 not found");
        return None;
    }
    let out_path =
        std::env::temp_dir().join(format!("sa-viz-write-{tag}-{}.pickle", std::process::id()));
    std::fs::write(&out_path, bytes).unwrap();
    let script = format!(
        r#"
import pickle, pickletools, sys
raw = open(sys.argv[1], 'rb').read()
allowed = set("{VIEWER_OPCODES}".split())
used = {{op.name for op, _, _ in pickletools.genops(raw)}}
assert used <= allowed, used - allowed
assert raw[1] <= 4
d = pickle.loads(raw)
assert set(d) >= {{'segments', 'device_traces'}}
for seg in d['segments']:
    assert set(seg) >= {{'device', 'address', 'total_size', 'stream', 'segment_type', 'blocks'}}, seg.keys()
    for b in seg['blocks']:
        assert b['state'] in ('active_allocated', 'active_pending_free', 'inactive')
        assert set(b) >= {{'size', 'requested_size', 'state', 'frames'}}
tr = d['device_traces'][0]
names = {{'alloc', 'free_requested', 'free_completed', 'segment_alloc', 'segment_free',
          'segment_map', 'segment_unmap', 'oom', 'snapshot', 'user_defined'}}
for e in tr:
    assert set(e) >= {{'action', 'addr', 'size', 'stream', 'time_us', 'frames'}}
    assert e['action'] in names, e['action']
print(len(tr), sum(e['action'] == 'alloc' for e in tr))
"#
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .arg(&out_path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&out_path);
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn written_pickle_loads_in_python_with_pytorch_keys_and_viewer_opcodes() {
    let path = common::shared_trace("tp_allreduce_0.pickle.gz");
    let snap = read_snapshot(&path).unwrap();
    let mut bytes = Vec::new();
    write_pickle(&snap, &mut bytes).unwrap();
    let Some(out) = python_check(&bytes, "torch") else {
        return;
    };
    let expected = format!("{} {}\n", snap.device_traces[0].len(), snap.alloc_count());
    assert_eq!(out, expected);
}

#[test]
fn engine_snapshot_as_pickle_loads_in_python() {
    let ours = model::from_engine(&common::engine::engine_snapshot());
    let torch = pytorch::to_torch(&ours);
    let mut bytes = Vec::new();
    write_pickle(&torch, &mut bytes).unwrap();
    let Some(out) = python_check(&bytes, "engine") else {
        return;
    };
    let allocs = ours.devices[0]
        .trace
        .iter()
        .filter(|e| e.action == model::TraceAction::Alloc)
        .count();
    assert_eq!(out, format!("{} {allocs}\n", torch.device_traces[0].len()));
    assert!(allocs > 0);
}

/// A stack shared by many entries is written once and referred to through the memo, as
/// PyTorch's own pickles do: 10,000 entries with one 30-frame stack take a few bytes each
/// beyond their numbers, read back with that stack, and load in Python.
#[test]
fn a_shared_stack_is_written_once() {
    use streamalloc_viz::model::{DeviceSnapshot, Event, Frame, Snapshot, TraceAction};
    let mut snap = Snapshot::new("pytorch");
    let stack = snap.stacks.push((0..30).map(|i| Frame {
        name: format!("layer_{i}").into(),
        filename: "model.py".into(),
        line: i,
    }));
    let trace = (0..10_000u64)
        .map(|i| Event {
            action: TraceAction::Alloc,
            addr: 0x1000 * (i + 1),
            size: 512,
            stream: 0,
            time_ns: i * 1000,
            stack: Some(stack),
            device_free: None,
        })
        .collect();
    snap.devices.push(DeviceSnapshot {
        device: 0,
        time_ns: None,
        trace_dropped: 0,
        segments: Vec::new(),
        trace,
    });
    let mut bytes = Vec::new();
    write_pickle(&pytorch::to_torch(&snap), &mut bytes).unwrap();
    // Each entry: its dict, keys by memo, four numbers and a memo reference to its stack.
    assert!(bytes.len() < 10_000 * 80, "{} bytes", bytes.len());
    let back = pytorch::read_model(std::path::Path::new("shared.pickle"), &bytes).unwrap();
    assert_eq!(back.stacks.len(), 1);
    assert_eq!(back.stacks.frames_of(0).count(), 30);
    assert!(back.devices[0].trace.iter().all(|e| e.stack == Some(0)));
    if let Some(out) = python_check(&bytes, "shared") {
        assert!(out.starts_with("10000 "), "{out}");
    }
}
