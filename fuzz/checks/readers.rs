//! What the fuzz targets `json` and `gzip` check for one input. The targets and the test
//! that replays their corpora on stable Rust (`tests/fuzz_corpus_readers.rs`) include this
//! file, so both run exactly the same checks.
//!
//! Any input must give a value or an error: a panic (a failed check below included), a
//! stack overflow, a timeout or running out of memory is a crash.

use std::path::Path;
use streamalloc_viz::model::{self, Snapshot};
use streamalloc_viz::{files, perfetto, pytorch, wire, VizError};

/// The decompressed-size limit [`gzip`] also decodes with: small enough for a few
/// kilobytes of input to reach it.
const SMALL_LIMIT: u64 = 64 << 10;

/// `data` as our JSON snapshot and as a trace for `streamalloc replay`.
pub fn json(data: &[u8]) {
    let path = Path::new("fuzz.json");
    if let Ok(snapshot) = model::parse_json(path, data) {
        usable(path, &snapshot);
    }
    let _ = streamalloc::replay::traces_from_bytes(path, data.to_vec());
}

/// `data` through the bounded gunzip, then as a file for the viewer and for replay (which
/// both decompress with it first).
pub fn gzip(data: &[u8]) {
    let path = Path::new("fuzz.gz");
    let small = pytorch::gunzip_within(path, data, SMALL_LIMIT, "fuzzing");
    if let Ok(out) = &small {
        assert!(
            out.len() as u64 <= SMALL_LIMIT,
            "{} bytes past the limit",
            out.len()
        );
    }
    if let Ok(full) = pytorch::maybe_gunzip(path, data.to_vec()) {
        if !data.starts_with(&[0x1f, 0x8b]) {
            assert_eq!(full, data, "input that is not gzip comes back unchanged");
        } else if full.len() as u64 <= SMALL_LIMIT {
            // The limit refuses a stream exactly when it decompresses to more.
            assert_eq!(
                small.ok().as_ref(),
                Some(&full),
                "within the limit, all of it"
            );
        } else {
            assert!(
                matches!(small, Err(VizError::Limit { .. })),
                "{} bytes accepted past a limit of {SMALL_LIMIT}: {small:?}",
                full.len()
            );
        }
    }
    if let Ok(snapshot) = files::from_bytes(path, data.to_vec()) {
        usable(path, &snapshot);
    }
    let _ = streamalloc::replay::traces_from_bytes(path, data.to_vec());
}

/// A snapshot a reader accepted is one every consumer takes: within the limits, encoded
/// for the viewer, written as Perfetto JSON and as a PyTorch pickle that reads back, and
/// written as our JSON that reads back the same (but for the free-form `config` and
/// `stats`, whose floats JSON need not round-trip).
pub fn usable(path: &Path, snapshot: &Snapshot) {
    snapshot
        .check_limits(path)
        .expect("an accepted snapshot is within the limits");
    for device in &snapshot.devices {
        wire::encode_device(snapshot, device);
    }
    perfetto::write_perfetto(snapshot, &mut std::io::sink()).expect("writes as Perfetto JSON");
    let mut pickle = Vec::new();
    pytorch::write_pickle(&pytorch::to_torch(snapshot), &mut pickle).expect("writes as a pickle");
    pytorch::parse_snapshot(path, &pickle).expect("the pickle written reads back");
    let mut json = Vec::new();
    model::write_json(snapshot, &mut json).expect("writes as our JSON");
    let again = model::parse_json(path, &json).expect("the JSON written reads back");
    let schema_only = |s: &Snapshot| Snapshot {
        config: None,
        stats: None,
        ..s.clone()
    };
    assert_eq!(
        schema_only(&again),
        schema_only(snapshot),
        "JSON round trip"
    );
}

/// `data` as any snapshot file, through the viewer's load path (`files::from_bytes`: gunzip,
/// sniffing, the PyTorch reader straight from the pickle decoder's arena, or our JSON with
/// its interned stacks), and as PyTorch's shape: both readers agree on what they accept.
pub fn snapshot(data: &[u8]) {
    let path = Path::new("fuzz.snapshot");
    if let Ok(snapshot) = files::from_bytes(path, data.to_vec()) {
        usable(path, &snapshot);
        if data.first() == Some(&0x80) {
            let torch = pytorch::parse_snapshot(path, data).expect("both pickle readers accept it");
            let entries: usize = torch.device_traces.iter().map(Vec::len).sum();
            assert_eq!(entries, snapshot.event_count(), "the same entries");
        }
    }
}
