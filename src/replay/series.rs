//! The replay over time: streamalloc's reserved and live bytes after each event of a
//! recorded trace, and the lowest memory cap under which the replay still completes.
//!
//! [`super::run`] answers "what peak would streamalloc reach on this trace?"; a user
//! looking at their own PyTorch timeline also wants to see *where* the two allocators
//! differ, and how little memory streamalloc could be given. [`replay_series`] runs the
//! same pass over the trace as [`replay_steps`]' first (a property test holds the two to
//! the same peaks) and reports the figures after every event; [`lowest_completing_cap`]
//! bisects [`replay_steps`] under `memory_limit` caps.

use super::report::ReplayError;
use super::run::{replay_steps, Pass, REPLAY_DEVICE_BYTES};
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::config::Config;
use streamalloc_allocator::trace::TraceEntry;
use streamalloc_allocator::Allocator;

/// What the replay holds after one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Bytes streamalloc has reserved from the (simulated) device.
    pub reserved: u64,
    /// Recorded sizes of the blocks live in the replay.
    pub live: u64,
}

/// Replays `events` once through a fresh allocator configured by `config`, as
/// [`replay_steps`] does with one step, and calls `observe(i, sample)` after event `i`
/// (every event, markers and segment events included, so that `i` is the event's index
/// in `events`). `progress` is called now and then with the number of events done.
pub fn replay_series(
    events: &[TraceEntry],
    config: &Config,
    observe: &mut dyn FnMut(usize, Sample),
    progress: &mut dyn FnMut(usize),
) -> Result<(), ReplayError> {
    let allocator =
        Allocator::new(SimBackend::new(REPLAY_DEVICE_BYTES), config.clone()).map_err(|source| {
            ReplayError::Alloc {
                index: 0,
                action: "create",
                size: 0,
                source,
            }
        })?;
    Pass::new(events.len() as u64).run(&allocator, events, true, progress, &mut |index, live| {
        let reserved = allocator.stats().reserved_bytes.current;
        observe(index, Sample { reserved, live });
    })
}

/// The caps [`lowest_completing_cap`] tries: `CAP_LOWEST + k * CAP_STEP` times peak live,
/// for `k` in `0..=CAP_STEPS`.
pub const CAP_LOWEST: f64 = 1.0;
/// The step between two caps tried, as a fraction of peak live.
pub const CAP_STEP: f64 = 0.005;
/// The number of steps from the lowest cap to the highest (1.50 times peak live).
pub const CAP_STEPS: u32 = 100;

/// The highest cap tried, as a multiple of peak live.
pub fn cap_highest() -> f64 {
    cap_ratio(CAP_STEPS)
}

fn cap_ratio(step: u32) -> f64 {
    CAP_LOWEST + f64::from(step) * CAP_STEP
}

/// The cap of `ratio` times `peak_live`, in bytes, rounded up.
pub fn cap_bytes(peak_live: u64, ratio: f64) -> u64 {
    (peak_live as f64 * ratio).ceil() as u64
}

/// Where [`lowest_completing_cap`] is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CapProgress {
    /// Replaying under a cap of `ratio` times peak live: `done` of `events` events.
    Replaying {
        /// The cap tried, as a multiple of peak live.
        ratio: f64,
        /// Events replayed so far.
        done: usize,
        /// Events in all.
        events: usize,
        /// Which replay this is, from 1.
        probe: u32,
        /// The most replays the search can take.
        probes_at_most: u32,
    },
    /// The replay under a cap of `ratio` times peak live completed, or ran out of memory.
    Tried {
        /// The cap tried, as a multiple of peak live.
        ratio: f64,
        /// Whether every request was served within the cap.
        completed: bool,
    },
}

/// The outcome of [`lowest_completing_cap`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CapSearch {
    /// The lowest cap tried under which the replay completes, as a multiple of peak live;
    /// `None` when it does not complete even at [`cap_highest`].
    pub ratio: Option<f64>,
    /// That cap in bytes.
    pub bytes: Option<u64>,
    /// Replays run.
    pub probes: u32,
}

/// The lowest cap, among `CAP_LOWEST + k * CAP_STEP` times `peak_live` (1.000, 1.005, ...,
/// 1.500), under which replaying `events` with `config` (its `memory_limit` replaced by the
/// cap) completes. Bisection: it assumes that a replay completing under one cap completes
/// under every larger one, and takes at most 8 replays. A replay that fails for any reason
/// other than running out of memory under the cap counts as not completing.
pub fn lowest_completing_cap(
    events: &[TraceEntry],
    config: &Config,
    peak_live: u64,
    progress: &mut dyn FnMut(CapProgress),
) -> CapSearch {
    // The first replay tries the highest cap; then each halves the steps left.
    let probes_at_most = 1 + (u32::BITS - CAP_STEPS.leading_zeros());
    let mut probes = 0;
    let mut completes = |step: u32| {
        probes += 1;
        let ratio = cap_ratio(step);
        let capped = Config {
            memory_limit: Some(cap_bytes(peak_live, ratio).max(1)),
            ..config.clone()
        };
        let probe = probes;
        let mut replaying = |done| {
            progress(CapProgress::Replaying {
                ratio,
                done,
                events: events.len(),
                probe,
                probes_at_most,
            })
        };
        let completed = replay_steps(events, &capped, 1, &mut replaying).is_ok();
        progress(CapProgress::Tried { ratio, completed });
        completed
    };
    if !completes(CAP_STEPS) {
        return CapSearch {
            ratio: None,
            bytes: None,
            probes,
        };
    }
    // Invariant: the step `high` completes; every step at or below `low` that was tried
    // failed (`low` is `None` while none was).
    let (mut low, mut high): (Option<u32>, u32) = (None, CAP_STEPS);
    loop {
        let bottom = low.map_or(0, |l| l + 1);
        if bottom >= high {
            break;
        }
        let middle = bottom + (high - bottom) / 2;
        if completes(middle) {
            high = middle;
        } else {
            low = Some(middle);
        }
    }
    let ratio = cap_ratio(high);
    CapSearch {
        ratio: Some(ratio),
        bytes: Some(cap_bytes(peak_live, ratio)),
        probes,
    }
}
