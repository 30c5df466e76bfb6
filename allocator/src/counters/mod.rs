//! The counters the engine updates as it works, kept as cheaply as their meaning allows and
//! turned into the [`Stats`] users read only when they read them ([`Counters::read`]).
//!
//! Every malloc and free updates the statistics, so their cost is part of every call,
//! while users read them rarely. So nothing is kept that can be worked out when read:
//! - a gauge keeps its current value, its peak and what was taken from it ([`Level`]);
//!   what was added to it is `current + freed` (a [`Gauge`]'s invariant);
//! - a value counted twice is kept once: PyTorch's `allocated_bytes`, `requested_bytes`
//!   and `reserved_bytes` over all pools are the engine's own gauges, updated by the same
//!   events; its `allocation` over all pools is `allocs - frees` with its own peak;
//! - the counters of every malloc and free lie together at the front (`#[repr(C)]`), a
//!   few cache lines rather than the ~1 KiB of [`Stats`];
//! - PyTorch's active and inactive-split statistics change once per operation by its net
//!   change ([`Nets`]), applied only to the pool kinds the operation touched.
//!
//! `Level` updates are the only arithmetic on the fast path; `read` (and the invariant
//! checks, which compare what it returns with the blocks) shows that the derived values
//! mean what [`Stats`] documents.

mod level;

use self::level::{add, gauges, settle_array, sub, Level, Levels, Nets};
use crate::stats::{kind_index, StatArray, Stats, TorchStats};
use crate::types::PoolKind;

/// PyTorch's view of the blocks handed to callers of one pool kind (`StatArray` entries
/// `small_pool` or `large_pool`).
#[derive(Clone, Copy, Debug, Default)]
struct Handed {
    /// Blocks.
    blocks: Level,
    /// Their bytes, withheld blocks included (PyTorch's `allocated_bytes`).
    bytes: Level,
    /// Bytes their callers asked for.
    requested: Level,
}

