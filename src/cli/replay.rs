//! `streamalloc replay TRACE...`: replays recorded allocation traces through the engine on
//! the simulated device and prints, per trace, our peak reserved memory beside the
//! recording allocator's, both against peak live bytes. Needs no GPU.
//!
//! A file that cannot be read gets one line on stderr naming it and the problem; the other
//! traces still run, and the exit status is non-zero at the end.

use super::CliError;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use streamalloc::replay::load_traces;
use streamalloc::replay::{replay_steps, ReplayReport};
use streamalloc_allocator::Config;

/// Arguments of `streamalloc replay`.
#[derive(Args, Debug)]
pub(crate) struct ReplayArgs {
    /// Trace files: PyTorch snapshots (.pickle, .pickle.gz) or streamalloc JSON.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Allocator configuration (`key:value,...`); overrides STREAMALLOC_CONF.
    #[arg(long)]
    conf: Option<String>,
    /// Print one JSON object per trace instead of the table.
    #[arg(long)]
    json: bool,
    /// Replay each trace this many times back to back, as that many training steps, to
    /// see the steady state (the last step's page maps, unmaps and syncs are printed).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    steps: u32,
}

/// Traces with at least this many events get a progress bar (on a terminal).
const PROGRESS_MIN_EVENTS: usize = 100_000;

/// One JSON line of `--json`.
#[derive(serde::Serialize)]
struct JsonRow<'a> {
    trace: &'a str,
    #[serde(flatten)]
    report: &'a ReplayReport,
    ratio: f64,
    native_ratio: f64,
    config: String,
}

pub(crate) fn run(args: ReplayArgs) -> Result<ExitCode, CliError> {
    let config = match &args.conf {
        // Blamed on the flag: the environment variable was not read.
        Some(text) => {
            Config::parse(text).map_err(|err| CliError::Message(err.describe("--conf")))?
        }
        None => Config::from_env()?,
    };
    if !args.json {
        println!("config: {}", config.to_conf_string());
        println!(
            "{:<28} {:>8} {:>13} {:>13} {:>13} {:>7} {:>7} {:>8}",
            "trace", "allocs", "peak live", "ours", "native", "ours/", "native/", "ns/op"
        );
    }
    // Unreadable input exits 2 like every other command's input errors; a trace that
    // loads but fails in the engine exits 1.
    let (mut unreadable, mut failed) = (false, false);
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    for path in &args.traces {
        let traces = match load_traces(path) {
            Ok(traces) => traces,
            Err(err) => {
                eprintln!("streamalloc replay: {err}");
                unreadable = true;
                continue;
            }
        };
        for trace in traces {
            let bar = progress_bar(trace.entries.len() * args.steps as usize);
            let mut progress = |done: usize| {
                if let Some(bar) = &bar {
                    bar.set_position(done as u64);
                }
            };
            let result = replay_steps(&trace.entries, &config, args.steps as usize, &mut progress);
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            let report = match result {
                Ok(report) => report,
                Err(err) => {
                    eprintln!("streamalloc replay: {}: {err}", trace.name);
                    failed = true;
                    continue;
                }
            };
            if args.json {
                let row = JsonRow {
                    trace: &trace.name,
                    report: &report,
                    ratio: report.ratio(),
                    native_ratio: report.native_ratio(),
                    config: config.to_conf_string(),
                };
                println!(
                    "{}",
                    serde_json::to_string(&row).map_err(|e| CliError::Message(e.to_string()))?
                );
            } else {
                // A trace without segment events says nothing of what its allocator
                // reserved: no figure rather than a zero.
                let recorded_segments = report.native_peak_reserved_bytes > 0;
                let (native, native_ratio) = if recorded_segments {
                    (
                        mib(report.native_peak_reserved_bytes),
                        format!("{:.3}", report.native_ratio()),
                    )
                } else {
                    ("n/a".to_string(), "n/a".to_string())
                };
                println!(
                    "{:<28} {:>8} {:>13} {:>13} {:>13} {:>7.3} {:>7} {:>8.0}",
                    trace.name,
                    report.allocs,
                    mib(report.peak_live_bytes),
                    mib(report.peak_reserved_bytes),
                    native,
                    report.ratio(),
                    native_ratio,
                    report.ns_per_op
                );
                if !recorded_segments {
                    println!(
                        "  native: n/a (the trace has no segment events of the recording allocator)"
                    );
                }
                println!(
                    "  {} page maps, {} page unmaps, {} device syncs, {} segment allocs/frees, {} stitches ({} taken again)",
                    report.page_maps,
                    report.page_unmaps,
                    report.device_syncs,
                    report.segment_events,
                    report.stitches,
                    report.stitch_revivals
                );
                if report.steps > 1 {
                    println!(
                        "  last of {} steps: {} page maps ({}), {} page unmaps ({}), {} device syncs, {} stitch maps",
                        report.steps,
                        report.last_step_page_maps,
                        mib(report.last_step_page_map_bytes),
                        report.last_step_page_unmaps,
                        mib(report.last_step_page_unmap_bytes),
                        report.last_step_device_syncs,
                        report.last_step_stitch_maps
                    );
                }
                if report.unknown_frees > 0 {
                    println!(
                        "  {} frees of blocks allocated before recording began were ignored",
                        report.unknown_frees
                    );
                }
            }
        }
    }
    Ok(if unreadable {
        ExitCode::from(2)
    } else if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// A progress bar on stderr for long traces, only when stderr is a terminal.
fn progress_bar(events: usize) -> Option<ProgressBar> {
    if events < PROGRESS_MIN_EVENTS || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(events as u64);
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} events ({eta})") {
        bar.set_style(style);
    }
    Some(bar)
}
