//! The allocator: the policy that ties pool, lifetimes, stats and trace together.
//!
//! One [`Allocator`] serves one device. Its state sits behind one mutex; the fast path
//! (a ready block of the caller's stream) takes the lock once and makes no backend call.
//!
//! # Allocation policy, in order
//! 1. a ready block of the caller's stream (best fit) — no event, no wait;
//! 2. blocks whose events completed: a batched completion pass, only once enough events are
//!    in flight (`event_batch`), or always under the PyTorch policy;
//! 3. (`stream_wait` policy) the best-fitting block of the caller's pending list or of any
//!    other stream: the caller's stream waits for it on the device;
//! 4. grow the pool by a new segment, within the memory limit; with expandable segments,
//!    map memory into the stream's address reservation instead, first (past the live peak
//!    plus a slack) synchronising and unmapping free mappings until the excess is gone;
//! 5. synchronise, return every cached segment to the device, and grow again;
//! 6. a typed out-of-memory error with a fragmentation report.

use crate::backend::Backend;
use crate::config::{Config, ReusePolicy};
use crate::error::{AllocError, BackendError, OutOfMemory};
use crate::lifetime::{EventKey, EventTable, StreamTable};
use crate::lock::EngineLock;
use crate::pool::arena::{Arena, BlockKey, StreamSlot};
use crate::pool::expandable::ExpandableTable;
use crate::pool::size::{
    pool_of, round_size, segment_size_for, should_split, MAX_REQUEST, MIN_BLOCK_SIZE,
};
use crate::snapshot::{BlockInfo, BlockState, SegmentInfo, Snapshot};
use crate::stats::Stats;
use crate::trace::{CompactRing, TraceAction, NO_STREAM};
use crate::types::{Allocation, DevicePtr, PoolKind, StreamId};
use crate::util::BuildAddrHasher;
use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;

/// Requests at least `max_split_size` may use a cached block at most this much larger
/// (PyTorch's `kLargeBuffer`), so oversize blocks are not wasted on much smaller requests.
const OVERSIZE_SLACK: u64 = 20 << 20;

/// Expandable segments first map up to this much (in 1/10,000) beyond the live peak
/// before reclaiming free pages; each reclaim widens the slack by a quarter, up to
/// [`MAX_RECLAIM_SLACK_BP`].
const RECLAIM_SLACK_BP: u64 = 100;

/// The widest reclaim slack, in 1/10,000 of the live peak.
const MAX_RECLAIM_SLACK_BP: u64 = 2_500;

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
    /// [`State::allocated_key`] tells the two apart by `Block::allocated`. A quarantined
    /// block is allocated but absent.
    allocated: HashMap<u64, BlockKey, BuildAddrHasher>,
    /// Counters.
    stats: Stats,
    /// Recent events.
    trace: CompactRing,
    /// Reserved bytes never exceeded (from `memory_limit`, `memory_fraction` or
    /// [`Allocator::set_memory_limit`]).
    limit: Option<u64>,
    /// Expandable segments, when configured and the backend has virtual memory.
    vmm: Option<ExpandableTable>,
}

impl<B: Backend> Allocator<B> {
    /// An allocator over `backend`. `memory_fraction` is resolved against the backend's
    /// total memory here; the stricter of it and `memory_limit` applies.
    pub fn new(backend: B, config: Config) -> Result<Self, AllocError> {
        let mut limit = config.memory_limit;
        if let Some(fraction) = config.memory_fraction {
            let total = backend.total_memory()?;
            let by_fraction = (total as f64 * fraction) as u64;
            limit = Some(limit.map_or(by_fraction, |l| l.min(by_fraction)));
        }
        let vmm = if !config.expandable_segments {
            None
        } else if backend.supports_virtual_memory() {
            Some(ExpandableTable::new(
                backend.page_size(),
                backend.total_memory()?,
                RECLAIM_SLACK_BP,
            ))
        } else {
            // Info, not a warning: expandable segments are the default, and a backend
            // without virtual memory is an expected configuration.
            tracing::info!(
                "expandable_segments:true needs a backend with virtual memory; using whole segments"
            );
            None
        };
        let state = State {
            arena: Arena::default(),
            streams: StreamTable::default(),
            events: EventTable::default(),
            allocated: HashMap::default(),
            stats: Stats::default(),
            trace: CompactRing::new(config.trace_capacity),
            limit,
            vmm,
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
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        if size == 0 || size > MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        let now = self.early_now();
        self.state
            .lock()
            .malloc(&self.backend, &self.config, size, stream, now)
    }

    /// The clock, read before taking the lock when tracing (so that the read overlaps the
    /// lock's atomic instruction), else 0.
    #[inline]
    fn early_now(&self) -> u64 {
        if self.config.trace_capacity != 0 {
            self.backend.now_ns()
        } else {
            0
        }
    }

    /// Returns a block. Streams recorded with [`Allocator::record_use`] get one event each;
    /// the block is reusable at once by its own stream.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let now = self.early_now();
        self.state.lock().free(&self.backend, ptr, now)
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

    /// Synchronises the device and returns every wholly free segment to it. Idle event
    /// objects are destroyed too. Returns the bytes released.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        Ok(self.state.lock().release_cached(&self.backend)?)
    }

    /// Sets (or, with `None`, lifts) the reserved-bytes limit. If more is reserved than the
    /// new limit, cached memory is released; allocated memory is never taken back.
    pub fn set_memory_limit(&self, limit: Option<u64>) -> Result<(), AllocError> {
        let mut state = self.state.lock();
        state.limit = limit;
        if let Some(limit) = limit {
            if state.stats.reserved_bytes.current > limit {
                state.release_cached(&self.backend)?;
            }
        }
        Ok(())
    }

    /// The limit in force.
    pub fn memory_limit(&self) -> Option<u64> {
        self.state.lock().limit
    }

    /// A copy of the counters.
    pub fn stats(&self) -> Stats {
        self.state.lock().stats
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let mut state = self.state.lock();
        let stats = &mut state.stats;
        stats.allocated_bytes.reset_peak();
        stats.requested_bytes.reset_peak();
        stats.reserved_bytes.reset_peak();
        stats.active_bytes.reset_peak();
        stats.pending_free_bytes.reset_peak();
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
        let mut state = self.state.lock();
        state.snapshot(&self.backend, &self.config)
    }

    /// Walks every structure and checks the engine's invariants: segments tiled by blocks,
    /// each free block in exactly the list its state calls for, the allocated map matching
    /// the allocated blocks, counters equal to the sums they summarise, event references
    /// balanced. Costs a full walk: for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.state.lock().check_invariants()
    }
}

impl State {
    // ---- Allocation -------------------------------------------------------------------

