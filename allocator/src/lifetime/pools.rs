//! Memory pools and their use counts: how long a pool's memory must stay out of general
//! circulation.
//!
//! A captured CUDA graph keeps the addresses it was captured with and writes them on every
//! replay, whatever the program has freed since. So the memory a graph allocates during
//! capture must serve nothing but that graph (and the graphs it shares a pool with) until
//! every graph using it is destroyed: PyTorch's private pools. `torch.cuda.MemPool` is
//! the same mechanism without a graph.
//!
//! This table holds only the use counts, as PyTorch's `createOrIncrefPool`,
//! `releasePool` and `getPoolUseCount` define them; which blocks belong to a pool is the
//! stream table's business (a slot is a stream in one pool), and what a pool's memory may
//! be used for is the policy's.

use crate::types::PoolId;
use std::collections::HashMap;

/// The pools other than the default one, by id.
#[derive(Debug, Default)]
pub(crate) struct PoolTable {
    uses: HashMap<PoolId, u32>,
}

impl PoolTable {
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

    /// Forgets released pools that `has_memory` says hold nothing any more.
    pub(crate) fn forget_empty(&mut self, has_memory: impl Fn(PoolId) -> bool) {
        self.uses
            .retain(|&pool, uses| *uses > 0 || has_memory(pool));
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
}
