//! What a trace means over time: allocation and segment lifetimes, and the counters the
//! viewer, the plotter and the Perfetto exporter draw.
//!
//! A trace is a list of events; a timeline pairs them up. Each `alloc` is matched with the
//! `free_requested` and `free_completed` at the same address that follow it, each
//! `segment_alloc`/`segment_map` with the `segment_free`/`segment_unmap` that removes its
//! address range (expandable segments unmap parts of mappings, or several at once). A new
//! `alloc` at
//! the address of a block still pending ends that block's lifetime (streamalloc reuses
//! pending blocks after a device-side wait, without a `free_completed`). Blocks and
//! segments alive before the first event (their free is seen but not their allocation, or
//! they are in the snapshot's segment list with no allocation in the trace) get
//! `start: None`; those still alive at the end get `end: None`.
//!
//! A `sleep` ends the segment spans of its range like an unmap and opens a *sleeping* span
//! ([`Timeline::sleeping`]); the `wake` that maps the range again closes it and starts a
//! segment span like a map.
//!
//! Counters (bytes, after each event):
//! - `active`: allocated until `free_completed` (PyTorch's "active"; the peak of this is
//!   the trace's peak live memory),
//! - `allocated`: held by callers, until `free_requested`,
//! - `pending`: freed by callers but awaiting other streams' events,
//! - `reserved`: in segments,
//! - `staging`: staging buffers in use (streamalloc traces only),
//!
//! and, per stream, `cached`: bytes of the stream's segments not in active blocks.

use crate::limits::{Budget, OverBudget};
use crate::model::{BlockState, DeviceSnapshot, TraceAction};
use std::collections::{BTreeMap, HashMap};

/// One allocation's lifetime, as event indices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocSpan {
    /// The `alloc` event; `None` if allocated before the trace began.
    pub start: Option<u32>,
    /// The `free_requested` event, if seen.
    pub free_requested: Option<u32>,
    /// The `free_completed` event; `None` if still active at the end.
    pub end: Option<u32>,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Index into [`Timeline::streams`] of the allocating stream.
    pub stream: u32,
    /// Index into [`Timeline::streams`] of the stream owning the segment it lies in.
    pub owner: u32,
    /// Call stack (index into the snapshot's `stacks`).
    pub stack: Option<u32>,
}

/// One segment's lifetime, as event indices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSpan {
    /// The `segment_alloc`/`segment_map` event; `None` if it existed before the trace.
    pub start: Option<u32>,
    /// The `segment_free`/`segment_unmap` event; `None` if alive at the end.
    pub end: Option<u32>,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Index into [`Timeline::streams`].
    pub stream: u32,
}

/// The derived view of one device's trace.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// Distinct streams, in order of first appearance; other fields index this.
    pub streams: Vec<u64>,
    /// Every allocation, in the order of its `alloc` (those from before the trace first).
    pub allocs: Vec<AllocSpan>,
    /// Every segment, in the order of its allocation (those from before the trace first).
    pub segments: Vec<SegmentSpan>,
    /// Every range a sleeping memory pool gave back, from its `sleep` to the `wake` that
    /// mapped it again (streamalloc traces; `start: None` for ranges asleep before the
    /// trace, which the snapshot's sleeping segments give).
    pub sleeping: Vec<SegmentSpan>,
    /// Counter values after each event (`counters[k][i]`, `k` in [`Counter::ALL`]).
    pub counters: [Vec<u64>; 5],
    /// Counter values before the first event.
    pub initial: [u64; 5],
    /// Per stream: `(event index, cached bytes after it)` at every change.
    pub cached_changes: Vec<Vec<(u32, u64)>>,
    /// Per stream, cached bytes before the first event.
    pub cached_initial: Vec<u64>,
}

/// The counters of [`Timeline::counters`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Allocated until `free_completed`.
    Active = 0,
    /// Held by callers.
    Allocated = 1,
    /// Freed, awaiting events.
    Pending = 2,
    /// In segments.
    Reserved = 3,
    /// Staging buffers in use.
    Staging = 4,
}

impl Counter {
    /// All counters, in index order.
    pub const ALL: [Counter; 5] = [
        Counter::Active,
        Counter::Allocated,
        Counter::Pending,
        Counter::Reserved,
        Counter::Staging,
    ];

    /// The name used in files and the viewer.
    pub fn name(self) -> &'static str {
        match self {
            Counter::Active => "active",
            Counter::Allocated => "allocated",
            Counter::Pending => "pending",
            Counter::Reserved => "reserved",
            Counter::Staging => "staging",
        }
    }
}

