//! Counters a user reads to see where memory went, in PyTorch's vocabulary.
//!
//! Invariants (checked by the property tests):
//! `allocated_bytes == Σ size of live blocks`,
//! `reserved_bytes == Σ size of segments`,
//! `allocated_bytes + cached_bytes == reserved_bytes`.
//!
//! [`TorchStats`] keeps the same events in the form of PyTorch's `DeviceStats` (every
//! `torch.cuda.memory_stats()` key), updated where the engine's own counters are; the
//! per-operation rules it follows are in `allocator::torch_stats`.

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

    /// Adds `delta` if positive, takes it away if negative: one net change, counted once in
    /// `allocated` or `freed` (PyTorch applies a block's net change per call the same way).
    #[inline]
    fn apply(&mut self, delta: i64) {
        if delta > 0 {
            self.add(delta.unsigned_abs());
        } else if delta < 0 {
            self.sub(delta.unsigned_abs());
        }
    }
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
    /// Net changes of the current operation, applied once when it ends.
    #[serde(skip)]
    pub(crate) nets: Nets,
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
            nets: Nets::default(),
        }
    }
}

/// Net changes of active and inactive-split blocks within one engine operation, per pool
/// kind (`[small, large]`): (blocks, bytes). A block moves between the engine's lists
/// several times in one call (unlisted, merged, split, listed again); only the net change
/// is PyTorch's event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Nets {
    active: [(i64, i64); 2],
    inactive_split: [(i64, i64); 2],
    /// Some net is not zero.
    dirty: bool,
}

impl TorchStats {
    /// Adds `amount` to `array`'s `all` gauge and to `kind`'s.
    #[inline]
    fn add(array: &mut StatArray, kind: PoolKind, amount: u64) {
        array[0].add(amount);
        array[kind_index(kind)].add(amount);
    }

    /// Takes `amount` from `array`'s `all` gauge and from `kind`'s.
    #[inline]
    fn sub(array: &mut StatArray, kind: PoolKind, amount: u64) {
        array[0].sub(amount);
        array[kind_index(kind)].sub(amount);
    }

