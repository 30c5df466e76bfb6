//! Which free list a free block sits in, and merging it with its neighbours: the glue
//! between the arena's blocks and the per-stream free lists. The stream policy lives in
//! allocation and freeing, the data structure in `pool::free_list`.

use super::torch_stats::{counts_split, stat_kind};
use super::*;
use crate::pool::free_list::FreeList;

impl State {
    /// Takes the best-fitting ready block of `need.slot`'s own list out of it: reuse that
    /// needs no synchronisation at all.
    #[inline]
    pub(super) fn take_ready(&mut self, need: Need) -> Option<BlockKey> {
        // What `unlist` would do for a ready block: no pending bytes to count.
        let (_, _, key) = self.streams.get_mut(need.slot).ready[need.pool as usize]
            .take_best_fit(need.size, need.max_size)?;
        let block = self.arena.block(key);
        debug_assert!(block.pending().is_empty());
        if counts_split(block) {
            let (kind, size) = (block.pool(), block.size());
            self.stats.split_out(kind, size);
        }
        Some(key)
    }

    /// Parks a ready block of `size` bytes in its owner's hot list, evicting the oldest into
    /// the free lists.
    #[inline]
    pub(super) fn push_hot(&mut self, key: BlockKey, owner: StreamSlot, size: u64) {
        let evicted = self.streams.get_mut(owner).hot.push(size, key);
        self.streams.note_hot(owner);
        let block = self.arena.park_hot(key);
        if counts_split(block) {
            let kind = block.pool();
            self.stats.split_in(kind, size);
        }
        if let Some(evicted) = evicted {
            self.unhot(evicted);
        }
    }

    /// After a malloc of `slot` found no hot block of its size: parking did not pay, so the
    /// list is disarmed and its blocks go to the free lists, merged, before best fit looks.
    #[inline]
    pub(super) fn hot_missed(&mut self, slot: StreamSlot) {
        if self.streams.get(slot).hot.len() == 0 {
            return;
        }
        for key in self.streams.get_mut(slot).hot.drain(true) {
            self.unhot(key);
        }
    }

    /// Moves every hot block into the free lists, merging it. Returns true if any moved.
    pub(super) fn flush_hot(&mut self) -> bool {
        let mut any = false;
        for slot in self.streams.take_hot_slots() {
            for key in self.streams.get_mut(slot).hot.drain(false) {
                self.unhot(key);
                any = true;
            }
        }
        any
    }

    /// Moves a block taken out of its hot list out of the allocated map and into the free
    /// lists, merging it.
    #[inline(never)]
    pub(super) fn unhot(&mut self, key: BlockKey) {
        let block = self.arena.block(key);
        let addr = block.addr();
        if counts_split(block) {
            let (kind, size) = (block.pool(), block.size());
            self.stats.split_out(kind, size);
        }
        self.arena.unpark(key);
        self.allocated.remove(&addr);
        self.insert_free(key);
    }

    /// Two free blocks may merge if the result needs no more synchronisation than either:
    /// same owner, and both ready or both pending.
    pub(super) fn mergeable(&self, a: BlockKey, b: BlockKey) -> bool {
        let (a, b) = (self.arena.block(a), self.arena.block(b));
        a.is_free()
            && b.is_free()
            && a.owner() == b.owner()
            && a.pending().is_empty() == b.pending().is_empty()
    }

    /// Puts the unlisted free block `key` in its owner's list, merging it with mergeable
    /// neighbours first.
    pub(super) fn insert_free(&mut self, key: BlockKey) {
        let key = self.merge_neighbours(key);
        self.list(key);
    }

    /// Merges the unlisted free block `key` with its mergeable neighbours (taking them out
    /// of their lists); returns the block that holds it now, still unlisted.
    #[inline]
    pub(super) fn merge_neighbours(&mut self, key: BlockKey) -> BlockKey {
        let mut key = key;
        if let Some(prev) = self.arena.block(key).prev() {
            if self.mergeable(prev, key) {
                self.unlist(prev);
                self.merge_into(prev, key);
                key = prev;
            }
        }
        if let Some(next) = self.arena.block(key).next() {
            if self.mergeable(key, next) {
                self.unlist(next);
                self.merge_into(key, next);
            }
        }
        key
    }

    /// Merges unlisted `right` into `left`, uniting their pending events.
    pub(super) fn merge_into(&mut self, left: BlockKey, right: BlockKey) {
        for event in self.arena.merge(left, right) {
            if self.arena.block(left).pending().contains(&event) {
                self.events.release(event, &mut self.stats);
            } else {
                self.arena.add_pending(left, event);
            }
        }
    }

    /// The free list `key` belongs in (its owner's, for its pool and pending state), with the
    /// block's size and address, whether it is pending, and how PyTorch's statistics count
    /// it: its kind, and whether it is split (when ready).
    #[inline]
    fn home_list(&mut self, key: BlockKey) -> (&mut FreeList, u64, u64, bool, PoolKind, bool) {
        let block = self.arena.block(key);
        let pool = block.pool();
        let pending = !block.pending().is_empty();
        let (size, addr, owner) = (block.size(), block.addr(), block.owner());
        let (kind, split) = (stat_kind(block), counts_split(block));
        let list = self.streams.get_mut(owner).list(pool, pending);
        (list, size, addr, pending, kind, split)
    }

    /// Adds a free block to the list its owner and pending state call for.
    #[inline]
    pub(super) fn list(&mut self, key: BlockKey) {
        let owner = self.arena.block(key).owner();
        self.streams.note_free(owner);
        let (list, size, addr, pending, kind, split) = self.home_list(key);
        list.insert(size, addr, key);
        if pending {
            self.stats.pending_in(kind, size);
        } else if split {
            self.stats.split_in(kind, size);
        }
    }

    /// Removes a free block from its list.
    #[inline]
    pub(super) fn unlist(&mut self, key: BlockKey) {
        let (list, size, addr, pending, kind, split) = self.home_list(key);
        list.remove(size, addr, key);
        if pending {
            self.stats.pending_out(kind, size);
        } else if split {
            self.stats.split_out(kind, size);
        }
    }

    /// Marks a block that could not be ordered as allocated to nobody, dropping the events
    /// recorded for it before the failure: it stays out of the free lists and the allocated
    /// map until `release_cached` synchronises the device, which finds it as an allocated
    /// block absent from the allocated map.
    pub(super) fn list_quarantined(&mut self, key: BlockKey) {
        self.arena.take_pending(key);
        let block = self.arena.block(key);
        let (size, kind) = (block.size(), stat_kind(block));
        self.arena.withhold(key);
        self.stats.withheld_in(kind, size);
    }
}
