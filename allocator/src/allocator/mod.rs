//! The allocator: the policy that ties pool, lifetimes, stats and trace together.
//!
//! One [`Allocator`] serves one device. Its state sits behind one lock (`crate::lock`); the
//! fast path (a ready block of the caller's stream) takes it once and makes no backend call
//! but the trace clock.
//!
//! # Allocation policy, in order
//! Memory pressure decides how far a request goes: while memory is plentiful it is served
//! without waiting on other streams' work in flight; near the limit the engine becomes
//! frugal, in a fixed order, and fails only after all of it.
//! 1. a ready block of the caller's stream (best fit) — no event, no wait;
//! 2. blocks whose events completed: a batched completion pass, only once enough events are
//!    in flight (`event_batch`), or always under the PyTorch policy;
//! 3. (`stream_wait` policy) the best-fitting block of the caller's pending list or of any
//!    other stream: the caller's stream waits for it on the device;
//! 4. (expandable segments, `stitch`) revive a kept stitched range, or stitch free pages
//!    that need no device wait (the stream's own), growing only the shortfall and only
//!    within the growth budget; a new stitch is skipped for growth while remapping takes
//!    more than its share of time (`expandable`'s `REMAP_TIME_SHARE`);
//! 5. grow within the growth budget (the live peak plus a slack) and the limit: a new
//!    segment, or pages mapped into the stream's address reservation;
//! 6. (`stitch`) stitch free pages of every stream of the memory pool, the caller's stream
//!    waiting on the device for their last uses;
//! 7. grow past the budget, within the limit (expandable segments reclaim free mappings
//!    first, as `reclaim` asks: a synchronisation);
//! 8. under pressure (the limit, or the device, refuses): synchronise once, so that every
//!    free byte is idle for every stream; then the caller's blocks and any stream's,
//!    stitching every free page of the pool, unmapping free whole pages until the request
//!    fits and mapping it, and finally returning every cached byte and growing again;
//! 9. a typed out-of-memory error with a fragmentation report.
//!
//! With a memory limit set, a request fails only if live bytes, the request (in whole
//! pages), the free bytes stranded in partly used pages and the memory the pool may not
//! touch (other pools' pinned memory) exceed the limit: step 8 reaches every other byte
//! (`tests/pressure_properties.rs` states it).
//!
//! Every step looks only at blocks of the request's memory pool (`pools`): a slot is a
//! stream in one pool, and step 3 considers only slots of the same pool. A pool whose tag
//! is asleep refuses requests before step 1; a tagged pool is never stitched (`sleep`).

mod allocate;
mod completion;
mod expandable;
mod free;
mod free_lists;
mod invariants;
mod join;
mod pools;
mod release;
mod report;
mod sleep;
mod stitch;
mod torch_stats;
mod unmap;
mod unstitch;
mod wake;

use expandable::RECLAIM_SLACK_BP;
pub use pools::PoolBlock;
use release::Release;
pub use sleep::{Backup, SleepReport, TagInfo, WakeReport};

use crate::backend::Backend;
use crate::config::{Config, ReusePolicy};
use crate::counters::Counters;
use crate::error::{AllocError, BackendError, OutOfMemory};
use crate::lifetime::{EventKey, EventTable, PoolTable, StreamTable};
use crate::lock::EngineLock;
use crate::pool::arena::{Arena, BlockKey, StreamSlot};
use crate::pool::expandable::ExpandableTable;
use crate::pool::size::{
    pool_of, round_size, segment_size_for, should_split, MAX_REQUEST, MIN_BLOCK_SIZE,
    SEGMENT_ROUNDING,
};
use crate::pool::sleep::TagTable;
use crate::pool::stitch::StitchTable;
use crate::snapshot::{BlockInfo, BlockState, SegmentInfo, Snapshot};
use crate::stats::Stats;
use crate::trace::{CompactRing, TraceAction, NO_STREAM};
use crate::types::{Allocation, DevicePtr, PoolId, PoolKind, StreamId};
use crate::util::BuildAddrHasher;
use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;

/// Requests at least `max_split_size` may use a cached block at most this much larger
/// (PyTorch's `kLargeBuffer`), so oversize blocks are not wasted on much smaller requests.
const OVERSIZE_SLACK: u64 = 20 << 20;

/// Where a live allocation lies (see [`Allocator::allocation_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationSite {
    /// Bytes reserved for it (the request rounded).
    pub size: u64,
    /// The first byte of its segment: for an expandable segment, of the address
    /// reservation.
    pub segment: DevicePtr,
    /// The segment's bytes (the reservation's, for an expandable segment).
    pub segment_size: u64,
    /// The memory is mapped through the VMM API: an expandable segment, or a stitched
    /// range.
    pub expandable: bool,
    /// The allocation is a stitched range (pages of several mappings joined): CUDA IPC
    /// shares its pages ([`Allocator::stitched_pages`]).
    pub stitched: bool,
}

