//! Allocation: the fast path (the hot list, the stream's own ready blocks) and the slow
//! path (completed events, device-side waits, growth, release and retry, out of memory),
//! in the order of the policy in the parent module's docs.

use super::torch_stats::{counts_split, stat_kind};
use super::*;
use crate::lifetime::fences::OwnerWork;

impl State {
    /// Allocates: the hot list here, everything else out of line ([`State::malloc_cached`]),
    /// so that a same-size malloc after a free runs a short path of code.
    #[inline]
    pub(super) fn malloc<B: Backend>(
        &mut self,
        backend: &B,
        config: &Config,
        requested: u64,
        stream: StreamId,
        pool_id: PoolId,
        now: u64,
    ) -> Result<Allocation, AllocError> {
        let size = round_size(requested);
        let slot = if pool_id.is_default() {
            self.streams.slot(stream)
        } else {
            self.streams.slot_in(stream, pool_id)
        };
        // 1. A ready block of the stream: stream order makes reuse safe, no event needed.
        //    First the hot list (same size freed recently: no split, no merge); on a miss
        //    its blocks are merged into the free lists before best fit looks.
        if let Some(key) = self.streams.get_mut(slot).hot.take(size) {
            return Ok(self.hand_out_hot(key, slot, requested, now));
        }
        self.malloc_cached(backend, config, requested, size, slot, now)
    }

    /// Step 1 past the hot list, then the slow path: the stream's best-fitting ready block,
    /// its hot blocks merged into the free lists first.
    #[inline(never)]
    fn malloc_cached<B: Backend>(
        &mut self,
        backend: &B,
        config: &Config,
        requested: u64,
        size: u64,
        slot: StreamSlot,
        now: u64,
    ) -> Result<Allocation, AllocError> {
        // Expandable segments serve every size from one pool: a small block among large
        // free ones pins only the pages it touches, and it fills slivers no large request
        // could use (measured: 1.189 → 1.036 on the generated trace; see the README).
        let pool_id = self.streams.pool(slot);
        let pool = if self.growth.expandable().is_some() && !self.pools.grows_whole(pool_id) {
            PoolKind::Large
        } else {
            pool_of(size)
        };
        let max_size = max_block_for(size, config);
        self.hot_missed(slot);
        let need = Need {
            slot,
            pool,
            size,
            max_size,
        };
        if let Some(key) = self.take_ready(need) {
            return Ok(self.hand_out_as(key, slot, size, requested, now, true));
        }
        // The slow path's host time (`Stats::slow_path_ns`): two reads of the precise clock
        // against the microseconds it takes.
        let started_ns = backend.precise_ns();
        let served = self.malloc_slow(backend, config, requested, need, now);
        self.stats.slow_paths += 1;
        self.stats.slow_path_ns += backend.precise_ns().saturating_sub(started_ns);
        served
    }