/// The engine's counters: what [`Stats`] is made of. See the module docs.
#[derive(Clone, Debug)]
#[repr(C)]
pub(crate) struct Counters {
    // ---- Every malloc and free -------------------------------------------------------
    /// Bytes in blocks handed to callers, and withheld ones (PyTorch's
    /// `allocated_bytes.all` too).
    pub(crate) allocated_bytes: Level,
    /// Bytes callers asked for (PyTorch's `requested_bytes.all` too).
    pub(crate) requested_bytes: Level,
    /// Bytes of blocks allocated or awaiting other streams' events, changed at once.
    pub(crate) active_bytes: Level,
    /// Blocks handed out.
    pub(crate) allocs: u64,
    /// Blocks returned by callers.
    pub(crate) frees: u64,
    /// Peak of PyTorch's `allocation.all`, whose current value is `allocs - frees`.
    allocation_peak: u64,
    /// PyTorch's view of the handed-out blocks, per pool kind (`[small, large]`).
    handed: [Handed; 2],
    /// The current operation's net changes.
    nets: Nets,
    /// PyTorch's `active`.
    active: Levels,
    /// PyTorch's `active_bytes`.
    active_bytes_by_kind: Levels,
    /// PyTorch's `oversize_allocations`.
    oversize_allocations: Level,
    /// Blocks at least this large are oversize (`max_split_size`; `u64::MAX` when unset).
    max_split_size: u64,
    // ---- Slow paths ------------------------------------------------------------------
    /// Bytes obtained from the device (PyTorch's `reserved_bytes.all` too).
    pub(crate) reserved_bytes: Level,
    /// Bytes in free blocks that carry pending events.
    pub(crate) pending_free_bytes: Level,
    /// PyTorch's `inactive_split`.
    inactive_split: Levels,
    /// PyTorch's `inactive_split_bytes`.
    inactive_split_bytes: Levels,
    /// PyTorch's `segment`.
    segment: Levels,
    /// PyTorch's `reserved_bytes` (its `all` entry unused: `reserved_bytes` above).
    reserved_by_kind: Levels,
    /// PyTorch's `oversize_segments`.
    oversize_segments: Level,
    /// PyTorch's counters that are not gauges (`num_alloc_retries`, ...).
    pub(crate) torch: TorchCounts,
    /// See [`Stats::segment_allocs`].
    pub(crate) segment_allocs: u64,
    /// See [`Stats::segment_frees`].
    pub(crate) segment_frees: u64,
    /// See [`Stats::cross_stream_waits`].
    pub(crate) cross_stream_waits: u64,
    /// See [`Stats::events_recorded`].
    pub(crate) events_recorded: u64,
    /// See [`Stats::event_queries`].
    pub(crate) event_queries: u64,
    /// See [`Stats::events_outstanding`].
    pub(crate) events_outstanding: u64,
    /// See [`Stats::events_created`].
    pub(crate) events_created: u64,
    /// See [`Stats::events_destroyed`].
    pub(crate) events_destroyed: u64,
    /// See [`Stats::ooms`].
    pub(crate) ooms: u64,
    /// See [`Stats::retries`].
    pub(crate) retries: u64,
    /// See [`Stats::invalid_frees`].
    pub(crate) invalid_frees: u64,
    /// See [`Stats::device_syncs`].
    pub(crate) device_syncs: u64,
    /// See [`Stats::page_map_bytes`].
    pub(crate) page_map_bytes: u64,
    /// See [`Stats::page_unmap_bytes`].
    pub(crate) page_unmap_bytes: u64,
    /// See [`Stats::stitches`].
    pub(crate) stitches: u64,
    /// See [`Stats::stitched_map_bytes`].
    pub(crate) stitched_map_bytes: u64,
    /// See [`Stats::stitch_revivals`].
    pub(crate) stitch_revivals: u64,
    /// See [`Stats::stitch_evictions`].
    pub(crate) stitch_evictions: u64,
    /// See [`Stats::vmm_ns`].
    pub(crate) vmm_ns: u64,
    /// See [`Stats::slow_paths`].
    pub(crate) slow_paths: u64,
    /// See [`Stats::slow_path_ns`].
    pub(crate) slow_path_ns: u64,
    /// See [`Stats::sleeping_bytes`].
    pub(crate) sleeping_bytes: u64,
    /// See [`Stats::host_backup_bytes`].
    pub(crate) host_backup_bytes: u64,
}

/// PyTorch's counters that are plain counts.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TorchCounts {
    /// See [`TorchStats::alloc_retries`].
    pub(crate) alloc_retries: u64,
    /// See [`TorchStats::device_allocs`].
    pub(crate) device_allocs: u64,
    /// See [`TorchStats::device_frees`].
    pub(crate) device_frees: u64,
}

impl Counters {
    /// Zeroed counters; blocks of `max_split_size` bytes or more are oversize (`None`:
    /// none is).
    pub(crate) fn new(max_split_size: Option<u64>) -> Self {
        Self {
            allocated_bytes: Level::default(),
            requested_bytes: Level::default(),
            active_bytes: Level::default(),
            allocs: 0,
            frees: 0,
            allocation_peak: 0,
            handed: [Handed::default(); 2],
            nets: Nets::default(),
            active: Levels::default(),
            active_bytes_by_kind: Levels::default(),
            oversize_allocations: Level::default(),
            max_split_size: max_split_size.unwrap_or(u64::MAX),
            reserved_bytes: Level::default(),
            pending_free_bytes: Level::default(),
            inactive_split: Levels::default(),
            inactive_split_bytes: Levels::default(),
            segment: Levels::default(),
            reserved_by_kind: Levels::default(),
            oversize_segments: Level::default(),
            torch: TorchCounts::default(),
            segment_allocs: 0,
            segment_frees: 0,
            cross_stream_waits: 0,
            events_recorded: 0,
            event_queries: 0,
            events_outstanding: 0,
            events_created: 0,
            events_destroyed: 0,
            ooms: 0,
            retries: 0,
            invalid_frees: 0,
            device_syncs: 0,
            page_map_bytes: 0,
            page_unmap_bytes: 0,
            stitches: 0,
            stitched_map_bytes: 0,
            stitch_revivals: 0,
            stitch_evictions: 0,
            vmm_ns: 0,
            slow_paths: 0,
            slow_path_ns: 0,
            sleeping_bytes: 0,
            host_backup_bytes: 0,
        }
    }

