//! The PyTorch snapshot reader against the shared real traces, and against broken input.

mod common;

use std::io::Write;
use streamalloc_viz::pytorch::{read_snapshot, TraceAction};
use streamalloc_viz::VizError;

/// The traces' allocation counts, as the reference script counts them
/// (tests/data/trace_stats.py).
#[test]
fn shared_traces_have_the_reference_allocation_counts() {
    for (name, allocs) in [("gpt2.pickle.gz", 4716), ("bert_varlen.pickle.gz", 7153)] {
        let path = common::shared_trace(name);
        let snap = read_snapshot(&path).unwrap();
        let trace = snap.device_traces.iter().find(|t| !t.is_empty()).unwrap();
        let n = trace
            .iter()
            .filter(|e| e.action == TraceAction::Alloc)
            .count();
        assert_eq!(n, allocs, "{name}");
        assert!(!snap.segments.is_empty());
        // Every entry of these recent traces has a time and a call stack.
        assert!(trace.iter().all(|e| e.time_us.is_some()));
        assert!(trace.iter().any(|e| !e.frames.is_empty()));
        if name == "gpt2.pickle.gz" {
            // trace_stats.py: gpt2 peak live 15044.8 MiB.
            let (mut live, mut peak) = (0i64, 0i64);
            for e in trace {
                match e.action {
                    TraceAction::Alloc => live += e.size as i64,
                    TraceAction::FreeCompleted => live -= e.size as i64,
                    _ => {}
                }
                peak = peak.max(live);
            }
            assert_eq!(
                format!("{:.1}", peak as f64 / (1u64 << 20) as f64),
                "15044.8"
            );
        }
        // Blocks tile their segment.
        for s in &snap.segments {
            let sum: u64 = s.blocks.iter().map(|b| b.size).sum();
            assert_eq!(sum, s.total_size);
        }
    }
}

#[test]
fn tiny_trace_opens() {
    let path = common::shared_trace("tp_allreduce_0.pickle.gz");
    let snap = read_snapshot(&path).unwrap();
    assert_eq!(snap.device_traces[0].len(), 123);
}

fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("streamalloc-viz-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
    path
}

#[test]
fn missing_file_names_the_path() {
    let err = read_snapshot("/nonexistent/x.pickle".as_ref()).unwrap_err();
    assert!(matches!(err, VizError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/x.pickle"), "{err}");
}

#[test]
fn foreign_file_is_refused_with_a_reason() {
    let path = temp("foreign.pickle", b"hello, world\n");
    let err = read_snapshot(&path).unwrap_err();
    assert!(
        err.to_string().contains("no pickle protocol header"),
        "{err}"
    );

    // A valid pickle of something else: a list of ints.
    let path = temp(
        "list.pickle",
        b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02e.",
    );
    let err = read_snapshot(&path).unwrap_err();
    assert!(
        err.to_string().contains("expected a dict, found list"),
        "{err}"
    );

    // A pickle of a Python class (collections.OrderedDict()): refused, not executed.
    let path = temp(
        "global.pickle",
        b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01.",
    );
    let err = read_snapshot(&path).unwrap_err();
    assert!(matches!(err, VizError::Pickle { .. }), "{err}");
    assert!(err.to_string().contains("global.pickle"), "{err}");

    // A dict without the snapshot keys: {'a': 1}.
    let path = temp(
        "dict.pickle",
        b"\x80\x04\x95\n\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s.",
    );
    let err = read_snapshot(&path).unwrap_err();
    assert!(
        err.to_string().contains("missing key \"segments\""),
        "{err}"
    );
}

#[test]
fn truncated_and_corrupt_inputs_give_errors_not_panics() {
    let path = common::shared_trace("tp_allreduce_0.pickle.gz");
    let gz = std::fs::read(&path).unwrap();
    // Truncated gzip.
    let cut = temp("cut.pickle.gz", &gz[..gz.len() / 2]);
    let err = read_snapshot(&cut).unwrap_err();
    assert!(matches!(err, VizError::Gzip { .. }), "{err}");

    let mut raw = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut raw).unwrap();
    // Truncated pickle at many offsets.
    for frac in 1..20 {
        let end = raw.len() * frac / 20;
        let p = temp("cut.pickle", &raw[..end]);
        assert!(read_snapshot(&p).is_err(), "truncated at {end} should fail");
    }
    // Flipped bytes: must not panic (some flips still decode, e.g. inside a string).
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..64 {
        let mut bad = raw.clone();
        for _ in 0..4 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let i = 2 + (state as usize) % (bad.len() - 2);
            bad[i] ^= (state >> 32) as u8 | 1;
        }
        let p = temp("flip.pickle", &bad);
        let _ = read_snapshot(&p);
    }
}
