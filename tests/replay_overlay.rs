//! `view --replay` and `plot --replay`: a recorded snapshot replayed through streamalloc
//! and drawn over the recording.
//! - The replay event by event reaches the same peaks as `replay_steps` on any trace.
//! - The cap search returns a cap under which the replay completes, and the next step down
//!   was tried and ran out of memory.
//! - Blocks live before the trace began are replayed first, so both reserved figures count
//!   the memory they hold.
//! - On the sample trace, the figures, the legend, the page's data (`/api/replay`) and the
//!   SVG say the same thing.
//! - The replay is charged to the file's memory budget, and refused before it runs when
//!   the budget cannot afford it.

mod cli;
#[path = "common/trace_steps.rs"]
mod trace_steps;
use trace_steps::{trace_of, Step};

use proptest::prelude::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use streamalloc::replay::{
    cap_bytes, lowest_completing_cap, replay_overlay, replay_overlay_within, replay_series,
    replay_steps, OverlayError, CAP_STEP, REPLAY_STAGE,
};
use streamalloc_allocator::testing::proptest_cases;
use streamalloc_allocator::{Config, ReusePolicy};
use streamalloc_viz::limits::Budget;
use streamalloc_viz::overlay::{SeriesBuilder, MAX_POINTS};

const MIB: u64 = 1 << 20;

fn steps(most: usize) -> impl Strategy<Value = Vec<Step>> {
    let size = prop_oneof![
        4 => 1u64..=8192,
        3 => 8193u64..=MIB,
        3 => (MIB + 1)..=(24 * MIB),
    ];
    trace_steps::steps(size, most)
}

fn config(expandable: bool, pytorch: bool, stitch: bool) -> Config {
    Config {
        expandable_segments: expandable,
        stitch,
        reuse_policy: if pytorch {
            ReusePolicy::Pytorch
        } else {
            ReusePolicy::StreamWait
        },
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: proptest_cases(64), failure_persistence: None, ..ProptestConfig::default()
    })]

    /// The line drawn is the replay `replay` reports: one sample per event, in order, whose
    /// maxima are the report's peaks.
    #[test]
    fn the_series_reaches_the_peaks_replay_reports(
        steps in steps(300),
        expandable in any::<bool>(),
        pytorch in any::<bool>(),
        stitch in any::<bool>(),
    ) {
        let events = trace_of(&steps);
        let config = config(expandable, pytorch, stitch);
        let report = replay_steps(&events, &config, 1, &mut |_| {}).unwrap();
        let (mut next, mut reserved, mut live) = (0, 0, 0);
        replay_series(&events, &config, &mut |i, sample| {
            assert_eq!(i, next, "one sample per event, in order");
            next += 1;
            reserved = reserved.max(sample.reserved);
            live = live.max(sample.live);
        }, &mut |_| {}).unwrap();
        prop_assert_eq!(next, events.len());
        prop_assert_eq!(reserved, report.peak_reserved_bytes);
        prop_assert_eq!(live, report.peak_live_bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: proptest_cases(16), failure_persistence: None, ..ProptestConfig::default()
    })]

    /// The cap found is one the replay completes under, and the step below it was tried
    /// and ran out of memory (or it is the lowest step); with no cap found, the highest
    /// was tried and ran out.
    #[test]
    fn the_lowest_cap_completes_and_the_step_below_does_not(
        steps in steps(120),
        expandable in any::<bool>(),
    ) {
        let events = trace_of(&steps);
        let config = config(expandable, false, true);
        let peak_live = replay_steps(&events, &config, 1, &mut |_| {}).unwrap().peak_live_bytes;
        prop_assume!(peak_live > 0);
        let mut tried = Vec::new();
        let search = lowest_completing_cap(&events, &config, peak_live, &mut |p| {
            if let streamalloc::replay::CapProgress::Tried { ratio, completed } = p {
                tried.push((ratio, completed));
            }
        });
        prop_assert!(search.probes <= 8, "{search:?}");
        prop_assert_eq!(tried.len() as u32, search.probes);
        let completes = |ratio: f64| {
            let capped = Config { memory_limit: Some(cap_bytes(peak_live, ratio)), ..config.clone() };
            replay_steps(&events, &capped, 1, &mut |_| {}).is_ok()
        };
        match search.ratio {
            Some(ratio) => {
                prop_assert!(completes(ratio), "{search:?}");
                prop_assert_eq!(search.bytes, Some(cap_bytes(peak_live, ratio)));
                if ratio > 1.0 + 1e-9 {
                    let below = ratio - CAP_STEP;
                    prop_assert!(
                        tried.iter().any(|&(r, ok)| (r - below).abs() < 1e-9 && !ok),
                        "{below} was not tried and refused: {tried:?}"
                    );
                }
            }
            None => prop_assert!(!completes(1.5), "{tried:?}"),
        }
    }
}

