//! `MemPool(allocator=...)` across the C ABI: a pool's segments from the caller's
//! allocator (the policy is `registry::sources`).

use super::{error, fail, or_fail};
use crate::registry::sources::{SegmentAlloc, SegmentFree, SegmentSource, WithSources};
use crate::registry::{self, Registry};
use std::ffi::{c_int, c_void};
use streamalloc_allocator::{Backend, PoolId};

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
