//! `MemPool(use_on_oom=True)` across the C ABI (the policy is `registry::fallback`).

use super::{error, fail, or_fail};
use crate::registry::{self, Registry};
use std::ffi::c_int;
use streamalloc_allocator::{Backend, PoolId};

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
