//! Pools that serve, as a last resort, the default pool's requests it has no memory for
//! (PyTorch's `torch.cuda.MemPool(use_on_oom=True)`).
//!
//! PyTorch's allocator, when a request outside any pool finds no memory even after freeing
//! its cache, tries the pools marked `use_on_oom` before raising. Here the same request is
//! made again in each such pool that still has uses, in the order they were marked; the
//! block then belongs to that pool (its free returns it there), as in PyTorch. The first
//! out-of-memory error is the one reported when none can serve it.

use super::{CallError, Device};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;
use streamalloc_allocator::{AllocError, Allocation, Allocator, Backend, PoolId};

/// The pools of a device marked `use_on_oom`, in the order marked.
#[derive(Debug, Default)]
pub(super) struct MarkedPools {
    list: RwLock<Vec<PoolId>>,
    /// False until a pool is marked: a failed request then returns at once.
    any: AtomicBool,
}

impl MarkedPools {
    /// `err`, the failure of a request in `pool`, or, when that is the default pool's
    /// out-of-memory error, the same request served (`serve_in`) by the first marked pool
    /// with uses left that can (see the module docs).
    #[cold]
    #[inline(never)]
    pub(super) fn or_marked<B: Backend>(
        &self,
        allocator: &Allocator<B>,
        pool: PoolId,
        err: AllocError,
        serve_in: impl Fn(PoolId) -> Result<Allocation, AllocError>,
    ) -> Result<Allocation, AllocError> {
        let out_of_memory = matches!(err, AllocError::OutOfMemory(_));
        if !out_of_memory || !pool.is_default() || !self.any.load(Ordering::Acquire) {
            return Err(err);
        }
        let marked = self.list.read().unwrap_or_else(|p| p.into_inner()).clone();
        for candidate in marked {
            if allocator.pool_use_count(candidate) == 0 {
                continue;
            }
            let served = serve_in(candidate);
            if served.is_ok() {
                return served;
            }
        }
        Err(err)
    }
}

impl<B: Backend> Device<B> {
    /// Marks `pool` as serving the default pool's requests it has no memory for (`on`),
    /// last in the order, or unmarks it. The pool must exist; the default pool is refused.
    pub fn set_use_on_oom(&self, pool: PoolId, on: bool) -> Result<(), CallError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("used on out-of-memory").into());
        }
        if self.run(|allocator| allocator.pool_use_count(pool))? == 0 {
            return Err(AllocError::UnknownPool(pool).into());
        }
        let mut list = self.marked.list.write().unwrap_or_else(|p| p.into_inner());
        list.retain(|&p| p != pool);
        if on {
            list.push(pool);
            self.marked.any.store(true, Ordering::Release);
        }
        Ok(())
    }
}