mod counters;
mod sleeping;

/// What the budget calls building a timeline.
const STAGE: &str = "building the timeline";
/// What one entry of the maps used while pairing costs (key, value, the map's overhead).
const MAP_ENTRY_BYTES: u64 = 48;

impl Timeline {
    /// Pairs up the events of `device` and computes the counters.
    pub fn build(device: &DeviceSnapshot) -> Timeline {
        match Timeline::build_within(device, &mut Budget::default()) {
            Ok(t) => t,
            Err(_) => unreachable!("an unlimited budget never runs out"),
        }
    }

    /// [`Timeline::build`], charging what it holds to `budget` (and what it needs only
    /// while building, given back at the end): a trace the budget cannot afford is an
    /// error before its memory is taken.
    pub fn build_within(
        device: &DeviceSnapshot,
        budget: &mut Budget,
    ) -> Result<Timeline, OverBudget> {
        let mut transient = 0u64;
        let built = Timeline::pair(device, budget, &mut transient);
        budget.release(transient);
        built
    }

    fn pair(
        device: &DeviceSnapshot,
        budget: &mut Budget,
        transient: &mut u64,
    ) -> Result<Timeline, OverBudget> {
        let mut charge_transient = |budget: &mut Budget, bytes: u64| {
            budget.charge_for(STAGE, bytes)?;
            *transient += bytes;
            Ok::<(), OverBudget>(())
        };
        let mut t = Timeline::default();
        let mut stream_index: HashMap<u64, u32> = HashMap::new();
        let mut stream = |s: u64, streams: &mut Vec<u64>| -> u32 {
            *stream_index.entry(s).or_insert_with(|| {
                streams.push(s);
                (streams.len() - 1) as u32
            })
        };
        let trace = &device.trace;
        let n = trace.len();

        // Segments: mapped address ranges. `segment_alloc`/`segment_map` add a range;
        // `segment_free`/`segment_unmap` remove one, which for expandable segments may be
        // part of a mapping or span several: each affected span ends there and what is
        // left of it continues as a new span. Ranges removed without having been added
        // were mapped before the trace began.
        let mut live_segs: BTreeMap<u64, usize> = BTreeMap::new();
        // Ranges ending past 2^64 are refused when a file is loaded (`check_limits`);
        // the additions below saturate so that a snapshot built in code cannot wrap either.
        let mut early_segs = Vec::new();
        let mut late_segs: Vec<SegmentSpan> = Vec::new();
        for (i, e) in trace.iter().enumerate() {
            let at = Some(i as u32);
            match e.action {
                TraceAction::SegmentAlloc | TraceAction::SegmentMap | TraceAction::Wake => {
                    let s = stream(e.stream, &mut t.streams);
                    budget.reserve(STAGE, &mut late_segs, 1)?;
                    charge_transient(budget, MAP_ENTRY_BYTES)?;
                    late_segs.push(SegmentSpan {
                        start: at,
                        end: None,
                        addr: e.addr,
                        size: e.size,
                        stream: s,
                    });
                    live_segs.insert(e.addr, late_segs.len() - 1);
                }
                TraceAction::SegmentFree | TraceAction::SegmentUnmap | TraceAction::Sleep => {
                    let lo = e.addr;
                    let hi = match (e.size, live_segs.get(&lo)) {
                        (0, Some(&k)) => lo.saturating_add(late_segs[k].size),
                        (size, _) => lo.saturating_add(size),
                    };
                    // Live spans overlapping [lo, hi), in address order.
                    let mut hit: Vec<usize> = live_segs
                        .range(..hi)
                        .rev()
                        .map(|(_, &k)| k)
                        .take_while(|&k| late_segs[k].addr.saturating_add(late_segs[k].size) > lo)
                        .collect();
                    hit.reverse();
                    let mut cursor = lo;
                    // At most two pieces left of each span hit, and one gap before it.
                    budget.reserve(STAGE, &mut late_segs, 2 * hit.len() + 1)?;
                    budget.reserve(STAGE, &mut early_segs, hit.len() + 1)?;
                    charge_transient(budget, MAP_ENTRY_BYTES * 2 * hit.len() as u64)?;
                    for k in hit {
                        let (sa, se, st) = {
                            let sp = &late_segs[k];
                            (sp.addr, sp.addr.saturating_add(sp.size), sp.stream)
                        };
                        live_segs.remove(&sa);
                        late_segs[k].end = at;
                        if sa > cursor {
                            let s = stream(e.stream, &mut t.streams);
                            early_segs.push(SegmentSpan {
                                start: None,
                                end: at,
                                addr: cursor,
                                size: sa - cursor,
                                stream: s,
                            });
                        }
                        for (ra, rb) in [(sa, lo), (hi, se)] {
                            if rb > ra {
                                late_segs.push(SegmentSpan {
                                    start: at,
                                    end: None,
                                    addr: ra,
                                    size: rb - ra,
                                    stream: st,
                                });
                                live_segs.insert(ra, late_segs.len() - 1);
                            }
                        }
                        cursor = cursor.max(se);
                    }
                    if cursor < hi {
                        let s = stream(e.stream, &mut t.streams);
                        early_segs.push(SegmentSpan {
                            start: None,
                            end: at,
                            addr: cursor,
                            size: hi - cursor,
                            stream: s,
                        });
                    }
                }
                _ => {}
            }
        }
        // Segments in the snapshot that no range mapped in the trace overlaps existed
        // before it (a sleeping pool's hold no memory: they are sleeping ranges).
        t.sleeping = sleeping::sleeping_spans(device, budget, &mut charge_transient, &mut |s| {
            stream(s, &mut t.streams)
        })?;
        for seg in device.segments.iter().filter(|seg| !seg.asleep) {
            let end = seg.addr.saturating_add(seg.size);
            let overlapped = live_segs.range(..end).next_back().is_some_and(|(_, &k)| {
                late_segs[k].addr.saturating_add(late_segs[k].size) > seg.addr
            });
            if !overlapped {
                let s = stream(seg.stream, &mut t.streams);
                budget.reserve(STAGE, &mut early_segs, 1)?;
                early_segs.push(SegmentSpan {
                    start: None,
                    end: None,
                    addr: seg.addr,
                    size: seg.size,
                    stream: s,
                });
            }
        }
        early_segs.append(&mut late_segs);
        t.segments = early_segs;

        // Allocations.
        let mut live: HashMap<u64, usize> = HashMap::new();
        let mut early = Vec::new();
        let mut late: Vec<AllocSpan> = Vec::new();
        // Frees whose alloc was not seen, by address, until their free_completed.
        let mut orphan: HashMap<u64, usize> = HashMap::new();
        for (i, e) in trace.iter().enumerate() {
            let i32_ = i as u32;
            match e.action {
                TraceAction::Alloc => {
                    budget.reserve(STAGE, &mut late, 1)?;
                    charge_transient(budget, MAP_ENTRY_BYTES)?;
                    // streamalloc hands a freed block carrying pending events to another
                    // request at once (after a device-side wait), with no free_completed:
                    // the reuse ends the old lifetime.
                    if let Some(k) = live.remove(&e.addr) {
                        late[k].end = Some(i32_);
                    }
                    let s = stream(e.stream, &mut t.streams);
                    late.push(AllocSpan {
                        start: Some(i32_),
                        free_requested: None,
                        end: None,
                        addr: e.addr,
                        size: e.size,
                        stream: s,
                        owner: s,
                        stack: e.stack,
                    });
                    live.insert(e.addr, late.len() - 1);
                }
                TraceAction::FreeRequested => {
                    if let Some(&k) = live.get(&e.addr) {
                        late[k].free_requested = Some(i32_);
                    } else {
                        let s = stream(e.stream, &mut t.streams);
                        budget.reserve(STAGE, &mut early, 1)?;
                        charge_transient(budget, MAP_ENTRY_BYTES)?;
                        early.push(AllocSpan {
                            start: None,
                            free_requested: Some(i32_),
                            end: None,
                            addr: e.addr,
                            size: e.size,
                            stream: s,
                            owner: s,
                            stack: e.stack,
                        });
                        orphan.insert(e.addr, early.len() - 1);
                    }
                }
                TraceAction::FreeCompleted => {
                    if let Some(k) = live.remove(&e.addr) {
                        late[k].end = Some(i32_);
                    } else if let Some(k) = orphan.remove(&e.addr) {
                        early[k].end = Some(i32_);
                    } else {
                        let s = stream(e.stream, &mut t.streams);
                        budget.reserve(STAGE, &mut early, 1)?;
                        early.push(AllocSpan {
                            start: None,
                            free_requested: None,
                            end: Some(i32_),
                            addr: e.addr,
                            size: e.size,
                            stream: s,
                            owner: s,
                            stack: e.stack,
                        });
                    }
                }
                _ => {}
            }
        }
        // Active blocks in the snapshot that no traced alloc explains existed before it.
        for seg in &device.segments {
            for b in &seg.blocks {
                // Pages lent to a stitched range are the allocation traced at the range.
                let stitched = b.lent_to.is_some_and(|range| live.contains_key(&range));
                if b.state == BlockState::Inactive
                    || stitched
                    || live.contains_key(&b.addr)
                    || orphan.contains_key(&b.addr)
                {
                    continue;
                }
                let s = stream(b.stream, &mut t.streams);
                budget.reserve(STAGE, &mut early, 1)?;
                early.push(AllocSpan {
                    start: None,
                    free_requested: None,
                    end: None,
                    addr: b.addr,
                    size: b.size,
                    stream: s,
                    owner: s,
                    stack: b.stack,
                });
            }
        }
        budget.reserve(STAGE, &mut early, late.len())?;
        early.append(&mut late);
        t.allocs = early;
        // Streams: a few bytes each, in the per-stream tables below.
        budget.charge_for(STAGE, 64 * t.streams.len() as u64)?;
        // Sorting the allocations and segments by time.
        charge_transient(
            budget,
            (t.allocs.len() * size_of::<usize>() + t.segments.len() * 24) as u64,
        )?;
        t.assign_owners(n);
        t.compute_counters(trace, budget, &mut charge_transient)?;
        Ok(t)
    }