    /// Every way of serving `need` after the stream's ready blocks, in the order of the
    /// policy (the parent module's docs). The block's `alloc` record carries `now`, the
    /// clock read when the request came in: the ring lifts it past the records noted on the
    /// way (a `segment_alloc`, say), which read the clock themselves.
    #[cold]
    #[inline(never)]
    pub(super) fn malloc_slow<B: Backend>(
        &mut self,
        backend: &B,
        config: &Config,
        requested: u64,
        need: Need,
        now: u64,
    ) -> Result<Allocation, AllocError> {
        let Need { slot, size, .. } = need;
        let stream = self.streams.id(slot);
        self.streams.prune_free_slots();
        // Hot blocks are invisible to best fit and to other streams: merge them back first.
        if self.flush_hot() {
            if let Some(key) = self.take_ready(need) {
                return Ok(self.hand_out(key, slot, size, requested, now));
            }
        }
        // A capturing stream may not query events, wait on events recorded outside the
        // capture, or synchronise: it only gets ready blocks of its own or fresh segments.
        // While any capture is under way (global capture mode), no stream may: a query or a
        // synchronisation anywhere, or a wait on a capturing stream's event, breaks it.
        let capturing = self.pools.capture_underway() || backend.is_capturing(stream)?;
        let policy = config.reuse_policy;
        if !capturing {
            self.record_due_fences(backend);
            // 2. Blocks whose events completed, found by one batched pass.
            let due =
                policy == ReusePolicy::Pytorch || self.events.outstanding() >= config.event_batch;
            if due && self.collect_completed(backend)? {
                if let Some(key) = self.take_ready(need) {
                    return Ok(self.hand_out(key, slot, size, requested, now));
                }
            }
            // 3. Any other free block, reused after a device-side wait.
            if let Some(key) = self.take_waitable(backend, need, policy)? {
                return Ok(self.hand_out(key, slot, size, requested, now));
            }
            // 4. Revive a kept stitch, or stitch pages that need no wait.
            if let Some(key) = self.stitch(backend, need, policy, Effort::Light)? {
                return Ok(self.hand_out_whole(key, slot, requested, now));
            }
        }
        // 5. Grow within the growth budget.
        if let Some(key) = self.grow_any(backend, need, capturing, Effort::Light)? {
            return Ok(self.hand_out(key, slot, size, requested, now));
        }
        if !capturing {
            // 6. Stitch free pages of every stream of the pool, waiting on the device.
            if let Some(key) = self.stitch(backend, need, policy, Effort::Waiting)? {
                return Ok(self.hand_out_whole(key, slot, requested, now));
            }
            // 7. Grow past the budget, within the limit.
            if let Some(key) = self.grow_any(backend, need, false, Effort::Waiting)? {
                return Ok(self.hand_out(key, slot, size, requested, now));
            }
            // 8. Under pressure: every free byte, after one synchronisation.
            if let Some(served) = self.serve_under_pressure(backend, need, policy)? {
                return Ok(match served {
                    Served::Block(key) => self.hand_out(key, slot, size, requested, now),
                    Served::Stitched(key) => self.hand_out_whole(key, slot, requested, now),
                });
            }
        }
        // 9. Out of memory.
        Err(AllocError::OutOfMemory(
            self.out_of_memory(backend, requested, slot),
        ))
    }

    /// Fences for the streams that freed blocks since their newest one, so that another
    /// stream taking those blocks later waits for little or nothing (`lifetime::fences`).
    fn record_due_fences<B: Backend>(&mut self, backend: &B) {
        let slots = self.streams.take_event_slots();
        for &index in &slots {
            if self.streams.get(index).fences.wants_fence() {
                if let Err(err) = self.record_fence(backend, index) {
                    tracing::debug!(%err, "fence not recorded");
                    break;
                }
            }
        }
        self.streams.return_event_slots(slots);
    }

