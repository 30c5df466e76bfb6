//! Freeing: a block no other stream used goes back to its owner at once (the hot list); one
//! that other streams used gets one event per stream and waits in its owner's pending list.

use super::torch_stats::stat_kind;
use super::*;

impl State {
    /// Frees `ptr` within a larger operation (restoring a pool's checkpoint); a pointer
    /// this allocator did not hand out is an invalid free.
    pub(super) fn free<B: Backend>(
        &mut self,
        backend: &B,
        ptr: DevicePtr,
        now: u64,
    ) -> Result<(), AllocError> {
        if self.free_as(backend, ptr, now, false)? {
            Ok(())
        } else {
            Err(self.invalid_free(ptr))
        }
    }

    /// Counts a free of `ptr`, which this allocator did not hand out (or already freed).
    #[cold]
    pub(super) fn invalid_free(&mut self, ptr: DevicePtr) -> AllocError {
        self.stats.invalid_frees += 1;
        AllocError::UnknownPointer(ptr)
    }

    /// Frees `ptr` as an operation of its own ([`Allocator::free`]) if this allocator handed
    /// it out; false, counting nothing, if not. A block no other stream used changes
    /// PyTorch's active statistics at once, the operation's only change to them.
    #[inline]
    pub(super) fn free_if_owned<B: Backend>(
        &mut self,
        backend: &B,
        ptr: DevicePtr,
        now: u64,
    ) -> Result<bool, AllocError> {
        self.free_as(backend, ptr, now, true)
    }

    /// Frees `ptr`; false if it is no live block of this allocator. `alone`: the free is
    /// an operation of its own.
    #[inline]
    fn free_as<B: Backend>(
        &mut self,
        backend: &B,
        ptr: DevicePtr,
        now: u64,
        alone: bool,
    ) -> Result<bool, AllocError> {
        // One map lookup; the entry stays while the block is hot (see `allocated`).
        let MapEntry::Occupied(entry) = self.allocated.entry(ptr.0) else {
            return Ok(false);
        };
        let key = *entry.get();
        let block = self.arena.block(key);
        if !block.is_allocated() {
            return Ok(false);
        }
        if block.is_stitched() {
            return self.free_stitched(backend, key, now).map(|()| true);
        }
        let (size, requested, owner) = (block.size(), block.requested(), block.owner());
        let kind = stat_kind(block);
        let stream = self.streams.get_mut(owner);
        let uses = self.arena.free(key, stream.fences.epoch());
        let fence = stream.fences.note_free();
        let park = uses.is_empty() && stream.hot.admit();
        // The free leaves the stream with an unfenced free: the passes must visit it. Most
        // frees find it listed already, and need not index the table again.
        if !stream.in_event_slots() {
            self.streams.note_events(owner);
        }
        if !park {
            entry.remove();
        }
        if alone && uses.is_empty() {
            // Nothing else this free does changes an active block.
            self.stats.returned_alone(kind, size, requested);
        } else {
            self.stats.returned(kind, size, requested);
        }
        if fence && !self.pools.capture_underway() {
            self.fence_after_free(backend, owner);
        }
        if uses.is_empty() {
            // No other stream used it, and an allocated block carries no pending events:
            // ready for its owner at once. The request and its completion are one trace
            // record, read back as PyTorch's `free_requested` + `free_completed`.
            debug_assert!(self.arena.block(key).pending().is_empty());
            if self.trace.enabled() {
                self.trace.push_free_completed(ptr.0, size, owner, now);
            }
            if park {
                self.push_hot(key, owner, size);
            } else {
                self.insert_free(key);
            }
            return Ok(true);
        }
        self.free_shared(backend, key, ptr, (size, kind, owner), uses, now)
    }

