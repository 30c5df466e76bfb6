//! The PyTorch traces in `tests/data/traces` replayed through
//! the engine: our peak reserved over peak live must stay within the goal of 1.02 on each,
//! where PyTorch's own allocator reached 1.047 (gpt2) and 1.150 (bert_varlen). Also: bad
//! files get one-line errors naming them, and the CLI keeps going past them; what
//! `snapshot convert --to json` writes replays to the same figures as the original.

use std::path::{Path, PathBuf};
use std::process::Command;
use streamalloc::replay::{cap_bytes, peak_live_bytes, replay, replay_steps};
use streamalloc::replay::{load_traces, shared_traces_dir};
use streamalloc::replay::{replay_on_device, replay_steps_paced, DriverWork, Pacing};
use streamalloc_allocator::Config;

mod cli;

const GOAL: f64 = 1.02;

fn traces_dir() -> PathBuf {
    shared_traces_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
}

/// Every trace of the repository: the shared ones and the H200 recordings.
fn repository_traces() -> Vec<PathBuf> {
    let dirs = [
        traces_dir(),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/gpu/traces"),
    ];
    dirs.iter()
        .flat_map(|dir| std::fs::read_dir(dir).unwrap())
        .map(|entry| entry.unwrap().path())
        .collect()
}

/// `tests/data/DIR/NAME`, a trace kept apart from the shared ones.
fn data_trace_path(dir: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(dir)
        .join(name)
}

/// The entries of `tests/data/DIR/NAME` (its one device).
fn data_trace(dir: &str, name: &str) -> Vec<streamalloc_allocator::trace::TraceEntry> {
    load_traces(&data_trace_path(dir, name))
        .unwrap()
        .remove(0)
        .entries
}

/// A test trace; a missing one fails the test rather than skipping it.
fn shared_trace(name: &str) -> PathBuf {
    let path = traces_dir().join(name);
    assert!(path.exists(), "test trace {} is missing", path.display());
    path
}

/// Replays one shared trace; checks the recorded figures and our ratio.
fn check(name: &str, allocs: u64, peak_live_mib: f64, native_mib: f64, bound: f64) {
    let path = shared_trace(name);
    let traces = load_traces(&path).unwrap();
    assert_eq!(traces.len(), 1);
    let config = Config::default();
    let report = replay(&traces[0].entries, &config, &mut |_| {}).unwrap();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    // The figures trace_stats.py gives (baselines/results.md).
    assert_eq!(report.allocs, allocs);
    assert!(
        (mib(report.peak_live_bytes) - peak_live_mib).abs() < 0.1,
        "{report:?}"
    );
    assert!(
        (mib(report.native_peak_reserved_bytes) - native_mib).abs() < 0.1,
        "{report:?}"
    );
    assert_eq!(report.unknown_frees, 0);
    println!(
        "{name}: ours {:.4}, native {:.4}",
        report.ratio(),
        report.native_ratio()
    );
    assert!(report.peak_reserved_bytes >= report.peak_live_bytes);
    assert!(
        report.ratio() <= bound,
        "{name}: ratio {:.4} > {bound}",
        report.ratio()
    );
    // Whole segments stay faithful to the recording allocator: no worse than PyTorch's own
    // ratio, within rounding.
    let whole_segments = Config {
        expandable_segments: false,
        ..Config::default()
    };
    let whole = replay(&traces[0].entries, &whole_segments, &mut |_| {}).unwrap();
    assert!(
        whole.ratio() <= report.native_ratio() + 0.01,
        "{name}: whole-segment ratio {:.4}, native {:.4}",
        whole.ratio(),
        report.native_ratio()
    );
}

#[test]
fn gpt2_replays_within_the_goal() {
    check("gpt2.pickle.gz", 4716, 15044.8, 15754.0, GOAL);
}

#[test]
fn bert_varlen_replays_within_the_goal() {
    check("bert_varlen.pickle.gz", 7153, 8081.9, 9292.0, GOAL);
}

/// Replayed as three training steps back to back, the last step maps, unmaps and
/// synchronises nothing: reclaiming must not turn into remapping every step (on a GPU each
/// mapping costs tens of µs and each synchronisation drains the pipeline).
fn check_steady_state(name: &str, bound: f64) {
    check_three_steps(&shared_trace(name), bound);
}

/// The trace at `path` replayed as three steps with expandable segments: the last step
/// maps, unmaps and synchronises nothing, and the ratio stays within `bound`.
fn check_three_steps(path: &Path, bound: f64) {
    let name = path.file_name().unwrap().to_string_lossy();
    let traces = load_traces(path).unwrap();
    let config = Config::default();
    let report = replay_steps(&traces[0].entries, &config, 3, &mut |_| {}).unwrap();
    println!("{name}, 3 steps: {report:?}");
    assert_eq!(report.steps, 3);
    assert_eq!(
        (
            report.last_step_page_maps,
            report.last_step_page_unmaps,
            report.last_step_device_syncs
        ),
        (0, 0, 0),
        "{name}: {report:?}"
    );
    assert!(
        report.ratio() <= bound,
        "{name}: ratio {:.4}",
        report.ratio()
    );
}

#[test]
fn gpt2_steady_state_does_not_remap() {
    check_steady_state("gpt2.pickle.gz", GOAL);
}

