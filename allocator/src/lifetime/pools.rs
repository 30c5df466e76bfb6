//! Memory pools and their use counts: how long a pool's memory must stay out of general
//! circulation.
//!
//! A captured CUDA graph keeps the addresses it was captured with and writes them on every
//! replay, whatever the program has freed since. So the memory a graph allocates during
//! capture must serve nothing but that graph (and the graphs it shares a pool with) until
//! every graph using it is destroyed: PyTorch's private pools. `torch.cuda.MemPool` is
//! the same mechanism without a graph.
//!
//! This table holds the use counts, as PyTorch's `createOrIncrefPool`, `releasePool` and
//! `getPoolUseCount` define them, and the rules a pool was given before it allocated
//! (whole segments, no splitting); which blocks belong to a pool is the stream table's
//! business (a slot is a stream in one pool), and what a pool's memory may be used for is
//! the policy's.

use crate::types::PoolId;
use std::collections::{HashMap, HashSet};

/// The pools other than the default one, by id.
#[derive(Debug, Default)]
pub(crate) struct PoolTable {
    uses: HashMap<PoolId, u32>,
    /// Pools being allocated to (a graph capture or `use_mem_pool` under way), one entry per
    /// begin not yet ended.
    underway: Vec<PoolId>,
    /// Pools that grow by whole segments from `Segments::alloc_segment` whatever the
    /// allocator's growth: a pool whose segments come from another allocator
    /// (`MemPool(allocator=...)`), and every pool that never splits.
    whole_segments: HashSet<PoolId>,
    /// Pools whose blocks are never split (`MemPool(no_split=True)`).
    no_split: HashSet<PoolId>,
}

impl PoolTable {
    /// A capture into `pool` (or a `use_mem_pool` context) begins: one use more, as
    /// PyTorch's `beginAllocateToPool` adds one. Returns the new use count.
    pub(crate) fn begin(&mut self, pool: PoolId) -> u32 {
        self.underway.push(pool);
        self.incref(pool)
    }

    /// Ends the newest begin of `pool` (its use stays until released); false if none.
    pub(crate) fn end(&mut self, pool: PoolId) -> bool {
        match self.underway.iter().rposition(|&p| p == pool) {
            Some(index) => {
                self.underway.remove(index);
                true
            }
            None => false,
        }
    }

    /// True while some pool is being allocated to. A capture in CUDA's global mode
    /// (PyTorch's default) forbids event queries, waits on the capturing stream's events
    /// and synchronisation on *every* stream, and the engine cannot tell which streams
    /// capture, so it refrains from all three everywhere, as PyTorch does.
    pub(crate) fn capture_underway(&self) -> bool {
        !self.underway.is_empty()
    }

    /// Creates `pool` with one use, or adds a use. Returns the new count.
    pub(crate) fn incref(&mut self, pool: PoolId) -> u32 {
        let uses = self.uses.entry(pool).or_default();
        *uses += 1;
        *uses
    }

    /// Drops a use of a live pool; `None` if it has none. Returns the remaining count.
    pub(crate) fn release(&mut self, pool: PoolId) -> Option<u32> {
        let uses = self.uses.get_mut(&pool).filter(|uses| **uses > 0)?;
        *uses -= 1;
        Some(*uses)
    }

    /// The use count, 0 for an unknown pool.
    pub(crate) fn uses(&self, pool: PoolId) -> u32 {
        self.uses.get(&pool).copied().unwrap_or(0)
    }

    /// True if `pool` is the default pool or has uses: its memory serves only it. The
    /// default pool is "live" too, in the sense that it is never released whole.
    pub(crate) fn is_live(&self, pool: PoolId) -> bool {
        pool.is_default() || self.uses(pool) > 0
    }

    /// True if `pool`'s free memory must stay mapped and reserved: a pool other than the
    /// default with uses left (a live graph may still replay into it).
    pub(crate) fn pins_memory(&self, pool: PoolId) -> bool {
        !pool.is_default() && self.uses(pool) > 0
    }