    /// True for a block size PyTorch calls oversize.
    #[inline]
    fn oversize(&self, size: u64) -> bool {
        size >= self.max_split_size
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

/// How the engine tells its counters what happened: each call updates the engine's own
/// counters and PyTorch's view of them together. `kind` is the pool a block counts in
/// (`allocator::torch_stats::stat_kind`).
impl Stats {
    /// A block of `size` bytes for a request of `requested` was handed to a caller.
    #[inline]
    pub(crate) fn handed_out(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.allocated_bytes.add(size);
        self.requested_bytes.add(requested);
        self.active_bytes.add(size);
        self.allocs += 1;
        let torch = &mut self.torch;
        TorchStats::add(&mut torch.allocation, kind, 1);
        TorchStats::add(&mut torch.allocated_bytes, kind, size);
        TorchStats::add(&mut torch.requested_bytes, kind, requested);
        if torch.oversize(size) {
            torch.oversize_allocations.add(1);
        }
        torch.nets.add_active(kind, 1, size);
    }

    /// The caller returned a block of `size` bytes handed out for `requested`.
    #[inline]
    pub(crate) fn returned(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.allocated_bytes.sub(size);
        self.requested_bytes.sub(requested);
        self.active_bytes.sub(size);
        self.frees += 1;
        let torch = &mut self.torch;
        TorchStats::sub(&mut torch.allocation, kind, 1);
        TorchStats::sub(&mut torch.allocated_bytes, kind, size);
        TorchStats::sub(&mut torch.requested_bytes, kind, requested);
        if torch.oversize(size) {
            torch.oversize_allocations.sub(1);
        }
        torch.nets.add_active(kind, -1, size);
    }

    /// A free block of `size` bytes now awaits other streams' events (listed as pending, or
    /// withheld while a capture is under way).
    #[inline]
    pub(crate) fn pending_in(&mut self, kind: PoolKind, size: u64) {
        self.pending_free_bytes.add(size);
        self.active_bytes.add(size);
        self.torch.nets.add_active(kind, 1, size);
    }

    /// A free block of `size` bytes stopped awaiting events as such (unlisted to be
    /// reused, merged or promoted).
    #[inline]
    pub(crate) fn pending_out(&mut self, kind: PoolKind, size: u64) {
        self.pending_free_bytes.sub(size);
        self.active_bytes.sub(size);
        self.torch.nets.add_active(kind, -1, size);
    }

    /// A block of `size` bytes whose reuse could not be ordered is kept allocated to nobody.
    pub(crate) fn withheld_in(&mut self, kind: PoolKind, size: u64) {
        self.allocated_bytes.add(size);
        self.active_bytes.add(size);
        TorchStats::add(&mut self.torch.allocated_bytes, kind, size);
        self.torch.nets.add_active(kind, 1, size);
    }

    /// A withheld block of `size` bytes was freed after a synchronisation.
    pub(crate) fn withheld_out(&mut self, kind: PoolKind, size: u64) {
        self.allocated_bytes.sub(size);
        self.active_bytes.sub(size);
        TorchStats::sub(&mut self.torch.allocated_bytes, kind, size);
        self.torch.nets.add_active(kind, -1, size);
    }

    /// A free block of a whole segment that shares its segment entered the free lists
    /// (or a hot list), ready for reuse.
    #[inline]
    pub(crate) fn split_in(&mut self, kind: PoolKind, size: u64) {
        self.torch.nets.add_split(kind, 1, size);
    }

    /// Such a block left them.
    #[inline]
    pub(crate) fn split_out(&mut self, kind: PoolKind, size: u64) {
        self.torch.nets.add_split(kind, -1, size);
    }

    /// `bytes` were obtained from the device for blocks of `kind`: a whole segment
    /// (`segment`), or pages mapped into an expandable one. One device call.
    pub(crate) fn reserved(&mut self, kind: PoolKind, bytes: u64, segment: bool) {
        self.reserved_bytes.add(bytes);
        let torch = &mut self.torch;
        TorchStats::add(&mut torch.reserved_bytes, kind, bytes);
        torch.device_allocs += 1;
        if segment {
            self.segment_allocs += 1;
            TorchStats::add(&mut torch.segment, kind, 1);
            if torch.oversize(bytes) {
                torch.oversize_segments.add(1);
            }
        }
    }

    /// `bytes` counted in `kind` went back to the device: a whole segment (`segment`), or
    /// part of the pages one unmapping returned ([`Stats::device_freed`] counts the call).
    pub(crate) fn released(&mut self, kind: PoolKind, bytes: u64, segment: bool) {
        self.reserved_bytes.sub(bytes);
        let torch = &mut self.torch;
        TorchStats::sub(&mut torch.reserved_bytes, kind, bytes);
        if segment {
            self.segment_frees += 1;
            torch.device_frees += 1;
            TorchStats::sub(&mut torch.segment, kind, 1);
            if torch.oversize(bytes) {
                torch.oversize_segments.sub(1);
            }
        }
    }

    /// One call that unmapped pages (their bytes are [`Stats::released`]).
    pub(crate) fn device_freed(&mut self) {
        self.torch.device_frees += 1;
    }

    /// Applies the current operation's net changes of active and inactive-split blocks:
    /// each a single increase or decrease of its gauges, as PyTorch's allocator makes one
    /// per call. Called once an engine operation is over.
    #[inline]
    pub(crate) fn settle(&mut self) {
        let torch = &mut self.torch;
        if !torch.nets.dirty {
            return;
        }
        let nets = std::mem::take(&mut torch.nets);
        let pairs = [
            (&nets.active, &mut torch.active, &mut torch.active_bytes),
            (
                &nets.inactive_split,
                &mut torch.inactive_split,
                &mut torch.inactive_split_bytes,
            ),
        ];
        for (net, blocks, bytes) in pairs {
            for (kind, &(count, size)) in [PoolKind::Small, PoolKind::Large].iter().zip(net) {
                blocks[kind_index(*kind)].apply(count);
                bytes[kind_index(*kind)].apply(size);
            }
            blocks[0].apply(net[0].0 + net[1].0);
            bytes[0].apply(net[0].1 + net[1].1);
        }
    }

    /// True if every net change of the last operation was applied.
    pub(crate) fn settled(&self) -> bool {
        !self.torch.nets.dirty
    }

    /// Sets every peak to its current value.
    pub(crate) fn reset_peaks(&mut self) {
        self.allocated_bytes.reset_peak();
        self.requested_bytes.reset_peak();
        self.reserved_bytes.reset_peak();
        self.active_bytes.reset_peak();
        self.pending_free_bytes.reset_peak();
        let torch = &mut self.torch;
        for array in [
            &mut torch.allocation,
            &mut torch.segment,
            &mut torch.active,
            &mut torch.inactive_split,
            &mut torch.allocated_bytes,
            &mut torch.reserved_bytes,
            &mut torch.active_bytes,
            &mut torch.inactive_split_bytes,
            &mut torch.requested_bytes,
        ] {
            array.iter_mut().for_each(Gauge::reset_peak);
        }
        torch.oversize_allocations.reset_peak();
        torch.oversize_segments.reset_peak();
    }
}

impl Nets {
    #[inline]
    fn add_active(&mut self, kind: PoolKind, blocks: i64, bytes: u64) {
        let net = &mut self.active[kind as usize];
        net.0 += blocks;
        net.1 += blocks.signum() * bytes as i64;
        self.dirty = true;
    }

    #[inline]
    fn add_split(&mut self, kind: PoolKind, blocks: i64, bytes: u64) {
        let net = &mut self.inactive_split[kind as usize];
        net.0 += blocks;
        net.1 += blocks.signum() * bytes as i64;
        self.dirty = true;
    }
}
