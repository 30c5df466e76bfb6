//! Counters a user reads to see where memory went, in PyTorch's vocabulary.
//!
//! Invariants (checked by the property tests):
//! `allocated_bytes == Σ size of live blocks`,
//! `reserved_bytes == Σ size of segments`,
//! `allocated_bytes + cached_bytes == reserved_bytes`.
//!
//! [`TorchStats`] keeps the same events in the form of PyTorch's `DeviceStats` (every
//! `torch.cuda.memory_stats()` key); the per-operation rules it follows are in
//! `allocator::torch_stats`. Both are what users read: the engine keeps cheaper counters
//! as it works and makes these from them when asked (`counters`).

use crate::types::PoolKind;
use serde::{Deserialize, Serialize};

/// A gauge with its peak since the last reset, and what was ever added to it and taken
/// from it (PyTorch's `allocated` and `freed` of a byte statistic):
/// `current == allocated - freed`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gauge {
    /// Value now.
    pub current: u64,
    /// Highest value since creation or the last [`crate::Allocator::reset_peak_stats`].
    pub peak: u64,
    /// Sum of everything added, over the allocator's life. Absent from records written
    /// before it was counted (then 0).
    #[serde(default)]
    pub allocated: u64,
    /// Sum of everything taken away, over the allocator's life.
    #[serde(default)]
    pub freed: u64,
}

/// PyTorch's `StatArray`: a gauge over every block, then over the small pool's (blocks of
/// at most 1 MiB) and the large pool's, in PyTorch's order (`all`, `small_pool`,
/// `large_pool`).
pub type StatArray = [Gauge; 3];

/// The index in a [`StatArray`] of blocks of `kind`.
#[inline]
pub(crate) fn kind_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 1,
        PoolKind::Large => 2,
    }
}

/// PyTorch's `DeviceStats`, kept by the engine as PyTorch's allocator keeps it, so that every
/// `torch.cuda.memory_stats()` key means what it means there. Counts are blocks, bytes are
/// block sizes (requests rounded), except `requested_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TorchStats {
    /// Blocks handed to callers.
    pub allocation: StatArray,
    /// Whole segments obtained from the device (expandable segments' mappings are not
    /// segments, as in PyTorch: they count in `reserved_bytes` and the device calls only).
    pub segment: StatArray,
    /// Blocks allocated, or freed and still awaiting other streams' events.
    pub active: StatArray,
    /// Free blocks of whole segments that share their segment with other blocks, so that
    /// the segment cannot go back to the device (expandable segments excluded, as in
    /// PyTorch: their free whole pages can always be unmapped).
    pub inactive_split: StatArray,
    /// Bytes of blocks handed to callers.
    pub allocated_bytes: StatArray,
    /// Bytes obtained from the device: whole segments, and pages mapped into expandable
    /// segments (counted in the pool kind of the request that mapped them).
    pub reserved_bytes: StatArray,
    /// Bytes of `active` blocks.
    pub active_bytes: StatArray,
    /// Bytes of `inactive_split` blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes callers asked for.
    pub requested_bytes: StatArray,
    /// Blocks of at least `max_split_size` bytes handed to callers.
    pub oversize_allocations: Gauge,
    /// Whole segments of at least `max_split_size` bytes.
    pub oversize_segments: Gauge,
    /// Attempts to grow again after releasing cached memory (PyTorch's retries, successful
    /// or not).
    pub alloc_retries: u64,
    /// Calls that obtained memory from the device: whole segments and mapping operations.
    pub device_allocs: u64,
    /// Calls that gave memory back: whole segments freed and unmapping operations.
    pub device_frees: u64,
    /// Blocks at least this large are not split for smaller requests (`max_split_size`;
    /// `u64::MAX` when unset, which PyTorch's `int64_t` reads as -1).
    pub max_split_size: u64,
}

impl Default for TorchStats {
    fn default() -> Self {
        Self {
            allocation: StatArray::default(),
            segment: StatArray::default(),
            active: StatArray::default(),
            inactive_split: StatArray::default(),
            allocated_bytes: StatArray::default(),
            reserved_bytes: StatArray::default(),
            active_bytes: StatArray::default(),
            inactive_split_bytes: StatArray::default(),
            requested_bytes: StatArray::default(),
            oversize_allocations: Gauge::default(),
            oversize_segments: Gauge::default(),
            alloc_retries: 0,
            device_allocs: 0,
            device_frees: 0,
            max_split_size: u64::MAX,
        }
    }
}