    /// What users read: every counter, derived values worked out.
    pub(crate) fn read(&self) -> Stats {
        let by_kind = |level: fn(&Handed) -> Level, all: Level| -> StatArray {
            [
                all.gauge(),
                level(&self.handed[0]).gauge(),
                level(&self.handed[1]).gauge(),
            ]
        };
        let allocation = Level {
            current: self.allocs - self.frees,
            peak: self.allocation_peak,
            freed: self.frees,
        };
        let mut reserved_by_kind = gauges(&self.reserved_by_kind);
        reserved_by_kind[0] = self.reserved_bytes.gauge();
        Stats {
            allocated_bytes: self.allocated_bytes.gauge(),
            requested_bytes: self.requested_bytes.gauge(),
            reserved_bytes: self.reserved_bytes.gauge(),
            active_bytes: self.active_bytes.gauge(),
            pending_free_bytes: self.pending_free_bytes.gauge(),
            allocs: self.allocs,
            frees: self.frees,
            segment_allocs: self.segment_allocs,
            segment_frees: self.segment_frees,
            cross_stream_waits: self.cross_stream_waits,
            events_recorded: self.events_recorded,
            event_queries: self.event_queries,
            events_outstanding: self.events_outstanding,
            events_created: self.events_created,
            events_destroyed: self.events_destroyed,
            ooms: self.ooms,
            retries: self.retries,
            invalid_frees: self.invalid_frees,
            device_syncs: self.device_syncs,
            page_map_bytes: self.page_map_bytes,
            page_unmap_bytes: self.page_unmap_bytes,
            stitches: self.stitches,
            stitched_map_bytes: self.stitched_map_bytes,
            stitch_revivals: self.stitch_revivals,
            stitch_evictions: self.stitch_evictions,
            vmm_ns: self.vmm_ns,
            slow_paths: self.slow_paths,
            slow_path_ns: self.slow_path_ns,
            sleeping_bytes: self.sleeping_bytes,
            host_backup_bytes: self.host_backup_bytes,
            torch: TorchStats {
                allocation: by_kind(|h| h.blocks, allocation),
                segment: gauges(&self.segment),
                active: gauges(&self.active),
                inactive_split: gauges(&self.inactive_split),
                allocated_bytes: by_kind(|h| h.bytes, self.allocated_bytes),
                reserved_bytes: reserved_by_kind,
                active_bytes: gauges(&self.active_bytes_by_kind),
                inactive_split_bytes: gauges(&self.inactive_split_bytes),
                requested_bytes: by_kind(|h| h.requested, self.requested_bytes),
                oversize_allocations: self.oversize_allocations.gauge(),
                oversize_segments: self.oversize_segments.gauge(),
                alloc_retries: self.torch.alloc_retries,
                device_allocs: self.torch.device_allocs,
                device_frees: self.torch.device_frees,
                max_split_size: self.max_split_size,
            },
        }
    }

    /// True for a block size PyTorch calls oversize.
    #[inline]
    fn oversize(&self, size: u64) -> bool {
        size >= self.max_split_size
    }

    // ---- Events, each updating the engine's counters and PyTorch's view together -----
    // `kind` is the pool a block counts in (`allocator::torch_stats::stat_kind`).

    /// A block of `size` bytes for a request of `requested` was handed to a caller.
    #[inline]
    pub(crate) fn handed_out(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.count_handed_out(kind, size, requested);
        self.nets.add_active(kind, 1, size);
    }