/// Without stitching, BERT with varying lengths maps nothing in its third step.
#[test]
fn bert_varlen_steady_state_does_not_remap_without_stitching() {
    let traces = load_traces(&shared_trace("bert_varlen.pickle.gz")).unwrap();
    let config = Config::parse("stitch:false").unwrap();
    let report = replay_steps(&traces[0].entries, &config, 3, &mut |_| {}).unwrap();
    assert_eq!(
        (
            report.last_step_page_maps,
            report.last_step_page_unmaps,
            report.last_step_device_syncs
        ),
        (0, 0, 0),
        "{report:?}"
    );
    assert!(report.ratio() <= GOAL, "ratio {:.4}", report.ratio());
}

/// With stitching (the default), BERT with varying sequence lengths settles: its third step
/// maps, stitches and synchronises nothing, and stays near its live peak. Its 1.35 GB
/// logits request is stitched from runs of at least an eighth of its size, grown where the
/// pool lacks them: stitched from every small hole between live blocks instead, its kept
/// ranges found some hole refilled by a medium tensor in the next step and new ones were
/// made in every step (with runs of a 128th at least, in its 11th and 16th).
#[test]
fn bert_varlen_with_stitching_settles_near_the_peak() {
    let traces = load_traces(&shared_trace("bert_varlen.pickle.gz")).unwrap();
    let report = replay_steps(&traces[0].entries, &Config::default(), 3, &mut |_| {}).unwrap();
    assert_eq!(report.device_syncs, 0, "{report:?}");
    let last = (
        report.last_step_page_maps,
        report.last_step_page_unmaps,
        report.last_step_stitch_maps,
        report.last_step_stitches,
    );
    assert_eq!(last, (0, 0, 0, 0), "{report:?}");
    assert!(report.ratio() <= 1.03, "ratio {:.4}", report.ratio());
}

/// A memory limit that does not bind changes no choice: replayed as three steps under a
/// limit of 1.03 times its live peak, each training loop that needs less without a limit
/// (BERT with varying lengths, GPT-2, and GPT-2 and ResNet-50 as recorded on an H200)
/// reserves what it reserves without one and settles the same way, its last step mapping,
/// stitching and synchronising nothing. (Under a limit pages are mapped one by one so
/// that any of them can go back alone; stitching every free page while the limit was
/// still far made kept stitches of the holes between live blocks, refilled in the next
/// step: BERT made a new stitch and 10 second mappings in every step, GPT-2 3.)
#[test]
fn a_limit_that_does_not_bind_changes_no_choice() {
    let h200 = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/gpu/traces");
    let paths = [
        shared_trace("bert_varlen.pickle.gz"),
        shared_trace("gpt2.pickle.gz"),
        h200.join("gpt2_native_steps2-3.pickle.gz"),
        h200.join("resnet50_native_steps2-4.pickle.gz"),
    ];
    for path in paths {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let entries = &load_traces(&path).unwrap()[0].entries;
        let free = replay_steps(entries, &Config::default(), 3, &mut |_| {}).unwrap();
        let limit = cap_bytes(peak_live_bytes(entries), 1.03);
        assert!(free.peak_reserved_bytes <= limit, "{name}: {free:?}");
        let limited = Config {
            memory_limit: Some(limit),
            ..Config::default()
        };
        let capped = replay_steps(entries, &limited, 3, &mut |_| {}).unwrap();
        assert_eq!(
            capped.peak_reserved_bytes, free.peak_reserved_bytes,
            "{name}: {capped:?}"
        );
        let last = (
            capped.last_step_page_maps,
            capped.last_step_page_unmaps,
            capped.last_step_stitch_maps,
            capped.last_step_device_syncs,
        );
        assert_eq!(last, (0, 0, 0, 0), "{name}: {capped:?}");
    }
}

/// Every training trace of the repository, replayed as three steps with the default
/// configuration, settles by its third: no page mapped or unmapped, no second mapping, no
/// synchronisation. FSDP2's rank 0 alone still makes a few new stitches in its third step
/// (docs/design.md, "What is not yet steady"), and maps nothing else: its wide runs grow
/// only within the growth budget, so narrower ones that the next step refills are
/// stitched instead (one new stitch while wide runs grew past the budget, at 1.065 of its
/// live peak instead of 1.042).
#[test]
fn every_training_trace_settles_by_its_third_step() {
    for path in repository_traces() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let entries = &load_traces(&path).unwrap()[0].entries;
        let report = replay_steps(entries, &Config::default(), 3, &mut |_| {}).unwrap();
        let last = *report.pass_driver_work.last().unwrap();
        if name == "fsdp2_gpt2_rank0.pickle.gz" {
            assert!(report.last_step_stitches <= 3, "{name}: {report:?}");
            let rest = DriverWork {
                stitch_maps: 0,
                ..last
            };
            assert_eq!(rest, DriverWork::default(), "{name}: {report:?}");
        } else {
            assert_eq!(last, DriverWork::default(), "{name}: {report:?}");
        }
    }
}

/// GPT-2 replayed as eight steps calls the driver in its first alone: a stitch's
/// shortfall is held to a growth budget that counts the whole request as live, as growing
/// does. Counted with the shortfall alone, the budget looked tighter than it was, a stitch
/// took narrower runs than it needed, and a new stitch came in the sixth step (1.004 of
/// the live peak became 1.006).
#[test]
fn gpt2_calls_the_driver_in_its_first_step_alone() {
    let entries = &load_traces(&shared_trace("gpt2.pickle.gz")).unwrap()[0].entries;
    let report = replay_steps(entries, &Config::default(), 8, &mut |_| {}).unwrap();
    for (step, work) in report.pass_driver_work.iter().enumerate().skip(1) {
        assert_eq!(
            *work,
            DriverWork::default(),
            "step {}: {report:?}",
            step + 1
        );
    }
    assert!(report.ratio() <= 1.005, "ratio {:.4}", report.ratio());
}

