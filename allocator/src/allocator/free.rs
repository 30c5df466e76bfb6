//! Freeing: a block no other stream used goes back to its owner at once (the hot list); one
//! that other streams used gets one event per stream and waits in its owner's pending list.

use super::torch_stats::stat_kind;
use super::*;

impl State {
    #[inline]
    pub(super) fn free<B: Backend>(
        &mut self,
        backend: &B,
        ptr: DevicePtr,
        now: u64,
    ) -> Result<(), AllocError> {
        // One map lookup; the entry stays while the block is hot (see `allocated`).
        let entry = match self.allocated.entry(ptr.0) {
            MapEntry::Occupied(entry) if self.arena.block(*entry.get()).is_allocated() => entry,
            _ => {
                self.stats.invalid_frees += 1;
                return Err(AllocError::UnknownPointer(ptr));
            }
        };
        let key = *entry.get();
        let block = self.arena.block(key);
        if block.is_stitched() {
            return self.free_stitched(backend, key, now);
        }
        let (size, requested, owner) = (block.size(), block.requested(), block.owner());
        let kind = stat_kind(block);
        let stream = self.streams.get_mut(owner);
        let uses = self.arena.free(key, stream.fences.epoch());
        let fence = stream.fences.note_free();
        let park = uses.is_empty() && stream.hot.admit();
        if !park {
            entry.remove();
        }
        self.stats.returned(kind, size, requested);
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
            return Ok(());
        }
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
            return Ok(());
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
        Ok(())
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