/// A caching allocator for one device over backend `B`. `Send + Sync` when `B` is; every
/// method may be called from any thread.
#[derive(Debug)]
pub struct Allocator<B: Backend> {
    backend: B,
    config: Config,
    state: EngineLock<State>,
}

/// Everything behind the lock.
#[derive(Debug)]
struct State {
    /// Segments and blocks.
    arena: Arena,
    /// Per-stream free lists and in-flight events.
    streams: StreamTable,
    /// Recorded events and the idle event pool.
    events: EventTable,
    /// Address → block, for blocks handed out and for hot blocks (freed and parked in their
    /// stream's hot list, so that a same-size malloc+free pair touches the map not at all);
    /// [`State::allocated_key`] tells the two apart by the block's state. A quarantined
    /// block is allocated but absent.
    allocated: HashMap<u64, BlockKey, BuildAddrHasher>,
    /// Counters, read as [`Stats`].
    stats: Counters,
    /// The pool kind each mapped stretch of the expandable segments counts in, for
    /// PyTorch's per-kind `reserved_bytes`.
    mapped_kinds: torch_stats::MappedKinds,
    /// Recent events.
    trace: CompactRing,
    /// Reserved bytes never exceeded (from `memory_limit`, `memory_fraction` or
    /// [`Allocator::set_memory_limit`]).
    limit: Option<u64>,
    /// How memory is obtained: whole segments or expandable ones.
    growth: Growth,
    /// Expandable segments unmap free mappings to stay near the live peak (the `reclaim`
    /// key); off, they unmap before mapping only to stay within the limit.
    reclaim: bool,
    /// Requests no free block fits are served from free pages stitched into one range
    /// (the `stitch` key; expandable segments only).
    stitching: bool,
    /// Stitched ranges, active and dormant.
    stitches: StitchTable,
    /// Use counts of the memory pools other than the default one, and the pools being
    /// allocated to.
    pools: PoolTable,
    /// Blocks freed while a capture was under way whose other-stream uses still need
    /// events: recording them then would put the events into the capture, so the blocks
    /// stay allocated to nobody, with their address and uses, until the last capture ends.
    deferred_frees: Vec<(BlockKey, u64, thin_vec::ThinVec<StreamSlot>)>,
    /// Tagged memory pools, and what the sleeping ones gave back (`sleep`).
    tags: TagTable,
}

/// How far a step of the policy may go to find memory (see the module docs): each level
/// allows what the previous ones do, and more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Effort {
    /// No device wait on another stream's work, and no memory past the growth budget.
    Light,
    /// Device-side waits on other streams' work; memory up to the limit.
    Waiting,
    /// Right after a device-wide synchronisation: every free byte is idle, so nothing needs
    /// waiting for, and free pages may be unmapped to make room.
    Synchronised,
}

/// What a request needs from a free block: its stream slot, the pool kind whose lists may
/// serve it, its rounded size, and the largest block that may be split for it
/// (`max_split_size`). The policy's steps pass it along whole.
#[derive(Clone, Copy, Debug)]
struct Need {
    slot: StreamSlot,
    pool: PoolKind,
    size: u64,
    max_size: u64,
}

/// How the allocator obtains memory from the device: what `expandable_segments` chose,
/// fixed when the allocator is created.
#[derive(Debug)]
enum Growth {
    /// Whole segments, obtained and returned whole: PyTorch's rules, what
    /// `cudaIpcGetMemHandle` needs, and all a backend without virtual memory offers.
    WholeSegments,
    /// Address reservations with pages mapped on demand (`pool::expandable`); boxed, as
    /// the table is large beside the other variant.
    Expandable(Box<ExpandableTable>),
}

impl Growth {
    /// The expandable segments' table, if memory grows that way.
    fn expandable(&self) -> Option<&ExpandableTable> {
        match self {
            Growth::Expandable(table) => Some(table.as_ref()),
            Growth::WholeSegments => None,
        }
    }

    /// The expandable segments' table, if memory grows that way.
    fn expandable_mut(&mut self) -> Option<&mut ExpandableTable> {
        match self {
            Growth::Expandable(table) => Some(table.as_mut()),
            Growth::WholeSegments => None,
        }
    }
}

