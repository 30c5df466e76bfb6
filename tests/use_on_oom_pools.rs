//! Pools marked `use_on_oom` (`torch.cuda.MemPool(use_on_oom=True)`), on simulated
//! devices: a default-pool request that finds no memory is served from a marked pool's
//! cache, and the block goes back to that pool when freed; unmarked, or for requests of
//! other pools, the out-of-memory error stands.

use std::ffi::{c_void, CStr};
use streamalloc::ffi::{self, pool_rules, pools};
use streamalloc::registry::Registry;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::Config;

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (4, 2);

fn registry() -> Registry<SimBackend> {
    Registry::simulated(Config {
        expandable_segments: false,
        ..Config::default()
    })
}

fn last_error() -> String {
    // SAFETY: the slot holds a NUL-terminated string until the next call.
    unsafe { CStr::from_ptr(ffi::streamalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn malloc(registry: &Registry<SimBackend>, size: usize, pool: (u64, u64)) -> u64 {
    pools::malloc_in_pool(registry, size, 0, std::ptr::null_mut(), pool.0, pool.1) as usize as u64
}

fn free(registry: &Registry<SimBackend>, ptr: u64) {
    ffi::free(
        registry,
        ptr as usize as *mut c_void,
        0,
        0,
        std::ptr::null_mut(),
    );
}

/// A registry whose 1 GiB device is mostly cached, free, in pool POOL.
fn pool_holding_most_memory() -> (Registry<SimBackend>, u64) {
    let registry = registry();
    assert_eq!(pools::pool_incref(&registry, 0, POOL.0, POOL.1), 1);
    let cached = malloc(&registry, 700 * MIB, POOL);
    assert_ne!(cached, 0, "{}", last_error());
    free(&registry, cached);
    (registry, cached)
}

#[test]
fn a_default_pool_request_without_memory_is_served_from_a_marked_pools_cache() {
    let (registry, cached) = pool_holding_most_memory();
    assert_eq!(malloc(&registry, 600 * MIB, (0, 0)), 0);
    assert!(last_error().contains("out of memory"), "{}", last_error());

    assert_eq!(
        pool_rules::pool_set_use_on_oom(&registry, 0, POOL.0, POOL.1, 1),
        0
    );
    let served = malloc(&registry, 600 * MIB, (0, 0));
    assert_eq!(served, cached, "the marked pool's cached block");
    let live = pools::pool_use_count(&registry, 0, POOL.0, POOL.1);
    assert_eq!(live, 1);
    let mut in_pool = [0u64; 4];
    // SAFETY: `in_pool` has room for 4 addresses.
    let n = unsafe {
        pools::pool_live_allocations(&registry, 0, POOL.0, POOL.1, in_pool.as_mut_ptr(), 4)
    };
    assert_eq!(
        (n, in_pool[0]),
        (1, served),
        "the block belongs to the marked pool"
    );
    free(&registry, served);

    // Requests of another pool do not fall back.
    assert_eq!(pools::pool_incref(&registry, 0, 9, 9), 1);
    assert_eq!(malloc(&registry, 600 * MIB, (9, 9)), 0);

    assert_eq!(
        pool_rules::pool_set_use_on_oom(&registry, 0, POOL.0, POOL.1, 0),
        0
    );
    assert_eq!(malloc(&registry, 600 * MIB, (0, 0)), 0, "unmarked");
}

#[test]
fn only_an_existing_pool_other_than_the_default_can_be_marked() {
    let registry = registry();
    assert_eq!(pool_rules::pool_set_use_on_oom(&registry, 0, 0, 0, 1), -1);
    assert_eq!(pool_rules::pool_set_use_on_oom(&registry, 0, 7, 7, 1), -1);
    assert!(last_error().contains("does not exist"), "{}", last_error());
    assert_eq!(
        pool_rules::pool_set_use_on_oom(&registry, 99, POOL.0, POOL.1, 1),
        -1
    );
}
