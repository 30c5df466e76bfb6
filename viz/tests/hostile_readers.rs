//! The readers against hostile files: what they build is bounded by what they read, shared
//! data stays shared, and stream indices are never wrapped.

use std::path::Path;
use std::time::{Duration, Instant};
use streamalloc_viz::model::{Event, Snapshot, TraceAction};
use streamalloc_viz::{files, limits, wire, VizError};

/// A pickle of `{"segments": [], "device_traces": [[...]]}` whose one trace is `entries`
/// (opcodes building the entries between a MARK and APPENDS) after `prelude`.
fn snapshot_pickle(prelude: &[u8], entries: &[u8]) -> Vec<u8> {
    let mut p = vec![0x80, 4];
    p.extend(prelude);
    p.extend([b'}', b'(', 0x8c, 8]);
    p.extend(b"segments");
    p.push(b']');
    p.extend([0x8c, 13]);
    p.extend(b"device_traces");
    p.extend([b']', b'(', b']', b'(']);
    p.extend(entries);
    p.extend([b'e', b'e', b'u', b'.']);
    p
}

fn short_str(p: &mut Vec<u8>, s: &str) {
    p.extend([0x8c, s.len() as u8]);
    p.extend(s.as_bytes());
}

/// One trace entry dict referred to millions of times through the memo: two bytes of
/// input each, an event of 64 bytes each once read. Refused by the budget in bytes, fast,
/// with one error naming the file.
#[test]
fn an_entry_shared_millions_of_times_is_refused_by_the_byte_budget() {
    let mut prelude = vec![b'}', 0x94, b'('];
    short_str(&mut prelude, "action");
    short_str(&mut prelude, "alloc");
    prelude.extend([b'u', b'0']);
    let mut refs = Vec::new();
    for _ in 0..4_000_000 {
        refs.extend([b'h', 0]);
    }
    let bytes = snapshot_pickle(&prelude, &refs);
    let started = Instant::now();
    let err = files::from_bytes(Path::new("shared.pickle"), bytes).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, VizError::Limit { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.starts_with("shared.pickle: ") && text.contains("in memory"),
        "{text}"
    );
}

/// The same entry shared a few thousand times is legitimate and reads.
#[test]
fn an_entry_shared_a_few_times_reads() {
    let mut prelude = vec![b'}', 0x94, b'('];
    short_str(&mut prelude, "action");
    short_str(&mut prelude, "alloc");
    prelude.extend([b'u', b'0']);
    let refs: Vec<u8> = std::iter::repeat_n([b'h', 0], 5000).flatten().collect();
    let snap =
        files::from_bytes(Path::new("few.pickle"), snapshot_pickle(&prelude, &refs)).unwrap();
    assert_eq!(snap.event_count(), 5000);
}

/// PyTorch memoises frame dicts: stacks of different entries share frames. 20,000 entries
/// with distinct 50-frame stacks over 60 frames keep 60 frames, not a million.
#[test]
fn frames_shared_between_stacks_are_kept_once() {
    let mut prelude = Vec::new();
    for f in 0..60u32 {
        prelude.extend([b'}', b'r']);
        prelude.extend(f.to_le_bytes());
        prelude.push(b'(');
        short_str(&mut prelude, "name");
        short_str(&mut prelude, &format!("f{f}"));
        short_str(&mut prelude, "filename");
        short_str(&mut prelude, "model.py");
        short_str(&mut prelude, "line");
        prelude.extend([b'K', f as u8]);
        prelude.extend([b'u', b'0']);
    }
    let mut entries = Vec::new();
    for e in 0..20_000u32 {
        entries.extend([b'}', b'(']);
        short_str(&mut entries, "action");
        short_str(&mut entries, "alloc");
        short_str(&mut entries, "frames");
        entries.extend([b']', b'(']);
        for k in 0..50u32 {
            entries.push(b'j');
            entries.extend(((e * 7 + k * (e % 13 + 1)) % 60).to_le_bytes());
        }
        entries.extend([b'e', b'u']);
    }
    let snap = files::from_bytes(
        Path::new("frames.pickle"),
        snapshot_pickle(&prelude, &entries),
    )
    .unwrap();
    assert_eq!(snap.event_count(), 20_000);
    assert_eq!(snap.stacks.frames().len(), 60);
    let referenced: usize = (0..snap.stacks.len() as u32)
        .map(|i| snap.stacks.frame_ids(i).len())
        .sum();
    assert!(referenced >= 50 * snap.stacks.len());
    let e = &snap.devices[0].trace[123];
    let frame = snap.stacks.frames_of(e.stack.unwrap()).next().unwrap();
    assert!(frame.name.starts_with('f') && &*frame.filename == "model.py");
}