/// A copy of the allocator's counters at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Bytes in blocks handed to callers (rounded sizes).
    pub allocated_bytes: Gauge,
    /// Bytes callers asked for (unrounded).
    pub requested_bytes: Gauge,
    /// Bytes obtained from the device.
    pub reserved_bytes: Gauge,
    /// Bytes in blocks that are allocated, or freed but still awaiting other streams'
    /// events (PyTorch's "active").
    pub active_bytes: Gauge,
    /// Bytes in free blocks that carry pending events.
    pub pending_free_bytes: Gauge,
    /// Blocks handed out.
    pub allocs: u64,
    /// Blocks returned by callers.
    pub frees: u64,
    /// Segments obtained from the device.
    pub segment_allocs: u64,
    /// Segments returned to the device.
    pub segment_frees: u64,
    /// `cuStreamWaitEvent` calls made to reuse a block across streams.
    pub cross_stream_waits: u64,
    /// `cuEventRecord` calls.
    pub events_recorded: u64,
    /// `cuEventQuery` calls.
    pub event_queries: u64,
    /// Event objects currently recorded and referenced (not in the pool).
    pub events_outstanding: u64,
    /// Event objects created (the pool's size is `events_created - events_destroyed`).
    pub events_created: u64,
    /// Event objects destroyed.
    pub events_destroyed: u64,
    /// Requests that failed with out-of-memory.
    pub ooms: u64,
    /// Synchronisations made to free memory for a request no other step could serve
    /// (PyTorch's `num_alloc_retries`), whether the retry succeeded or not.
    pub retries: u64,
    /// Frees of pointers the allocator did not hand out (or already freed).
    pub invalid_frees: u64,
    /// Device-wide synchronisations the allocator made (emptying the cache, or reclaiming
    /// pages of expandable segments): each one stalls the host until the GPU is idle.
    pub device_syncs: u64,
    /// Bytes of physical pages mapped into expandable segments, over the allocator's life.
    pub page_map_bytes: u64,
    /// Bytes of physical pages unmapped from expandable segments, over its life.
    pub page_unmap_bytes: u64,
    /// Stitched ranges made: free pages of expandable segments mapped a second time into
    /// one range for a request no free block fitted.
    pub stitches: u64,
    /// Bytes mapped into stitched ranges (second mappings: no memory is reserved by them).
    pub stitched_map_bytes: u64,
    /// Stitched ranges kept after their free and taken again, mapping nothing.
    pub stitch_revivals: u64,
    /// Stitched ranges unmapped.
    pub stitch_evictions: u64,
    /// Host nanoseconds spent in the driver's virtual-memory calls (mapping pages, mapping
    /// them a second time for a stitch, unmapping), over the allocator's life: what memory
    /// that follows live blocks costs in time. Absent from records written before it was
    /// kept (then zero).
    #[serde(default)]
    pub vmm_ns: u64,
    /// Requests that the stream's own ready blocks could not serve: the policy's slow path
    /// (completed events, other streams' blocks, stitching, growth, reclaims). Absent from
    /// records written before it was kept (then zero).
    #[serde(default)]
    pub slow_paths: u64,
    /// Host nanoseconds those requests took (the backend's precise clock), driver calls and
    /// synchronisations included: with `allocs`, what the allocator cost the host beyond
    /// its fast path. Absent from records written before it was kept (then zero).
    #[serde(default)]
    pub slow_path_ns: u64,
    /// The same events in PyTorch's terms (`torch.cuda.memory_stats()`). Absent from records
    /// written before it was kept (then zeros).
    #[serde(default)]
    pub torch: TorchStats,
    /// Bytes of device memory that sleeping memory pools gave back, their addresses kept
    /// (not part of `reserved_bytes`; see `Allocator::sleep`).
    #[serde(default)]
    pub sleeping_bytes: u64,
    /// Bytes of page-locked host memory held for sleeping pools' backups (kept between
    /// sleeps).
    #[serde(default)]
    pub host_backup_bytes: u64,
}