/// FSDP2's rank 0 replayed as ten steps: after its second step memory grows by at most a
/// page or two a step and never by more than 1% of its live peak in all, nothing is
/// unmapped and nothing synchronised, and the peak stays within 1.05 of live (1.029 in the
/// first step, 1.046 after ten). Stitches that took holes of a few dozen MiB found them
/// refilled in the next step, and grew what they lacked anew: with no runs wider than a
/// 128th, the peak crept from 1.038 to 1.075 of live over ten steps (1.109 over 25); with
/// wide runs grown past the growth budget it held 1.065 from the first step.
#[test]
fn fsdp2_grows_little_after_its_second_step() {
    let entries = &load_traces(&shared_trace("fsdp2_gpt2_rank0.pickle.gz")).unwrap()[0].entries;
    let report = replay_steps(entries, &Config::default(), 10, &mut |_| {}).unwrap();
    let peaks = &report.pass_peak_reserved_bytes;
    let live = report.peak_live_bytes;
    assert!(peaks[9] - peaks[1] <= live / 100, "{peaks:?}");
    for (step, work) in report.pass_driver_work.iter().enumerate().skip(2) {
        let remap = (work.page_maps <= 2, work.page_unmaps, work.device_syncs);
        assert_eq!(remap, (true, 0, 0), "step {}: {work:?}", step + 1);
    }
    assert!(report.ratio() <= 1.05, "ratio {:.4}", report.ratio());
}

/// `--steps N` reports each step's own peak reserved bytes and driver work, so that memory
/// growing from one step to the next, and remapping that stops late or never, show: one
/// figure per step, each peak at least the step's live peak (the step serves all of it),
/// their largest the run's peak, the first step's what a replay of that step alone
/// reserves; the steps' driver work adds up to the run's.
#[test]
fn every_step_reports_its_own_peak_and_driver_work() {
    let traces = load_traces(&shared_trace("bert_varlen.pickle.gz")).unwrap();
    let entries = &traces[0].entries;
    let config = Config::default();
    let steps = replay_steps(entries, &config, 3, &mut |_| {}).unwrap();
    let peaks = &steps.pass_peak_reserved_bytes;
    assert_eq!(peaks.len(), 3, "{peaks:?}");
    assert!(
        peaks.iter().all(|&peak| peak >= steps.peak_live_bytes),
        "a step reserved less than it held live: {peaks:?}, live {}",
        steps.peak_live_bytes
    );
    assert_eq!(peaks.iter().max(), Some(&steps.peak_reserved_bytes));
    let alone = replay(entries, &config, &mut |_| {}).unwrap();
    assert_eq!(alone.pass_peak_reserved_bytes, vec![peaks[0]]);
    assert_eq!(alone.peak_reserved_bytes, peaks[0]);
    // Each step's driver work: the steps' shares add up to the run's, the last is the
    // last step's figures, and the first step, which maps the memory, is never without.
    let work = &steps.pass_driver_work;
    assert_eq!(work.len(), 3, "{work:?}");
    let total = |f: fn(&DriverWork) -> u64| work.iter().map(f).sum::<u64>();
    assert_eq!(total(|w| w.page_maps), steps.page_maps, "{work:?}");
    assert_eq!(total(|w| w.page_unmaps), steps.page_unmaps, "{work:?}");
    assert_eq!(total(|w| w.device_syncs), steps.device_syncs, "{work:?}");
    let last = work[2];
    assert_eq!(
        (
            last.page_maps,
            last.page_unmaps,
            last.stitch_maps,
            last.device_syncs
        ),
        (
            steps.last_step_page_maps,
            steps.last_step_page_unmaps,
            steps.last_step_stitch_maps,
            steps.last_step_device_syncs
        )
    );
    assert!(work[0].page_maps > 0, "{work:?}");
}

/// Replays a trace recorded on an H200 by benches/gpu/alloc_bench.py (`CAPTURE=...`) under
/// PyTorch's allocator, as three steps; the recordings start after two warm-up steps, so
/// they carry no segment events of their own (PyTorch reserved 1.047x (GPT-2) and 1.185x
/// (ResNet-50) its peak allocation in those runs).
fn check_recorded_on_h200(file: &str, bound: f64) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/gpu/traces")
        .join(file);
    check_three_steps(&path, bound);
}

#[test]
fn gpt2_recorded_on_h200_steady_state_does_not_remap() {
    check_recorded_on_h200("gpt2_native_steps2-3.pickle.gz", GOAL);
}