impl<B: Backend> Allocator<B> {
    /// An allocator over `backend`. `memory_fraction` is resolved against the backend's
    /// total memory here; the stricter of it and `memory_limit` applies.
    pub fn new(backend: B, config: Config) -> Result<Self, AllocError> {
        backend.set_trace_clock(config.trace_clock);
        let mut limit = config.memory_limit;
        if let Some(fraction) = config.memory_fraction {
            let total = backend.total_memory()?;
            let by_fraction = (total as f64 * fraction) as u64;
            limit = Some(limit.map_or(by_fraction, |l| l.min(by_fraction)));
        }
        let growth = if !config.expandable_segments {
            Growth::WholeSegments
        } else if backend.supports_virtual_memory() {
            let mut table = ExpandableTable::new(
                backend.page_size(),
                backend.total_memory()?,
                RECLAIM_SLACK_BP,
            );
            // Under a limit every free page must be able to go back alone: one allocation
            // per page. Otherwise runs are mapped in pieces, since the driver's calls cost
            // per allocation (on an H200 ~55 µs a page to grow, ~37 to stitch, against ~2
            // µs a page in 64 MiB pieces), and stitches take whole pieces (whole growth pieces
            // too under a limit, while it does not bind).
            table.page_granular = config.page_allocations || limit.is_some();
            backend.set_page_allocations(table.page_granular);
            Growth::Expandable(Box::new(table))
        } else {
            // Info, not a warning: expandable segments are the default, and a backend
            // without virtual memory is an expected configuration.
            tracing::info!(
                "expandable_segments:true needs a backend with virtual memory; using whole segments"
            );
            Growth::WholeSegments
        };
        let state = State {
            arena: Arena::default(),
            streams: StreamTable::default(),
            events: EventTable::default(),
            allocated: HashMap::default(),
            stats: Counters::new(config.max_split_size),
            mapped_kinds: torch_stats::MappedKinds::default(),
            trace: CompactRing::new(config.trace_capacity),
            limit,
            growth,
            reclaim: config.reclaim,
            stitching: config.stitch,
            stitches: StitchTable::default(),
            pools: PoolTable::default(),
            deferred_frees: Vec::new(),
            tags: TagTable::default(),
        };
        Ok(Self {
            backend,
            config,
            state: EngineLock::new(state),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Allocates at least `size` bytes for use on `stream`.
    #[inline]
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        if size == 0 || size > MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        let now = self.early_now();
        // `move`: the values travel in the closure, not as pointers to the caller's stack.
        self.operation(move |state| {
            state.malloc(
                &self.backend,
                &self.config,
                size,
                stream,
                PoolId::DEFAULT,
                now,
            )
        })
    }

    /// Runs `body` on the state under the lock, then applies the net changes it made to
    /// PyTorch's statistics (one change per operation, as PyTorch counts them).
    #[inline]
    fn operation<T>(&self, body: impl FnOnce(&mut State) -> T) -> T {
        let mut state = self.state.lock();
        let result = body(&mut state);
        state.stats.settle();
        result
    }

    /// Allocates at least `size` bytes for use on `stream` from memory pool `pool`, which
    /// must be live ([`Allocator::create_or_incref_pool`]) unless it is the default one.
    /// The block comes from, and returns to, that pool's own segments. With the
    /// `graph_pools` switch off, every pool is served from the default one.
    pub fn malloc_in(
        &self,
        size: u64,
        stream: StreamId,
        pool: PoolId,
    ) -> Result<Allocation, AllocError> {
        if pool.is_default() || !self.config.graph_pools {
            return self.malloc(size, stream);
        }
        if size == 0 || size > MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        let now = self.early_now();
        self.operation(|state| {
            if !state.pools.is_live(pool) {
                return Err(AllocError::UnknownPool(pool));
            }
            if let Some(tag) = state.tags.asleep(pool) {
                let tag = tag.name.clone();
                return Err(AllocError::PoolAsleep { tag, size });
            }
            state.malloc(&self.backend, &self.config, size, stream, pool, now)
        })
    }

    /// The clock's raw ticks, read before taking the lock when tracing (so that the read
    /// overlaps the lock's atomic instruction), else 0.
    #[inline]
    fn early_now(&self) -> u64 {
        if self.config.trace_capacity != 0 {
            self.backend.now_ticks()
        } else {
            0
        }
    }

    /// Returns a block. Streams recorded with [`Allocator::record_use`] get one event each;
    /// the block is reusable at once by its own stream.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let now = self.early_now();
        self.operation(|state| {
            if state.free_if_owned(&self.backend, ptr, now)? {
                Ok(())
            } else {
                Err(state.invalid_free(ptr))
            }
        })
    }

    /// [`Allocator::free`] if `ptr` is a live block of this allocator; `Ok(false)`, with
    /// nothing counted, if it is not: for a caller that looks for the owner of a pointer
    /// among several allocators (a free that names no device) and counts a pointer nobody
    /// owns itself.
    #[inline]
    pub fn free_if_owned(&self, ptr: DevicePtr) -> Result<bool, AllocError> {
        let now = self.early_now();
        self.operation(|state| state.free_if_owned(&self.backend, ptr, now))
    }

    /// True if `ptr` is a block this allocator handed out and that is not yet freed.
    pub fn owns(&self, ptr: DevicePtr) -> bool {
        self.state.lock().allocated_key(ptr.0).is_some()
    }

    /// Notes that `stream` uses the block at `ptr` (PyTorch's `record_stream`): when the
    /// block is freed, its reuse will be ordered after the work `stream` has by then.
    pub fn record_use(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        self.state.lock().record_use(ptr, stream)
    }

    /// Marks `stream` as one its owner may destroy while blocks freed on it are cached (a
    /// library's own stream: PyTorch's `ExternalStream`, a CUDA program's `cudaStreamCreate`).
    /// From then on every free on it records its fence at once and nothing is recorded on it
    /// later, when it may be gone (see `lifetime::fences`). PyTorch's pooled streams live as
    /// long as the process and need no mark.
    pub fn mark_stream_volatile(&self, stream: StreamId) {
        let mut state = self.state.lock();
        let slot = state.streams.slot(stream);
        state.streams.get_mut(slot).fences.set_volatile();
    }

    /// Synchronises the device and returns every wholly free segment to it. Idle event
    /// objects are destroyed too. Returns the bytes released.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        Ok(self.operation(|state| state.release_cached(&self.backend))?)
    }

