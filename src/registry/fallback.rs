//! Pools that serve, as a last resort, the default pool's requests it has no memory for
//! (PyTorch's `torch.cuda.MemPool(use_on_oom=True)`).
//!
//! PyTorch's allocator, when a request outside any pool finds no memory even after freeing
//! its cache, tries the pools marked `use_on_oom` before raising. Here the same request is
//! made again in each such pool that still has uses, in the order they were marked; the
//! block then belongs to that pool (its free returns it there), as in PyTorch. The first
//! out-of-memory error is the one reported when none can serve it.

use super::Registry;
use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;
use streamalloc_allocator::{AllocError, Allocation, Allocator, Backend, PoolId, StreamId};

/// The pools of a registry marked `use_on_oom`, by device, in the order marked.
#[derive(Debug)]
pub(crate) struct MarkedPools {
    map: RwLock<BTreeMap<c_int, Vec<PoolId>>>,
    /// False until a pool is marked: a failed request then returns at once.
    any: AtomicBool,
}

impl MarkedPools {
    pub(crate) const fn new() -> Self {
        Self {
            map: RwLock::new(BTreeMap::new()),
            any: AtomicBool::new(false),
        }
    }

    /// Marks `pool` of `device` (`on`), last in the order, or unmarks it.
    pub(crate) fn mark(&self, device: c_int, pool: PoolId, on: bool) {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        let marked = map.entry(device).or_default();
        marked.retain(|&p| p != pool);
        if on {
            marked.push(pool);
            self.any.store(true, Ordering::Release);
        }
    }
}

/// `result` of a request of `size` bytes for `stream` in `pool`, or, when that is the
/// default pool's out-of-memory error, the same request served by the first marked pool
/// with uses left that can (see the module docs).
pub fn or_marked_pools<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    allocator: &Allocator<B>,
    request: (u64, StreamId, PoolId),
    result: Result<Allocation, AllocError>,
) -> Result<Allocation, AllocError> {
    let (size, stream, pool) = request;
    let out_of_memory = matches!(result, Err(AllocError::OutOfMemory(_)));
    let marked = &registry.marked;
    if !out_of_memory || pool != PoolId::DEFAULT || !marked.any.load(Ordering::Acquire) {
        return result;
    }
    let marked = {
        let map = marked.map.read().unwrap_or_else(|p| p.into_inner());
        map.get(&device).cloned().unwrap_or_default()
    };
    for candidate in marked {
        if allocator.pool_use_count(candidate) == 0 {
            continue;
        }
        let served =
            super::sources::with_pool_source(registry, device, candidate.0, candidate.1, || {
                allocator.malloc_in(size, stream, candidate)
            });
        if served.is_ok() {
            return served;
        }
    }
    result
}