/// Paced as on an H200 (each physical allocation mapped or unmapped 50 µs, the program's
/// own time between events as recorded), a training loop keeps the memory it keeps unpaced: its stitches are revived
/// step after step, and revived stitches never count against remapping's share of time.
/// (Charging every new stitch instead widened the slack during the first steps: GPT-2
/// small then reserved 1.040 of its peak, here as on the GPU, and ResNet-50 1.021.)
#[test]
fn training_loops_paced_as_on_a_gpu_keep_their_stitches() {
    let h200 = Pacing::Recorded {
        driver_call_ns: 50_000,
    };
    let traces = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/gpu/traces");
    for path in [
        shared_trace("gpt2.pickle.gz"),
        traces.join("resnet50_native_steps2-4.pickle.gz"),
    ] {
        let traces = load_traces(&path).unwrap();
        let entries = &traces[0].entries;
        let still = replay_steps(entries, &Config::default(), 3, &mut |_| {}).unwrap();
        let paced = replay_steps_paced(entries, &Config::default(), 3, h200, &mut |_| {}).unwrap();
        println!(
            "{}: still {:.4}, paced {:.4}",
            path.file_name().unwrap().to_string_lossy(),
            still.ratio(),
            paced.ratio()
        );
        assert_eq!(
            paced.peak_reserved_bytes, still.peak_reserved_bytes,
            "{paced:?}"
        );
        assert!(paced.ratio() <= 1.012, "{:.4}", paced.ratio());
    }
}

/// Stitching costs the driver about what growing alone would: stitches map whole pieces of
/// memory a second time, and while no limit is in force memory is mapped in pieces, not
/// page by page. The driver's time goes by physical allocations (on an H200, ~55 µs each
/// to grow and ~37 to stitch, whatever their size); with one allocation per page, stitching
/// made 6-8 times as many as growing alone on these traces, and FSDP2 steps that stitched
/// 4.6 GB spent half a second in the driver.
#[test]
fn stitching_costs_the_driver_about_what_growing_alone_does() {
    let traces = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/gpu/traces");
    for path in [
        shared_trace("gpt2.pickle.gz"),
        shared_trace("bert_varlen.pickle.gz"),
        shared_trace("fsdp2_gpt2_rank0.pickle.gz"),
        traces.join("resnet50_native_steps2-4.pickle.gz"),
    ] {
        let traces = load_traces(&path).unwrap();
        let entries = &traces[0].entries;
        let grown = replay_steps(
            entries,
            &Config::parse("stitch:false").unwrap(),
            3,
            &mut |_| {},
        )
        .unwrap();
        let stitched = replay_steps(entries, &Config::default(), 3, &mut |_| {}).unwrap();
        let name = path.file_name().unwrap().to_string_lossy();
        println!(
            "{name}: {} driver allocations stitching, {} growing alone",
            stitched.driver_allocations, grown.driver_allocations
        );
        assert!(
            stitched.driver_allocations * 2 <= grown.driver_allocations * 3,
            "{name}: {} driver allocations stitching, {} growing alone",
            stitched.driver_allocations,
            grown.driver_allocations
        );
    }
}

/// GPT-2 small generating with growing KV caches (benches/gpu/fragmentation/capture_infer.py,
/// PyTorch 2.11 on an H200, weights included): PyTorch reserved 1.334x its peak. The
/// default configuration replays within the goal (1.015): requests that pack against the
/// live block above leave their remainders where pages can be unmapped.
#[test]
fn kv_cache_generation_recorded_on_h200_replays_within_the_goal() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/gpu/traces/gpt2_generate_native.pickle.gz");
    let traces = load_traces(&path).unwrap();
    let report = replay(&traces[0].entries, &Config::default(), &mut |_| {}).unwrap();
    let whole = Config {
        expandable_segments: false,
        ..Config::default()
    };
    let whole = replay(&traces[0].entries, &whole, &mut |_| {}).unwrap();
    println!(
        "generation: ours {:.4}, whole segments {:.4}",
        report.ratio(),
        whole.ratio()
    );
    assert!(report.ratio() <= GOAL, "{:.4}", report.ratio());
    assert!(
        whole.ratio() > 1.3,
        "whole segments reproduce PyTorch: {:.4}",
        whole.ratio()
    );
}

/// `reclaim:false` is for programs that cannot afford a device synchronisation inside a
/// malloc: the generation trace, which the default keeps remapping at its prefill peaks
/// (reclaims synchronise, unmap and map again), replays as three passes with no
/// synchronisation and nothing mapped after the first pass, at the fragmentation of its
/// high-water mark (1.043 of its live peak, against the default's 1.015).
#[test]
fn without_reclaims_generation_never_synchronises_and_stops_mapping() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/gpu/traces/gpt2_generate_native.pickle.gz");
    let traces = load_traces(&path).unwrap();
    let entries = &traces[0].entries;
    // The reclaim mechanism alone, without stitching.
    let no_reclaim = Config::parse("reclaim:false,stitch:false").unwrap();
    let quiet = replay_steps(entries, &no_reclaim, 3, &mut |_| {}).unwrap();
    let reclaiming = replay_steps(
        entries,
        &Config::parse("stitch:false").unwrap(),
        3,
        &mut |_| {},
    )
    .unwrap();
    println!("reclaim:false {quiet:?}\nreclaiming {reclaiming:?}");
    assert_eq!(quiet.device_syncs, 0, "{quiet:?}");
    assert_eq!(
        (quiet.last_step_page_maps, quiet.last_step_page_unmaps),
        (0, 0),
        "{quiet:?}"
    );
    assert!(quiet.ratio() <= 1.05, "{:.4}", quiet.ratio());
    // What the switch gives up: reclaiming synchronises to unmap, and ends lower.
    assert!(reclaiming.device_syncs > 0, "{reclaiming:?}");
    assert!(
        reclaiming.ratio() < quiet.ratio(),
        "{:.4} against {:.4}",
        reclaiming.ratio(),
        quiet.ratio()
    );
    // Stitching (the default) needs neither: no synchronisation, nothing mapped in the
    // third pass, and closer to the live peak than either.
    let stitching = replay_steps(entries, &Config::default(), 3, &mut |_| {}).unwrap();
    assert_eq!(stitching.device_syncs, 0, "{stitching:?}");
    assert_eq!(
        (
            stitching.last_step_page_maps,
            stitching.last_step_stitch_maps,
            stitching.last_step_stitches
        ),
        (0, 0, 0),
        "{stitching:?}"
    );
    assert!(stitching.ratio() <= 1.02, "{:.4}", stitching.ratio());
}