    /// Step 3 of the policy: under the `stream_wait` policy, the best-fitting block of the
    /// caller's pending list or of another stream of its pool, unlisted, the caller's
    /// stream waiting on the device for its last uses.
    fn take_waitable<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        policy: ReusePolicy,
    ) -> Result<Option<BlockKey>, AllocError> {
        if policy != ReusePolicy::StreamWait {
            return Ok(None);
        }
        let Some(key) = self.best_waitable(need) else {
            return Ok(None);
        };
        self.unlist(key);
        self.wait_or_relist(backend, key, need.slot)?;
        Ok(Some(key))
    }

    /// Step 8 of the policy, when neither the budget nor the limit (or the device) left
    /// room: one device synchronisation makes every free byte idle for every stream and
    /// every event complete; then, in order, the caller's blocks and any stream's; free
    /// pages of the pool stitched (growing only the shortfall); free whole pages unmapped
    /// until the request fits, and mapped for it; and last, every cached byte returned and
    /// growth tried again. `None` if none of it finds room.
    fn serve_under_pressure<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        policy: ReusePolicy,
    ) -> Result<Option<Served>, AllocError> {
        // PyTorch's `num_alloc_retries`: a synchronisation to free memory and try again.
        self.stats.retries += 1;
        self.stats.torch.alloc_retries += 1;
        self.synchronize(backend)?;
        self.coalesce_across_streams();
        if let Some(key) = self.take_ready(need) {
            return Ok(Some(Served::Block(key)));
        }
        if let Some(key) = self.take_waitable(backend, need, policy)? {
            return Ok(Some(Served::Block(key)));
        }
        if let Some(key) = self.stitch(backend, need, policy, Effort::Synchronised)? {
            return Ok(Some(Served::Stitched(key)));
        }
        // Whole segments have nothing to unmap: they grow again only once released.
        if self.grows_by_mapping(need) {
            if let Some(key) = self.grow_any(backend, need, false, Effort::Synchronised)? {
                return Ok(Some(Served::Block(key)));
            }
        }
        if self.stats.reserved_bytes.current > self.stats.allocated_bytes.current {
            self.release_cached(backend)?;
            if let Some(key) = self.grow_any(backend, need, false, Effort::Synchronised)? {
                return Ok(Some(Served::Block(key)));
            }
        }
        Ok(None)
    }

    /// The best-fitting block that `need.slot` can take after device-side waits: its own
    /// pending blocks, and every free block of other streams in its memory pool.
    pub(super) fn best_waitable(&self, need: Need) -> Option<BlockKey> {
        let Need {
            slot,
            pool,
            size,
            max_size,
        } = need;
        let mut best: Option<(u64, u64, BlockKey)> = None;
        let memory_pool = self.streams.pool(slot);
        for &index in self.streams.free_slots() {
            let state = self.streams.get(index);
            if state.pool != memory_pool {
                continue;
            }
            let own = index == slot;
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

    /// [`State::wait_for_block`] for a block unlisted to be taken: if the wait fails the
    /// block is not taken and goes back in its list, or it would be free and in none.
    pub(super) fn wait_or_relist<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        slot: StreamSlot,
    ) -> Result<(), AllocError> {
        self.wait_for_block(backend, key, slot).map_err(|err| {
            self.list(key);
            err.into()
        })
    }

    /// Releases the free block `key`'s pending events: they are complete, or waited for
    /// by the stream taking it. Always inlined: every malloc calls it, and called it cost
    /// the mixed-size loop 8 instructions an operation.
    #[inline(always)]
    pub(super) fn release_pending(&mut self, key: BlockKey) {
        // Usually none: no call, no cold line touched.
        if self.arena.block(key).pending().is_empty() {
            return;
        }
        for event in self.arena.take_pending(key) {
            self.events.release(event, &mut self.stats);
        }
    }

    /// Makes `slot`'s stream wait on the device for everything that may still use the
    /// (unlisted) block `key`: its pending events and, if it belongs to another stream, the
    /// work queued on that stream so far.
    pub(super) fn wait_for_block<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        slot: StreamSlot,
    ) -> Result<(), BackendError> {
        let stream = self.streams.id(slot);
        let owner = self.arena.block(key).owner();
        let mut waited = false;
        for &event in self.arena.block(key).pending() {
            if !self.events.is_complete(event) && self.events.stream(event) != slot {
                backend.stream_wait_event(stream, self.events.handle(event))?;
                self.stats.cross_stream_waits += 1;
                waited = true;
            }
        }
        if owner != slot {
            // The owner's work up to the free: nothing once a fence covering the free is
            // seen complete; else that fence; else a fence recorded now, which covers every
            // block the owner freed so far (`lifetime::fences`).
            let freed = self.arena.block(key).freed_epoch();
            let fences = &self.streams.get(owner).fences;
            let fence = match fences.work_for(freed) {
                OwnerWork::Done => None,
                OwnerWork::Fence(event) => Some(event),
                // The owner may be gone: no call may name it. Its free's own fence failed
                // (or came during a capture); a synchronisation covers its work instead.
                OwnerWork::Unfenced if fences.is_volatile() => {
                    self.synchronize(backend)?;
                    None
                }
                OwnerWork::Unfenced => Some(self.record_fence(backend, owner)?),
            };
            if let Some(event) = fence {
                backend.stream_wait_event(stream, self.events.handle(event))?;
                self.stats.cross_stream_waits += 1;
                waited = true;
            }
        }
        if waited {
            let block = self.arena.block(key);
            let (addr, size) = (block.addr(), block.size());
            self.note(backend, TraceAction::CrossStreamWait, addr, size, slot);
        }
        Ok(())
    }

    /// Room for `need`, unlisted and owned by its slot, from a new segment or from pages
    /// mapped into an expandable one, as far as `effort` allows (see
    /// [`State::grow_expandable`]); `None` if the budget, the limit or the device refuses.
    /// Whole segments know no budget: they grow at the first effort and not again before a
    /// synchronisation has released memory.
    pub(super) fn grow_any<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        capturing: bool,
        effort: Effort,
    ) -> Result<Option<BlockKey>, AllocError> {
        if self.grows_by_mapping(need) {
            self.grow_expandable(backend, need, capturing, effort)
        } else if effort == Effort::Waiting {
            Ok(None)
        } else {
            self.grow(backend, need.size, need.pool, need.slot)
        }
    }

    /// True if `need`'s memory pool grows by mapping pages into expandable segments, not by
    /// whole segments (expandable segments off, or a pool whose memory comes from a
    /// caller's allocator).
    pub(super) fn grows_by_mapping(&self, need: Need) -> bool {
        self.growth.expandable().is_some() && !self.pools.grows_whole(self.streams.pool(need.slot))
    }

    /// A new segment for a rounded `size`, unlisted and owned by `slot`; `None` if the limit
    /// or the device refuses.
    pub(super) fn grow<B: Backend>(
        &mut self,
        backend: &B,
        size: u64,
        pool: PoolKind,
        slot: StreamSlot,
    ) -> Result<Option<BlockKey>, AllocError> {
        // A block of a pool that never splits is its whole segment: sized to the request.
        let segment_size = if self.pools.never_splits(self.streams.pool(slot)) {
            size.div_ceil(SEGMENT_ROUNDING) * SEGMENT_ROUNDING
        } else {
            segment_size_for(size)
        };
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
        self.stats.reserved(pool, segment_size, true);
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
            false,
        )))
    }

    /// Gives the hot block `key`, of exactly the size asked for, back to its owner `slot`:
    /// nothing to split, no events, and its address is still in the allocated map.
    #[inline]
    pub(super) fn hand_out_hot(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        requested: u64,
        now: u64,
    ) -> Allocation {
        debug_assert_eq!(self.arena.block(key).owner(), slot);
        // One lookup of the block for the hand-out and its accounting.
        let block = self.arena.hand_out(key, slot, requested);
        let (addr, size, kind) = (block.addr(), block.size(), stat_kind(block));
        if counts_split(block) {
            self.stats.split_out(block.pool(), size);
        }
        debug_assert_eq!(self.allocated.get(&addr), Some(&key));
        self.account_block((addr, size, kind), slot, requested, now, true)
    }

    /// Counts and traces the block `key`, just handed to `slot`.
    #[inline]
    pub(super) fn account_alloc(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        requested: u64,
        now: u64,
    ) -> Allocation {
        self.account(key, slot, requested, now, false)
    }

    /// [`State::account_alloc`]; `alone` when the operation moved no other active block
    /// (served from the stream's ready blocks), so that PyTorch's active statistics change
    /// at once instead of by the operation's net change.
    #[inline(always)]
    fn account(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        requested: u64,
        now: u64,
        alone: bool,
    ) -> Allocation {
        let block = self.arena.block(key);
        let (addr, size, kind) = (block.addr(), block.size(), stat_kind(block));
        self.account_block((addr, size, kind), slot, requested, now, alone)
    }

    /// [`State::account`] of the block at `addr` of `size` bytes counted in `kind`.
    #[inline(always)]
    fn account_block(
        &mut self,
        (addr, size, kind): (u64, u64, PoolKind),
        slot: StreamSlot,
        requested: u64,
        now: u64,
        alone: bool,
    ) -> Allocation {
        if alone {
            self.stats.handed_out_alone(kind, size, requested);
        } else {
            self.stats.handed_out(kind, size, requested);
        }
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
    pub(super) fn hand_out(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        size: u64,
        requested: u64,
        now: u64,
    ) -> Allocation {
        self.hand_out_as(key, slot, size, requested, now, false)
    }

    /// [`State::hand_out`]; `alone` as for [`State::account`].
    #[inline]
    fn hand_out_as(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        size: u64,
        requested: u64,
        now: u64,
        alone: bool,
    ) -> Allocation {
        let block = self.arena.block(key);
        let (pool, expandable, block_size) = (block.pool(), block.is_expandable(), block.size());
        // In an expandable segment a free sliver costs no more than the same bytes kept
        // inside the allocation, and may serve a later request: split down to the minimum.
        let mut key = key;
        if (should_split(block_size, size, pool)
            || (expandable && block_size - size >= MIN_BLOCK_SIZE))
            && !self.pools.never_splits(self.streams.pool(slot))
        {
            let at_top = expandable && self.packs_at_top(key);
            let right = self
                .arena
                .split(key, if at_top { block_size - size } else { size });
            // The remainder is still free and still needs what the whole block needed (a
            // ready block, as every block of the fast path is, needs nothing).
            if !self.arena.block(key).pending().is_empty() {
                self.arena.copy_pending(key, right);
                for &event in self.arena.block(right).pending() {
                    self.events.retain(event);
                }
            }
            let (taken, rest) = if at_top { (right, key) } else { (key, right) };
            // Listed as it is: the block was listed, so it had no neighbour it could merge
            // with, and the remainder has its owner and pending state (`check_invariants`
            // checks that no listed block has one). Skipping the merge attempts saves
            // touching the next block, a cold line in a Python loop.
            self.list(rest);
            key = taken;
        }
        self.release_pending(key);
        let addr = self.arena.hand_out(key, slot, requested).addr();
        self.allocated.insert(addr, key);
        self.account(key, slot, requested, now, alone)
    }
}