/// Our JSON snapshot of `trace` (events as `(action, addr, size, stream)`) on device 0,
/// with `segments` (`(addr, size, [(addr, size, state)])`) as the snapshot's list.
fn snapshot_json(trace: &[(&str, u64, u64, u64)], segments: serde_json::Value) -> Vec<u8> {
    let events: Vec<serde_json::Value> = trace
        .iter()
        .enumerate()
        .map(|(i, &(action, addr, size, stream))| {
            serde_json::json!({"action": action, "addr": addr, "size": size,
                "stream": stream, "time_ns": i})
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "format": "streamalloc-snapshot", "version": 1, "source": "pytorch",
        "stacks": [], "devices": [{"device": 0, "segments": segments, "trace": events}],
    }))
    .unwrap()
}

/// A model's weights, allocated before recording began, are in the snapshot's segment
/// list and never in the trace: the replay allocates them first, so its reserved memory
/// counts them as the recorded one does.
#[test]
fn blocks_from_before_the_trace_are_replayed_first() {
    let weights = 1u64 << 30;
    let base = 0x7f00_0000_0000u64;
    let bytes = snapshot_json(
        &[
            ("segment_alloc", base + weights, 64 * MIB, 0),
            ("alloc", base + weights, 8 * MIB, 0),
            ("free_requested", base + weights, 8 * MIB, 0),
            ("free_completed", base + weights, 8 * MIB, 0),
            ("alloc", base + weights, 16 * MIB, 0),
        ],
        serde_json::json!([{"addr": base, "size": weights, "pool": "large", "stream": 0,
            "blocks": [{"addr": base, "size": weights, "requested": weights,
                "state": "active_allocated", "stream": 0}]}]),
    );
    let path = Path::new("weights.json");
    let snapshot = streamalloc_viz::model::parse_json(path, &bytes).unwrap();
    let device = &snapshot.devices[0];
    let overlay =
        replay_overlay(&snapshot, device, &Config::default(), false, &mut |_| {}).unwrap();
    assert_eq!(overlay.events, 5);
    assert_eq!(overlay.reserved.len(), 5, "one point per event");
    assert!(overlay.initial_reserved >= weights, "{overlay:?}");
    assert_eq!(overlay.peak_live, weights + 16 * MIB);
    assert_eq!(overlay.recorded_peak_reserved, weights + 64 * MIB);
    assert!(overlay.replayed_peak_reserved >= overlay.peak_live);
    assert!(!overlay.cap_searched);
    assert_eq!(overlay.legend.cap, "");
}

/// The sample trace that `demo --write-trace` writes.
fn sample() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces/bert_varlen.pickle.gz")
}

