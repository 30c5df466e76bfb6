//! What a replay reports ([`ReplayReport`], one step's [`DriverWork`]) and why one stops
//! ([`ReplayError`]): the records `streamalloc replay` prints as its table and its
//! `--json`, kept apart from the passes that fill them (`run`).

use serde::Serialize;
use streamalloc_allocator::error::AllocError;

/// What a replay measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Events replayed (the trace's, times `steps`).
    pub events: u64,
    /// Passes over the trace ([`replay_steps`](super::replay_steps)).
    pub steps: u64,
    /// Allocations replayed.
    pub allocs: u64,
    /// Frees replayed (at `free_completed`, or at `free_requested` when none follows).
    pub frees: u64,
    /// Frees of addresses not allocated within the trace (allocated before recording
    /// started); ignored.
    pub unknown_frees: u64,
    /// Blocks still allocated when the trace ends.
    pub live_at_end: u64,
    /// Peak of the recorded sizes of live blocks.
    pub peak_live_bytes: u64,
    /// Our peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// The recording allocator's peak reserved bytes, from the trace's segment events.
    pub native_peak_reserved_bytes: u64,
    /// Segments obtained and returned by our allocator.
    pub segment_events: u64,
    /// Page ranges mapped and unmapped (expandable segments), on the simulator.
    pub page_maps: u64,
    /// Page ranges unmapped, on the simulator.
    pub page_unmaps: u64,
    /// Device-wide synchronisations the allocator made, on the simulator (each is a host
    /// stall on a real GPU).
    pub device_syncs: u64,
    /// `page_maps` of the last pass alone: non-zero in a steady state means remapping.
    pub last_step_page_maps: u64,
    /// `page_unmaps` of the last pass alone.
    pub last_step_page_unmaps: u64,
    /// `device_syncs` of the last pass alone.
    pub last_step_device_syncs: u64,
    /// Bytes of pages mapped in the last pass.
    pub last_step_page_map_bytes: u64,
    /// Bytes of pages unmapped in the last pass.
    pub last_step_page_unmap_bytes: u64,
    /// Stitched ranges made (free pages mapped a second time into one range) and kept
    /// ones taken again, over all passes.
    pub stitches: u64,
    /// Stitched ranges taken again without mapping, over all passes.
    pub stitch_revivals: u64,
    /// Second mappings made for stitched ranges in the last pass (one per physical
    /// allocation a stitch spans): non-zero in a steady state means remapping too.
    pub last_step_stitch_maps: u64,
    /// Stitched ranges made (not revived) in the last pass.
    pub last_step_stitches: u64,
    /// Physical allocations the driver created, mapped (a second time too) or unmapped,
    /// over all passes: its time on a GPU is proportional to these (40-70 µs each to map
    /// on an H200), not to the calls' count or bytes.
    pub driver_allocations: u64,
    /// `driver_allocations` of the last pass alone.
    pub last_step_driver_allocations: u64,
    /// Host nanoseconds per replayed operation (malloc or free), engine calls only.
    pub ns_per_op: f64,
    /// Our peak reserved bytes within each pass, in order: one entry per step. A steady
    /// allocator's figures stop rising after its first passes; figures that keep rising
    /// are memory that grows from one training step to the next.
    pub pass_peak_reserved_bytes: Vec<u64>,
    /// The driver's work in each pass, in order (filled by [`replay_steps_paced`](super::replay_steps_paced); empty
    /// from [`replay_on`](super::replay_on), which does not count the device's calls).
    pub pass_driver_work: Vec<DriverWork>,
}

/// What one pass asked of the driver, on the simulator: what a steady state makes none of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverWork {
    /// Page ranges mapped (new memory).
    pub page_maps: u64,
    /// Page ranges unmapped.
    pub page_unmaps: u64,
    /// Second mappings made for stitched ranges.
    pub stitch_maps: u64,
    /// Device-wide synchronisations.
    pub device_syncs: u64,
}

impl DriverWork {
    /// True if the pass made no driver call at all.
    pub fn is_none(&self) -> bool {
        *self == DriverWork::default()
    }
}

impl ReplayReport {
    /// Our peak reserved over peak live.
    pub fn ratio(&self) -> f64 {
        self.peak_reserved_bytes as f64 / self.peak_live_bytes.max(1) as f64
    }

    /// The recording allocator's peak reserved over peak live.
    pub fn native_ratio(&self) -> f64 {
        self.native_peak_reserved_bytes as f64 / self.peak_live_bytes.max(1) as f64
    }
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The engine refused a recorded request.
    #[error("event {index} ({action} of {size} bytes): {source}")]
    Alloc {
        /// Position of the event in the trace.
        index: usize,
        /// Its action name.
        action: &'static str,
        /// Its size.
        size: u64,
        /// What the engine said.
        source: AllocError,
    },
}
