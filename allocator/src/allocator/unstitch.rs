//! A stitched range's end: freeing it (its pages go back to the blocks that lent them,
//! carrying the events of the streams that used it), keeping it dormant for a later
//! request of its size, and unmapping dormant ranges once their events are complete (see
//! the policy in `stitch`).

use super::*;
use crate::lifetime::EventKey;
use thin_vec::ThinVec;

/// Dormant stitches kept before the least recently freed are unmapped (once their events
/// are complete). Each holds only address space and a second mapping.
const MAX_DORMANT: usize = 64;

impl State {
    /// Frees the handed-out stitched block `key`: the counters as for any free, then the
    /// pages go back ([`State::return_stitch`]), or wait for the captures under way to end.
    #[cold]
    #[inline(never)]
    pub(super) fn free_stitched<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        now: u64,
    ) -> Result<(), AllocError> {
        let block = self.arena.block(key);
        let (addr, size, requested, owner) =
            (block.addr(), block.size(), block.requested(), block.owner());
        let kind = super::torch_stats::stat_kind(block);
        let epoch = self.streams.get(owner).fences.epoch();
        let uses = self.arena.free(key, epoch);
        self.allocated.remove(&addr);
        self.stats.returned(kind, size, requested);
        if self.pools.capture_underway() {
            // Recording the range's events now would put them into the capture: it stays
            // allocated to nobody until the captures end (`complete_deferred_frees`).
            self.note(backend, TraceAction::FreeRequested, addr, size, owner);
            self.arena.withhold(key);
            self.stats.pending_in(kind, size);
            self.deferred_frees.push((key, addr, uses));
            return Ok(());
        }
        if self.trace.enabled() {
            self.trace.push_free_completed(addr, size, owner, now);
        }
        self.return_stitch(backend, key, &uses)?;
        Ok(())
    }

    /// Gives the pages of the freed (free, unlisted) stitched block `key` back to their
    /// pool and keeps the stitch dormant. One event is recorded on every stream that used
    /// the range: the lent blocks, now free blocks of the range's owner, wait for the other
    /// streams'; the range itself for all of them before it may be unmapped.
    pub(super) fn return_stitch<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        uses: &[StreamSlot],
    ) -> Result<(), BackendError> {
        let owner = self.arena.block(key).owner();
        let epoch = self.streams.get(owner).fences.epoch();
        let mut last_use = ThinVec::new();
        for &slot in std::iter::once(&owner).chain(uses) {
            match self
                .events
                .record(backend, slot, self.streams.id(slot), &mut self.stats)
            {
                Ok(event) => {
                    self.events.retain(event);
                    self.streams.get_mut(slot).in_flight.push_back(event);
                    self.streams.note_events(slot);
                    last_use.push(event);
                }
                Err(err) => {
                    // The pages' reuse cannot be ordered: the range stays allocated to
                    // nobody, its pages lent, until `empty_cache` synchronises.
                    tracing::error!(%err, "recording a use event failed; stitched range quarantined until empty_cache");
                    for event in last_use {
                        self.events.release(event, &mut self.stats);
                    }
                    self.list_quarantined(key);
                    return Err(err);
                }
            }
        }
        // The owner's event is a fence too: it covers the range's pages, and every block
        // the owner freed before, for whichever stream takes them next.
        let fence = last_use[0];
        self.events.retain(fence);
        self.streams.get_mut(owner).fences.push(fence);
        self.streams.note_events(owner);
        self.park_stitch(key, last_use, epoch);
        self.evict_idle_stitches(backend)
    }

    /// [`State::return_stitch`] with the device idle (after a synchronisation): the pages
    /// need no events.
    pub(super) fn return_stitch_idle(&mut self, key: BlockKey) {
        let addr = self.arena.block(key).addr();
        self.park_stitch(key, ThinVec::new(), 0);
        tracing::debug!(addr, "stitched range returned after a synchronisation");
    }

    /// Takes the lent blocks of the freed stitched block `key` back as free blocks of its
    /// owner, freed in the owner's `epoch` and pending on `last_use` past its first event
    /// (the owner's own, which its stream order and its fences cover), forgets the range's
    /// segment and keeps the stitch dormant with `last_use`.
    fn park_stitch(&mut self, key: BlockKey, last_use: ThinVec<EventKey>, epoch: u32) {
        let (owner, segment) = {
            let block = self.arena.block(key);
            (block.owner(), block.segment())
        };
        let mut stitch = self
            .stitches
            .deactivate(segment)
            .expect("a stitched block's segment has an active stitch");
        let others = last_use.get(1..).unwrap_or(&[]);
        for &lent in &stitch.lent {
            self.arena.take_back(lent, owner, epoch);
            for &event in others {
                self.events.retain(event);
                self.arena.add_pending(lent, event);
            }
            self.insert_free(lent);
        }
        self.arena.remove_segment(segment);
        stitch.last_use = last_use;
        self.stitches.park(stitch);
    }

    /// Unmaps the least recently freed dormant stitches past [`MAX_DORMANT`] whose events
    /// are known complete (those still running are kept: address space costs nothing).
    fn evict_idle_stitches<B: Backend>(&mut self, backend: &B) -> Result<(), BackendError> {
        while self.stitches.dormant().len() > MAX_DORMANT {
            let oldest_done = self.stitches.dormant().iter().position(|stitch| {
                stitch
                    .last_use
                    .iter()
                    .all(|&event| self.events.is_complete(event))
            });
            match oldest_done {
                Some(index) => self.evict_stitch(backend, index)?,
                None => break,
            }
        }
        Ok(())
    }

    /// Unmaps the dormant stitches that map any of `[addr, addr + len)`: the pages are about
    /// to go back to the device. Only valid right after a device-wide synchronisation.
    pub(super) fn evict_stitches_over<B: Backend>(
        &mut self,
        backend: &B,
        addr: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        for index in self.stitches.dormant_over(addr, len).into_iter().rev() {
            self.evict_stitch(backend, index)?;
        }
        Ok(())
    }

    /// Unmaps every dormant stitch of a pool that `which` may release. Only valid right
    /// after a device-wide synchronisation.
    pub(super) fn evict_dormant_stitches<B: Backend>(
        &mut self,
        backend: &B,
        which: Release,
    ) -> Result<(), BackendError> {
        let doomed: Vec<usize> = self
            .stitches
            .dormant()
            .iter()
            .enumerate()
            .filter(|(_, stitch)| match which {
                Release::Unpinned => !self.pools.pins_memory(stitch.memory_pool),
                Release::Pool(pool) => stitch.memory_pool == pool,
            })
            .map(|(index, _)| index)
            .collect();
        for index in doomed.into_iter().rev() {
            self.evict_stitch(backend, index)?;
        }
        Ok(())
    }

    /// Unmaps dormant stitch `index` and releases its range; its events must be complete.
    fn evict_stitch<B: Backend>(&mut self, backend: &B, index: usize) -> Result<(), BackendError> {
        let stitch = self.stitches.take_dormant(index);
        debug_assert!(stitch
            .last_use
            .iter()
            .all(|&event| self.events.is_complete(event)));
        let started_ns = backend.precise_ns();
        backend.unmap_pages(DevicePtr(stitch.addr), stitch.size)?;
        backend.release_address_space(DevicePtr(stitch.addr), stitch.size)?;
        let unmap_ns = self.count_vmm(backend, started_ns);
        if !stitch.revived {
            // Mapped for one request and unmapped again: remapping that served nothing a
            // free block or growth could not have.
            self.table_mut().remap_ns += stitch.map_ns + unmap_ns;
        }
        for event in stitch.last_use {
            self.events.release(event, &mut self.stats);
        }
        self.stats.stitch_evictions += 1;
        self.note(
            backend,
            TraceAction::Unstitch,
            stitch.addr,
            stitch.size,
            StreamSlot::MAX,
        );
        Ok(())
    }
}
