//! Rules PyTorch gives a memory pool when it makes one, across the C ABI:
//! `torch.cuda.MemPool(no_split=True)` (`setNoSplit`), whose blocks are never split, each a
//! whole segment of its own; `MemPool(allocator=...)`, whose segments come from the
//! caller's allocator (the policy is `registry::sources`); `MemPool(use_on_oom=True)`,
//! which serves the default pool's requests it has no memory for (`registry::fallback`).

use super::{device_call, error, fail, or_fail};
use crate::registry::sources::{SegmentAlloc, SegmentFree, SegmentSource, WithSources};
use crate::registry::{self, Registry};
use std::ffi::{c_int, c_void};
use streamalloc_allocator::{Backend, PoolId};

/// Makes pool `(id0, id1)` of `device` never split its blocks: each block is a whole
/// segment of its own, sized to its request rounded to 2 MiB, whatever
/// `expandable_segments` says for the other pools. The pool must exist and not have
/// allocated yet. Returns 0, or -1 (the default pool, an unknown pool, a pool that already
/// holds memory, or the device unavailable).
#[no_mangle]
pub extern "C" fn streamalloc_pool_set_no_split(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_set_no_split(registry::global(), device, id0, id1)
}

/// [`streamalloc_pool_set_no_split`] on `registry`.
pub fn pool_set_no_split<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
) -> c_int {
    let pool = PoolId(id0, id1);
    if pool.is_default() {
        return error::call(-1, || {
            fail(
                -1,
                "streamalloc_pool_set_no_split: the default pool splits its blocks",
            )
        });
    }
    device_call(registry, device, -1, |allocator| {
        allocator
            .set_pool_no_split(pool)
            .map(|()| 0)
            .map_err(|err| format!("streamalloc_pool_set_no_split: device {device}: {err}"))
    })
}

/// Makes pool `(id0, id1)` of `device` take its segments from `alloc` / `free` (called
/// with `ctx`) from now on, whole, whatever `expandable_segments` says for the other pools;
/// it must not have allocated yet. The engine splits and caches them like its own and
/// hands each back to `free` when it releases it. Returns 0, or -1: the pool already
/// allocated, it does not exist, or the device is unavailable.
///
/// # Safety
/// `alloc` and `free` must be safe to call from any thread with `ctx` until every segment
/// made is freed (`streamalloc_empty_cache_pool` after the pool's last release).
#[no_mangle]
pub unsafe extern "C" fn streamalloc_pool_set_segment_source(
    device: c_int,
    id0: u64,
    id1: u64,
    alloc: Option<SegmentAlloc>,
    free: Option<SegmentFree>,
    ctx: *mut c_void,
) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { pool_set_segment_source(registry::global(), device, id0, id1, alloc, free, ctx) }
}

/// [`streamalloc_pool_set_segment_source`] on `registry`.
///
/// # Safety
/// As [`streamalloc_pool_set_segment_source`].
pub unsafe fn pool_set_segment_source<B: Backend>(
    registry: &Registry<WithSources<B>>,
    device: c_int,
    id0: u64,
    id1: u64,
    alloc: Option<SegmentAlloc>,
    free: Option<SegmentFree>,
    ctx: *mut c_void,
) -> c_int {
    let (Some(alloc), Some(free)) = (alloc, free) else {
        return error::call(-1, || {
            fail(
                -1,
                "streamalloc_pool_set_segment_source: alloc or free is null",
            )
        });
    };
    if (id0, id1) == (0, 0) {
        return error::call(-1, || {
            fail(
                -1,
                "streamalloc_pool_set_segment_source: the default pool (0, 0) takes its memory from streamalloc",
            )
        });
    }
    let source = SegmentSource {
        alloc,
        free,
        ctx: ctx as usize,
    };
    error::call(-1, || {
        let set = registry.on(device, |d| d.set_segment_source(PoolId(id0, id1), source));
        or_fail(-1, set.map(|()| 0))
    })
}

/// Marks pool `(id0, id1)` of `device` as serving the default pool's requests it has no
/// memory for (`on` != 0), or unmarks it (`on` == 0). The pool must exist. Returns 0, or
/// -1 (the default pool, an unknown pool, or the device unavailable).
#[no_mangle]
pub extern "C" fn streamalloc_pool_set_use_on_oom(
    device: c_int,
    id0: u64,
    id1: u64,
    on: c_int,
) -> c_int {
    pool_set_use_on_oom(registry::global(), device, id0, id1, on)
}

/// [`streamalloc_pool_set_use_on_oom`] on `registry`.
pub fn pool_set_use_on_oom<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
    on: c_int,
) -> c_int {
    let pool = PoolId(id0, id1);
    if pool == PoolId::DEFAULT {
        return error::call(-1, || {
            fail(
                -1,
                "streamalloc_pool_set_use_on_oom: the default pool is the one the others back up",
            )
        });
    }
    error::call(-1, || {
        let set = registry.on(device, |d| d.set_use_on_oom(pool, on != 0));
        or_fail(-1, set.map(|()| 0))
    })
}