    /// Sets (or, with `None`, lifts) the reserved-bytes limit. If more is reserved than the
    /// new limit, cached memory is released; allocated memory is never taken back.
    pub fn set_memory_limit(&self, limit: Option<u64>) -> Result<(), AllocError> {
        self.operation(|state| {
            state.limit = limit;
            if let Some(limit) = limit {
                state.map_page_by_page(&self.backend);
                if state.stats.reserved_bytes.current > limit {
                    state.release_cached(&self.backend)?;
                }
            }
            Ok(())
        })
    }

    /// The limit in force.
    pub fn memory_limit(&self) -> Option<u64> {
        self.state.lock().limit
    }

    /// The largest free cached block of the default pool (PyTorch's `cacheInfo`, which
    /// `cudnn.benchmark` asks to size its workspace).
    pub fn largest_free_block(&self) -> u64 {
        self.state.lock().largest_free_block(PoolId::DEFAULT)
    }

    /// The live allocation at `ptr` (the address malloc returned): its size and the
    /// segment it lies in.
    pub fn allocation_at(&self, ptr: DevicePtr) -> Option<AllocationSite> {
        let state = self.state.lock();
        let key = state.allocated_key(ptr.0)?;
        let block = state.arena.block(key);
        let segment = state.arena.segment(block.segment());
        Some(AllocationSite {
            size: block.size(),
            segment: DevicePtr(segment.addr()),
            segment_size: segment.size(),
            expandable: segment.is_expandable() || segment.is_stitched(),
            stitched: segment.is_stitched(),
        })
    }

    /// The pages of the live stitched allocation at `ptr`, in the order they appear in it:
    /// runs of whole pages of expandable segments, mapped first there. What CUDA IPC shares
    /// for it: the stitched range is a second mapping, with no physical allocation of its
    /// own to export, while each page of a run is one (stitching maps one allocation per
    /// page). `None` if `ptr` is no live stitched allocation.
    pub fn stitched_pages(&self, ptr: DevicePtr) -> Option<Vec<(DevicePtr, u64)>> {
        let state = self.state.lock();
        let key = state.allocated_key(ptr.0)?;
        let stitch = state.stitches.active(state.arena.block(key).segment())?;
        Some(
            stitch
                .sources
                .iter()
                .map(|source| (DevicePtr(source.addr), source.len))
                .collect(),
        )
    }

    /// A copy of the counters.
    pub fn stats(&self) -> Stats {
        self.state.lock().stats.read()
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        self.state.lock().stats.reset_peaks();
    }

    /// Appends an event to the trace ring on behalf of a component built on the allocator
    /// (the staging pool records its acquire/release this way).
    pub fn trace_event(&self, action: TraceAction, addr: DevicePtr, size: u64, stream: StreamId) {
        let mut state = self.state.lock();
        let slot = state.streams.slot(stream);
        state.note(&self.backend, action, addr.0, size, slot);
    }

    /// Segments, blocks, trace, stats and configuration at this instant.
    pub fn snapshot(&self) -> Snapshot {
        self.operation(|state| state.snapshot(&self.backend, &self.config))
    }

    /// Walks every structure and checks the engine's invariants: segments tiled by blocks,
    /// each free block in exactly the list its state calls for, the allocated map matching
    /// the allocated blocks, counters equal to the sums they summarise, event references
    /// balanced. Costs a full walk: for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.state.lock().check_invariants()
    }
}

#[cfg(test)]
mod tests;