/// What step 8 of the policy found: a block to split as usual, or a stitched range to hand
/// out whole.
enum Served {
    Block(BlockKey),
    Stitched(BlockKey),
}

impl State {
    /// True if a request should take the top of the free block `key` of an expandable
    /// segment rather than its bottom: the block above is live and the one below is not
    /// (it is unmapped, or there is none). The request then packs against the live block,
    /// and the remainder faces memory that is unmapped or will be freed, where it can merge
    /// and its whole pages can be unmapped. Taken from the bottom, the remainder would be
    /// left between two live blocks, in pages no unmapping can return. On the KV-cache
    /// generation replay the peak went from 1.036 to 1.015 of peak live (one pass; 1.030
    /// after ten), BERT with varying lengths from 1.015 to 1.010 (`--steps 3`), the other
    /// training traces unchanged. Whole segments keep PyTorch's rule (always the bottom).
    fn packs_at_top(&self, key: BlockKey) -> bool {
        let block = self.arena.block(key);
        let live = |neighbour: Option<BlockKey>| {
            neighbour.is_some_and(|n| {
                let n = self.arena.block(n);
                n.is_allocated() || n.is_hot()
            })
        };
        live(block.next()) && !live(block.prev())
    }
}

/// The largest cached block a request of rounded `size` may take (PyTorch's
/// `max_split_size` rule): small requests never take oversize blocks, and oversize
/// requests take one at most [`OVERSIZE_SLACK`] larger.
#[inline]
pub(super) fn max_block_for(size: u64, config: &Config) -> u64 {
    match config.max_split_size {
        None => u64::MAX,
        Some(max_split) if size < max_split => max_split - 1,
        Some(_) => size + OVERSIZE_SLACK,
    }
}
