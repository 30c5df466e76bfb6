//! `torch.cuda.MemPool(no_split=True)` through the C ABI (`streamalloc_pool_set_no_split`),
//! on simulated devices: every block of such a pool is a whole segment of its own, handed
//! out whole and reused whole, with expandable segments in effect for the other pools or
//! not; the rule is refused for the default pool, an unknown pool and a pool that already
//! allocated.

use std::ffi::{c_void, CStr};
use streamalloc::ffi::{self, pool_rules, pools};
use streamalloc::registry::Registry;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::{Config, PoolId};

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (3, 1);

fn registry(expandable_segments: bool) -> Registry<SimBackend> {
    Registry::simulated(Config {
        expandable_segments,
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
    let ptr = pools::malloc_in_pool(registry, size, 0, std::ptr::null_mut(), pool.0, pool.1);
    assert!(!ptr.is_null(), "malloc({size}): {}", last_error());
    ptr as usize as u64
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

/// The pool's segments as (base, size, blocks in it).
fn segments(registry: &Registry<SimBackend>, pool: (u64, u64)) -> Vec<(u64, u64, usize)> {
    let snapshot = registry.device(0).unwrap().allocator().snapshot();
    snapshot
        .segments
        .iter()
        .filter(|s| s.mempool == PoolId(pool.0, pool.1))
        .map(|s| (s.addr.0, s.size, s.blocks.len()))
        .collect()
}

#[test]
fn a_pool_that_never_splits_gives_each_block_a_whole_segment_of_its_own() {
    for expandable in [true, false] {
        let registry = registry(expandable);
        assert_eq!(pools::pool_incref(&registry, 0, POOL.0, POOL.1), 1);
        assert_eq!(
            pool_rules::pool_set_no_split(&registry, 0, POOL.0, POOL.1),
            0,
            "{}",
            last_error()
        );
        let blocks: Vec<u64> = [4096, 3 * MIB, 3 * MIB, 5 * MIB + 1]
            .iter()
            .map(|&size| malloc(&registry, size, POOL))
            .collect();
        let segs = segments(&registry, POOL);
        assert_eq!(segs.len(), 4, "expandable {expandable}: {segs:?}");
        let mut sizes: Vec<u64> = segs.iter().map(|&(_, size, _)| size).collect();
        sizes.sort_unstable();
        assert_eq!(
            sizes,
            [2, 4, 4, 6].map(|m| m * MIB as u64),
            "each request rounded to 2 MiB"
        );
        for &(base, _, count) in &segs {
            assert_eq!(count, 1, "one block per segment");
            assert!(blocks.contains(&base), "the block starts its segment");
        }
        // Reused whole: a smaller request takes a freed block without splitting it.
        free(&registry, blocks[1]);
        assert_eq!(malloc(&registry, 2 * MIB, POOL), blocks[1]);
        assert_eq!(segments(&registry, POOL).len(), 4);
        // The default pool is untouched by the rule.
        let a = malloc(&registry, 3 * MIB, (0, 0));
        let b = malloc(&registry, 3 * MIB, (0, 0));
        let default_segments = segments(&registry, (0, 0));
        assert!(default_segments.iter().any(|&(_, _, count)| count > 1));
        for ptr in [a, b] {
            free(&registry, ptr);
        }
        let device = registry.device(0).unwrap();
        device.run(|a| a.check_invariants()).unwrap().unwrap();
    }
}

#[test]
fn no_split_is_refused_for_the_default_pool_unknown_pools_and_pools_that_allocated() {
    let registry = registry(true);
    assert_eq!(pool_rules::pool_set_no_split(&registry, 0, 0, 0), -1);
    assert!(last_error().contains("default pool"), "{}", last_error());
    assert_eq!(pool_rules::pool_set_no_split(&registry, 0, 9, 9), -1);
    assert!(last_error().contains("does not exist"), "{}", last_error());
    assert_eq!(pools::pool_incref(&registry, 0, POOL.0, POOL.1), 1);
    malloc(&registry, MIB, POOL);
    assert_eq!(
        pool_rules::pool_set_no_split(&registry, 0, POOL.0, POOL.1),
        -1
    );
    assert!(
        last_error().contains("already holds memory"),
        "{}",
        last_error()
    );
}