    #[inline]
    fn malloc<B: Backend>(
        &mut self,
        backend: &B,
        config: &Config,
        requested: u64,
        stream: StreamId,
        now: u64,
    ) -> Result<Allocation, AllocError> {
        let size = round_size(requested);
        // Expandable segments serve every size from one pool: a small block among large
        // free ones pins only the pages it touches, and it fills slivers no large request
        // could use (measured: 1.189 → 1.036 on the generated trace; see the README).
        let pool = if self.vmm.is_some() {
            PoolKind::Large
        } else {
            pool_of(size)
        };
        let max_size = max_block_for(size, config);
        let slot = self.streams.slot(stream);
        // 1. A ready block of the stream: stream order makes reuse safe, no event needed.
        //    First the hot list (same size freed recently: no split, no merge).
        if let Some(key) = self.streams.get_mut(slot).hot.take(size) {
            self.arena.blocks[key].hot = false;
            return Ok(self.hand_out_hot(key, slot, requested, now));
        }
        if let Some(key) = self.take_ready(slot, pool, size, max_size) {
            return Ok(self.hand_out(key, slot, size, requested, now));
        }
        self.malloc_slow(backend, config, requested, size, pool, max_size, slot)
    }

    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn malloc_slow<B: Backend>(
        &mut self,
        backend: &B,
        config: &Config,
        requested: u64,
        size: u64,
        pool: PoolKind,
        max_size: u64,
        slot: StreamSlot,
    ) -> Result<Allocation, AllocError> {
        let stream = self.streams.id(slot);
        // Hot blocks are invisible to best fit and to other streams: merge them back first.
        if self.flush_hot() {
            if let Some(key) = self.take_ready(slot, pool, size, max_size) {
                return Ok(self.hand_out(key, slot, size, requested, self.clock(backend)));
            }
        }
        // A capturing stream may not query events, wait on events recorded outside the
        // capture, or synchronise: it only gets ready blocks of its own or fresh segments.
        let capturing = backend.is_capturing(stream)?;
        if !capturing {
            // 2. Blocks whose events completed, found by one batched pass.
            let due = config.reuse_policy == ReusePolicy::Pytorch
                || self.events.outstanding() >= config.event_batch;
            if due && self.collect_completed(backend)? {
                if let Some(key) = self.take_ready(slot, pool, size, max_size) {
                    return Ok(self.hand_out(key, slot, size, requested, self.clock(backend)));
                }
            }
            // 3. Any other free block, reused after a device-side wait.
            if config.reuse_policy == ReusePolicy::StreamWait {
                if let Some(key) = self.best_waitable(slot, pool, size, max_size) {
                    self.unlist(key);
                    self.wait_for_block(backend, key, slot)?;
                    return Ok(self.hand_out(key, slot, size, requested, self.clock(backend)));
                }
            }
        }
        // 4. Grow.
        if let Some(key) = self.grow_any(backend, size, pool, max_size, slot, capturing)? {
            return Ok(self.hand_out(key, slot, size, requested, self.clock(backend)));
        }
        // 5. Return cached memory to the device and grow again.
        if !capturing && self.stats.reserved_bytes.current > self.stats.allocated_bytes.current {
            self.release_cached(backend)?;
            if let Some(key) = self.grow_any(backend, size, pool, max_size, slot, capturing)? {
                self.stats.retries += 1;
                return Ok(self.hand_out(key, slot, size, requested, self.clock(backend)));
            }
        }
        // 6. Out of memory.
        Err(AllocError::OutOfMemory(
            self.out_of_memory(backend, requested, slot),
        ))
    }

    /// The best-fitting block of `pool` that `slot` can take after device-side waits: its
    /// own pending blocks, and every free block of other streams.
    fn best_waitable(
        &self,
        slot: StreamSlot,
        pool: PoolKind,
        size: u64,
        max_size: u64,
    ) -> Option<BlockKey> {
        let mut best: Option<(u64, u64, BlockKey)> = None;
        for (index, state) in self.streams.states.iter().enumerate() {
            let own = index as StreamSlot == slot;
            let lists = [
                Some(&state.pending[pool as usize]),
                (!own).then_some(&state.ready[pool as usize]),
            ];
            for list in lists.into_iter().flatten() {
                if let Some(found) = list.best_fit(size, max_size) {
                    if best.is_none_or(|b| (found.0, found.1) < (b.0, b.1)) {
                        best = Some(found);
                    }
                }
            }
        }
        best.map(|(_, _, key)| key)
    }