#[test]
fn resnet50_recorded_on_h200_steady_state_does_not_remap_within_the_goal() {
    // 1.046 while hot blocks stayed parked under sizes that do not repeat (PyTorch: 1.185).
    check_recorded_on_h200("resnet50_native_steps2-4.pickle.gz", GOAL);
}

#[test]
fn whole_segments_reproduce_the_native_allocator() {
    // Without expandable segments the engine follows PyTorch's rules, so it should
    // fragment like PyTorch: a check that replay is faithful, not just optimistic.
    let path = shared_trace("gpt2.pickle.gz");
    let traces = load_traces(&path).unwrap();
    let config = Config::parse("expandable_segments:false").unwrap();
    let report = replay(&traces[0].entries, &config, &mut |_| {}).unwrap();
    let gap = (report.ratio() - report.native_ratio()).abs();
    assert!(
        gap < 0.01,
        "classic {:.4}, native {:.4}",
        report.ratio(),
        report.native_ratio()
    );
}

#[test]
fn bad_files_get_one_line_errors_naming_them() {
    let dir = cli::scratch_dir("replay");
    let foreign = dir.join("notes.txt");
    std::fs::write(&foreign, "hello, not a trace").unwrap();
    let corrupt_gzip = dir.join("cut.pickle.gz");
    std::fs::write(&corrupt_gzip, [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2]).unwrap();
    let bad_entry = dir.join("bad.json");
    std::fs::write(&bad_entry, r#"[{"action":"alloc","addr":1}]"#).unwrap();
    for path in [
        &foreign,
        &corrupt_gzip,
        &bad_entry,
        &dir.join("missing.json"),
    ] {
        let err = load_traces(path).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }
    let bytes = std::fs::read(shared_trace("gpt2.pickle.gz")).unwrap();
    let truncated = dir.join("truncated.pickle.gz");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_traces(&truncated).unwrap_err().to_string();
    assert!(err.contains("truncated.pickle.gz"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cli_reports_good_traces_past_bad_ones_and_fails_at_the_end() {
    let dir = cli::scratch_dir("cli");
    let bad = dir.join("bad.pickle");
    std::fs::write(&bad, [0x80, 4, 0x95]).unwrap();
    // A small trace in our JSON format: two blocks on two streams.
    let good = dir.join("small.json");
    std::fs::write(
        &good,
        r#"[{"action":"segment_alloc","addr":0,"size":4194304,"stream":0,"time_ns":0},
            {"action":"alloc","addr":4096,"size":3000000,"stream":0,"time_ns":1},
            {"action":"alloc","addr":8192,"size":1000,"stream":7,"time_ns":2},
            {"action":"free_completed","addr":4096,"size":3000000,"stream":0,"time_ns":3}]"#,
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .args(["replay", "--json"])
        .arg(&bad)
        .arg(&good)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("bad.pickle"), "{stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let row: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!(row["trace"], "small.json");
    assert_eq!(row["allocs"], 2);
    assert_eq!(row["peak_live_bytes"], 3_001_000);
    assert_eq!(row["native_peak_reserved_bytes"], 4 << 20);
    assert!(row["peak_reserved_bytes"].as_u64().unwrap() >= 3_001_000);
    assert!(row["ns_per_op"].as_f64().unwrap() > 0.0);
    std::fs::remove_dir_all(&dir).ok();
}

/// A trace whose recording began after its program had reserved memory (its allocator's
/// segments grew less during it than its blocks needed) is named as such: replayed from an
/// empty device, it misses where the earlier blocks lay. FSDP2 with checkpointing recorded
/// from its first timed step replays at 1.053 of its live peak, the same run recorded
/// from the start at 1.122 (on the engine of the time; the device measured 1.120).
#[test]
fn a_trace_recorded_after_its_program_reserved_memory_is_named() {
    let note = "recording began after its program reserved memory";
    let run = |path: &Path| {
        let output = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
            .arg("replay")
            .arg(path)
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let stdout = run(&data_trace_path("unsettled", "fsdp2_ckpt_rank0.pickle.gz"));
    assert!(stdout.contains(note), "{stdout}");
    let stdout = run(&data_trace_path("whole_runs", "fsdp2_ckpt_rank0.pickle.gz"));
    assert!(!stdout.contains(note), "{stdout}");
}

#[test]
fn a_snapshot_of_several_devices_gives_one_trace_per_device() {
    use streamalloc_viz::pytorch::{write_pickle, TorchSnapshot, TorchTraceEntry, TraceAction};
    let event = |action, addr, size, stream| TorchTraceEntry {
        action,
        addr,
        size,
        stream,
        time_us: Some(1),
        frames: Vec::new().into(),
        device_free: None,
    };
    let device = |base: u64| {
        vec![
            event(TraceAction::SegmentAlloc, base, 20 << 20, 0),
            event(TraceAction::Alloc, base, 3 << 20, 0),
            event(TraceAction::Alloc, base + (3 << 20), 5 << 20, 9),
            event(TraceAction::FreeRequested, base, 3 << 20, 0),
            event(TraceAction::FreeCompleted, base, 3 << 20, 0),
            event(TraceAction::Snapshot, 0, 0, 0),
        ]
    };
    let snapshot = TorchSnapshot {
        device_traces: vec![device(1 << 30), Vec::new(), device(2 << 30)],
        ..TorchSnapshot::default()
    };
    let mut bytes = Vec::new();
    write_pickle(&snapshot, &mut bytes).unwrap();
    let path = cli::scratch_dir("devices").join("devices.pickle");
    std::fs::write(&path, bytes).unwrap();
    let traces = load_traces(&path).unwrap();
    let names: Vec<&str> = traces.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["devices.pickle[device 0]", "devices.pickle[device 2]"]
    );
    for trace in &traces {
        // The `snapshot` marker is dropped; the rest replays.
        assert_eq!(trace.entries.len(), 5);
        let report = replay(&trace.entries, &Config::default(), &mut |_| {}).unwrap();
        assert_eq!((report.allocs, report.frees, report.live_at_end), (2, 1, 1));
        assert_eq!(report.peak_live_bytes, 8 << 20);
        assert_eq!(report.native_peak_reserved_bytes, 20 << 20);
        assert!(report.peak_reserved_bytes >= 8 << 20);
    }
}

/// A bad `--conf` is blamed on the flag, not on `STREAMALLOC_CONF`, which was not read.
#[test]
fn bad_conf_flag_is_blamed_on_the_flag() {
    let trace = shared_trace("tp_allreduce_0.pickle.gz");
    for conf in ["memory_limit:0x10", "no_such_key:1", "garbage"] {
        let out = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
            .args(["replay", "--conf", conf])
            .arg(&trace)
            .env_remove("STREAMALLOC_CONF")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{conf}: {stderr}");
        assert!(stderr.contains("--conf"), "{conf}: {stderr}");
        assert!(!stderr.contains("STREAMALLOC_CONF"), "{conf}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{conf}: {stderr}");
    }
}

/// A gzip bomb (70 MiB of zeros in about 70 KB, made here) is refused by every reader
/// with one line naming the file and the limit; replay goes on with the other files, and
/// the limit can be set through the environment.
#[test]
fn gzip_bombs_are_refused_and_the_limit_can_be_set() {
    use std::io::Write;
    let dir = cli::scratch_dir("bomb");
    let bomb = dir.join("bomb.pickle.gz");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..70 {
        gz.write_all(&zeros).unwrap();
    }
    let bytes = gz.finish().unwrap();
    // Small enough that 70 MB is past 200 times its size, whatever the compressor.
    assert!(
        bytes.len() * 200 < 64 << 20,
        "a small file: {} bytes",
        bytes.len()
    );
    std::fs::write(&bomb, &bytes).unwrap();
    let good = shared_trace("tp_allreduce_0.pickle.gz");
    let run = |args: &[&str], files: &[&Path], limit: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_streamalloc"));
        cmd.args(args)
            .args(files)
            .env_remove("STREAMALLOC_MAX_DECOMPRESSED");
        if let Some(limit) = limit {
            cmd.env("STREAMALLOC_MAX_DECOMPRESSED", limit);
        }
        cmd.output().unwrap()
    };
    let out = run(&["replay", "--json"], &[&bomb, &good], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("bomb.pickle.gz") && stderr.contains("limit"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("tp_allreduce_0.pickle.gz"),
        "the good file still ran"
    );

    let png = dir.join("bomb.png");
    let out = run(&["plot", "-o", png.to_str().unwrap()], &[&bomb], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("decompresses to more than"), "{stderr}");

    // Raised, the bomb decompresses and is refused for what it is (zeros, not a pickle);
    // lowered, even the real trace (52 KB unpacked) is over it.
    let out = run(&["replay"], &[&bomb], Some("100M"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("decompresses to more than"), "{stderr}");
    let out = run(&["replay"], &[&good], Some("16K"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("STREAMALLOC_MAX_DECOMPRESSED=16K"),
        "{stderr}"
    );
    let out = run(&["replay"], &[&good], Some("lots"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a byte count"));
    std::fs::remove_dir_all(&dir).ok();
}

/// `streamalloc replay --json` of `paths`: its exit status, stderr, and one row per trace.
fn replay_json(paths: &[&Path]) -> (bool, String, Vec<serde_json::Value>) {
    replay_json_with(&[], paths)
}

/// [`replay_json`] with more of `replay`'s flags.
fn replay_json_with(flags: &[&str], paths: &[&Path]) -> (bool, String, Vec<serde_json::Value>) {
    let output = cli::streamalloc()
        .args(["replay", "--json"])
        .args(flags)
        .args(paths)
        .output()
        .unwrap();
    let rows = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
        rows,
    )
}

/// A replay row without what differs between runs or files: the name and the timing.
fn figures(mut row: serde_json::Value) -> serde_json::Value {
    let map = row.as_object_mut().unwrap();
    map.remove("trace");
    map.remove("ns_per_op");
    row
}

#[test]
fn a_trace_converted_to_our_json_replays_to_the_same_figures() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("replay_converted");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["gpt2.pickle.gz", "tp_allreduce_0.pickle.gz"] {
        let original = shared_trace(name);
        let json = dir.join(format!("{name}.json"));
        let json_gz = dir.join(format!("{name}.json.gz"));
        cli::convert(&original, &json, "json");
        cli::convert(&original, &json_gz, "json");
        let (ok, stderr, rows) = replay_json(&[&original, &json, &json_gz]);
        assert!(ok, "{name}: {stderr}");
        assert_eq!(rows.len(), 3, "{name}: {rows:?}");
        assert!(
            rows[0]["allocs"].as_u64().unwrap() > 0,
            "{name}: {:?}",
            rows[0]
        );
        let expected = figures(rows[0].clone());
        for row in &rows[1..] {
            assert_eq!(figures(row.clone()), expected, "{name}: {row}");
        }
    }
}

#[test]
fn a_json_file_that_is_no_trace_is_refused_saying_what_it_holds() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("replay_refused");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let perfetto = dir.join("gpt2.trace.json");
    cli::convert(&shared_trace("gpt2.pickle.gz"), &perfetto, "perfetto");
    let number = dir.join("number.json");
    std::fs::write(&number, "42").unwrap();
    for (path, found) in [
        (
            &perfetto,
            r#"a JSON object with keys ["displayTimeUnit", "otherData", "traceEvents"], not a snapshot with a trace"#,
        ),
        (
            &number,
            "a JSON number, neither a list of trace entries nor a snapshot",
        ),
    ] {
        let (ok, stderr, rows) = replay_json(&[path]);
        assert!(!ok && rows.is_empty(), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(&path.display().to_string()), "{stderr}");
        assert!(stderr.contains(found), "{found:?} not in {stderr}");
    }
}

/// Every trace of the repository replayed as three steps under a memory limit of 1.02 times
/// its own peak live bytes (`replay --limit-ratio 1.02`), and without a limit: each
/// completes, and its last step neither synchronises nor unmaps. (Under a limit this tight
/// the FSDP2 trace's largest request, its logits, finds 2% of the peak free only in pages
/// scattered over several streams: stitching joins them with device waits instead of
/// synchronising to unmap them.)
#[test]
fn every_trace_completes_at_a_limit_of_1_02_times_its_peak_and_settles() {
    let paths = repository_traces();
    for path in &paths {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let entries = &load_traces(path).unwrap()[0].entries;
        let limit = cap_bytes(peak_live_bytes(entries), 1.02);
        for memory_limit in [Some(limit), None] {
            let config = Config {
                memory_limit,
                ..Config::default()
            };
            let report = replay_steps(entries, &config, 3, &mut |_| {})
                .unwrap_or_else(|err| panic!("{name} under {memory_limit:?}: {err}"));
            assert_eq!(
                (report.last_step_device_syncs, report.last_step_page_unmaps),
                (0, 0),
                "{name} under {memory_limit:?}: {report:?}"
            );
        }
    }
    assert!(paths.len() >= 7, "{} traces", paths.len());
}

/// `replay --driver-call-us` paces the replay (same figures for a training trace, see
/// `training_loops_paced_as_on_a_gpu_keep_their_stitches`) and refuses a zero or a word.
#[test]
fn replay_driver_call_us_paces_and_rejects_nonsense() {
    let trace = shared_trace("tp_allreduce_0.pickle.gz");
    let (ok, stderr, rows) =
        replay_json_with(&["--steps", "2", "--driver-call-us", "80"], &[&trace]);
    assert!(ok && rows.len() == 1, "{stderr}");
    let row = &rows[0];
    assert_eq!(row["steps"], 2, "{row}");
    for bad in ["0", "fast"] {
        assert_replay_refuses(&["--driver-call-us", bad], &trace, "--driver-call-us");
    }
}

/// `streamalloc replay FLAGS TRACE` is a usage error (exit status 2) whose message names
/// `flag`.
fn assert_replay_refuses(flags: &[&str], trace: &Path, flag: &str) {
    let output = cli::streamalloc()
        .arg("replay")
        .args(flags)
        .arg(trace)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{flags:?}: {output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(flag), "{flags:?}: {stderr}");
}

/// `replay --device-ratio R` caps the simulated device, not the allocator: no limit is set
/// (the configuration says `memory_limit:none`), reserved memory stays within the device,
/// and a device too small for the trace's live bytes stops the replay. It cannot be
/// combined with `--limit-ratio`.
#[test]
fn replay_device_ratio_caps_the_device_not_the_allocator() {
    let trace = shared_trace("gpt2.pickle.gz");
    let (ok, stderr, rows) = replay_json_with(&["--device-ratio", "1.02"], &[&trace]);
    assert!(ok && rows.len() == 1, "{stderr}");
    let row = &rows[0];
    assert!(
        row["config"]
            .as_str()
            .unwrap()
            .contains("memory_limit:none"),
        "{row}"
    );
    let entries = &load_traces(&trace).unwrap()[0].entries;
    let device = cap_bytes(peak_live_bytes(entries), 1.02).next_multiple_of(2 << 20);
    let reserved = row["peak_reserved_bytes"].as_u64().unwrap();
    assert!(
        reserved <= device,
        "{reserved} reserved on a device of {device}"
    );

    let half = peak_live_bytes(entries) / 2;
    let refused = replay_on_device(
        entries,
        &Config::default(),
        1,
        Pacing::Still,
        half,
        &mut |_| {},
    );
    assert!(refused.is_err(), "{refused:?}");

    assert_replay_refuses(
        &["--device-ratio", "1.02", "--limit-ratio", "1.02"],
        &trace,
        "--device-ratio",
    );
}

/// FSDP2 with activation checkpointing on a Llama-style model by one rank, ten steps of
/// lengths 128-2,048 (`tests/data/unsettled/`; recorded under PyTorch's expandable
/// segments by `DIST_SNAPSHOT=OUT/fsdp2_ckpt DIST_WARMUP=2 DIST_STEPS=10 torchrun
/// --standalone --nproc-per-node=1 benches/gpu/dist/workloads.py --worker fsdp2_ckpt
/// pt_expandable OUT/run`, from its first timed step). Kept apart from the traces every
/// test above replays because it does not settle yet (`docs/design.md`, "What is not yet
/// steady"); [`fsdp2_with_checkpointing_settles`] states the goal.
fn unsettled_trace(name: &str) -> Vec<streamalloc_allocator::trace::TraceEntry> {
    data_trace("unsettled", name)
}

/// What holds for it already: its later steps reserve at most 0.5% of its live peak more
/// than its first, within 1.03 of that peak (1.021), and under 1.02 times that peak it
/// completes with no synchronisation in its third step. Its logits find their free memory
/// in blocks of two streams side by side: counted one by one, stitches grew 450-500 MiB
/// for each (1.165); with runs down to a 128th alone the peak grew 1.077, 1.178, 1.302 of
/// live over three steps; with wide runs grown past the growth budget, 1.053.
#[test]
fn fsdp2_with_checkpointing_holds_its_first_peak_and_completes_at_1_02() {
    let entries = &unsettled_trace("fsdp2_ckpt_rank0.pickle.gz");
    let report = replay_steps(entries, &Config::default(), 3, &mut |_| {}).unwrap();
    let peaks = &report.pass_peak_reserved_bytes;
    let growth = peaks.iter().max().unwrap() - peaks[0];
    assert!(growth <= report.peak_live_bytes / 200, "{peaks:?}");
    assert!(report.ratio() <= 1.03, "ratio {:.4}", report.ratio());
    let config = Config {
        memory_limit: Some(cap_bytes(peak_live_bytes(entries), 1.02)),
        ..Config::default()
    };
    let capped = replay_steps(entries, &config, 3, &mut |_| {}).unwrap();
    assert_eq!(capped.last_step_device_syncs, 0, "{capped:?}");
}

/// The goal for it, as for the repository's other traces: nothing mapped, unmapped,
/// stitched or synchronised in its third step, with and without a limit of 1.02 times its
/// live peak, and at most 1.10 of that peak reserved. Today its third step makes 31 second
/// mappings, maps 2 pages and unmaps one (1.021 of its live peak); under the limit 27,
/// with a page mapped and 2 unmapped.
#[test]
#[ignore = "not yet steady: docs/design.md, \"What is not yet steady\""]
fn fsdp2_with_checkpointing_settles() {
    let entries = &unsettled_trace("fsdp2_ckpt_rank0.pickle.gz");
    let limit = cap_bytes(peak_live_bytes(entries), 1.02);
    for memory_limit in [None, Some(limit)] {
        let config = Config {
            memory_limit,
            ..Config::default()
        };
        let report = replay_steps(entries, &config, 3, &mut |_| {}).unwrap();
        assert_eq!(
            report.pass_driver_work.last(),
            Some(&DriverWork::default()),
            "under {memory_limit:?}: {report:?}"
        );
        assert!(report.ratio() <= 1.10, "ratio {:.4}", report.ratio());
    }
}

/// A whole run of one rank (`tests/data/whole_runs/`), from before its model was built:
/// two warm-up steps and ten timed ones, the optimizer's state allocated among the first
/// step's freed activations as on the device (recorded under PyTorch's expandable segments
/// by `DIST_SNAPSHOT_FROM=start DIST_SNAPSHOT=OUT/ROW DIST_WARMUP=2 DIST_STEPS=10 torchrun
/// --standalone --nproc-per-node=1 benches/gpu/dist/workloads.py --worker ROW
/// pt_expandable OUT/run`). Replayed once: such a trace's lasting allocations are made
/// once.
fn whole_run_trace(name: &str) -> Vec<streamalloc_allocator::trace::TraceEntry> {
    data_trace("whole_runs", name)
}

/// Whole FSDP2 runs reserve what the GPU measured for the same runs (1 × H200, the same
/// steps): within 1.05 of their live peak with checkpointing (1.039 replayed, 1.034 on the
/// device) and 1.03 without (1.019, 1.017), and both complete under a limit of 1.02 times
/// that peak. While a stitch grew its wide runs' shortfall past the growth budget, the
/// checkpointing run reserved 1.122 (1.120 on the device): its logits, met again at longer
/// sequences in steps 9 and 11, found free runs that a narrower stitch would have covered.
#[test]
fn whole_fsdp2_runs_reserve_what_the_device_measured() {
    for (name, most) in [
        ("fsdp2_ckpt_rank0.pickle.gz", 1.05),
        ("fsdp2_gpt2_rank0.pickle.gz", 1.03),
    ] {
        let entries = &whole_run_trace(name);
        let report = replay_steps(entries, &Config::default(), 1, &mut |_| {}).unwrap();
        assert!(
            report.ratio() <= most,
            "{name}: ratio {:.4}",
            report.ratio()
        );
        let config = Config {
            memory_limit: Some(cap_bytes(peak_live_bytes(entries), 1.02)),
            ..Config::default()
        };
        replay_steps(entries, &config, 1, &mut |_| {}).unwrap();
    }
}
