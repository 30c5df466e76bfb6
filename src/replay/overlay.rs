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

use super::run::ReplayError;
use super::series::{cap_highest, lowest_completing_cap, replay_series, CapProgress};
use streamalloc_allocator::config::Config;
use streamalloc_allocator::trace::{TraceAction, TraceEntry};
use streamalloc_allocator::types::{DevicePtr, StreamId};
use streamalloc_viz::model::{DeviceSnapshot, Snapshot};
use streamalloc_viz::overlay::{Cap, CapOutcome, Recorded, ReplayOverlay, SeriesBuilder};
use streamalloc_viz::timeline::{Counter, Timeline};

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
    let timeline = Timeline::build(device);
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
    let (entries, earlier) = entries_with_earlier_blocks(device, &timeline);
    drop(timeline);
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