    /// Makes `slot`'s stream wait on the device for everything that may still use the
    /// (unlisted) block `key`: its pending events and, if it belongs to another stream, the
    /// work queued on that stream so far.
    fn wait_for_block<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        slot: StreamSlot,
    ) -> Result<(), BackendError> {
        let stream = self.streams.id(slot);
        let owner = self.arena.blocks[key].stream;
        let mut waited = false;
        for &event in &self.arena.blocks[key].pending {
            if !self.events.is_complete(event) && self.events.stream(event) != slot {
                backend.stream_wait_event(stream, self.events.handle(event))?;
                self.stats.cross_stream_waits += 1;
                waited = true;
            }
        }
        if owner != slot {
            // One-shot event: once the wait is enqueued it has captured what it needs, so
            // the object goes straight back to the pool.
            let handle = self.events.acquire_handle(backend, &mut self.stats)?;
            let recorded = backend
                .record_event(handle, self.streams.id(owner))
                .and_then(|()| backend.stream_wait_event(stream, handle));
            self.events.recycle_handle(handle);
            recorded?;
            self.stats.events_recorded += 1;
            self.stats.cross_stream_waits += 1;
            waited = true;
        }
        if waited {
            let (addr, size) = (self.arena.blocks[key].addr, self.arena.blocks[key].size);
            self.note(backend, TraceAction::CrossStreamWait, addr, size, slot);
        }
        Ok(())
    }

    /// Room for a rounded `size`, unlisted and owned by `slot`, from a new segment or from
    /// pages mapped into an expandable one; `None` if the limit or the device refuses.
    fn grow_any<B: Backend>(
        &mut self,
        backend: &B,
        size: u64,
        pool: PoolKind,
        max_size: u64,
        slot: StreamSlot,
        capturing: bool,
    ) -> Result<Option<BlockKey>, AllocError> {
        if self.vmm.is_some() {
            self.grow_expandable(backend, size, pool, max_size, slot, capturing)
        } else {
            self.grow(backend, size, pool, slot)
        }
    }

    /// A new segment for a rounded `size`, unlisted and owned by `slot`; `None` if the limit
    /// or the device refuses.
    fn grow<B: Backend>(
        &mut self,
        backend: &B,
        size: u64,
        pool: PoolKind,
        slot: StreamSlot,
    ) -> Result<Option<BlockKey>, AllocError> {
        let segment_size = segment_size_for(size);
        if let Some(limit) = self.limit {
            if self.stats.reserved_bytes.current + segment_size > limit {
                return Ok(None);
            }
        }
        let ptr = match backend.alloc_segment(segment_size) {
            Ok(ptr) => ptr,
            Err(err) if err.out_of_memory => return Ok(None),
            Err(err) => return Err(err.into()),
        };
        self.stats.reserved_bytes.add(segment_size);
        self.stats.segment_allocs += 1;
        self.note(
            backend,
            TraceAction::SegmentAlloc,
            ptr.0,
            segment_size,
            slot,
        );
        tracing::debug!(ptr = ?ptr, size = segment_size, "segment allocated");
        Ok(Some(self.arena.add_segment(
            ptr.0,
            segment_size,
            pool,
            slot,
        )))
    }

    /// Gives the hot block `key`, of exactly the size asked for, back to its owner `slot`:
    /// nothing to split, no events, and its address is still in the allocated map.
    #[inline]
    fn hand_out_hot(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        requested: u64,
        now: u64,
    ) -> Allocation {
        let block = &mut self.arena.blocks[key];
        debug_assert!(block.stream == slot && block.pending.is_empty());
        block.allocated = true;
        block.requested = requested;
        let (addr, size) = (block.addr, block.size);
        debug_assert_eq!(self.allocated.get(&addr), Some(&key));
        self.account_alloc(addr, size, slot, requested, now)
    }

    /// Counts and traces a block of `size` bytes at `addr` handed to `slot`.
    #[inline]
    fn account_alloc(
        &mut self,
        addr: u64,
        size: u64,
        slot: StreamSlot,
        requested: u64,
        now: u64,
    ) -> Allocation {
        let stats = &mut self.stats;
        stats.allocated_bytes.add(size);
        stats.requested_bytes.add(requested);
        stats.active_bytes.add(size);
        stats.allocs += 1;
        if self.trace.enabled() {
            self.trace.push(TraceAction::Alloc, addr, size, slot, now);
        }
        Allocation {
            ptr: DevicePtr(addr),
            requested,
            size,
            stream: self.streams.id(slot),
        }
    }

    /// Gives the unlisted free block `key` (synchronisation already done) to `slot`,
    /// splitting off what it does not need.
    #[inline]
    fn hand_out(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        size: u64,
        requested: u64,
        now: u64,
    ) -> Allocation {
        let segment = &self.arena.segments[self.arena.blocks[key].segment];
        let (pool, expandable) = (segment.pool, segment.expandable);
        let block_size = self.arena.blocks[key].size;
        // Taken before the remainder is listed, so the remainder cannot merge back into it.
        self.arena.blocks[key].allocated = true;
        // In an expandable segment a free sliver costs no more than the same bytes kept
        // inside the allocation, and may serve a later request: split down to the minimum.
        if should_split(block_size, size, pool)
            || (expandable && block_size - size >= MIN_BLOCK_SIZE)
        {
            let right = self.arena.split(key, size);
            // The remainder is still free and still needs what the whole block needed.
            let pending = self.arena.blocks[key].pending.clone();
            for &event in &pending {
                self.events.retain(event);
            }
            self.arena.blocks[right].pending = pending;
            self.insert_free(right);
        }
        let pending = std::mem::take(&mut self.arena.blocks[key].pending);
        for event in pending {
            self.events.release(event, &mut self.stats);
        }
        let block = &mut self.arena.blocks[key];
        block.stream = slot;
        block.requested = requested;
        let (addr, size) = (block.addr, block.size);
        self.allocated.insert(addr, key);
        self.account_alloc(addr, size, slot, requested, now)
    }

    // ---- Free -------------------------------------------------------------------------

    #[inline]
    fn free<B: Backend>(
        &mut self,
        backend: &B,
        ptr: DevicePtr,
        now: u64,
    ) -> Result<(), AllocError> {
        // One map lookup; the entry stays while the block is hot (see `allocated`).
        let entry = match self.allocated.entry(ptr.0) {
            MapEntry::Occupied(entry) if self.arena.blocks[*entry.get()].allocated => entry,
            _ => {
                self.stats.invalid_frees += 1;
                return Err(AllocError::UnknownPointer(ptr));
            }
        };
        let key = *entry.get();
        let block = &mut self.arena.blocks[key];
        let (size, requested, owner) = (block.size, block.requested, block.stream);
        let uses = std::mem::take(&mut block.uses);
        if !uses.is_empty() {
            entry.remove();
        }
        block.allocated = false;
        block.requested = 0;
        let stats = &mut self.stats;
        stats.allocated_bytes.sub(size);
        stats.requested_bytes.sub(requested);
        stats.active_bytes.sub(size);
        stats.frees += 1;
        if uses.is_empty() {
            // No other stream used it, and an allocated block carries no pending events:
            // ready for its owner at once. The request and its completion are one trace
            // record, read back as PyTorch's `free_requested` + `free_completed`.
            debug_assert!(self.arena.blocks[key].pending.is_empty());
            if self.trace.enabled() {
                self.trace.push_free_completed(ptr.0, size, owner, now);
            }
            self.push_hot(key, owner, size);
            return Ok(());
        }
        self.note(backend, TraceAction::FreeRequested, ptr.0, size, owner);
        if let Err(err) = self.record_uses(backend, key, &uses) {
            // Without the events the block's reuse cannot be ordered: keep it out of
            // circulation (leaked until empty_cache synchronises) rather than risk a race.
            tracing::error!(%err, ?ptr, "recording a use event failed; block quarantined until empty_cache");
            self.arena.blocks[key].pending.clear();
            self.list_quarantined(key);
            return Err(err.into());
        }
        // One event per use stream: pending until they complete or are waited on.
        debug_assert!(!self.arena.blocks[key].pending.is_empty());
        self.insert_free(key);
        Ok(())
    }

    /// The block handed out at `addr`, if any (hot blocks share the map; see `allocated`).
    #[inline]
    fn allocated_key(&self, addr: u64) -> Option<BlockKey> {
        let key = *self.allocated.get(&addr)?;
        self.arena.blocks[key].allocated.then_some(key)
    }

    /// One event on each use stream, now; the block and the stream's in-flight queue each
    /// hold a reference.
    fn record_uses<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        uses: &[StreamSlot],
    ) -> Result<(), BackendError> {
        for &use_slot in uses {
            let event = self.events.record(
                backend,
                use_slot,
                self.streams.id(use_slot),
                &mut self.stats,
            )?;
            self.events.retain(event);
            self.streams.get_mut(use_slot).in_flight.push_back(event);
            self.arena.blocks[key].pending.push(event);
        }
        Ok(())
    }

    fn record_use(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let key = self
            .allocated_key(ptr.0)
            .ok_or(AllocError::UnknownPointer(ptr))?;
        let slot = self.streams.slot(stream);
        let block = &mut self.arena.blocks[key];
        if slot != block.stream && !block.uses.contains(&slot) {
            block.uses.push(slot);
        }
        Ok(())
    }

    // ---- Free lists -------------------------------------------------------------------

    /// Takes the best-fitting ready block of `slot`'s own list out of it: reuse that needs no
    /// synchronisation at all.
    #[inline]
    fn take_ready(
        &mut self,
        slot: StreamSlot,
        pool: PoolKind,
        size: u64,
        max_size: u64,
    ) -> Option<BlockKey> {
        // What `unlist` would do for a ready block: no pending bytes to count.
        let (_, _, key) =
            self.streams.get_mut(slot).ready[pool as usize].take_best_fit(size, max_size)?;
        debug_assert!(self.arena.blocks[key].pending.is_empty());
        Some(key)
    }

    /// Parks a ready block of `size` bytes in its owner's hot list, evicting the oldest into
    /// the free lists.
    #[inline]
    fn push_hot(&mut self, key: BlockKey, owner: StreamSlot, size: u64) {
        let evicted = self.streams.get_mut(owner).hot.push(size, key);
        self.arena.blocks[key].hot = true;
        if let Some(evicted) = evicted {
            self.unhot(evicted);
        }
    }

    /// Moves every hot block into the free lists, merging it. Returns true if any moved.
    fn flush_hot(&mut self) -> bool {
        let mut any = false;
        for index in 0..self.streams.len() {
            for key in std::mem::take(&mut self.streams.states[index].hot).keys() {
                self.unhot(key);
                any = true;
            }
        }
        any
    }

    /// Moves a block taken out of its hot list out of the allocated map and into the free
    /// lists, merging it.
    fn unhot(&mut self, key: BlockKey) {
        let block = &mut self.arena.blocks[key];
        block.hot = false;
        let addr = block.addr;
        self.allocated.remove(&addr);
        self.insert_free(key);
    }

    /// Two free blocks may merge if the result needs no more synchronisation than either:
    /// same owner, and both ready or both pending.
    fn mergeable(&self, a: BlockKey, b: BlockKey) -> bool {
        let (a, b) = (&self.arena.blocks[a], &self.arena.blocks[b]);
        !a.allocated
            && !b.allocated
            && !a.unmapped
            && !b.unmapped
            && !a.hot
            && !b.hot
            && a.stream == b.stream
            && a.pending.is_empty() == b.pending.is_empty()
    }

    /// Puts the unlisted free block `key` in its owner's list, merging it with mergeable
    /// neighbours first.
    fn insert_free(&mut self, key: BlockKey) {
        let mut key = key;
        if let Some(prev) = self.arena.blocks[key].prev {
            if self.mergeable(prev, key) {
                self.unlist(prev);
                self.merge_into(prev, key);
                key = prev;
            }
        }
        if let Some(next) = self.arena.blocks[key].next {
            if self.mergeable(key, next) {
                self.unlist(next);
                self.merge_into(key, next);
            }
        }
        self.list(key);
    }

    /// Merges unlisted `right` into `left`, uniting their pending events.
    fn merge_into(&mut self, left: BlockKey, right: BlockKey) {
        for event in self.arena.merge(left, right) {
            if self.arena.blocks[left].pending.contains(&event) {
                self.events.release(event, &mut self.stats);
            } else {
                self.arena.blocks[left].pending.push(event);
            }
        }
    }

    /// Adds a free block to the list its owner and pending state call for.
    #[inline]
    fn list(&mut self, key: BlockKey) {
        let block = &self.arena.blocks[key];
        let pool = self.arena.segments[block.segment].pool;
        let pending = !block.pending.is_empty();
        let (size, addr) = (block.size, block.addr);
        self.streams
            .get_mut(block.stream)
            .list(pool, pending)
            .insert(size, addr, key);
        if pending {
            self.stats.pending_free_bytes.add(size);
            self.stats.active_bytes.add(size);
        }
    }

    /// Removes a free block from its list.
    #[inline]
    fn unlist(&mut self, key: BlockKey) {
        let block = &self.arena.blocks[key];
        let pool = self.arena.segments[block.segment].pool;
        let pending = !block.pending.is_empty();
        let (size, addr) = (block.size, block.addr);
        self.streams
            .get_mut(block.stream)
            .list(pool, pending)
            .remove(size, addr, key);
        if pending {
            self.stats.pending_free_bytes.sub(size);
            self.stats.active_bytes.sub(size);
        }
    }

    /// Marks a block that could not be ordered as allocated to nobody: it stays out of the
    /// free lists and the allocated map until `release_cached` synchronises the device,
    /// which finds it as an allocated block absent from the allocated map.
    fn list_quarantined(&mut self, key: BlockKey) {
        let block = &mut self.arena.blocks[key];
        block.allocated = true;
        block.requested = 0;
        self.stats.allocated_bytes.add(block.size);
        self.stats.active_bytes.add(block.size);
    }

    // ---- Event completion ---------------------------------------------------------------

    /// One batched pass: on each stream, queries in-flight events oldest first up to the
    /// first incomplete one, then returns every pending block whose events all completed to
    /// its owner's ready list. Returns true if any block became ready.
    fn collect_completed<B: Backend>(&mut self, backend: &B) -> Result<bool, BackendError> {
        let mut completed_any = false;
        for index in 0..self.streams.len() {
            while let Some(&event) = self.streams.states[index].in_flight.front() {
                if !self.events.is_complete(event) {
                    self.stats.event_queries += 1;
                    if !backend.query_event(self.events.handle(event))? {
                        break;
                    }
                    self.events.mark_complete(event);
                    completed_any = true;
                }
                self.streams.states[index].in_flight.pop_front();
                self.events.release(event, &mut self.stats);
            }
        }
        if completed_any {
            Ok(self.promote_completed(backend) > 0)
        } else {
            Ok(false)
        }
    }

    /// Moves pending blocks whose events are all complete to the ready lists.
    fn promote_completed<B: Backend>(&mut self, backend: &B) -> usize {
        let mut ready = Vec::new();
        for state in &self.streams.states {
            for list in &state.pending {
                ready.extend(list.keys().filter(|key| {
                    self.arena.blocks[*key]
                        .pending
                        .iter()
                        .all(|event| self.events.is_complete(*event))
                }));
            }
        }
        for &key in &ready {
            self.unlist(key);
            for event in std::mem::take(&mut self.arena.blocks[key].pending) {
                self.events.release(event, &mut self.stats);
            }
            let block = &self.arena.blocks[key];
            let (addr, size, owner) = (block.addr, block.size, block.stream);
            self.note(backend, TraceAction::FreeCompleted, addr, size, owner);
            self.insert_free(key);
        }
        ready.len()
    }

    // ---- Expandable segments -----------------------------------------------------------

    /// Room for a rounded `size` in `slot`'s expandable segment of `pool`, unlisted and
    /// owned by `slot`; `None` if the limit, the device or the address space refuses.
    ///
    /// First, unless the stream is capturing a graph: if mapping would take reserved memory
    /// past the live peak plus the slack (1% at first, see below) or past the limit, and a
    /// ready free block covers a whole mapping, synchronise the device (unmapping does not
    /// synchronise, and the memory's last users may be any stream), settle every event,
    /// retry the caller's free list, then unmap free mappings until the excess is gone.
    /// Then map the fewest pages that give room, right after a free block of the caller
    /// when one borders an unmapped stretch, so the request packs against it.
    #[allow(clippy::too_many_arguments)]
    fn grow_expandable<B: Backend>(
        &mut self,
        backend: &B,
        size: u64,
        pool: PoolKind,
        max_size: u64,
        slot: StreamSlot,
        capturing: bool,
    ) -> Result<Option<BlockKey>, AllocError> {
        let Some(vmm) = self.vmm.as_ref() else {
            return Ok(None);
        };
        // Reclaim (synchronise, unmap free mappings, map where there is room) only when
        // mapping would take reserved memory past the live peak plus a slack, or past the
        // limit. Measured on an H200 (GPT-2 small), what a reclaim costs decides the policy:
        // - reclaiming at every new high-water mark made steps 1.42x slower: the peak creeps
        //   up a little every step; against the live peak, stable in a steady state, it
        //   stops;
        // - unmapping every free page then remapped 4.7 GB a step (1.34x): unmap only the
        //   excess;
        // - a workload whose free memory is scattered differently at every peak (GPT-2's
        //   1.5 GB logits find no hole big enough) still remapped 1.4 GB a step: each reclaim
        //   widens the slack by a quarter, so reclaims die out where they would recur.
        // Mapping in large pieces (`ExpandableTable::pieces`) makes what remains cheap.
        let after = self.stats.reserved_bytes.current + size.div_ceil(vmm.page) * vmm.page;
        let live_peak = vmm
            .live_peak_at_growth
            .max(self.stats.allocated_bytes.current + size);
        let budget = live_peak + live_peak / 10_000 * vmm.slack_bp;
        let over_limit = after > budget || self.limit.is_some_and(|limit| after > limit);
        if !capturing && over_limit && self.has_unmappable_pages() {
            self.synchronize(backend)?;
            if let Some(key) = self.take_ready(slot, pool, size, max_size) {
                return Ok(Some(key));
            }
            let excess = after.saturating_sub(self.limit.map_or(budget, |limit| limit.min(budget)));
            self.unmap_free_pages_upto(backend, excess)?;
            let vmm = self.vmm.as_mut().expect("expandable segments");
            vmm.slack_bp = (vmm.slack_bp * 5 / 4 + 1).min(MAX_RECLAIM_SLACK_BP);
        }
        let segment = match self.vmm.as_ref().and_then(|v| v.segment_of(slot, pool)) {
            Some(segment) => segment,
            None => self.add_expandable_segment(backend, pool, slot)?,
        };
        // Where to map: over every unmapped stretch, the placement that maps the fewest pages
        // (lowest address among equals) — at the bottom of the stretch, continuing the
        // caller's free block below it; at the top, continuing the free block above; or the
        // whole stretch, joining both.
        let vmm = self.vmm.as_ref().expect("expandable segments");
        let page = vmm.page;
        let blocks = &self.arena.blocks;
        let reusable = |neighbour: Option<BlockKey>| {
            neighbour.filter(|&n| {
                let b = &blocks[n];
                !b.allocated && !b.unmapped && !b.hot && b.pending.is_empty() && b.stream == slot
            })
        };
        let pages_for = |bytes: u64| (bytes.div_ceil(page) * page).max(page);
        let mut best: Option<Placement> = None;
        for (&addr, &hole) in vmm.unmapped(segment) {
            let room = blocks[hole].size;
            let below = reusable(blocks[hole].prev);
            let above = reusable(blocks[hole].next);
            let lo = below.map_or(0, |k| blocks[k].size);
            let hi = above.map_or(0, |k| blocks[k].size);
            let options = [
                (lo + room >= size).then(|| Placement {
                    addr,
                    hole,
                    map: pages_for(size.saturating_sub(lo)).min(room),
                    top: false,
                    below,
                    above: None,
                }),
                (hi + room >= size).then(|| {
                    let map = pages_for(size.saturating_sub(hi)).min(room);
                    Placement {
                        addr: addr + room - map,
                        hole,
                        map,
                        top: true,
                        below: None,
                        above,
                    }
                }),
                (lo + room + hi >= size).then_some(Placement {
                    addr,
                    hole,
                    map: room,
                    top: false,
                    below,
                    above,
                }),
            ];
            for option in options.into_iter().flatten() {
                if best.as_ref().is_none_or(|b| option.map < b.map) {
                    best = Some(option);
                }
            }
            if best.as_ref().is_some_and(|b| b.map == page) {
                break;
            }
        }
        let Some(placement) = best else {
            return Ok(None);
        };
        let Placement {
            addr,
            hole,
            map,
            top,
            below,
            above,
        } = placement;
        if let Some(limit) = self.limit {
            if self.stats.reserved_bytes.current + map > limit {
                return Ok(None);
            }
        }
        // One physical allocation per piece; on failure, undo the pieces already mapped
        // (untouched, so unmapping them needs no synchronisation).
        let pieces: Vec<_> = self
            .vmm
            .as_ref()
            .expect("expandable segments")
            .pieces(addr, map)
            .collect();
        for (index, &(at, len)) in pieces.iter().enumerate() {
            if let Err(err) = backend.map_pages(DevicePtr(at), len) {
                for &(done, done_len) in &pieces[..index] {
                    backend.unmap_pages(DevicePtr(done), done_len)?;
                }
                return if err.out_of_memory {
                    Ok(None)
                } else {
                    Err(err.into())
                };
            }
        }
        let vmm = self.vmm.as_mut().expect("expandable segments");
        for &(at, len) in &pieces {
            vmm.add_mapping(at, len);
        }
        // Cut the mapped part out of the stretch; what stays unmapped stays indexed.
        let vmm = self.vmm.as_mut().expect("expandable segments");
        let holes = vmm.unmapped_mut(segment);
        let room = self.arena.blocks[hole].size;
        let mapped = if map == room {
            holes.remove(&addr);
            hole
        } else if top {
            self.arena.split(hole, room - map)
        } else {
            holes.remove(&addr);
            let rest = self.arena.split(hole, map);
            holes.insert(addr + map, rest);
            hole
        };
        vmm.mapped += map;
        self.stats.page_map_bytes += map;
        vmm.live_peak_at_growth = vmm
            .live_peak_at_growth
            .max(self.stats.allocated_bytes.current + size);
        let block = &mut self.arena.blocks[mapped];
        block.unmapped = false;
        block.stream = slot;
        self.stats.reserved_bytes.add(map);
        self.note(backend, TraceAction::SegmentMap, addr, map, slot);
        let mut key = mapped;
        if let Some(prev) = below {
            self.unlist(prev);
            self.merge_into(prev, key);
            key = prev;
        }
        if let Some(next) = above {
            self.unlist(next);
            self.merge_into(key, next);
        }
        Ok(Some(key))
    }

    /// Reserves the address space of `slot`'s expandable segment of `pool`.
    fn add_expandable_segment<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolKind,
        slot: StreamSlot,
    ) -> Result<usize, AllocError> {
        let vmm = self.vmm.as_mut().expect("expandable segments");
        let size = vmm.reservation;
        let ptr = backend.reserve_address_space(size)?;
        let head = self.arena.add_segment(ptr.0, size, pool, slot);
        let segment = self.arena.blocks[head].segment;
        self.arena.segments[segment].expandable = true;
        self.arena.blocks[head].unmapped = true;
        vmm.add(slot, pool, segment, ptr.0, head);
        tracing::debug!(?ptr, size, "address space reserved");
        Ok(segment)
    }

    /// True if some ready free block of an expandable segment covers a whole mapping.
    /// Blocks awaiting other streams' events do not count: synchronising for them would be
    /// the host wait the lifetime model avoids.
    fn has_unmappable_pages(&self) -> bool {
        let Some(vmm) = self.vmm.as_ref() else {
            return false;
        };
        self.streams.states.iter().any(|state| {
            state.ready.iter().any(|list| {
                list.keys_at_least(vmm.page).any(|key| {
                    let block = &self.arena.blocks[key];
                    self.arena.segments[block.segment].expandable
                        && vmm.has_whole_mapping(block.addr, block.size)
                })
            })
        })
    }

    /// Per ready free block of an expandable segment, the mappings lying wholly inside it,
    /// lowest first (contiguous: the block lies on mapped memory).
    fn unmappable(&self) -> Vec<(BlockKey, Vec<(u64, u64)>)> {
        let Some(vmm) = self.vmm.as_ref() else {
            return Vec::new();
        };
        let mut victims = Vec::new();
        for state in &self.streams.states {
            for list in &state.ready {
                for key in list.keys_at_least(vmm.page) {
                    let block = &self.arena.blocks[key];
                    if !self.arena.segments[block.segment].expandable {
                        continue;
                    }
                    let mappings = vmm.whole_mappings(block.addr, block.size);
                    if !mappings.is_empty() {
                        victims.push((key, mappings));
                    }
                }
            }
        }
        victims
    }

    /// Unmaps every whole mapping inside a ready free block of an expandable segment. Only
    /// valid when no stream can still use those blocks: right after a device-wide
    /// synchronisation.
    fn unmap_free_pages<B: Backend>(&mut self, backend: &B) -> Result<(), BackendError> {
        self.unmap_free_pages_upto(backend, u64::MAX)
    }

    /// Unmaps at least `bytes` of the whole mappings inside ready free blocks of expandable
    /// segments, or all of them if there are fewer: highest addresses first, so what stays
    /// mapped stays low and compact, where placement looks first. Only valid right after a
    /// device-wide synchronisation.
    fn unmap_free_pages_upto<B: Backend>(
        &mut self,
        backend: &B,
        bytes: u64,
    ) -> Result<(), BackendError> {
        let mut victims = self.unmappable();
        victims.sort_unstable_by_key(|(_, mappings)| std::cmp::Reverse(mappings[0].0));
        let mut left = bytes;
        for (key, mappings) in victims {
            if left == 0 {
                break;
            }
            // Whole mappings from the top of the block down, until enough.
            let end = mappings.last().map_or(0, |&(at, len)| at + len);
            let mut start = end;
            for &(at, len) in mappings.iter().rev() {
                if left == 0 {
                    break;
                }
                start = at;
                left = left.saturating_sub(len);
            }
            self.unmap_block_pages(backend, key, start, end - start)?;
        }
        Ok(())
    }

    /// Unmaps `[start, start + len)`, whole pages inside the listed, ready free block `key`;
    /// what is left of the block on either side stays listed.
    fn unmap_block_pages<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        start: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        backend.unmap_pages(DevicePtr(start), len)?;
        self.vmm
            .as_mut()
            .expect("expandable segments")
            .remove_mappings(start, len);
        self.unlist(key);
        let (addr, size, segment, owner) = {
            let block = &self.arena.blocks[key];
            (block.addr, block.size, block.segment, block.stream)
        };
        let mut middle = key;
        if start > addr {
            middle = self.arena.split(key, start - addr);
            self.list(key);
        }
        if start + len < addr + size {
            let tail = self.arena.split(middle, len);
            self.list(tail);
        }
        self.arena.blocks[middle].unmapped = true;
        self.stats.reserved_bytes.sub(len);
        self.stats.page_unmap_bytes += len;
        self.note(backend, TraceAction::SegmentUnmap, start, len, owner);
        let vmm = self.vmm.as_mut().expect("expandable segments");
        vmm.mapped -= len;
        let holes = vmm.unmapped_mut(segment);
        let (mut merged, mut merged_addr) = (middle, start);
        if let Some(prev) = self.arena.blocks[middle].prev {
            if self.arena.blocks[prev].unmapped {
                self.arena.merge(prev, middle);
                merged = prev;
                merged_addr = self.arena.blocks[prev].addr;
            }
        }
        if let Some(next) = self.arena.blocks[merged].next {
            if self.arena.blocks[next].unmapped {
                holes.remove(&self.arena.blocks[next].addr);
                self.arena.merge(merged, next);
            }
        }
        holes.insert(merged_addr, merged);
        Ok(())
    }

    /// Returns the address space of expandable segments with nothing mapped.
    fn release_unmapped_segments<B: Backend>(&mut self, backend: &B) -> Result<(), BackendError> {
        let Some(vmm) = self.vmm.as_mut() else {
            return Ok(());
        };
        let empty: Vec<usize> = vmm
            .segments()
            .filter(|&segment| {
                let head = &self.arena.blocks[self.arena.segments[segment].head];
                head.unmapped && head.next.is_none()
            })
            .collect();
        for segment in empty {
            let (addr, size) = (
                self.arena.segments[segment].addr,
                self.arena.segments[segment].size,
            );
            backend.release_address_space(DevicePtr(addr), size)?;
            vmm.remove(segment);
            self.arena.remove_segment(segment);
        }
        Ok(())
    }

    // ---- Releasing memory ---------------------------------------------------------------

    /// Synchronises the device, settles every event, coalesces free blocks across streams
    /// (after a device-wide sync any free byte is safe for any stream) and returns wholly
    /// free segments and idle events to the backend. Returns the bytes released.
    fn release_cached<B: Backend>(&mut self, backend: &B) -> Result<u64, BackendError> {
        let reserved_before = self.stats.reserved_bytes.current;
        self.synchronize(backend)?;
        self.coalesce_across_streams();
        self.unmap_free_pages(backend)?;
        self.release_unmapped_segments(backend)?;
        let free_segments: Vec<_> = self
            .arena
            .segments
            .iter()
            .filter(|(segment, seg)| !seg.expandable && self.arena.segment_is_free(*segment))
            .map(|(segment, seg)| (segment, seg.head, seg.stream))
            .collect();
        let mut released = reserved_before - self.stats.reserved_bytes.current;
        for (segment, head, stream) in free_segments {
            let (addr, size) = (
                self.arena.segments[segment].addr,
                self.arena.segments[segment].size,
            );
            backend.free_segment(DevicePtr(addr), size)?;
            self.unlist(head);
            self.arena.remove_segment(segment);
            self.stats.reserved_bytes.sub(size);
            self.stats.segment_frees += 1;
            self.note(backend, TraceAction::SegmentFree, addr, size, stream);
            released += size;
        }
        self.events.destroy_idle(backend, &mut self.stats)?;
        self.note(backend, TraceAction::EmptyCache, 0, released, 0);
        tracing::debug!(released, "cached memory released");
        Ok(released)
    }

    /// Synchronises the device (counted in `device_syncs`) and settles what that makes
    /// complete (see [`State::settle_after_sync`]).
    fn synchronize<B: Backend>(&mut self, backend: &B) -> Result<(), BackendError> {
        backend.synchronize_device()?;
        self.stats.device_syncs += 1;
        self.settle_after_sync(backend);
        Ok(())
    }

    /// After a device-wide synchronisation: every event is complete, so every pending block
    /// becomes ready, and hot and quarantined blocks return to the free lists.
    fn settle_after_sync<B: Backend>(&mut self, backend: &B) {
        self.flush_hot();
        self.events.mark_all_complete();
        for index in 0..self.streams.len() {
            while let Some(event) = self.streams.states[index].in_flight.pop_front() {
                self.events.release(event, &mut self.stats);
            }
        }
        self.promote_completed(backend);
        self.release_quarantined();
    }

    /// Frees quarantined blocks (allocated to nobody) now that the device is idle.
    fn release_quarantined(&mut self) {
        let quarantined: Vec<BlockKey> = self
            .arena
            .blocks
            .iter()
            .filter(|(key, block)| block.allocated && self.allocated.get(&block.addr) != Some(key))
            .map(|(key, _)| key)
            .collect();
        for key in quarantined {
            let block = &mut self.arena.blocks[key];
            block.allocated = false;
            let size = block.size;
            self.stats.allocated_bytes.sub(size);
            self.stats.active_bytes.sub(size);
            self.insert_free(key);
        }
    }

    /// Merges every run of adjacent free blocks regardless of owner; the run takes its
    /// first block's owner. Only valid right after a device-wide synchronisation.
    fn coalesce_across_streams(&mut self) {
        let heads: Vec<BlockKey> = self
            .arena
            .segments
            .iter()
            .map(|(_, seg)| seg.head)
            .collect();
        for head in heads {
            let mut cursor = Some(head);
            while let Some(key) = cursor {
                if self.arena.blocks[key].allocated || self.arena.blocks[key].unmapped {
                    cursor = self.arena.blocks[key].next;
                    continue;
                }
                let mut unlisted = false;
                while let Some(next) = self.arena.blocks[key].next {
                    if self.arena.blocks[next].allocated || self.arena.blocks[next].unmapped {
                        break;
                    }
                    if !unlisted {
                        self.unlist(key);
                        unlisted = true;
                    }
                    self.unlist(next);
                    self.merge_into(key, next);
                }
                if unlisted {
                    self.list(key);
                }
                cursor = self.arena.blocks[key].next;
            }
        }
    }

    // ---- Reporting ----------------------------------------------------------------------

    #[cold]
    fn out_of_memory<B: Backend>(
        &mut self,
        backend: &B,
        requested: u64,
        slot: StreamSlot,
    ) -> OutOfMemory {
        let (mut free_cached, mut largest) = (0, 0);
        for state in &self.streams.states {
            for list in state.ready.iter().chain(state.pending.iter()) {
                free_cached += list.bytes();
                largest = largest.max(list.largest());
            }
        }
        self.stats.ooms += 1;
        self.note(backend, TraceAction::Oom, 0, requested, slot);
        let report = OutOfMemory {
            requested,
            stream: self.streams.id(slot),
            free_cached,
            largest_free_block: largest,
            reserved: self.stats.reserved_bytes.current,
            allocated: self.stats.allocated_bytes.current,
            limit: self.limit,
        };
        tracing::warn!(%report, "allocation failed");
        report
    }

    /// The clock for a trace record taken under the lock (0 when not tracing).
    #[inline]
    fn clock<B: Backend>(&self, backend: &B) -> u64 {
        if self.trace.enabled() {
            backend.now_ns()
        } else {
            0
        }
    }

    /// Records an event now. The ring keeps `slot`, turned into the stream's handle only when
    /// read; a slot no stream has (`empty_cache` before any allocation) reads as stream 0.
    #[inline]
    fn note<B: Backend>(
        &mut self,
        backend: &B,
        action: TraceAction,
        addr: u64,
        size: u64,
        slot: StreamSlot,
    ) {
        if self.trace.enabled() {
            let slot = if (slot as usize) < self.streams.len() {
                slot
            } else {
                NO_STREAM
            };
            self.trace.push(action, addr, size, slot, backend.now_ns());
        }
    }

    fn snapshot<B: Backend>(&mut self, backend: &B, config: &Config) -> Snapshot {
        let mut segments: Vec<SegmentInfo> = self
            .arena
            .segments
            .iter()
            .map(|(segment, seg)| SegmentInfo {
                addr: DevicePtr(seg.addr),
                // An expandable segment reports the memory mapped into it, and only the
                // blocks on mapped pages.
                size: self
                    .arena
                    .segment_blocks(segment)
                    .filter(|(_, block)| !block.unmapped)
                    .map(|(_, block)| block.size)
                    .sum(),
                pool: seg.pool,
                stream: self.streams.id(seg.stream),
                blocks: self
                    .arena
                    .segment_blocks(segment)
                    .filter(|(_, block)| !block.unmapped)
                    .map(|(_, block)| BlockInfo {
                        addr: DevicePtr(block.addr),
                        size: block.size,
                        requested: block.requested,
                        state: if block.allocated {
                            BlockState::ActiveAllocated
                        } else if block.pending.is_empty() {
                            BlockState::Inactive
                        } else {
                            BlockState::ActivePendingFree
                        },
                        stream: self.streams.id(block.stream),
                        pending_events: block.pending.len() as u32,
                    })
                    .collect(),
            })
            .collect();
        segments.sort_by_key(|s| s.addr);
        Snapshot {
            config: config.clone(),
            stats: self.stats,
            segments,
            trace: self.trace.entries(|slot| self.streams.id(slot)),
            trace_dropped: self.trace.dropped(),
            time_ns: backend.now_ns(),
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.arena.validate()?;
        let (mut allocated, mut requested, mut pending_bytes, mut listed) =
            (0u64, 0u64, 0u64, 0usize);
        let mut hot_blocks = 0usize;
        let mut event_refs: HashMap<EventKey, u32> = HashMap::new();
        let (mut unmapped_bytes, mut unmapped_blocks) = (0u64, 0usize);
        for (key, block) in &self.arena.blocks {
            let pool = self.arena.segments[block.segment].pool;
            if block.unmapped {
                self.check_unmapped(key)?;
                unmapped_bytes += block.size;
                unmapped_blocks += 1;
                continue;
            }
            if block.allocated {
                if self.allocated.get(&block.addr) == Some(&key) {
                    requested += block.requested;
                }
                allocated += block.size;
                if !block.pending.is_empty() {
                    return Err(format!("allocated block {key} carries pending events"));
                }
                continue;
            }
            if !block.uses.is_empty() {
                return Err(format!("free block {key} has uses"));
            }
            if block.hot {
                let hot = &self.streams.get(block.stream).hot;
                if !block.pending.is_empty() || hot.keys().filter(|k| *k == key).count() != 1 {
                    return Err(format!(
                        "hot block {key} is not once in its owner's hot list, or is pending"
                    ));
                }
                hot_blocks += 1;
                continue;
            }
            let pending = !block.pending.is_empty();
            let state = self.streams.get(block.stream);
            let list = if pending {
                &state.pending[pool as usize]
            } else {
                &state.ready[pool as usize]
            };
            if !list.contains(block.size, block.addr, key) {
                return Err(format!("free block {key} is not in its list"));
            }
            listed += 1;
            if pending {
                pending_bytes += block.size;
            }
            for event in &block.pending {
                *event_refs.entry(*event).or_default() += 1;
            }
        }
        let total_listed: usize = self
            .streams
            .states
            .iter()
            .map(|s| {
                s.ready
                    .iter()
                    .chain(s.pending.iter())
                    .map(|l| l.len())
                    .sum::<usize>()
            })
            .sum();
        let total_hot: usize = self.streams.states.iter().map(|s| s.hot.len()).sum();
        if total_hot != hot_blocks {
            return Err(format!(
                "{total_hot} blocks in hot lists, {hot_blocks} hot blocks exist"
            ));
        }
        // The allocated map holds exactly the handed-out (unquarantined) and hot blocks, each
        // at its own address.
        for (&addr, &key) in &self.allocated {
            match self.arena.blocks.get(key) {
                Some(block) if block.addr == addr && (block.allocated || block.hot) => {}
                _ => return Err(format!("allocated map sends {addr:#x} to block {key}")),
            }
            if self.arena.blocks[key].hot && self.arena.blocks[key].allocated {
                return Err(format!("hot block {key} is allocated"));
            }
        }
        let hot_unmapped = self
            .arena
            .blocks
            .iter()
            .filter(|(key, block)| block.hot && self.allocated.get(&block.addr) != Some(key))
            .count();
        if hot_unmapped != 0 {
            return Err(format!(
                "{hot_unmapped} hot blocks missing from the allocated map"
            ));
        }
        if total_listed != listed {
            return Err(format!(
                "{total_listed} blocks listed, {listed} free blocks exist"
            ));
        }
        for state in &self.streams.states {
            for event in &state.in_flight {
                *event_refs.entry(*event).or_default() += 1;
            }
        }
        if event_refs.len() != self.events.outstanding() {
            return Err(format!(
                "{} events referenced, {} outstanding",
                event_refs.len(),
                self.events.outstanding()
            ));
        }
        let indexed: usize = self.vmm.as_ref().map_or(0, |vmm| {
            vmm.segments()
                .map(|segment| vmm.unmapped(segment).len())
                .sum()
        });
        if indexed != unmapped_blocks {
            return Err(format!(
                "{indexed} unmapped blocks indexed, {unmapped_blocks} exist"
            ));
        }
        let expandable_size: u64 = self
            .arena
            .segments
            .iter()
            .filter(|(_, s)| s.expandable)
            .map(|(_, s)| s.size)
            .sum();
        let mapped = self.vmm.as_ref().map_or(0, |vmm| vmm.mapped);
        if mapped != expandable_size - unmapped_bytes {
            return Err(format!(
                "{mapped} bytes counted mapped, the segments map {}",
                expandable_size - unmapped_bytes
            ));
        }
        let stats = &self.stats;
        let reserved: u64 =
            self.arena.segments.iter().map(|(_, s)| s.size).sum::<u64>() - unmapped_bytes;
        let checks = [
            ("allocated_bytes", stats.allocated_bytes.current, allocated),
            ("requested_bytes", stats.requested_bytes.current, requested),
            ("reserved_bytes", stats.reserved_bytes.current, reserved),
            (
                "pending_free_bytes",
                stats.pending_free_bytes.current,
                pending_bytes,
            ),
            (
                "active_bytes",
                stats.active_bytes.current,
                allocated + pending_bytes,
            ),
            (
                "events_outstanding",
                stats.events_outstanding,
                self.events.outstanding() as u64,
            ),
            (
                "event objects",
                stats.events_created - stats.events_destroyed,
                (self.events.outstanding() + self.events.idle()) as u64,
            ),
        ];
        for (name, counted, summed) in checks {
            if counted != summed {
                return Err(format!(
                    "{name} is {counted} but the blocks add up to {summed}"
                ));
            }
        }
        Ok(())
    }
}

