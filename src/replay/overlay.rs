//! A device of a recorded snapshot replayed through streamalloc, as the overlay that
//! `view --replay` and `plot --replay` draw over the recorded timeline
//! ([`streamalloc_viz::overlay`]).
//!
//! The comparison must be like for like. A PyTorch snapshot's trace usually begins after
//! the model's weights were allocated, and the recorded reserved memory counts their
//! segments; so the blocks the timeline finds live before the first event are allocated
//! first, on their recorded streams, and the replay's reserved memory counts them too.
//! Event `i` of the device's trace is event `i` of the overlay, markers included, so the
//! page and the plotter draw both on one x axis.
//!
//! A replay is a stage built from the snapshot like the viewer's data and the plot, so it
//! is charged to the file's memory budget ([`streamalloc_viz::limits::Budget`]): the
//! timeline and the replayed entries while it runs, the engine's bookkeeping and the
//! replay's maps per block live at once and per page reserved, and the overlay's points for
//! as long as they are kept. A snapshot whose replay the budget cannot afford is one line, never an abort.

use super::report::ReplayError;
use super::series::{cap_highest, lowest_completing_cap, replay_series, CapProgress};
use streamalloc_allocator::config::Config;
use streamalloc_allocator::trace::{TraceAction, TraceEntry};
use streamalloc_allocator::types::{DevicePtr, StreamId};
use streamalloc_viz::limits::{Budget, OverBudget};
use streamalloc_viz::model::{DeviceSnapshot, Snapshot};
use streamalloc_viz::overlay::{Cap, CapOutcome, Recorded, ReplayOverlay, SeriesBuilder};
use streamalloc_viz::timeline::{Counter, Timeline};

/// What the budget calls replaying a snapshot for its overlay.
pub const REPLAY_STAGE: &str = "replaying the trace";

/// What one block live at once costs while replaying: the engine's block records, its
/// address map and free lists, and the replay's maps of live blocks and pending frees.
/// Measured at about 200 bytes (300,000 live blocks on the simulator); charged with a
/// margin, since the engine's memory is not counted allocation by allocation.
pub const REPLAY_BYTES_PER_LIVE_BLOCK: u64 = 256;
/// What one page of reserved memory costs while replaying (the engine's and the
/// simulator's records of a mapped page): measured at about 190 bytes per 2 MiB page.
pub const REPLAY_BYTES_PER_PAGE: u64 = 256;
/// The page the replay's engine maps.
const REPLAY_PAGE_BYTES: u64 = 2 << 20;

/// Why [`replay_overlay_within`] made no overlay.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// The engine refused a recorded request.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The file's memory budget cannot afford the replay.
    #[error("{0}")]
    OverBudget(OverBudget),
}

impl From<OverBudget> for OverlayError {
    fn from(over: OverBudget) -> Self {
        OverlayError::OverBudget(over)
    }
}

/// Where [`replay_overlay`] is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OverlayProgress {
    /// The replay that draws the line: `done` of `events` events.
    Series {
        /// Events replayed so far.
        done: usize,
        /// Events in all.
        events: usize,
    },
    /// The search for the lowest cap under which the replay completes.
    Cap(CapProgress),
}

/// What to replay for `device`: an `alloc` for each block live before its first event
/// (from `timeline`, on its recorded stream), then every event of its trace. Returns the
/// entries and how many came before the trace's own.
pub fn entries_with_earlier_blocks(
    device: &DeviceSnapshot,
    timeline: &Timeline,
) -> (Vec<TraceEntry>, usize) {
    let mut entries: Vec<TraceEntry> = timeline
        .allocs
        .iter()
        .filter(|a| a.start.is_none())
        .map(|a| TraceEntry {
            action: TraceAction::Alloc,
            addr: DevicePtr(a.addr),
            size: a.size,
            stream: StreamId(timeline.streams[a.stream as usize]),
            time_ns: 0,
        })
        .collect();
    let earlier = entries.len();
    entries.extend(device.trace.iter().map(|e| TraceEntry {
        action: e.action,
        addr: DevicePtr(e.addr),
        size: e.size,
        stream: StreamId(e.stream),
        time_ns: e.time_ns,
    }));
    (entries, earlier)
}

/// Replays `device` of `snapshot` through streamalloc configured by `config`: the reserved
/// bytes after every event, downsampled for drawing, beside the recorded peaks; with
/// `search_cap`, also the lowest cap (1.000 to 1.500 times peak live, in steps of 0.005)
/// under which the replay completes (up to 8 more replays).
pub fn replay_overlay(
    snapshot: &Snapshot,
    device: &DeviceSnapshot,
    config: &Config,
    search_cap: bool,
    progress: &mut dyn FnMut(OverlayProgress),
) -> Result<ReplayOverlay, ReplayError> {
    let mut unlimited = Budget::default();
    match replay_overlay_within(
        snapshot,
        device,
        config,
        search_cap,
        &mut unlimited,
        progress,
    ) {
        Ok(overlay) => Ok(overlay),
        Err(OverlayError::Replay(err)) => Err(err),
        Err(OverlayError::OverBudget(_)) => unreachable!("an unlimited budget never runs out"),
    }
}

