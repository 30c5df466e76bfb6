//! Trace replay: run a recorded allocation trace through the engine and compare the memory
//! it reserves with what the recording allocator reserved.
//!
//! Users choose an allocator by how much memory it wastes. A PyTorch memory snapshot (or
//! our own trace) records every allocation and free of a real run; replaying those requests
//! through an [`Allocator`] on the simulated device measures our waste on the same work,
//! with no GPU. The figures: peak live bytes (what the program needed), our peak reserved,
//! and the recording allocator's peak reserved, rebuilt from its segment events.
//!
//! # Semantics
//! - Each `alloc` is replayed as a `malloc` of the recorded size on the recorded stream.
//! - Each block is freed at its `free_completed` (the moment the recording allocator could
//!   reuse it), or at its `free_requested` when no completion follows before the address is
//!   allocated again or the trace ends.
//! - A trace may begin mid-run, with blocks allocated before recording started: frees of
//!   addresses never allocated in the trace are counted in [`ReplayReport::unknown_frees`]
//!   and otherwise ignored, so peak live counts only blocks allocated within the trace. (The
//!   native figure then also misses the segments obtained before recording.)
//! - Peak live sums the recorded sizes of blocks allocated and not yet freed, at each
//!   event. The native peak reserved sums `segment_alloc`/`segment_map` minus
//!   `segment_free`/`segment_unmap`, as `trace_stats.py` does.
//! - Host time stands still unless the replay is paced ([`Pacing`]): then the simulated
//!   host clock moves by the recorded gap between consecutive events (the program's own
//!   work), and every physical allocation a driver call creates, maps or unmaps costs a
//!   fixed time on top, so that policies that weigh the driver's time against the
//!   program's (remapping's share of time) decide as they would on a GPU.

use std::collections::HashMap;
use std::time::Instant;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::backend::Backend;
use streamalloc_allocator::config::Config;
use streamalloc_allocator::trace::{TraceAction, TraceEntry};
use streamalloc_allocator::types::{DevicePtr, StreamId};
use streamalloc_allocator::Allocator;

use super::report::{DriverWork, ReplayError, ReplayReport};

/// Device memory of the simulated device a replay runs on: far beyond any recorded run, so
/// that replay measures packing, never out-of-memory.
pub const REPLAY_DEVICE_BYTES: u64 = 1 << 40;

/// How a replay moves the simulated host clock (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pacing {
    /// The clock stands still: the driver's calls and the program's work take no time.
    #[default]
    Still,
    /// The clock follows the trace's own timestamps, and each physical allocation a driver
    /// call creates, maps (a second time too) or unmaps takes this many ns.
    Recorded {
        /// Host time per allocation, in ns (on an H200, tens of microseconds).
        driver_call_ns: u64,
    },
}