impl State {
    /// Checks one unmapped block: free, page-aligned, in an expandable segment, indexed,
    /// not listed, and not adjacent to another unmapped block.
    fn check_unmapped(&self, key: BlockKey) -> Result<(), String> {
        let block = &self.arena.blocks[key];
        let Some(vmm) = self.vmm.as_ref() else {
            return Err(format!("unmapped block {key} without expandable segments"));
        };
        if !vmm.contains(block.segment) || !self.arena.segments[block.segment].expandable {
            return Err(format!(
                "unmapped block {key} outside an expandable segment"
            ));
        }
        if block.allocated || !block.pending.is_empty() || !block.uses.is_empty() {
            return Err(format!("unmapped block {key} is in use"));
        }
        if !block.addr.is_multiple_of(vmm.page) || !block.size.is_multiple_of(vmm.page) {
            return Err(format!("unmapped block {key} is not page-aligned"));
        }
        if vmm.unmapped(block.segment).get(&block.addr) != Some(&key) {
            return Err(format!("unmapped block {key} is not indexed"));
        }
        let pool = self.arena.segments[block.segment].pool as usize;
        let state = self.streams.get(block.stream);
        if state.ready[pool].contains(block.size, block.addr, key)
            || state.pending[pool].contains(block.size, block.addr, key)
        {
            return Err(format!("unmapped block {key} is in a free list"));
        }
        let neighbours = [block.prev, block.next];
        if neighbours
            .iter()
            .flatten()
            .any(|&n| self.arena.blocks[n].unmapped)
        {
            return Err(format!("unmapped block {key} borders another"));
        }
        Ok(())
    }
}