/// The most blocks the timeline has live at once, those from before the trace included:
/// what the replay holds at its fullest. Charges its per-event table to `budget` while it
/// counts.
fn most_blocks_live(timeline: &Timeline, budget: &mut Budget) -> Result<u64, OverBudget> {
    let n = timeline.len();
    let table = (4 * (n + 1)) as u64;
    budget.charge_for(REPLAY_STAGE, table)?;
    let mut change = vec![0i32; n + 1];
    let mut live = 0i64;
    for a in &timeline.allocs {
        match a.start {
            Some(at) => change[at as usize] += 1,
            None => live += 1,
        }
        if let Some(at) = a.end {
            change[at as usize] -= 1;
        }
    }
    let mut most = live;
    for d in change {
        live += i64::from(d);
        most = most.max(live);
    }
    budget.release(table);
    Ok(most.max(0) as u64)
}

/// [`replay_overlay`], charging what it builds to `budget`: while it runs, the timeline, the
/// replayed entries, [`REPLAY_BYTES_PER_LIVE_BLOCK`] per block live at once and
/// [`REPLAY_BYTES_PER_PAGE`] per 2 MiB page it may reserve (given back at the end); the
/// overlay's points stay charged. A replay the budget cannot afford is
/// [`OverlayError::OverBudget`] before it runs.
pub fn replay_overlay_within(
    snapshot: &Snapshot,
    device: &DeviceSnapshot,
    config: &Config,
    search_cap: bool,
    budget: &mut Budget,
    progress: &mut dyn FnMut(OverlayProgress),
) -> Result<ReplayOverlay, OverlayError> {
    let mut transient = 0u64;
    let made = replay_charged(
        snapshot,
        device,
        config,
        search_cap,
        budget,
        &mut transient,
        progress,
    );
    budget.release(transient);
    made
}

/// Charges what replaying `device` (timeline `timeline`) builds: the entries, the table of
/// frees at request and the engine's and the replay's bookkeeping while it runs (added to
/// `transient`), and the overlay's points, which stay.
fn charge_replay(
    device: &DeviceSnapshot,
    timeline: &Timeline,
    budget: &mut Budget,
    transient: &mut u64,
) -> Result<(), OverBudget> {
    let most_live = most_blocks_live(timeline, budget)?;
    let earlier = timeline.allocs.iter().filter(|a| a.start.is_none()).count();
    let entries = earlier + device.trace.len();
    // Pages: what the replay may reserve, the recording's peak or the cap search's
    // highest cap, whichever is more.
    let peak = |k: Counter| timeline.peak(k).map_or(0, |(_, v)| v);
    let reserved = peak(Counter::Reserved)
        .max(peak(Counter::Active).saturating_add(peak(Counter::Active) / 2));
    let pages = reserved.div_ceil(REPLAY_PAGE_BYTES);
    // The entries, one flag each for the frees at request, the blocks live at once, pages.
    let replaying = (entries * (size_of::<TraceEntry>() + 1)) as u64
        + most_live.saturating_mul(REPLAY_BYTES_PER_LIVE_BLOCK)
        + pages.saturating_mul(REPLAY_BYTES_PER_PAGE);
    budget.charge_for(REPLAY_STAGE, replaying)?;
    *transient += replaying;
    budget.charge_for(
        REPLAY_STAGE,
        SeriesBuilder::points_bytes(device.trace.len() as u64),
    )
}

fn replay_charged(
    snapshot: &Snapshot,
    device: &DeviceSnapshot,
    config: &Config,
    search_cap: bool,
    budget: &mut Budget,
    transient: &mut u64,
    progress: &mut dyn FnMut(OverlayProgress),
) -> Result<ReplayOverlay, OverlayError> {
    let before = budget.used();
    let timeline = Timeline::build_within(device, budget)?;
    let timeline_bytes = budget.used() - before;
    charge_replay(device, &timeline, budget, transient)?;
    let recorded = Recorded {
        by: match snapshot.source.as_str() {
            "pytorch" => "PyTorch",
            "streamalloc" => "streamalloc",
            _ => "recorded",
        }
        .to_string(),
        peak_reserved: timeline.peak(Counter::Reserved).map_or(0, |(_, v)| v),
        peak_live: timeline.peak(Counter::Active).map_or(0, |(_, v)| v),
        segment_events: device.trace.iter().any(|e| {
            matches!(
                e.action,
                TraceAction::SegmentAlloc | TraceAction::SegmentMap
            )
        }),
    };
    // The timeline goes before the replay runs, and what it held with it.
    let (entries, earlier) = entries_with_earlier_blocks(device, &timeline);
    drop(timeline);
    budget.release(timeline_bytes);
    let events = entries.len();
    let mut initial = 0;
    let mut series: Option<SeriesBuilder> = None;
    let mut observe = |index: usize, sample: super::series::Sample| {
        if index + 1 < earlier {
            return;
        }
        if index + 1 == earlier {
            initial = sample.reserved;
            return;
        }
        series
            .get_or_insert_with(|| SeriesBuilder::new((events - earlier) as u64, initial))
            .push(sample.reserved);
    };
    replay_series(&entries, config, &mut observe, &mut |done| {
        progress(OverlayProgress::Series { done, events })
    })?;
    let series = series.unwrap_or_else(|| SeriesBuilder::new(0, initial));
    let outcome = if search_cap {
        let search = lowest_completing_cap(&entries, config, recorded.peak_live, &mut |step| {
            progress(OverlayProgress::Cap(step))
        });
        CapOutcome::Searched {
            lowest: search
                .ratio
                .zip(search.bytes)
                .map(|(ratio, bytes)| Cap { ratio, bytes }),
            highest: cap_highest(),
        }
    } else {
        CapOutcome::NotSearched
    };
    Ok(ReplayOverlay::new(
        recorded,
        series,
        outcome,
        config.to_conf_string(),
    ))
}
