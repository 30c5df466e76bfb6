//! Counters a user reads to see where memory went, in PyTorch's vocabulary.
//!
//! Invariants (checked by the property tests):
//! `allocated_bytes == Σ size of live blocks`,
//! `reserved_bytes == Σ size of segments`,
//! `allocated_bytes + cached_bytes == reserved_bytes`.

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

impl Gauge {
    #[inline]
    pub(crate) fn add(&mut self, bytes: u64) {
        self.current += bytes;
        self.allocated += bytes;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    #[inline]
    pub(crate) fn sub(&mut self, bytes: u64) {
        debug_assert!(self.current >= bytes, "gauge underflow");
        self.current -= bytes;
        self.freed += bytes;
    }

    pub(crate) fn reset_peak(&mut self) {
        self.peak = self.current;
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
    /// Bytes of device memory that sleeping memory pools gave back, their addresses kept
    /// (not part of `reserved_bytes`; see `Allocator::sleep`).
    #[serde(default)]
    pub sleeping_bytes: u64,
    /// Bytes of page-locked host memory held for sleeping pools' backups (kept between
    /// sleeps).
    #[serde(default)]
    pub host_backup_bytes: u64,
}
