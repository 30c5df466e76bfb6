//! `streamalloc replay TRACE...`: replays recorded allocation traces through the engine on
//! the simulated device and prints, per trace, our peak reserved memory beside the
//! recording allocator's, both against peak live bytes. Needs no GPU.
//!
//! Every file is read before anything is printed: a file that cannot be read gets one line
//! on stderr naming it and the problem, the other traces still run, and the exit status is
//! non-zero at the end. The table's columns are as wide as the longest trace name, so rows
//! stay aligned.

use super::out::{errln, outln};
use super::CliError;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use streamalloc::replay::{
    cap_bytes, load_traces, peak_live_bytes, replay_on_device, DriverWork, LoadedTrace, Pacing,
    ReplayReport, REPLAY_DEVICE_BYTES,
};
use streamalloc_allocator::backend::sim::PAGE_SIZE as DEVICE_PAGE_BYTES;
use streamalloc_allocator::Config;

/// What `replay --help` says each figure means.
const COUNTERS_HELP: &str = "\
Columns of the table:
  trace        the file's name, with [device N] when it holds several devices
  allocs       allocations replayed (over all --steps)
  peak live    the most bytes in live blocks at once: what the program needed
  ours         streamalloc's peak reserved memory, replayed on the simulated device
  native       the recording allocator's peak reserved memory, rebuilt from the trace's
               segment events (n/a: the trace has none, e.g. recording began after warm-up)
  ours/live    ours over peak live (1.000: no memory held beyond what was live)
  native/live  native over peak live
  ns/op        host nanoseconds per replayed malloc or free, engine calls only

Under each row:
  page maps, page unmaps    ranges of physical pages mapped into, or unmapped from,
                            expandable segments (expandable_segments:true)
  device syncs              device-wide synchronisations the allocator made (each stalls
                            the host on a real GPU)
  segment allocs/frees      whole segments obtained and returned (expandable_segments:false)
  stitched ranges made      requests no free block fitted, served by mapping free pages
                            of several holes a second time into one range (stitch:true;
                            no memory added)
  reused                    stitched ranges kept after their free and taken again by a
                            later request without mapping anything
  last of N steps           the same counters for the final pass alone (--steps N): page
                            maps there mean the allocator still remaps in a steady state
  peak reserved of each     our peak reserved within each pass (--steps N): figures that
    step                    keep rising are memory growing from one step to the next
  steps with driver calls   the passes that mapped, unmapped or stitched pages or
                            synchronised, and the step from which none did (settled)
  frees ... ignored         frees of blocks allocated before recording began
  recording began after...  native is below peak live: the program had reserved memory
                            before recording, so where its lasting blocks lay (the model,
                            the optimizer's state) is not replayed

The configuration line lists every key (STREAMALLOC_CONF or --conf over the defaults);
with --limit-ratio R, each trace's memory_limit is R times its own peak live bytes.";

/// Arguments of `streamalloc replay`.
#[derive(Args, Debug)]
#[command(after_long_help = COUNTERS_HELP)]
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
    /// Replay each trace under a memory limit of R times its peak live bytes (its own
    /// figure, read before replaying), replacing any `memory_limit` of the configuration:
    /// a row per trace that completes, or a line naming the event where it ran out of
    /// memory. Exits 1 if any trace does not complete.
    #[arg(long, value_name = "R", value_parser = parse_limit_ratio)]
    limit_ratio: Option<f64>,
    /// Replay each trace on a simulated device of R times its peak live bytes (rounded up
    /// to whole 2 MiB pages), with no memory limit set: a cap the allocator is not told of,
    /// as when another process holds the rest of a GPU. The allocator meets only the
    /// device's refusals and what it says it has free. Rows and exit status as with
    /// --limit-ratio.
    #[arg(long, value_name = "R", value_parser = parse_limit_ratio, conflicts_with = "limit_ratio")]
    device_ratio: Option<f64>,
    /// Pace the replay as a GPU run: the simulated host clock follows the trace's own
    /// timestamps, and each physical allocation a driver call creates, maps (a second time
    /// too) or unmaps takes US microseconds (an H200 takes 40-70 to map one, 20-30 to
    /// unmap: `benches/gpu/vmm_cost/vmm_cost.py` measures them), so that remapping's share
    /// of time is weighed as on the device. Without it, time stands still.
    #[arg(long, value_name = "US", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    driver_call_us: Option<u32>,
}