/// Where [`State::grow_expandable`] maps pages: `map` bytes at `addr`, inside the unmapped
/// block `hole` (at its top or bottom), joined with the caller's free neighbours `below`
/// and `above` where given.
#[derive(Debug)]
struct Placement {
    addr: u64,
    hole: BlockKey,
    map: u64,
    top: bool,
    below: Option<BlockKey>,
    above: Option<BlockKey>,
}

/// The largest cached block a request of rounded `size` may take (PyTorch's
/// `max_split_size` rule): small requests never take oversize blocks, and oversize
/// requests take one at most [`OVERSIZE_SLACK`] larger.
#[inline]
fn max_block_for(size: u64, config: &Config) -> u64 {
    match config.max_split_size {
        None => u64::MAX,
        Some(max_split) if size < max_split => max_split - 1,
        Some(_) => size + OVERSIZE_SLACK,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SimBackend;

    fn sim(trace_capacity: usize) -> (SimBackend, Allocator<SimBackend>) {
        let device = SimBackend::new(1 << 30);
        let config = Config {
            trace_capacity,
            ..Config::default()
        };
        (device.clone(), Allocator::new(device, config).unwrap())
    }

    #[test]
    fn a_hot_block_is_free_to_callers_and_reused_without_the_map_changing() {
        let (device, allocator) = sim(64);
        let stream = device.create_stream();
        let block = allocator.malloc(4096, stream).unwrap();
        assert!(allocator.owns(block.ptr));
        allocator.free(block.ptr).unwrap();
        // Hot now: still in the address map, but freed as far as any caller can tell.
        assert!(!allocator.owns(block.ptr));
        assert_eq!(
            allocator.record_use(block.ptr, stream),
            Err(AllocError::UnknownPointer(block.ptr))
        );
        assert_eq!(
            allocator.free(block.ptr),
            Err(AllocError::UnknownPointer(block.ptr))
        );
        allocator.check_invariants().unwrap();
        let again = allocator.malloc(4096, stream).unwrap();
        assert_eq!(again.ptr, block.ptr);
        assert!(allocator.owns(again.ptr));
        allocator.check_invariants().unwrap();
        allocator.free(again.ptr).unwrap();
        assert_eq!(allocator.stats().invalid_frees, 1);
        // Flushed out of the hot list by a slow path: out of the map as well.
        allocator.empty_cache().unwrap();
        assert!(!allocator.owns(block.ptr));
        allocator.check_invariants().unwrap();
    }

    #[test]
    fn the_trace_reads_back_pytorch_entries() {
        let (device, allocator) = sim(64);
        let (compute, comm) = (device.create_stream(), device.create_stream());
        device.advance_host(100);
        let a = allocator.malloc(4096, compute).unwrap();
        device.advance_host(50);
        allocator.free(a.ptr).unwrap();
        let b = allocator.malloc(1 << 20, compute).unwrap();
        allocator.record_use(b.ptr, comm).unwrap();
        device.advance_host(10);
        allocator.free(b.ptr).unwrap();
        allocator.trace_event(TraceAction::StagingAcquire, DevicePtr(7), 8, comm);
        let entries: Vec<_> = allocator
            .snapshot()
            .trace
            .iter()
            .map(|e| (e.action, e.addr, e.size, e.stream, e.time_ns))
            .collect();
        use TraceAction::*;
        let (sa, sb) = (a.size, b.size);
        let segment = entries[0];
        assert_eq!(
            (segment.0, segment.3, segment.4),
            (SegmentAlloc, compute, 100)
        );
        assert_eq!(
            entries[1..],
            [
                (Alloc, a.ptr, sa, compute, 100),
                (FreeRequested, a.ptr, sa, compute, 150),
                (FreeCompleted, a.ptr, sa, compute, 150),
                (Alloc, b.ptr, sb, compute, 150),
                // Used by another stream: requested now, completed only once its event is
                // seen complete.
                (FreeRequested, b.ptr, sb, compute, 160),
                (StagingAcquire, DevicePtr(7), 8, comm, 160),
            ]
        );
    }

    #[test]
    fn a_full_trace_drops_whole_entries_oldest_first() {
        let (device, allocator) = sim(4);
        let stream = device.create_stream();
        for _ in 0..3 {
            let block = allocator.malloc(4096, stream).unwrap();
            device.advance_host(1);
            allocator.free(block.ptr).unwrap();
        }
        let snapshot = allocator.snapshot();
        let actions: Vec<_> = snapshot.trace.iter().map(|e| e.action).collect();
        // segment_alloc + 3 × (alloc, free_requested, free_completed) = 10 entries, 4 kept:
        // the second free's completion survives without its request.
        assert_eq!(
            actions,
            [
                TraceAction::FreeCompleted,
                TraceAction::Alloc,
                TraceAction::FreeRequested,
                TraceAction::FreeCompleted
            ]
        );
        assert_eq!(snapshot.trace_dropped, 6);
        assert_eq!(snapshot.trace[0].time_ns, 2);
    }
}
