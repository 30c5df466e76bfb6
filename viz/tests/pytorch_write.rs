//! The PyTorch pickle writer: what it writes reads back identically, loads in Python, and
//! uses only the opcodes PyTorch's JavaScript viewer decodes.

mod common;

use std::process::Command;
use streamalloc_viz::pytorch::{parse_snapshot, read_snapshot, write_pickle};

#[test]
fn written_pickle_reads_back_identically() {
    let Some(path) = common::shared_trace("tp_allreduce_0.pickle.gz") else {
        return;
    };
    let snap = read_snapshot(&path).unwrap();
    let mut bytes = Vec::new();
    write_pickle(&snap, &mut bytes).unwrap();
    let mut again = parse_snapshot("written".as_ref(), &bytes).unwrap();
    // Settings are not written back (PyTorch's viewer does not read them).
    again.allocator_settings = snap.allocator_settings.clone();
    assert_eq!(again, snap);
}

/// The opcodes `MemoryViz.js`'s `unpickle` accepts.
const VIEWER_OPCODES: &str = "PROTO APPEND APPENDS LIST TUPLE NEWFALSE NEWTRUE NONE BINGET \
    BININT BININT1 BININT2 EMPTY_DICT EMPTY_LIST FRAME LONG1 LONG_BINGET MARK MEMOIZE BINPUT \
    LONG_BINPUT SETITEMS SETITEM DICT SHORT_BINUNICODE BINUNICODE STOP EMPTY_TUPLE TUPLE1 \
    TUPLE2 TUPLE3 BINFLOAT";

#[test]
fn written_pickle_loads_in_python_with_pytorch_keys_and_viewer_opcodes() {
    let Some(path) = common::shared_trace("tp_allreduce_0.pickle.gz") else {
        return;
    };
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipping: python3 not found");
        return;
    }
    let snap = read_snapshot(&path).unwrap();
    let mut bytes = Vec::new();
    write_pickle(&snap, &mut bytes).unwrap();
    let out_path = std::env::temp_dir().join(format!("sa-viz-write-{}.pickle", std::process::id()));
    std::fs::write(&out_path, &bytes).unwrap();
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
seg = d['segments'][0]
assert set(seg) >= {{'device', 'address', 'total_size', 'stream', 'segment_type', 'blocks'}}, seg.keys()
assert seg['blocks'][0]['state'] in ('active_allocated', 'active_pending_free', 'inactive')
tr = d['device_traces'][0]
assert set(tr[0]) >= {{'action', 'addr', 'size', 'stream', 'time_us', 'frames'}}
print(len(tr), sum(e['action'] == 'alloc' for e in tr))
"#
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected = format!("{} {}\n", snap.device_traces[0].len(), snap.alloc_count());
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    let _ = std::fs::remove_file(&out_path);
}