/// Replays `events` through a fresh allocator configured by `config` on a simulated device
/// of [`REPLAY_DEVICE_BYTES`]. `progress` is called now and then with the number of events
/// done.
pub fn replay(
    events: &[TraceEntry],
    config: &Config,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayReport, ReplayError> {
    replay_steps(events, config, 1, progress)
}

/// Replays `events` `steps` times back to back through one fresh allocator, as `steps`
/// iterations of the recorded training step: a block still live at the end of one pass is
/// freed when the next pass allocates its address again. One pass shows how the allocator
/// copes with a step it has never seen; later passes show its steady state, where a good
/// allocator neither grows nor remaps (`last_step_*` count the final pass alone). The
/// native figure comes from the first pass (the recording allocator's segments).
pub fn replay_steps(
    events: &[TraceEntry],
    config: &Config,
    steps: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayReport, ReplayError> {
    replay_steps_paced(events, config, steps, Pacing::Still, progress)
}

/// [`replay_steps`], with the simulated host clock moved as `pacing` says.
pub fn replay_steps_paced(
    events: &[TraceEntry],
    config: &Config,
    steps: usize,
    pacing: Pacing,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayReport, ReplayError> {
    replay_on_device(events, config, steps, pacing, REPLAY_DEVICE_BYTES, progress)
}

/// [`replay_steps_paced`] on a simulated device of `device_bytes`: a device that holds
/// little more than the trace's peak is a cap the allocator is not told of (no limit in its
/// configuration), as when another process holds the rest of a GPU; it meets only the
/// device's refusals and what the device says it has free.
pub fn replay_on_device(
    events: &[TraceEntry],
    config: &Config,
    steps: usize,
    pacing: Pacing,
    device_bytes: u64,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayReport, ReplayError> {
    let steps = steps.max(1);
    let allocator =
        Allocator::new(SimBackend::new(device_bytes), config.clone()).map_err(|source| {
            ReplayError::Alloc {
                index: 0,
                action: "create",
                size: 0,
                source,
            }
        })?;
    let device = allocator.backend();
    let paced = match pacing {
        Pacing::Still => false,
        Pacing::Recorded { driver_call_ns } => {
            device.set_mapping_cost(driver_call_ns);
            true
        }
    };
    // After event `i`, the program's own time until the next one (none past a pass's end:
    // the next pass starts at once).
    let pace = |index: usize| {
        if let (true, Some(next)) = (paced, events.get(index + 1)) {
            device.advance_host(next.time_ns.saturating_sub(events[index].time_ns));
        }
    };
    let counts = || {
        [
            device.calls("map_pages"),
            device.calls("unmap_pages"),
            device.calls("synchronize_device"),
            device.calls("alias_pages"),
            device.driver_allocations(),
        ]
    };
    let mut pass = Pass::new(events.len() as u64 * steps as u64);
    let mut allocations_before_last = 0;
    let mut bytes_before_last = (0, 0);
    let mut stitches_before_last = 0;
    let started = Instant::now();
    let mut work = Vec::with_capacity(steps);
    for step in 0..steps {
        let before = counts();
        if step + 1 == steps {
            allocations_before_last = before[4];
            let stats = allocator.stats();
            bytes_before_last = (stats.page_map_bytes, stats.page_unmap_bytes);
            stitches_before_last = stats.stitches;
        }
        let offset = step * events.len();
        // Each pass's own peak: the statistics' peaks restart from the current values (the
        // policy reads none of them).
        allocator.reset_peak_stats();
        pass.run(
            &allocator,
            events,
            step == 0,
            &mut |done| progress(offset + done),
            &mut |index, _| pace(index),
        )?;
        pass.end_pass(&allocator);
        let after = counts();
        work.push(DriverWork {
            page_maps: after[0] - before[0],
            page_unmaps: after[1] - before[1],
            device_syncs: after[2] - before[2],
            stitch_maps: after[3] - before[3],
        });
    }
    let mut report = pass.finish(&allocator, started);
    let [maps, unmaps, syncs, _, allocations] = counts();
    report.steps = steps as u64;
    (report.page_maps, report.page_unmaps, report.device_syncs) = (maps, unmaps, syncs);
    let last = work.last().copied().unwrap_or_default();
    report.last_step_page_maps = last.page_maps;
    report.last_step_page_unmaps = last.page_unmaps;
    report.last_step_device_syncs = last.device_syncs;
    report.last_step_stitch_maps = last.stitch_maps;
    report.pass_driver_work = work;
    report.driver_allocations = allocations;
    report.last_step_driver_allocations = allocations - allocations_before_last;
    let stats = allocator.stats();
    report.last_step_page_map_bytes = stats.page_map_bytes - bytes_before_last.0;
    report.last_step_page_unmap_bytes = stats.page_unmap_bytes - bytes_before_last.1;
    report.last_step_stitches = stats.stitches - stitches_before_last;
    Ok(report)
}

/// Replays `events` through `allocator` (which should be fresh: its peak is reported).
/// The simulator's call counts (`page_maps`, `page_unmaps`, `device_syncs`) are left 0.
pub fn replay_on<B: Backend>(
    allocator: &Allocator<B>,
    events: &[TraceEntry],
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayReport, ReplayError> {
    let mut pass = Pass::new(events.len() as u64);
    let started = Instant::now();
    pass.run(allocator, events, true, progress, &mut |_, _| {})?;
    pass.end_pass(allocator);
    Ok(pass.finish(allocator, started))
}

/// The state of a replay carried from one pass over the trace to the next.
pub(super) struct Pass {
    /// Recorded address → our block and its recorded size.
    live: HashMap<u64, (DevicePtr, u64)>,
    report: ReplayReport,
    live_bytes: u64,
    /// The recording allocator's reserved bytes, from its segment events.
    native: u64,
    /// Our segment counters before the first pass.
    before: Option<(u64, u64)>,
}

impl Pass {
    pub(super) fn new(events: u64) -> Self {
        Self {
            live: HashMap::with_capacity(1024),
            report: ReplayReport {
                events,
                steps: 1,
                allocs: 0,
                frees: 0,
                unknown_frees: 0,
                live_at_end: 0,
                peak_live_bytes: 0,
                peak_reserved_bytes: 0,
                native_peak_reserved_bytes: 0,
                segment_events: 0,
                page_maps: 0,
                page_unmaps: 0,
                device_syncs: 0,
                last_step_page_maps: 0,
                last_step_page_unmaps: 0,
                last_step_device_syncs: 0,
                last_step_page_map_bytes: 0,
                last_step_page_unmap_bytes: 0,
                stitches: 0,
                stitch_revivals: 0,
                last_step_stitch_maps: 0,
                last_step_stitches: 0,
                driver_allocations: 0,
                last_step_driver_allocations: 0,
                ns_per_op: 0.0,
                pass_peak_reserved_bytes: Vec::new(),
                pass_driver_work: Vec::new(),
            },
            live_bytes: 0,
            native: 0,
            before: None,
        }
    }

    /// One pass over `events`; `first` passes also rebuild the native figure.
    /// `observe(i, live)` is called after event `i` (every event, markers included) with
    /// the recorded sizes of the blocks then live.
    pub(super) fn run<B: Backend>(
        &mut self,
        allocator: &Allocator<B>,
        events: &[TraceEntry],
        first: bool,
        progress: &mut dyn FnMut(usize),
        observe: &mut dyn FnMut(usize, u64),
    ) -> Result<(), ReplayError> {
        if self.before.is_none() {
            let stats = allocator.stats();
            self.before = Some((stats.segment_allocs, stats.segment_frees));
        }
        let free_at_request = frees_at_request(events);
        let (live, report) = (&mut self.live, &mut self.report);
        for (index, event) in events.iter().enumerate() {
            if index % 4096 == 0 {
                progress(index);
            }
            let fail = |source| ReplayError::Alloc {
                index,
                action: event.action.name(),
                size: event.size,
                source,
            };
            match event.action {
                TraceAction::Alloc => {
                    if let Some((ptr, size)) = live.remove(&event.addr.0) {
                        // Allocated again without a recorded free: free the old block first.
                        allocator.free(ptr).map_err(fail)?;
                        self.live_bytes = self.live_bytes.saturating_sub(size);
                        report.frees += 1;
                    }
                    let block = allocator
                        .malloc(event.size.max(1), event.stream)
                        .map_err(fail)?;
                    live.insert(event.addr.0, (block.ptr, event.size));
                    self.live_bytes = self.live_bytes.saturating_add(event.size);
                    report.peak_live_bytes = report.peak_live_bytes.max(self.live_bytes);
                    report.allocs += 1;
                }
                TraceAction::FreeRequested | TraceAction::FreeCompleted => {
                    let due = event.action == TraceAction::FreeCompleted || free_at_request[index];
                    if due {
                        match live.remove(&event.addr.0) {
                            Some((ptr, size)) => {
                                allocator.free(ptr).map_err(fail)?;
                                self.live_bytes = self.live_bytes.saturating_sub(size);
                                report.frees += 1;
                            }
                            None => report.unknown_frees += 1,
                        }
                    }
                }
                TraceAction::SegmentAlloc | TraceAction::SegmentMap if first => {
                    // Saturating: sizes are each below 2^63 (the readers' limit), but a
                    // trace may hold many.
                    self.native = self.native.saturating_add(event.size);
                    report.native_peak_reserved_bytes =
                        report.native_peak_reserved_bytes.max(self.native);
                }
                TraceAction::SegmentFree | TraceAction::SegmentUnmap if first => {
                    self.native = self.native.saturating_sub(event.size);
                }
                _ => {}
            }
            observe(index, self.live_bytes);
        }
        progress(events.len());
        Ok(())
    }

    /// Notes the pass just run: its peak reserved bytes (the statistics' peak, reset at its
    /// start by a replay of several passes).
    pub(super) fn end_pass<B: Backend>(&mut self, allocator: &Allocator<B>) {
        let peak = allocator.stats().reserved_bytes.peak;
        self.report.pass_peak_reserved_bytes.push(peak);
    }

    /// The report after the last pass, timed from `started`.
    fn finish<B: Backend>(mut self, allocator: &Allocator<B>, started: Instant) -> ReplayReport {
        let elapsed = started.elapsed();
        let stats = allocator.stats();
        let (allocs_before, frees_before) = self.before.unwrap_or_default();
        let report = &mut self.report;
        report.live_at_end = self.live.len() as u64;
        // Every pass notes its own peak ([`Pass::end_pass`]); the run's is the largest.
        report.peak_reserved_bytes = report
            .pass_peak_reserved_bytes
            .iter()
            .copied()
            .max()
            .unwrap_or(stats.reserved_bytes.peak);
        report.segment_events =
            (stats.segment_allocs - allocs_before) + (stats.segment_frees - frees_before);
        let ops = (report.allocs + report.frees).max(1);
        report.ns_per_op = elapsed.as_nanos() as f64 / ops as f64;
        report.stitches = stats.stitches;
        report.stitch_revivals = stats.stitch_revivals;
        self.report
    }
}

/// For each event, true if it is a `free_requested` that no `free_completed` of the same
/// address follows before the address is allocated again or the trace ends: the block is
/// then freed at the request.
pub(crate) fn frees_at_request(events: &[TraceEntry]) -> Vec<bool> {
    let mut at_request = vec![false; events.len()];
    let mut requested: HashMap<u64, usize> = HashMap::new();
    for (index, event) in events.iter().enumerate() {
        match event.action {
            TraceAction::FreeRequested => {
                if let Some(open) = requested.insert(event.addr.0, index) {
                    at_request[open] = true;
                }
            }
            TraceAction::FreeCompleted => {
                requested.remove(&event.addr.0);
            }
            TraceAction::Alloc => {
                if let Some(open) = requested.remove(&event.addr.0) {
                    at_request[open] = true;
                }
            }
            _ => {}
        }
    }
    for (_, open) in requested {
        at_request[open] = true;
    }
    at_request
}

/// The peak of the recorded sizes of live blocks over one pass of `events`, with the
/// replay's free semantics (a free at `free_completed`, or at `free_requested` when none
/// follows): the figure [`ReplayReport::peak_live_bytes`] reports, without replaying, so
/// that a memory limit can be set relative to it before the replay.
pub fn peak_live_bytes(events: &[TraceEntry]) -> u64 {
    let free_at_request = frees_at_request(events);
    let mut live: HashMap<u64, u64> = HashMap::with_capacity(1024);
    let (mut now, mut peak) = (0u64, 0u64);
    for (index, event) in events.iter().enumerate() {
        match event.action {
            TraceAction::Alloc => {
                if let Some(size) = live.insert(event.addr.0, event.size) {
                    now = now.saturating_sub(size);
                }
                now = now.saturating_add(event.size);
                peak = peak.max(now);
            }
            TraceAction::FreeRequested | TraceAction::FreeCompleted
                if event.action == TraceAction::FreeCompleted || free_at_request[index] =>
            {
                if let Some(size) = live.remove(&event.addr.0) {
                    now = now.saturating_sub(size);
                }
            }
            _ => {}
        }
    }
    peak
}

/// A trace entry for tests and generators: `action` of `size` bytes at `addr` on `stream`.
pub fn entry(action: TraceAction, addr: u64, size: u64, stream: u64) -> TraceEntry {
    TraceEntry {
        action,
        addr: DevicePtr(addr),
        size,
        stream: StreamId(stream),
        time_ns: 0,
    }
}

/// A deterministic training-like trace of about `events` entries: steps of a forward pass
/// allocating activations of varied sizes (small, medium, large), a backward pass freeing
/// them in reverse while allocating gradients, and a few blocks used across two streams
/// (free requested, completed later).
pub fn training_trace(events: usize) -> Vec<TraceEntry> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = Vec::with_capacity(events + 1024);
    let mut addr = 0x1000u64;
    while out.len() < events {
        let batch = 1 + next() % 4;
        let mut live = Vec::new();
        for layer in 0..200u64 {
            let size = match next() % 10 {
                0..=4 => 512 * (1 + next() % 2048),
                5..=7 => (1 << 20) + (next() % (9 << 20)),
                _ => (8 << 20) * batch + (layer % 7) * (1 << 20),
            };
            addr += 0x1000;
            let stream = u64::from(next() % 16 == 0);
            out.push(entry(TraceAction::Alloc, addr, size, stream));
            live.push((addr, size, stream));
        }
        let mut deferred = Vec::new();
        while let Some((block, size, stream)) = live.pop() {
            addr += 0x1000;
            let grad = size / 2 + 512;
            out.push(entry(TraceAction::Alloc, addr, grad, 0));
            out.push(entry(TraceAction::FreeRequested, block, size, stream));
            if stream == 1 {
                deferred.push((block, size, stream));
            } else {
                out.push(entry(TraceAction::FreeCompleted, block, size, stream));
            }
            out.push(entry(TraceAction::FreeRequested, addr, grad, 0));
            out.push(entry(TraceAction::FreeCompleted, addr, grad, 0));
        }
        for (block, size, stream) in deferred {
            out.push(entry(TraceAction::FreeCompleted, block, size, stream));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use TraceAction::*;

    #[test]
    fn the_peak_live_figure_is_known_before_replaying() {
        let events = training_trace(20_000);
        let report = replay(&events, &Config::default(), &mut |_| {}).unwrap();
        assert_eq!(peak_live_bytes(&events), report.peak_live_bytes);
    }

    #[test]
    fn frees_fall_back_to_the_request_and_unknown_frees_are_counted() {
        let events = [
            entry(SegmentAlloc, 0, 4 << 20, 0),
            entry(Alloc, 0x1000, 1 << 20, 0),
            entry(Alloc, 0x2000, 1 << 20, 0),
            entry(FreeRequested, 0x1000, 1 << 20, 0),
            entry(FreeRequested, 0x2000, 1 << 20, 0),
            entry(FreeCompleted, 0x2000, 1 << 20, 0),
            entry(FreeCompleted, 0x9000, 4096, 0),
        ];
        let report = replay(&events, &Config::default(), &mut |_| {}).unwrap();
        assert_eq!(report.allocs, 2);
        assert_eq!(report.frees, 2);
        assert_eq!(report.unknown_frees, 1);
        assert_eq!(report.live_at_end, 0);
        assert_eq!(report.peak_live_bytes, 2 << 20);
        assert_eq!(report.native_peak_reserved_bytes, 4 << 20);
        assert!(report.peak_reserved_bytes >= report.peak_live_bytes);
    }

    /// Segment sizes each within the readers' address limit can still add up past 2^64:
    /// the native figure saturates instead of wrapping (or panicking in a debug build).
    #[test]
    fn native_reserved_bytes_saturate() {
        let size = (1u64 << 63) - 4096;
        let events = [
            entry(SegmentAlloc, 0, size, 0),
            entry(SegmentAlloc, 0, size, 0),
            entry(SegmentAlloc, 0, size, 0),
        ];
        let report = replay(&events, &Config::default(), &mut |_| {}).unwrap();
        assert_eq!(report.native_peak_reserved_bytes, u64::MAX);
    }
}
