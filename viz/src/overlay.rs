//! The replayed allocator drawn over a recorded timeline: what `view --replay` and
//! `plot --replay` show.
//!
//! A PyTorch user arrives with "how much would streamalloc save on my run?". The answer is
//! one picture: their own recorded timeline, with the recording allocator's reserved
//! memory, the live memory, and the reserved memory streamalloc reaches when the same
//! requests are replayed through it. The replay itself is the `streamalloc` crate's (this
//! crate cannot run the engine's replay); it hands over a [`ReplayOverlay`]: the replayed
//! reserved bytes downsampled to at most [`MAX_POINTS`] points, so that a trace of millions
//! of events costs the page a few hundred kilobytes, and the legend's figures (each peak,
//! the saving, the lowest cap under which the replay completes) worded once here for the
//! page, the SVG and the PNG alike.

use serde::Serialize;

/// The most points an overlay holds, whatever the trace's length.
pub const MAX_POINTS: usize = 65_536;

/// Streamalloc's replayed reserved memory over a recorded trace, with the figures of the
/// legend. Serialised as is for the page (`/api/replay`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayOverlay {
    /// Events of the device's trace: the x axis, as the timeline counts them.
    pub events: u64,
    /// Events per point of [`ReplayOverlay::reserved`] (the last point may cover fewer).
    pub bucket: u64,
    /// Replayed reserved bytes before the first event (blocks allocated before recording
    /// began are allocated first).
    pub initial_reserved: u64,
    /// Per point: the most bytes streamalloc held reserved after any event of its bucket.
    pub reserved: Vec<u64>,
    /// Streamalloc's peak reserved bytes, replayed.
    pub replayed_peak_reserved: u64,
    /// The recording allocator's peak reserved bytes, from the timeline.
    pub recorded_peak_reserved: u64,
    /// Peak live bytes, from the timeline (allocated until `free_completed`).
    pub peak_live: u64,
    /// The recording allocator's name in the legend: "PyTorch" or "streamalloc", else
    /// "recorded".
    pub recorded_by: String,
    /// Whether the recorded reserved memory comes from the trace's segment events, rather
    /// than only from the snapshot's segment list (a trace recorded after warm-up).
    pub recorded_segment_events: bool,
    /// The lowest cap tried under which the replay completes; `None` when none up to
    /// [`ReplayOverlay::cap_highest`] did, or when no cap was searched.
    pub cap: Option<Cap>,
    /// Whether caps were searched at all.
    pub cap_searched: bool,
    /// The highest cap tried, as a multiple of peak live.
    pub cap_highest: f64,
    /// The replay's configuration, every key.
    pub config: String,
    /// The legend's lines, worded once for every picture.
    pub legend: Legend,
}

/// A memory cap under which the replay completes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Cap {
    /// As a multiple of peak live.
    pub ratio: f64,
    /// In bytes.
    pub bytes: u64,
}

/// The text of the legend: one entry per line drawn, then the verdict.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Legend {
    /// The recording allocator's reserved memory and its peak.
    pub recorded: String,
    /// Streamalloc's replayed reserved memory and its peak.
    pub replayed: String,
    /// Live memory and its peak.
    pub live: String,
    /// The saving in GiB and percent (or the excess, should streamalloc reserve more).
    pub saving: String,
    /// The lowest cap under which the replay completes.
    pub cap: String,
}

/// The replayed reserved bytes, taken event by event and kept as the maximum of each
/// bucket of events.
#[derive(Clone, Debug)]
pub struct SeriesBuilder {
    bucket: u64,
    in_bucket: u64,
    points: Vec<u64>,
    initial: u64,
    peak: u64,
    pushed: u64,
}

impl SeriesBuilder {
    /// A builder for a trace of `events` events whose value before the first is `initial`.
    pub fn new(events: u64, initial: u64) -> SeriesBuilder {
        let bucket = events.div_ceil(MAX_POINTS as u64).max(1);
        SeriesBuilder {
            bucket,
            in_bucket: 0,
            points: Vec::with_capacity(events.div_ceil(bucket) as usize),
            initial,
            peak: initial,
            pushed: 0,
        }
    }

    /// The value after the next event.
    pub fn push(&mut self, value: u64) {
        if self.in_bucket == 0 {
            self.points.push(value);
        } else if let Some(last) = self.points.last_mut() {
            *last = (*last).max(value);
        }
        self.in_bucket = (self.in_bucket + 1) % self.bucket;
        self.peak = self.peak.max(value);
        self.pushed += 1;
    }

    /// The highest value pushed (or the initial one).
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// Bytes the points of a builder for `events` events take: what a budget is charged
    /// for the series (at most [`MAX_POINTS`] of 8 bytes, whatever the trace's length).
    pub fn points_bytes(events: u64) -> u64 {
        let bucket = events.div_ceil(MAX_POINTS as u64).max(1);
        events.div_ceil(bucket) * size_of::<u64>() as u64
    }
}