    /// Forgets released pools that `has_memory` says hold nothing any more, with their
    /// rules.
    pub(crate) fn forget_empty(&mut self, has_memory: impl Fn(PoolId) -> bool) {
        self.uses
            .retain(|&pool, uses| *uses > 0 || has_memory(pool));
        let uses = &self.uses;
        self.whole_segments.retain(|pool| uses.contains_key(pool));
        self.no_split.retain(|pool| uses.contains_key(pool));
    }

    /// Makes `pool` grow by whole segments (see the field).
    pub(crate) fn set_whole_segments(&mut self, pool: PoolId) {
        self.whole_segments.insert(pool);
    }

    /// Makes `pool` never split its blocks; it grows by whole segments.
    pub(crate) fn set_no_split(&mut self, pool: PoolId) {
        self.no_split.insert(pool);
        self.whole_segments.insert(pool);
    }

    /// True if `pool` grows by whole segments whatever the allocator's growth. One branch
    /// for the default pool and while no pool has the rule.
    #[inline]
    pub(crate) fn grows_whole(&self, pool: PoolId) -> bool {
        !pool.is_default() && !self.whole_segments.is_empty() && self.whole_segments.contains(&pool)
    }

    /// True if `pool`'s blocks are never split.
    #[inline]
    pub(crate) fn never_splits(&self, pool: PoolId) -> bool {
        !pool.is_default() && !self.no_split.is_empty() && self.no_split.contains(&pool)
    }

    /// Pools known (live, or released with memory still held).
    pub(crate) fn len(&self) -> usize {
        self.uses.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_begin_adds_a_use_and_marks_a_capture_under_way_until_its_end() {
        let mut pools = PoolTable::default();
        let graph = PoolId(1, 0);
        assert!(!pools.capture_underway());
        assert_eq!(pools.begin(graph), 1);
        assert_eq!(pools.begin(graph), 2, "two graphs sharing the pool");
        assert!(pools.end(graph) && pools.capture_underway());
        assert!(pools.end(graph) && !pools.capture_underway());
        assert!(!pools.end(graph), "no begin left to end");
        assert_eq!(pools.uses(graph), 2, "ending a capture keeps its use");
    }

    #[test]
    fn uses_count_up_and_down_and_a_released_pool_stops_pinning() {
        let mut pools = PoolTable::default();
        let graph = PoolId(3, 0);
        assert!(!pools.is_live(graph));
        assert_eq!(pools.incref(graph), 1);
        assert_eq!(pools.incref(graph), 2);
        assert!(pools.pins_memory(graph));
        assert_eq!(pools.release(graph), Some(1));
        assert_eq!(pools.release(graph), Some(0));
        assert_eq!(pools.release(graph), None, "no use left to drop");
        assert!(!pools.pins_memory(graph) && !pools.is_live(graph));
        pools.forget_empty(|_| true);
        assert_eq!(pools.len(), 1, "kept while it holds memory");
        pools.forget_empty(|_| false);
        assert_eq!(pools.len(), 0);
        assert!(pools.is_live(PoolId::DEFAULT) && !pools.pins_memory(PoolId::DEFAULT));
    }

    #[test]
    fn a_pools_rules_last_as_long_as_the_pool() {
        let mut pools = PoolTable::default();
        let (nccl, unsplit) = (PoolId(4, 0), PoolId(5, 0));
        pools.incref(nccl);
        pools.incref(unsplit);
        pools.set_whole_segments(nccl);
        pools.set_no_split(unsplit);
        assert!(pools.grows_whole(nccl) && !pools.never_splits(nccl));
        assert!(pools.grows_whole(unsplit) && pools.never_splits(unsplit));
        assert!(!pools.grows_whole(PoolId::DEFAULT) && !pools.never_splits(PoolId::DEFAULT));
        pools.release(unsplit);
        pools.forget_empty(|_| false);
        assert!(pools.grows_whole(nccl), "still in use");
        assert!(!pools.grows_whole(unsplit) && !pools.never_splits(unsplit));
    }
}