#[test]
fn the_sample_trace_saves_memory_and_the_legend_says_how_much() {
    let snapshot = streamalloc_viz::files::load(&sample()).unwrap();
    let device = &snapshot.devices[0];
    let mut replays = 0;
    let overlay = replay_overlay(&snapshot, device, &Config::default(), true, &mut |p| {
        if let streamalloc::replay::OverlayProgress::Cap(
            streamalloc::replay::CapProgress::Tried { .. },
        ) = p
        {
            replays += 1;
        }
    })
    .unwrap();
    assert_eq!(overlay.events, device.trace.len() as u64);
    assert!(overlay.reserved.len() <= MAX_POINTS);
    assert_eq!(overlay.recorded_by, "PyTorch");
    assert!(overlay.recorded_segment_events);
    // PyTorch reached 1.150 of peak live on this trace; streamalloc stays within 1.02.
    let live = overlay.peak_live as f64;
    assert!((overlay.recorded_peak_reserved as f64 / live - 1.150).abs() < 0.01);
    assert!(
        overlay.replayed_peak_reserved as f64 / live < 1.02,
        "{overlay:?}"
    );
    assert!(overlay.saving_percent() > 10.0);
    let cap = overlay.cap.expect("the replay completes under some cap");
    assert!((1.0..=1.02).contains(&cap.ratio), "{cap:?}");
    assert!((1..=8).contains(&replays));
    let legend = &overlay.legend;
    assert!(legend.saving.starts_with("saving 1.1"), "{legend:?}");
    assert!(
        legend.saving.contains("%) of PyTorch's peak reserved"),
        "{legend:?}"
    );
    assert!(
        legend.cap.starts_with("lowest cap that completes: 1.0"),
        "{legend:?}"
    );
}