/// What the recording says, for [`ReplayOverlay::new`].
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    /// The recording allocator's name ("PyTorch").
    pub by: String,
    /// Its peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak live bytes.
    pub peak_live: u64,
    /// Whether its reserved bytes come from segment events.
    pub segment_events: bool,
}

/// The outcome of the cap search, for [`ReplayOverlay::new`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CapOutcome {
    /// No cap was searched.
    NotSearched,
    /// The lowest cap that completed; `None` when even the highest (`highest` times peak
    /// live) did not.
    Searched {
        /// The lowest completing cap.
        lowest: Option<Cap>,
        /// The highest cap tried, as a multiple of peak live.
        highest: f64,
    },
}

impl ReplayOverlay {
    /// The overlay of the replayed `series` over what was `recorded`, with the cap search's
    /// `outcome`, for a replay configured as `config` (every key).
    pub fn new(
        recorded: Recorded,
        series: SeriesBuilder,
        outcome: CapOutcome,
        config: String,
    ) -> ReplayOverlay {
        let (cap, cap_searched, cap_highest) = match outcome {
            CapOutcome::NotSearched => (None, false, 0.0),
            CapOutcome::Searched { lowest, highest } => (lowest, true, highest),
        };
        let mut overlay = ReplayOverlay {
            events: series.pushed,
            bucket: series.bucket,
            initial_reserved: series.initial,
            replayed_peak_reserved: series.peak,
            reserved: series.points,
            recorded_peak_reserved: recorded.peak_reserved,
            peak_live: recorded.peak_live,
            recorded_by: recorded.by,
            recorded_segment_events: recorded.segment_events,
            cap,
            cap_searched,
            cap_highest,
            config,
            legend: Legend::default(),
        };
        overlay.legend = overlay.word_legend();
        overlay
    }

    /// The most bytes the overlay's JSON can take (every point at 20 digits and a comma,
    /// every character of its texts escaped at 6 bytes, 1 KiB for the rest): what the
    /// page's copy is charged before it is written.
    pub fn json_bytes_bound(&self) -> usize {
        let l = &self.legend;
        let texts = [
            &self.recorded_by,
            &self.config,
            &l.recorded,
            &l.replayed,
            &l.live,
            &l.saving,
            &l.cap,
        ]
        .iter()
        .map(|t| t.len())
        .sum::<usize>();
        21 * self.reserved.len() + 6 * texts + 1024
    }

    /// Recorded peak reserved minus replayed peak reserved: negative when streamalloc
    /// would reserve more.
    pub fn saving_bytes(&self) -> i128 {
        i128::from(self.recorded_peak_reserved) - i128::from(self.replayed_peak_reserved)
    }

    /// [`ReplayOverlay::saving_bytes`] as a percentage of the recorded peak reserved.
    pub fn saving_percent(&self) -> f64 {
        if self.recorded_peak_reserved == 0 {
            return 0.0;
        }
        self.saving_bytes() as f64 / self.recorded_peak_reserved as f64 * 100.0
    }

    /// The most replayed reserved bytes over events `first..end` and on entry to them (after
    /// event `first - 1`), at the series' resolution: the maximum of the points those
    /// events fall in. This is what a pixel column covering those events draws.
    pub fn column_max(&self, first: usize, end: usize) -> u64 {
        let bucket = self.bucket.max(1) as usize;
        let point = |event: usize| {
            self.reserved
                .get(event / bucket)
                .copied()
                .unwrap_or(self.initial_reserved)
        };
        let mut value = if first == 0 {
            self.initial_reserved
        } else {
            point(first - 1)
        };
        if end > first {
            let last = (end - 1) / bucket;
            for p in first / bucket..=last.min(self.reserved.len().saturating_sub(1)) {
                value = value.max(self.reserved[p]);
            }
        }
        value
    }

    fn word_legend(&self) -> Legend {
        // "PyTorch reserved", "PyTorch's peak"; a recording of unknown origin is "recorded".
        let (who, whose) = match self.recorded_by.as_str() {
            "recorded" => ("recorded".to_string(), "the recorded".to_string()),
            name => (name.to_string(), format!("{name}'s")),
        };
        let recorded = if self.recorded_segment_events {
            format!(
                "{who} reserved (recorded): peak {}",
                gib(self.recorded_peak_reserved as i128)
            )
        } else {
            format!(
                "{who} reserved (the snapshot's segments; the trace records none): {}",
                gib(self.recorded_peak_reserved as i128)
            )
        };
        let saving = self.saving_bytes();
        let saving = if saving >= 0 {
            format!(
                "saving {} ({:.1}%) of {whose} peak reserved",
                gib(saving),
                self.saving_percent()
            )
        } else {
            format!(
                "streamalloc would reserve {} ({:.1}%) more than {whose} peak",
                gib(-saving),
                -self.saving_percent()
            )
        };
        let cap = match (self.cap_searched, self.cap) {
            (false, _) => String::new(),
            (true, Some(cap)) => format!(
                "lowest cap that completes: {:.3} x peak live ({})",
                cap.ratio,
                gib(cap.bytes as i128)
            ),
            (true, None) => format!(
                "does not complete under {:.2} x peak live ({})",
                self.cap_highest,
                gib((self.peak_live as f64 * self.cap_highest) as i128)
            ),
        };
        Legend {
            recorded,
            replayed: format!(
                "streamalloc reserved (replayed): peak {}",
                gib(self.replayed_peak_reserved as i128)
            ),
            live: format!("live: peak {}", gib(self.peak_live as i128)),
            saving,
            cap,
        }
    }
}