    /// [`Counters::handed_out`] in an operation that changes no other active block (a
    /// malloc served from the stream's ready blocks): its net change is this one, applied
    /// at once.
    #[inline]
    pub(crate) fn handed_out_alone(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.count_handed_out(kind, size, requested);
        self.before_active_alone();
        let index = kind_index(kind);
        self.active[index].add(1);
        self.active_bytes_by_kind[index].add(size);
        self.active[0].add(1);
        self.active_bytes_by_kind[0].add(size);
    }

    #[inline]
    fn count_handed_out(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.allocated_bytes.add(size);
        self.requested_bytes.add(requested);
        self.active_bytes.add(size);
        self.allocs += 1;
        let allocations = self.allocs - self.frees;
        if allocations > self.allocation_peak {
            self.allocation_peak = allocations;
        }
        let handed = &mut self.handed[kind as usize];
        handed.blocks.add(1);
        handed.bytes.add(size);
        handed.requested.add(requested);
        if self.oversize(size) {
            self.oversize_allocations.add(1);
        }
    }

    /// The caller returned a block of `size` bytes handed out for `requested`.
    #[inline]
    pub(crate) fn returned(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.count_returned(kind, size, requested);
        self.nets.add_active(kind, -1, size);
    }

    /// [`Counters::returned`] in an operation that changes no other active block (a free
    /// no other stream used): its net change is this one, applied at once.
    #[inline]
    pub(crate) fn returned_alone(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.count_returned(kind, size, requested);
        self.before_active_alone();
        let index = kind_index(kind);
        self.active[index].sub(1);
        self.active_bytes_by_kind[index].sub(size);
        self.active[0].sub(1);
        self.active_bytes_by_kind[0].sub(size);
    }

    #[inline]
    fn count_returned(&mut self, kind: PoolKind, size: u64, requested: u64) {
        self.allocated_bytes.sub(size);
        self.requested_bytes.sub(requested);
        self.active_bytes.sub(size);
        self.frees += 1;
        let handed = &mut self.handed[kind as usize];
        handed.blocks.sub(1);
        handed.bytes.sub(size);
        handed.requested.sub(requested);
        if self.oversize(size) {
            self.oversize_allocations.sub(1);
        }
    }

    /// Checks, in debug builds, that the operation's active change about to be applied at
    /// once is its only one: no net change before it, none allowed after.
    #[inline]
    fn before_active_alone(&mut self) {
        #[cfg(debug_assertions)]
        {
            assert_eq!(
                self.nets.touched & 3,
                0,
                "an active change applied at once after others in the same operation"
            );
            self.nets.active_changed = true;
        }
    }

    /// A free block of `size` bytes now awaits other streams' events (listed as pending, or
    /// withheld while a capture is under way).
    #[inline]
    pub(crate) fn pending_in(&mut self, kind: PoolKind, size: u64) {
        self.pending_free_bytes.add(size);
        self.active_bytes.add(size);
        self.nets.add_active(kind, 1, size);
    }

    /// A free block of `size` bytes stopped awaiting events as such (unlisted to be
    /// reused, merged or promoted).
    #[inline]
    pub(crate) fn pending_out(&mut self, kind: PoolKind, size: u64) {
        self.pending_free_bytes.sub(size);
        self.active_bytes.sub(size);
        self.nets.add_active(kind, -1, size);
    }

    /// A block of `size` bytes whose reuse could not be ordered is kept allocated to nobody.
    pub(crate) fn withheld_in(&mut self, kind: PoolKind, size: u64) {
        self.allocated_bytes.add(size);
        self.active_bytes.add(size);
        self.handed[kind as usize].bytes.add(size);
        self.nets.add_active(kind, 1, size);
    }

    /// A withheld block of `size` bytes was freed after a synchronisation.
    pub(crate) fn withheld_out(&mut self, kind: PoolKind, size: u64) {
        self.allocated_bytes.sub(size);
        self.active_bytes.sub(size);
        self.handed[kind as usize].bytes.sub(size);
        self.nets.add_active(kind, -1, size);
    }

