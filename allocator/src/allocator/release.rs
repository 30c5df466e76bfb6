//! Returning memory to the device (`empty_cache`, the out-of-memory retry, the memory
//! limit), each after one device synchronisation (`State::synchronize`).
//!
//! Memory of a pool with uses left is never returned here, not even when every block in
//! it is free: a live graph replays into those addresses (see `lifetime::pools`). Only an
//! explicit request naming the pool ([`Release::Pool`]) returns it.

use super::*;

/// Which cached memory a release may return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Release {
    /// The default pool's, and that of pools with no uses left.
    Unpinned,
    /// One pool's only, whatever its use count (`torch.cuda.MemPool`'s own empty_cache).
    Pool(PoolId),
}

impl State {
    /// True if a release of kind `which` may return memory owned by `slot`.
    pub(super) fn releasable(&self, which: Release, slot: StreamSlot) -> bool {
        let pool = self.streams.pool(slot);
        match which {
            Release::Unpinned => !self.pools.pins_memory(pool),
            Release::Pool(only) => pool == only,
        }
    }

    /// Releases what [`Release::Unpinned`] allows. Returns the bytes released.
    pub(super) fn release_cached<B: Backend>(&mut self, backend: &B) -> Result<u64, BackendError> {
        self.release_cached_where(backend, Release::Unpinned)
    }

    /// Synchronises the device, settles every event, coalesces free blocks across streams
    /// (after a device-wide sync any free byte is safe for any stream of its pool) and
    /// returns the wholly free segments and free mappings that `which` allows, and idle
    /// events, to the backend. Returns the bytes released.
    pub(super) fn release_cached_where<B: Backend>(
        &mut self,
        backend: &B,
        which: Release,
    ) -> Result<u64, BackendError> {
        let reserved_before = self.stats.reserved_bytes.current;
        self.synchronize(backend)?;
        self.evict_dormant_stitches(backend, which)?;
        self.coalesce_across_streams();
        self.unmap_free_pages_upto(backend, u64::MAX, which, &[])?;
        self.release_unmapped_segments(backend, which)?;
        let free_segments: Vec<_> = self
            .arena
            .segments()
            .filter(|(segment, seg)| {
                !seg.is_expandable()
                    && self.releasable(which, seg.stream())
                    && self.arena.segment_is_free(*segment)
            })
            .map(|(segment, seg)| (segment, seg.head(), seg.stream(), seg.pool()))
            .collect();
        let mut released = reserved_before - self.stats.reserved_bytes.current;
        for (segment, head, stream, kind) in free_segments {
            let seg = self.arena.segment(segment);
            let (addr, size) = (seg.addr(), seg.size());
            backend.free_segment(DevicePtr(addr), size)?;
            self.unlist(head);
            self.arena.remove_segment(segment);
            self.stats.released(kind, size, true);
            self.note(backend, TraceAction::SegmentFree, addr, size, stream);
            released += size;
        }
        self.forget_empty_pools();
        self.events.destroy_idle(backend, &mut self.stats)?;
        self.note(backend, TraceAction::EmptyCache, 0, released, 0);
        tracing::debug!(released, "cached memory released");
        Ok(released)
    }

    /// Synchronises the device (counted in `device_syncs`) and settles what that makes
    /// complete (see [`State::settle_after_sync`]).
    pub(super) fn synchronize<B: Backend>(&mut self, backend: &B) -> Result<(), BackendError> {
        backend.synchronize_device()?;
        self.stats.device_syncs += 1;
        self.settle_after_sync(backend);
        Ok(())
    }

    /// After a device-wide synchronisation: every event is complete, so every pending block
    /// becomes ready, and hot and quarantined blocks return to the free lists.
    pub(super) fn settle_after_sync<B: Backend>(&mut self, backend: &B) {
        self.flush_hot();
        self.events.mark_all_complete();
        // Streams outside the event slots have nothing in flight and every free fenced by a
        // completed fence: already idle.
        let slots = self.streams.take_event_slots();
        for &slot in &slots {
            let index = slot as usize;
            while let Some(event) = self.streams.states[index].in_flight.pop_front() {
                self.events.release(event, &mut self.stats);
            }
            let fences: Vec<EventKey> = self.streams.states[index].fences.synchronised().collect();
            for event in fences {
                self.events.release(event, &mut self.stats);
            }
        }
        self.streams.return_event_slots(slots);
        self.promote_completed(backend);
        self.release_quarantined();
    }

    /// Frees deferred and quarantined blocks (allocated to nobody) now that the device is
    /// idle: their other-stream uses are complete.
    pub(super) fn release_quarantined(&mut self) {
        for (key, _, _) in std::mem::take(&mut self.deferred_frees) {
            self.undefer(key);
            self.settle_freed(key);
        }
        let quarantined: Vec<BlockKey> = self
            .arena
            .blocks()
            .filter(|(key, block)| {
                block.is_allocated() && self.allocated.get(&block.addr()) != Some(key)
            })
            .map(|(key, _)| key)
            .collect();
        for key in quarantined {
            let block = self.arena.block(key);
            let (size, kind) = (block.size(), super::torch_stats::stat_kind(block));
            self.arena.free(key, 0);
            self.stats.withheld_out(kind, size);
            self.settle_freed(key);
        }
    }

    /// Puts the freed, unlisted block `key` back into circulation with the device idle: a
    /// stitched range gives its pages back, any other block is listed.
    fn settle_freed(&mut self, key: BlockKey) {
        if self.arena.block(key).is_stitched() {
            self.return_stitch_idle(key);
        } else {
            self.arena.mark_idle(key);
            self.insert_free(key);
        }
    }

    /// Merges every run of adjacent free blocks regardless of owner; the run takes its
    /// first block's owner. Only valid right after a device-wide synchronisation.
    pub(super) fn coalesce_across_streams(&mut self) {
        let heads: Vec<BlockKey> = self.arena.segments().map(|(_, seg)| seg.head()).collect();
        for head in heads {
            let mut cursor = Some(head);
            while let Some(key) = cursor {
                let block = self.arena.block(key);
                if !block.is_free() {
                    cursor = block.next();
                    continue;
                }
                let mut unlisted = false;
                while let Some(next) = self.arena.block(key).next() {
                    if !self.arena.block(next).is_free() {
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
                    // Merged across owners: idle for every stream after the synchronisation.
                    self.arena.mark_idle(key);
                    self.list(key);
                }
                cursor = self.arena.block(key).next();
            }
        }
    }
}