/// What a `streamalloc view` on `args` answers to `GET path`: status line and body.
fn get(url: &str, path: &str) -> (String, String) {
    let host = url.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = TcpStream::connect(host).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Starts `streamalloc view args --port 0`; returns the child, its URL and what it printed
/// before (the child is stopped if it prints no URL).
fn start_view(args: &[&std::ffi::OsStr]) -> (std::process::Child, String, String) {
    let mut child = cli::streamalloc()
        .arg("view")
        .args(args)
        .args(["--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut printed = String::new();
    let mut url = None;
    while url.is_none() {
        let mut line = String::new();
        if !matches!(stdout.read_line(&mut line), Ok(n) if n > 0) {
            break;
        }
        printed.push_str(&line);
        url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .map(str::to_string);
    }
    match url {
        Some(url) => (child, url, printed),
        None => {
            let _ = child.kill();
            let status = child.wait();
            panic!("view ended ({status:?}) before printing its URL: {printed}");
        }
    }
}

#[test]
fn view_replay_serves_the_overlay_and_prints_its_figures() {
    let sample = sample();
    let (mut child, url, printed) = start_view(&[sample.as_os_str(), "--replay".as_ref()]);
    let (status, body) = get(&url, "/api/replay?f=0&d=0");
    let (script, js) = get(&url, "/replay.js");
    let (missing, _) = get(&url, "/api/replay?f=0&d=9");
    let (page, html) = get(&url, "/");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(status.contains("200"), "{status}");
    let overlay: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(overlay["events"], 20905);
    assert!(overlay["reserved"].as_array().unwrap().len() == 20905);
    for key in ["recorded", "replayed", "live", "saving", "cap"] {
        let text = overlay["legend"][key].as_str().unwrap();
        assert!(
            printed.contains(&format!("  {text}\n")),
            "{key}: {text}\n{printed}"
        );
    }
    assert!(
        printed.contains("reuse_policy:stream_wait,stitch:true"),
        "{printed}"
    );
    assert!(
        script.contains("200") && js.contains("__vizOverlays"),
        "{script}"
    );
    assert!(missing.contains("404"), "{missing}");
    assert!(
        page.contains("200") && html.contains("/replay.js"),
        "{page}"
    );
}

#[test]
fn view_without_replay_has_no_overlay() {
    let sample = sample();
    let (mut child, url, printed) = start_view(&[sample.as_os_str()]);
    let (status, _) = get(&url, "/api/replay?f=0&d=0");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(status.contains("404"), "{status}");
    assert!(!printed.contains("saving"), "{printed}");
}

/// The SVG of `plot --replay` carries the three lines, each labelled, and a legend with
/// both peaks, the saving and the cap: the same words the terminal got.
#[test]
fn plot_replay_draws_three_labelled_lines_and_the_legend() {
    let dir = cli::scratch_dir("plot-replay");
    let svg_path = dir.join("replay.svg");
    let out = cli::streamalloc()
        .arg("plot")
        .arg(sample())
        .args(["--replay", "-o"])
        .arg(&svg_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    for (line, label) in [
        ("line-recorded-reserved", "PyTorch reserved"),
        ("line-replayed-reserved", "streamalloc reserved"),
        ("line-live", "live"),
    ] {
        assert!(svg.contains(&format!(r#"<polyline id="{line}""#)), "{line}");
        let id = line.trim_start_matches("line-");
        assert!(
            svg.contains(&format!(r#"id="label-{id}""#))
                && svg.contains(&format!(">{label}</text>")),
            "{label}"
        );
    }
    let figures: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("  "))
        .collect();
    assert_eq!(figures.len(), 5, "{stdout}");
    for text in figures {
        assert!(
            svg.contains(&format!(">{text}</text>")) || svg.contains(text),
            "{text}"
        );
    }
    assert!(svg.contains("<title>bert_varlen.pickle.gz, cuda:0: PyTorch's reserved memory"));
}

/// A bad `--conf` for the replay is refused before the snapshot is read, naming the flag.
#[test]
fn a_bad_replay_conf_is_refused_first() {
    let out = cli::streamalloc()
        .args([
            "plot",
            "/no/such/file.pickle",
            "-o",
            "x.svg",
            "--replay",
            "--conf",
        ])
        .arg("memory_limit:lots")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--conf") && !stderr.contains("/no/such"),
        "{stderr}"
    );
    let out = cli::streamalloc()
        .args(["plot", "x.pickle", "-o", "x.svg", "--conf", "stitch:false"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "--conf needs --replay");
}

/// The replay is a stage built from the file like the viewer's data: what it needs while it
/// runs (the timeline, the entries, the engine's records per live block and per page) is
/// charged to the file's budget and given back at the end, the overlay's points stay
/// charged, and a budget that cannot afford the replay refuses it before it starts.
#[test]
fn the_replay_is_charged_to_the_files_budget_and_refused_before_it_runs() {
    // 200 blocks of 1 GiB, never freed: a small file whose replay maps 100,000 pages.
    let trace: Vec<(&str, u64, u64, u64)> = (0..200u64)
        .map(|i| ("alloc", (i + 1) << 31, 1 << 30, 0))
        .collect();
    let bytes = snapshot_json(&trace, serde_json::json!([]));
    let snapshot = streamalloc_viz::model::parse_json(Path::new("big.json"), &bytes).unwrap();
    let device = &snapshot.devices[0];
    let config = Config::default();

    let mut budget = Budget::new(1 << 40);
    let overlay =
        replay_overlay_within(&snapshot, device, &config, false, &mut budget, &mut |_| {}).unwrap();
    assert_eq!(
        budget.used(),
        SeriesBuilder::points_bytes(200),
        "only the overlay's points stay charged"
    );
    let unlimited = replay_overlay(&snapshot, device, &config, false, &mut |_| {}).unwrap();
    assert_eq!(overlay, unlimited);

    let mut small = Budget::new(16 << 20);
    let mut replayed = false;
    let refused = replay_overlay_within(&snapshot, device, &config, true, &mut small, &mut |_| {
        replayed = true
    });
    match refused {
        Err(OverlayError::OverBudget(over)) => assert_eq!(over.stage, REPLAY_STAGE),
        other => panic!("not refused for its budget: {other:?}"),
    }
    assert!(!replayed, "refused before replaying");
}