    /// The rest of a free of the block `key` at `ptr`, whose (size, kind, owner) are given,
    /// after the counters: other streams used it (`uses`), so its reuse waits for their work.
    #[inline(never)]
    fn free_shared<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        ptr: DevicePtr,
        (size, kind, owner): (u64, PoolKind, StreamSlot),
        uses: thin_vec::ThinVec<StreamSlot>,
        now: u64,
    ) -> Result<bool, AllocError> {
        if self.trace.enabled() {
            self.trace
                .push(TraceAction::FreeRequested, ptr.0, size, owner, now);
        }
        if self.pools.capture_underway() {
            // An event recorded now on a capturing stream would become part of the
            // capture: the block waits, out of every list and counted as pending, until
            // the captures end (`complete_deferred_frees`) or the device synchronises.
            self.arena.withhold(key);
            self.stats.pending_in(kind, size);
            self.deferred_frees.push((key, ptr.0, uses));
            return Ok(true);
        }
        if let Err(err) = self.record_uses(backend, key, &uses) {
            // Without the events the block's reuse cannot be ordered: keep it out of
            // circulation (leaked until empty_cache synchronises) rather than risk a race.
            tracing::error!(%err, ?ptr, "recording a use event failed; block quarantined until empty_cache");
            self.list_quarantined(key);
            return Err(err.into());
        }
        // One event per use stream: pending until they complete or are waited on.
        debug_assert!(!self.arena.block(key).pending().is_empty());
        self.insert_free(key);
        Ok(true)
    }

    /// Frees the blocks deferred while captures were under way: records their use events
    /// now and lists them.
    pub(super) fn complete_deferred_frees<B: Backend>(
        &mut self,
        backend: &B,
    ) -> Result<(), BackendError> {
        for (key, _, uses) in std::mem::take(&mut self.deferred_frees) {
            self.undefer(key);
            if self.arena.block(key).is_stitched() {
                self.return_stitch(backend, key, &uses)?;
                continue;
            }
            if let Err(err) = self.record_uses(backend, key, &uses) {
                tracing::error!(%err, "recording a use event failed; block quarantined until empty_cache");
                self.list_quarantined(key);
                return Err(err);
            }
            self.insert_free(key);
        }
        Ok(())
    }

    /// Records a fence on `slot`'s stream after a free (see `lifetime::fences`). A driver
    /// error only costs the fence: takers then wait for the stream's work so far.
    #[cold]
    fn fence_after_free<B: Backend>(&mut self, backend: &B, slot: StreamSlot) {
        if let Err(err) = self.record_fence(backend, slot) {
            tracing::debug!(%err, "fence not recorded");
        }
    }

    /// Records a fence on `slot`'s stream now: it covers every block the stream freed so
    /// far. The fence list holds the event's reference.
    pub(super) fn record_fence<B: Backend>(
        &mut self,
        backend: &B,
        slot: StreamSlot,
    ) -> Result<EventKey, BackendError> {
        let event = self
            .events
            .record(backend, slot, self.streams.id(slot), &mut self.stats)?;
        self.streams.get_mut(slot).fences.push(event);
        self.streams.note_events(slot);
        Ok(event)
    }

    /// Takes a deferred block out of its waiting state (free, unlisted, uncounted).
    pub(super) fn undefer(&mut self, key: BlockKey) {
        let block = self.arena.block(key);
        debug_assert!(self.allocated.get(&block.addr()) != Some(&key));
        let (size, kind, owner) = (block.size(), stat_kind(block), block.owner());
        let epoch = self.streams.get(owner).fences.epoch();
        self.arena.free(key, epoch);
        self.stats.pending_out(kind, size);
    }

    /// The block handed out at `addr`, if any (hot blocks share the map; see `allocated`).
    #[inline]
    pub(super) fn allocated_key(&self, addr: u64) -> Option<BlockKey> {
        let key = *self.allocated.get(&addr)?;
        self.arena.block(key).is_allocated().then_some(key)
    }

    /// One event on each use stream, now; the block and the stream's in-flight queue each
    /// hold a reference.
    pub(super) fn record_uses<B: Backend>(
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
            self.streams.note_events(use_slot);
            self.arena.add_pending(key, event);
        }
        Ok(())
    }

    pub(super) fn record_use(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let key = self
            .allocated_key(ptr.0)
            .ok_or(AllocError::UnknownPointer(ptr))?;
        let slot = self.streams.slot(stream);
        self.arena.add_use(key, slot);
        Ok(())
    }
}
