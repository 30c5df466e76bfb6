//! `--replay` of `view` and `plot`: each shown device of a snapshot replayed through
//! streamalloc on the simulated device, drawn over the recorded timeline, with its figures
//! printed on stdout too (so a terminal answers "what would streamalloc save?" without the
//! picture).
//!
//! A replay and the search for the lowest cap take up to nine passes over the trace, which
//! for a trace of millions of events is a minute: a progress bar on a terminal, a line per
//! pass elsewhere for traces of [`PROGRESS_MIN_EVENTS`] events or more.

use super::out::{errln, outln};
use super::CliError;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use streamalloc::replay::{replay_overlay_within, CapProgress, OverlayError, OverlayProgress};
use streamalloc_allocator::Config;
use streamalloc_viz::limits::Budget;
use streamalloc_viz::model::{DeviceSnapshot, Snapshot};
use streamalloc_viz::overlay::ReplayOverlay;

/// Traces with at least this many events report progress when stderr is not a terminal.
const PROGRESS_MIN_EVENTS: usize = 100_000;

/// The replay options of `view` and `plot`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ReplayOverlayArgs {
    /// Replay the recorded allocations through streamalloc on the simulated device (no
    /// GPU) and draw its reserved memory over the recording: the recorded reserved memory,
    /// streamalloc's and the live memory, with each peak, the saving, and the lowest
    /// memory cap under which the replay still completes (searched from 1.000 to 1.500
    /// times peak live, in steps of 0.005).
    #[arg(long)]
    pub(crate) replay: bool,
    /// Allocator configuration of the replay (`key:value,...`); overrides
    /// STREAMALLOC_CONF.
    #[arg(long, requires = "replay", value_name = "KEY:VALUE,...")]
    pub(crate) conf: Option<String>,
}

impl ReplayOverlayArgs {
    /// The replay's configuration, when `--replay` was given (checked before any file is
    /// read, so a bad `--conf` costs nothing).
    pub(crate) fn config(&self) -> Result<Option<Config>, CliError> {
        if !self.replay {
            return Ok(None);
        }
        super::replay::config_from(self.conf.as_deref()).map(Some)
    }
}

/// Replays `device` of `snapshot` (named `name`) under `config`: the overlay to draw.
/// What the replay builds is charged to `budget`, the file's: a replay it cannot afford
/// is one line naming the file, before the replay runs.
pub(crate) fn replay_device(
    name: &str,
    snapshot: &Snapshot,
    device: &DeviceSnapshot,
    config: &Config,
    budget: &mut Budget,
) -> Result<ReplayOverlay, CliError> {
    let what = format!("{name} cuda:{}", device.device);
    let events = device.trace.len();
    let mut shown = Shown::new(&what, events);
    let made = replay_overlay_within(snapshot, device, config, true, budget, &mut |step| {
        shown.update(step)
    });
    let mut overlay = match made {
        Ok(overlay) => overlay,
        Err(OverlayError::OverBudget(over)) => {
            shown.finish();
            return Err(streamalloc_viz::VizError::Limit {
                path: name.into(),
                what: over.to_string(),
            }
            .into());
        }
        Err(OverlayError::Replay(err)) => {
            shown.finish();
            return Err(CliError::Message(format!(
                "{what}: the replay failed: {err}"
            )));
        }
    };
    shown.finish();
    overlay.config = super::every_config_key(config);
    Ok(overlay)
}

/// Prints the figures of `overlay`, the replay of device `device` of `name`.
pub(crate) fn print_figures(
    name: &str,
    device: u32,
    overlay: &ReplayOverlay,
) -> Result<(), CliError> {
    let legend = &overlay.legend;
    outln!(
        "{name} cuda:{device}, {} events replayed through streamalloc ({}):",
        overlay.events,
        overlay.config
    )?;
    for line in [
        &legend.recorded,
        &legend.replayed,
        &legend.live,
        &legend.saving,
        &legend.cap,
    ] {
        if !line.is_empty() {
            outln!("  {line}")?;
        }
    }
    Ok(())
}

/// Progress of one device's replays on stderr.
struct Shown<'a> {
    what: &'a str,
    bar: Option<ProgressBar>,
    /// Lines rather than a bar (stderr is not a terminal, the trace is long).
    lines: bool,
    /// Events to replay, said in the first line once the replay starts (not before: a
    /// replay its budget refuses says only that).
    events: usize,
}

impl<'a> Shown<'a> {
    fn new(what: &'a str, events: usize) -> Shown<'a> {
        let terminal = std::io::stderr().is_terminal();
        let bar = terminal.then(|| {
            let bar = ProgressBar::new(events as u64);
            if let Ok(style) = ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} events") {
                bar.set_style(style);
            }
            bar.set_message(format!("{what}: replaying"));
            bar
        });
        let lines = !terminal && events >= PROGRESS_MIN_EVENTS;
        Shown {
            what,
            bar,
            lines,
            events,
        }
    }

    fn update(&mut self, step: OverlayProgress) {
        match step {
            OverlayProgress::Series { done, .. } => {
                if self.lines && done == 0 {
                    errln!(
                        "{}: replaying {} events through streamalloc...",
                        self.what,
                        self.events
                    );
                }
                if let Some(bar) = &self.bar {
                    bar.set_position(done as u64);
                }
            }
            OverlayProgress::Cap(CapProgress::Replaying {
                ratio,
                done,
                probe,
                probes_at_most,
                ..
            }) => {
                if let Some(bar) = &self.bar {
                    if done == 0 {
                        bar.set_message(format!(
                            "{}: lowest cap, replay {probe} of at most {probes_at_most} \
                             ({ratio:.3} x peak live)",
                            self.what
                        ));
                    }
                    bar.set_position(done as u64);
                }
            }
            OverlayProgress::Cap(CapProgress::Tried { ratio, completed }) => {
                if self.lines {
                    errln!(
                        "{}: capped at {ratio:.3} x peak live, the replay {}",
                        self.what,
                        if completed {
                            "completes"
                        } else {
                            "runs out of memory"
                        }
                    );
                }
            }
        }
    }

    fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