/// A PyTorch-shaped trace as `_dump_snapshot` writes it: every entry has a `frames` list of
/// its own, each frame a memo reference to one of a few shared frame dicts. What is built
/// is what is held: a reference costs the slot it takes, equal lists share their items, a
/// frame and a stack are kept once. So the reader holds a small multiple of the events,
/// however dense the references (here two bytes each, the densest a pickle writes).
#[test]
fn entries_with_frames_lists_of_their_own_cost_what_they_hold() {
    // Frames memoised first, so that their references are BINGETs of two bytes.
    let mut prelude = Vec::new();
    for f in 0..100u8 {
        prelude.extend([b'}', 0x94, b'(']);
        short_str(&mut prelude, "name");
        short_str(&mut prelude, &format!("f{f}"));
        short_str(&mut prelude, "filename");
        short_str(&mut prelude, "model.py");
        short_str(&mut prelude, "line");
        prelude.extend([b'K', f, b'u', b'0']);
    }
    // Frame f's dict is memo entry f.
    let mut entries = Vec::new();
    let events = 100_000u32;
    for e in 0..events {
        entries.extend([b'}', b'(']);
        short_str(&mut entries, "action");
        short_str(&mut entries, "alloc");
        short_str(&mut entries, "frames");
        entries.extend([b']', b'(']);
        for k in 0..50u32 {
            let f = (e % 7 + k * 3) % 36;
            entries.extend([b'h', f as u8]);
        }
        entries.extend([b'e', b'u']);
    }
    let bytes = snapshot_pickle(&prelude, &entries);
    let input = bytes.len() as u64;
    let snap = files::from_bytes(Path::new("own-lists.pickle"), bytes).unwrap();
    assert_eq!(snap.event_count(), events as usize);
    assert_eq!(snap.stacks.frames().len(), 36);
    assert_eq!(snap.stacks.len(), 7, "equal stacks are kept once");
    // What the snapshot keeps: its events and a few stacks, well under one byte of memory
    // per byte of input (events are 64 bytes; the input is about 140 bytes an entry).
    assert!(
        snap.budget.used() < input,
        "{} of {input}",
        snap.budget.used()
    );
}

/// A budget refuses exactly past its limit (the readers' memory bound is this).
#[test]
fn the_byte_budget_is_proportional_to_the_input() {
    let b = limits::Budget::for_input(1000);
    let mut b2 = b.clone();
    let limit = limits::BUILT_BYTES_BASE + 1000 * limits::BUILT_BYTES_PER_INPUT_BYTE;
    assert!(b2.charge(limit).is_ok());
    assert!(b2.charge(1).is_err());
}

/// 70,000 streams: every event keeps its own stream in the viewer's columns (indices are
/// u32, not wrapped at 65,536).
#[test]
fn stream_indices_past_65535_stay_whole() {
    let mut snap = Snapshot::new("streamalloc");
    let trace = (0..70_000u64)
        .map(|s| Event {
            action: TraceAction::Alloc,
            addr: 0x1000 * (s + 1),
            size: 512,
            stream: 0x10_0000 + s,
            time_ns: s,
            stack: None,
            device_free: None,
        })
        .collect();
    snap.devices.push(streamalloc_viz::model::DeviceSnapshot {
        device: 0,
        time_ns: None,
        trace_dropped: 0,
        segments: Vec::new(),
        trace,
    });
    let blob = wire::encode_device(&snap, &snap.devices[0]);
    let len = u32::from_le_bytes(blob[..4].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&blob[4..4 + len]).unwrap();
    let base = (4 + len).next_multiple_of(8);
    let streams = header["streams"].as_array().unwrap();
    assert_eq!(streams.len(), 70_000);
    for column in ["ev_stream", "al_stream"] {
        let col = &header["columns"][column];
        assert_eq!(col["type"], "u32", "{column}");
        let off = base + col["offset"].as_u64().unwrap() as usize;
        for i in [0usize, 65_535, 65_536, 69_999] {
            let at = off + 4 * i;
            let index = u32::from_le_bytes(blob[at..at + 4].try_into().unwrap()) as usize;
            assert_eq!(
                streams[index].as_str().unwrap(),
                format!("{:#x}", 0x10_0000 + i),
                "{column}[{i}]"
            );
        }
    }
}