    /// The sleeping ranges at the instant before event `at`, as `(address, bytes)`.
    pub fn sleeping_at(&self, at: u32) -> Vec<(u64, u64)> {
        self.sleeping
            .iter()
            .filter(|s| s.start.is_none_or(|i| i < at) && s.end.is_none_or(|i| i >= at))
            .map(|s| (s.addr, s.size))
            .collect()
    }

    /// Sets each allocation's `owner` to the stream of the segment containing it when it
    /// was allocated (its own stream when no segment is known).
    fn assign_owners(&mut self, n: usize) {
        // Segment starts in event order; a sweep keeps the live segments by address.
        let mut seg_events: Vec<(u32, bool, usize)> = Vec::new(); // (at, is_start, seg)
        let mut by_addr: BTreeMap<u64, usize> = BTreeMap::new();
        for (k, s) in self.segments.iter().enumerate() {
            match s.start {
                None => {
                    by_addr.insert(s.addr, k);
                }
                Some(at) => seg_events.push((at, true, k)),
            }
            if let Some(at) = s.end {
                seg_events.push((at, false, k));
            }
        }
        seg_events.sort_unstable_by_key(|&(at, start, _)| (at, !start));
        let mut next = 0;
        let mut order: Vec<usize> = (0..self.allocs.len()).collect();
        order.sort_by_key(|&k| self.allocs[k].start.map_or(0, |s| s as usize + 1));
        for k in order {
            let at = self.allocs[k].start.map_or(0, |s| s as usize);
            while next < seg_events.len() && (seg_events[next].0 as usize) <= at.min(n) {
                let (_, start, seg) = seg_events[next];
                let addr = self.segments[seg].addr;
                if start {
                    by_addr.insert(addr, seg);
                } else if by_addr.get(&addr) == Some(&seg) {
                    by_addr.remove(&addr);
                }
                next += 1;
            }
            let a = &mut self.allocs[k];
            if let Some((_, &seg)) = by_addr.range(..=a.addr).next_back() {
                let s = &self.segments[seg];
                if a.addr < s.addr.saturating_add(s.size) {
                    a.owner = s.stream;
                }
            }
        }
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.counters[0].len()
    }

    /// True if the trace has no events.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value of `counter` after event `i`.
    pub fn value(&self, counter: Counter, i: usize) -> u64 {
        self.counters[counter as usize][i]
    }

    /// The event index where `counter` peaks (first such) and the peak value; `None` for
    /// an empty trace.
    pub fn peak(&self, counter: Counter) -> Option<(usize, u64)> {
        let c = &self.counters[counter as usize];
        let mut best: Option<(usize, u64)> = None;
        for (i, &v) in c.iter().enumerate() {
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        best
    }

    /// Allocations active just after event `i`, largest first.
    pub fn active_at(&self, i: usize) -> Vec<&AllocSpan> {
        let i = i as u32;
        let mut v: Vec<&AllocSpan> = self
            .allocs
            .iter()
            .filter(|a| a.start.is_none_or(|s| s <= i) && a.end.is_none_or(|e| e > i))
            .collect();
        v.sort_by_key(|a| std::cmp::Reverse(a.size));
        v
    }
}