/// A `--limit-ratio`: a finite number of at least 1 (below 1 no trace can complete).
fn parse_limit_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (1.0..=1e6).contains(&ratio) => Ok(ratio),
        Ok(_) => Err(format!(
            "{text} is not a ratio from 1 to 1000000 (times peak live)"
        )),
        Err(_) => Err(format!("{text} is not a number")),
    }
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

/// The configuration of a replay: `--conf` over the defaults, else `STREAMALLOC_CONF`.
/// Errors in `--conf` are blamed on the flag (the environment variable was not read).
pub(crate) fn config_from(conf: Option<&str>) -> Result<Config, CliError> {
    match conf {
        Some(text) => Config::parse(text).map_err(|err| CliError::Message(err.describe("--conf"))),
        None => Ok(Config::from_env()?),
    }
}

pub(crate) fn run(args: ReplayArgs) -> Result<ExitCode, CliError> {
    let config = config_from(args.conf.as_deref())?;
    // Every file first, so that a bad one is reported before the table starts. Unreadable
    // input exits 2 like every other command's input errors; a trace that loads but fails
    // in the engine exits 1.
    let mut unreadable = false;
    let mut traces: Vec<LoadedTrace> = Vec::new();
    for path in &args.traces {
        match load_traces(path) {
            Ok(loaded) => traces.extend(loaded),
            Err(err) => {
                errln!("streamalloc replay: {err}");
                unreadable = true;
            }
        }
    }
    let table = Table::new(traces.iter().map(|t| t.name.as_str()));
    if !args.json && !traces.is_empty() {
        outln!("configuration: {}", super::every_config_key(&config))?;
        if let Some(ratio) = args.limit_ratio {
            outln!("memory_limit: {ratio} x each trace's own peak live bytes")?;
        }
        if let Some(ratio) = args.device_ratio {
            outln!("device memory: {ratio} x each trace's own peak live bytes, no limit set")?;
        }
        outln!("{}", table.header())?;
    }
    let pacing = match args.driver_call_us {
        Some(us) => Pacing::Recorded {
            driver_call_ns: u64::from(us) * 1000,
        },
        None => Pacing::Still,
    };
    let mut failed = false;
    for trace in traces {
        let bar = progress_bar(trace.entries.len() * args.steps as usize);
        let mut progress = |done: usize| {
            if let Some(bar) = &bar {
                bar.set_position(done as u64);
            }
        };
        // A cap, of the allocator or of the device, is a multiple of the trace's own peak.
        let cap = |ratio: f64| cap_bytes(peak_live_bytes(&trace.entries), ratio).max(1);
        let capped;
        let config = match args.limit_ratio {
            Some(ratio) => {
                let limit = cap(ratio);
                capped = Config {
                    memory_limit: Some(limit),
                    ..config.clone()
                };
                &capped
            }
            None => &config,
        };
        let device_bytes = match args.device_ratio {
            Some(ratio) => cap(ratio).next_multiple_of(DEVICE_PAGE_BYTES),
            None => REPLAY_DEVICE_BYTES,
        };
        let result = replay_on_device(
            &trace.entries,
            config,
            args.steps as usize,
            pacing,
            device_bytes,
            &mut progress,
        );
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        let report = match result {
            Ok(report) => report,
            Err(err) => {
                match (args.limit_ratio, args.device_ratio) {
                    (Some(ratio), _) => errln!(
                        "streamalloc replay: {}: does not complete under {ratio} x peak live: {err}",
                        trace.name
                    ),
                    (_, Some(ratio)) => errln!(
                        "streamalloc replay: {}: does not complete on a device of {ratio} x peak live: {err}",
                        trace.name
                    ),
                    (None, None) => errln!("streamalloc replay: {}: {err}", trace.name),
                }
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
                config: super::every_config_key(config),
            };
            let line = serde_json::to_string(&row).map_err(|e| CliError::Message(e.to_string()))?;
            outln!("{line}")?;
        } else {
            table.print_row(&trace.name, &report)?;
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

/// The table's layout: the name column fits the longest name.
struct Table {
    name_width: usize,
}

impl Table {
    fn new<'a>(names: impl Iterator<Item = &'a str>) -> Table {
        let longest = names.map(|n| n.chars().count()).max().unwrap_or(0);
        Table {
            name_width: longest.max("trace".len()),
        }
    }

    fn header(&self) -> String {
        format!(
            "{:<w$}  {:>8} {:>13} {:>13} {:>13} {:>9} {:>11} {:>8}",
            "trace",
            "allocs",
            "peak live",
            "ours",
            "native",
            "ours/live",
            "native/live",
            "ns/op",
            w = self.name_width
        )
    }

    fn print_row(&self, name: &str, report: &ReplayReport) -> Result<(), CliError> {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
        // A trace without segment events says nothing of what its allocator reserved: no
        // figure rather than a zero.
        let recorded_segments = report.native_peak_reserved_bytes > 0;
        let (native, native_ratio) = if recorded_segments {
            (
                mib(report.native_peak_reserved_bytes),
                format!("{:.3}", report.native_ratio()),
            )
        } else {
            ("n/a".to_string(), "n/a".to_string())
        };
        // Padded by characters, as the header was measured.
        let pad = self.name_width.saturating_sub(name.chars().count());
        outln!(
            "{name}{:pad$}  {:>8} {:>13} {:>13} {:>13} {:>9.3} {:>11} {:>8.0}",
            "",
            report.allocs,
            mib(report.peak_live_bytes),
            mib(report.peak_reserved_bytes),
            native,
            report.ratio(),
            native_ratio,
            report.ns_per_op
        )?;
        if !recorded_segments {
            outln!("  native: n/a (the trace has no segment events of the recording allocator)")?;
        } else if report.native_peak_reserved_bytes < report.peak_live_bytes {
            // The recording allocator held less than the trace's blocks needed: it had
            // reserved memory before recording began. The replay starts from an empty
            // device, so where that memory's lasting blocks lay is not replayed.
            outln!(
                "  recording began after its program reserved memory (native below peak \
                 live): replayed from an empty device, the figures can differ from the \
                 device's; record from the program's start for a full picture"
            )?;
        }
        outln!(
            "  {} page maps, {} page unmaps, {} device syncs, {} segment allocs/frees, \
             {} stitched ranges made, {} reused, {} driver allocations",
            report.page_maps,
            report.page_unmaps,
            report.device_syncs,
            report.segment_events,
            report.stitches,
            report.stitch_revivals,
            report.driver_allocations
        )?;
        if report.steps > 1 {
            outln!(
                "  last of {} steps: {} page maps ({}), {} page unmaps ({}), {} device syncs, \
                 {} stitch maps ({} new stitches), {} driver allocations",
                report.steps,
                report.last_step_page_maps,
                mib(report.last_step_page_map_bytes),
                report.last_step_page_unmaps,
                mib(report.last_step_page_unmap_bytes),
                report.last_step_device_syncs,
                report.last_step_stitch_maps,
                report.last_step_stitches,
                report.last_step_driver_allocations
            )?;
            let peaks: Vec<String> = report
                .pass_peak_reserved_bytes
                .iter()
                .map(|&b| format!("{:.0}", b as f64 / (1u64 << 20) as f64))
                .collect();
            outln!("  peak reserved of each step: {} MiB", peaks.join(", "))?;
            outln!("  {}", settling(&report.pass_driver_work))?;
        }
        if report.unknown_frees > 0 {
            outln!(
                "  {} frees of blocks allocated before recording began were ignored",
                report.unknown_frees
            )?;
        }
        Ok(())
    }
}

/// Which steps asked the driver for anything (page maps or unmaps, stitch maps,
/// synchronisations), as ranges of step numbers from 1, and from which step on none did.
fn settling(work: &[DriverWork]) -> String {
    let busy: Vec<usize> = (1..=work.len())
        .filter(|&step| !work[step - 1].is_none())
        .collect();
    let Some(&last) = busy.last() else {
        return "no step made a driver call".to_string();
    };
    // Consecutive steps joined into spans: 1, 2, 3, 6 -> 1-3, 6.
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for step in busy {
        match spans.last_mut() {
            Some((_, end)) if *end + 1 == step => *end = step,
            _ => spans.push((step, step)),
        }
    }
    let ranges: Vec<String> = spans
        .iter()
        .map(|&(start, end)| {
            if start == end {
                start.to_string()
            } else {
                format!("{start}-{end}")
            }
        })
        .collect();
    let tail = if last == work.len() {
        "still in the last".to_string()
    } else {
        format!("none from step {} on", last + 1)
    };
    format!(
        "steps with driver calls (maps, unmaps, stitch maps, syncs): {}; {tail}",
        ranges.join(", ")
    )
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