    /// A free block of a whole segment that shares its segment entered the free lists
    /// (or a hot list), ready for reuse.
    #[inline]
    pub(crate) fn split_in(&mut self, kind: PoolKind, size: u64) {
        self.nets.add_split(kind, 1, size);
    }

    /// Such a block left them.
    #[inline]
    pub(crate) fn split_out(&mut self, kind: PoolKind, size: u64) {
        self.nets.add_split(kind, -1, size);
    }

    /// `bytes` were obtained from the device for blocks of `kind`: a whole segment
    /// (`segment`), or pages mapped into an expandable one. One device call.
    pub(crate) fn reserved(&mut self, kind: PoolKind, bytes: u64, segment: bool) {
        self.reserved_bytes.add(bytes);
        self.reserved_by_kind[kind_index(kind)].add(bytes);
        self.torch.device_allocs += 1;
        if segment {
            self.segment_allocs += 1;
            add(&mut self.segment, kind, 1);
            if self.oversize(bytes) {
                self.oversize_segments.add(1);
            }
        }
    }

    /// `bytes` counted in `kind` went back to the device: a whole segment (`segment`), or
    /// part of the pages one unmapping returned ([`Counters::device_freed`] counts the
    /// call).
    pub(crate) fn released(&mut self, kind: PoolKind, bytes: u64, segment: bool) {
        self.reserved_bytes.sub(bytes);
        self.reserved_by_kind[kind_index(kind)].sub(bytes);
        if segment {
            self.segment_frees += 1;
            self.torch.device_frees += 1;
            sub(&mut self.segment, kind, 1);
            if self.oversize(bytes) {
                self.oversize_segments.sub(1);
            }
        }
    }

    /// One call that unmapped pages (their bytes are [`Counters::released`]).
    pub(crate) fn device_freed(&mut self) {
        self.torch.device_frees += 1;
    }

    /// Applies the current operation's net changes of active and inactive-split blocks:
    /// each a single increase or decrease of its gauges, as PyTorch's allocator makes one
    /// per call. Called once an engine operation is over; nothing to do when it moved no
    /// block.
    #[inline]
    pub(crate) fn settle(&mut self) {
        #[cfg(debug_assertions)]
        {
            self.nets.active_changed = false;
        }
        if self.nets.touched != 0 {
            self.settle_nets();
        }
    }

    /// The net changes [`Counters::settle`] applies: slow paths only (the fast paths
    /// change the active statistics at once, and only whole segments that share their
    /// segment count as inactive-split).
    #[cold]
    #[inline(never)]
    fn settle_nets(&mut self) {
        let nets = std::mem::take(&mut self.nets);
        let touched = nets.touched;
        if touched & 3 != 0 {
            settle_array(
                &mut self.active,
                &mut self.active_bytes_by_kind,
                &nets.active,
                touched & 3,
            );
        }
        if touched & 12 != 0 {
            settle_array(
                &mut self.inactive_split,
                &mut self.inactive_split_bytes,
                &nets.inactive_split,
                touched >> 2,
            );
        }
    }

    /// True if every net change of the last operation was applied.
    pub(crate) fn settled(&self) -> bool {
        self.nets.touched == 0
    }

    /// Sets every peak to its current value.
    pub(crate) fn reset_peaks(&mut self) {
        for level in [
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
            &mut self.active_bytes,
            &mut self.reserved_bytes,
            &mut self.pending_free_bytes,
            &mut self.oversize_allocations,
            &mut self.oversize_segments,
        ] {
            level.reset_peak();
        }
        self.allocation_peak = self.allocs - self.frees;
        for handed in &mut self.handed {
            handed.blocks.reset_peak();
            handed.bytes.reset_peak();
            handed.requested.reset_peak();
        }
        for levels in [
            &mut self.active,
            &mut self.active_bytes_by_kind,
            &mut self.inactive_split,
            &mut self.inactive_split_bytes,
            &mut self.segment,
            &mut self.reserved_by_kind,
        ] {
            levels.iter_mut().for_each(Level::reset_peak);
        }
    }
}
