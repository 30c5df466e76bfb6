//! Rules PyTorch gives a memory pool when it makes one, across the C ABI:
//! `torch.cuda.MemPool(no_split=True)` (`setNoSplit`), whose blocks are never split, each a
//! whole segment of its own. (`MemPool(allocator=...)` gives a pool its segment source in
//! `external`, `MemPool(use_on_oom=True)` marks it in `fallback`.)

use super::{device_call, error, fail};
use crate::registry::{self, Registry};
use std::ffi::c_int;
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
