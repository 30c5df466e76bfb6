//! Joining free blocks that lie side by side but do not merge (different owners, or some
//! with events pending): free memory that no one block holds. Stitching counts such blocks
//! as one run when it may take them all, and joins them before lending the run's pages; a
//! kept stitch whose pages now lie in several such blocks is revived the same way. Under a
//! limit, blocks of different streams whose boundary cuts a page are joined before
//! stitching every free page, since neither stitching nor unmapping can take a page that
//! no one block holds. Joining takes each block over for the requesting stream (waiting on
//! the device for its events and its former owner's work, as for any block of another
//! stream) and merges the run.

use super::stitch::Pages;
use super::*;
use crate::pool::stitch::Source;

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
                self.claim(backend, next, need.slot, epoch)?;
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
        self.wait_or_relist(backend, key, slot)?;
        self.release_pending(key);
        self.arena.adopt(key, slot, epoch);
        Ok(())
    }

    /// Takes the listed free block `key` out of its list for `slot` to join it: unlisted
    /// if it is already `slot`'s and ready, taken over ([`State::take_over`]) otherwise.
    fn claim<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        slot: StreamSlot,
        epoch: u32,
    ) -> Result<(), AllocError> {
        let block = self.arena.block(key);
        if block.owner() == slot && block.pending().is_empty() {
            self.unlist(key);
            Ok(())
        } else {
            self.take_over(backend, key, slot, epoch)
        }
    }

    /// True if a stitch for `slot` taking `pages` may take the free block `key`.
    pub(super) fn may_take(&self, key: BlockKey, slot: StreamSlot, pages: Pages) -> bool {
        let block = self.arena.block(key);
        let own_ready = block.owner() == slot && block.pending().is_empty();
        match pages {
            Pages::Own => own_ready,
            Pages::NoWait => {
                own_ready
                    || (block.pending().is_empty()
                        && self
                            .streams
                            .get(block.owner())
                            .fences
                            .is_idle(block.freed_epoch()))
            }
            Pages::Any => true,
        }
    }

    /// The free blocks that `slot` may take (as `pages` allows) side by side around the
    /// free block `key`: the first of them, and the bytes they span.
    pub(super) fn takeable_run_around(
        &self,
        key: BlockKey,
        slot: StreamSlot,
        pages: Pages,
    ) -> (BlockKey, u64, u64) {
        let takeable =
            |key: BlockKey| self.arena.block(key).is_free() && self.may_take(key, slot, pages);
        let (mut head, mut tail) = (key, key);
        while let Some(prev) = self.arena.block(head).prev().filter(|&prev| takeable(prev)) {
            head = prev;
        }
        while let Some(next) = self.arena.block(tail).next().filter(|&next| takeable(next)) {
            tail = next;
        }
        let last = self.arena.block(tail);
        (
            head,
            self.arena.block(head).addr(),
            last.addr() + last.size(),
        )
    }

    /// The free blocks that hold all of `source` side by side, lowest first, if every one
    /// is a block `slot` may take as `pages` allows.
    pub(super) fn free_run_over(
        &self,
        source: &Source,
        slot: StreamSlot,
        pages: Pages,
    ) -> Option<Vec<BlockKey>> {
        let end = source.addr + source.len;
        let mut run = Vec::new();
        for (key, block) in self.arena.segment_blocks(source.segment) {
            if block.addr() + block.size() <= source.addr {
                continue;
            }
            if !block.is_free() || !self.may_take(key, slot, pages) {
                return None;
            }
            run.push(key);
            if block.addr() + block.size() >= end {
                return Some(run);
            }
        }
        None
    }

    /// Lends `source`'s pages to a stitched range of `slot`: the free blocks holding them
    /// (found by [`State::free_run_over`]: looked up one source at a time, since lending
    /// splits a block) are joined into one of `slot`'s, which gives up the pages.
    pub(super) fn lend_source<B: Backend>(
        &mut self,
        backend: &B,
        source: &Source,
        slot: StreamSlot,
        pages: Pages,
    ) -> Result<BlockKey, AllocError> {
        let run = self
            .free_run_over(source, slot, pages)
            .expect("a stitch's pages are free blocks it may take");
        let block = match run.as_slice() {
            [only] => *only,
            _ => self.join_run(backend, &run, slot)?,
        };
        self.lend_pages(backend, block, source.addr, source.len, slot)
    }

    /// Makes the free blocks `run` (side by side) one listed free block of `slot`: each
    /// claimed ([`State::claim`]) and all merged.
    fn join_run<B: Backend>(
        &mut self,
        backend: &B,
        run: &[BlockKey],
        slot: StreamSlot,
    ) -> Result<BlockKey, AllocError> {
        let epoch = self.streams.get(slot).fences.epoch();
        let mut joined: Option<BlockKey> = None;
        for &key in run {
            self.claim(backend, key, slot, epoch)?;
            match joined {
                None => joined = Some(key),
                Some(left) => self.merge_into(left, key),
            }
        }
        let joined = joined.expect("a run holds at least one block");
        let joined = self.merge_neighbours(joined);
        self.list(joined);
        Ok(joined)
    }
}