/// Bytes in GiB, with three decimals below a tenth of a GiB so that small figures do not
/// read 0.
pub fn gib(bytes: i128) -> String {
    let value = bytes as f64 / f64::from(1u32 << 30);
    if value.abs() < 0.1 {
        format!("{value:.3} GiB")
    } else {
        format!("{value:.2} GiB")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlay(points: &[u64]) -> ReplayOverlay {
        let mut series = SeriesBuilder::new(points.len() as u64, 5);
        for &p in points {
            series.push(p);
        }
        ReplayOverlay::new(
            Recorded {
                by: "PyTorch".into(),
                peak_reserved: 100 << 30,
                peak_live: 80 << 30,
                segment_events: true,
            },
            series,
            CapOutcome::NotSearched,
            String::new(),
        )
    }

    #[test]
    fn a_column_takes_the_most_of_its_events_and_of_the_state_it_starts_in() {
        let o = overlay(&[1, 9, 2, 3]);
        assert_eq!(o.bucket, 1);
        assert_eq!(
            o.column_max(0, 0),
            5,
            "before the first event: the initial value"
        );
        assert_eq!(o.column_max(0, 1), 5);
        assert_eq!(o.column_max(1, 2), 9);
        assert_eq!(o.column_max(2, 4), 9, "enters after event 1");
        assert_eq!(o.column_max(3, 4), 3);
        assert_eq!(o.column_max(4, 4), 3, "past the end: the last value");
    }

    #[test]
    fn long_traces_keep_each_buckets_maximum() {
        let events = MAX_POINTS as u64 * 3 + 1;
        let mut series = SeriesBuilder::new(events, 0);
        for i in 0..events {
            series.push(if i == 7 { 1000 } else { i % 3 });
        }
        assert_eq!(series.bucket, 4);
        assert!(series.points.len() <= MAX_POINTS);
        assert_eq!(series.points[1], 1000, "event 7 is in the second bucket");
        assert_eq!(series.peak(), 1000);
    }

    #[test]
    fn the_json_bound_holds_whatever_the_values_and_texts() {
        let mut o = overlay(&[u64::MAX; 5000]);
        assert!(serde_json::to_vec(&o).unwrap().len() <= o.json_bytes_bound());
        o.config = "\u{1}\"\\".repeat(500);
        o.recorded_by = "\u{7}".repeat(100);
        o.legend.saving = "\u{1f}".repeat(1000);
        o.cap = Some(Cap {
            ratio: f64::MAX,
            bytes: u64::MAX,
        });
        o.cap_highest = -f64::MIN_POSITIVE;
        o.initial_reserved = u64::MAX;
        assert!(serde_json::to_vec(&o).unwrap().len() <= o.json_bytes_bound());
    }

    #[test]
    fn the_legend_names_both_peaks_the_saving_and_the_cap() {
        let mut o = overlay(&[60 << 30, 90 << 30]);
        assert_eq!(o.saving_bytes(), 10 << 30);
        assert!((o.saving_percent() - 10.0).abs() < 1e-9);
        assert_eq!(
            o.legend.recorded,
            "PyTorch reserved (recorded): peak 100.00 GiB"
        );
        assert_eq!(
            o.legend.replayed,
            "streamalloc reserved (replayed): peak 90.00 GiB"
        );
        assert_eq!(o.legend.live, "live: peak 80.00 GiB");
        assert_eq!(
            o.legend.saving,
            "saving 10.00 GiB (10.0%) of PyTorch's peak reserved"
        );
        assert_eq!(o.legend.cap, "");
        o.cap_searched = true;
        o.cap = Some(Cap {
            ratio: 1.005,
            bytes: 86 << 30,
        });
        o.cap_highest = 1.5;
        assert_eq!(
            o.word_legend().cap,
            "lowest cap that completes: 1.005 x peak live (86.00 GiB)"
        );
        o.cap = None;
        assert_eq!(
            o.word_legend().cap,
            "does not complete under 1.50 x peak live (120.00 GiB)"
        );
        o.replayed_peak_reserved = 101 << 30;
        assert_eq!(
            o.word_legend().saving,
            "streamalloc would reserve 1.00 GiB (1.0%) more than PyTorch's peak"
        );
    }
}
