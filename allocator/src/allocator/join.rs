//! Joining free blocks of different streams whose boundary cuts a page: under a limit, the
//! pages such blocks share are free but belong to no one block, so neither stitching nor
//! unmapping can take them. The requesting stream takes each such block over (waiting on
//! the device for its events and its former owner's work, as for any block of another
//! stream) and merges the run, making the shared pages whole.

use super::*;

impl State {
    /// Joins free blocks of `need`'s memory pool that lie side by side, owned by different
    /// streams, where their boundary cuts a page: each block of such a run is taken over by
    /// `need.slot` (its stream waits on the device for the block's events and its former
    /// owner's work, as for any block of another stream) and the run is merged, so the
    /// pages it shares become whole and stitching can take them. Used under a limit, where
    /// growing for what those pages lack would not fit. True if any run was joined.
    pub(super) fn join_across_streams<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
    ) -> Result<bool, AllocError> {
        let Some(page) = self.growth.expandable().map(|vmm| vmm.page) else {
            return Ok(false);
        };
        let memory_pool = self.streams.pool(need.slot);
        let cuts_a_page = |arena: &crate::pool::arena::Arena, key: BlockKey| {
            let block = arena.block(key);
            let next = block.next().filter(|&next| {
                let next = arena.block(next);
                next.is_free() && next.owner() != block.owner()
            });
            next.is_some() && !(block.addr() + block.size()).is_multiple_of(page)
        };
        let mut starts = Vec::new();
        for &index in self.streams.free_slots() {
            let state = self.streams.get(index);
            if state.pool != memory_pool {
                continue;
            }
            for list in state.ready.iter().chain(&state.pending) {
                starts.extend(list.keys().filter(|&key| {
                    let block = self.arena.block(key);
                    block.is_expandable()
                        && cuts_a_page(&self.arena, key)
                        // The first of its run: the block below does not join it.
                        && !block.prev().is_some_and(|prev| {
                            self.arena.block(prev).is_free() && cuts_a_page(&self.arena, prev)
                        })
                }));
            }
        }
        let epoch = self.streams.get(need.slot).fences.epoch();
        for &start in &starts {
            // A run joined before may have absorbed it (no block is made in between, so a
            // key absorbed is not reused).
            if self.arena.get_block(start).is_none() {
                continue;
            }
            self.take_over(backend, start, need.slot, epoch)?;
            loop {
                let block = self.arena.block(start);
                let end = block.addr() + block.size();
                let Some(next) = block.next() else { break };
                let neighbour = self.arena.block(next);
                if !neighbour.is_free() || end.is_multiple_of(page) {
                    break;
                }
                if neighbour.owner() == need.slot && neighbour.pending().is_empty() {
                    self.unlist(next);
                } else {
                    self.take_over(backend, next, need.slot, epoch)?;
                }
                self.merge_into(start, next);
            }
            // Taken over, the run may now merge with a free block of `need.slot` on either
            // side (one that was already its own, ready): listed merged, as every free block.
            self.insert_free(start);
        }
        Ok(!starts.is_empty())
    }

    /// Takes the listed free block `key` out of its list for `slot`, which waits on the
    /// device for its events and former owner's work: it becomes `slot`'s ready block.
    fn take_over<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        slot: StreamSlot,
        epoch: u32,
    ) -> Result<(), AllocError> {
        self.unlist(key);
        self.wait_for_block(backend, key, slot)?;
        for event in self.arena.take_pending(key) {
            self.events.release(event, &mut self.stats);
        }
        self.arena.adopt(key, slot, epoch);
        Ok(())
    }
}
