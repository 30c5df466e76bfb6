//! PyTorch's `memory_stats()` as the library answers it (`streamalloc_torch_stat_name`,
//! `streamalloc_torch_stats`, `streamalloc_reset_accumulated_stats`), on simulated
//! devices: every key of PyTorch's is named, once; the values follow PyTorch's meaning
//! (small and large pools, active blocks awaiting other streams, inactive split blocks of
//! whole segments, mappings counted as device calls, oversize blocks, retries;
//! `allocated`/`freed` accumulate until reset, `current` and `peak` never reset), and what
//! the profiler is told of an allocation is its block's size and the device's totals.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_int, c_void, CStr};
use streamalloc::ffi::{self, stats};
use streamalloc::registry::Registry;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::Config;

const MIB: usize = 1 << 20;

fn registry(config: Config) -> Registry<SimBackend> {
    Registry::simulated(Config {
        expandable_segments: false,
        ..config
    })
}

fn expandable_registry() -> Registry<SimBackend> {
    Registry::simulated(Config {
        expandable_segments: true,
        ..Config::default()
    })
}

fn malloc(registry: &Registry<SimBackend>, size: usize) -> *mut c_void {
    let ptr = ffi::malloc(registry, size, 0, std::ptr::null_mut());
    assert!(!ptr.is_null(), "malloc({size}) failed");
    ptr
}

fn free(registry: &Registry<SimBackend>, ptr: *mut c_void) {
    ffi::free(registry, ptr, 0, 0, std::ptr::null_mut());
}

/// The `all`, `small_pool` and `large_pool` values of `array.*.field`.
fn pools(stats: &BTreeMap<String, i64>, array: &str, field: &str) -> [i64; 3] {
    ["all", "small_pool", "large_pool"].map(|pool| stats[&format!("{array}.{pool}.{field}")])
}

/// PyTorch 2.11's `torch.cuda.memory_stats()` keys (c10's `DeviceStats`, flattened by
/// `torch/csrc/cuda/Module.cpp` and `torch.cuda.memory_stats`).
fn pytorchs_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for array in [
        "allocation",
        "segment",
        "active",
        "inactive_split",
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
    ] {
        for pool in ["all", "small_pool", "large_pool"] {
            for field in ["current", "peak", "allocated", "freed"] {
                keys.insert(format!("{array}.{pool}.{field}"));
            }
        }
    }
    for stat in ["oversize_allocations", "oversize_segments"] {
        for field in ["current", "peak", "allocated", "freed"] {
            keys.insert(format!("{stat}.{field}"));
        }
    }
    for scalar in [
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ] {
        keys.insert(scalar.to_string());
    }
    keys
}

fn names() -> Vec<String> {
    let mut names = Vec::new();
    loop {
        let name = stats::streamalloc_torch_stat_name(names.len());
        if name.is_null() {
            return names;
        }
        // SAFETY: a non-null name is a static NUL-terminated string.
        names.push(
            unsafe { CStr::from_ptr(name) }
                .to_str()
                .unwrap()
                .to_string(),
        );
    }
}

fn torch_stats(registry: &Registry<SimBackend>, device: c_int) -> BTreeMap<String, i64> {
    let names = names();
    let mut values = vec![0i64; names.len()];
    // SAFETY: `values` has room for `values.len()` values.
    let n = unsafe { stats::torch_stats(registry, device, values.as_mut_ptr(), values.len()) };
    assert_eq!(n, names.len() as i64);
    names.into_iter().zip(values).collect()
}

#[test]
fn every_key_of_pytorchs_memory_stats_is_named_once() {
    let names = names();
    let unique: BTreeSet<String> = names.iter().cloned().collect();
    assert_eq!(unique.len(), names.len(), "a name listed twice: {names:?}");
    let pytorchs = pytorchs_keys();
    let unknown: Vec<&String> = unique.difference(&pytorchs).collect();
    assert!(unknown.is_empty(), "not PyTorch's keys: {unknown:?}");
    let missing: Vec<&String> = pytorchs.difference(&unique).collect();
    assert!(missing.is_empty(), "PyTorch's keys not named: {missing:?}");
    assert!(stats::streamalloc_torch_stat_name(names.len()).is_null());
}

#[test]
fn small_and_large_blocks_count_in_their_own_pools_as_in_pytorch() {
    let registry = registry(Config::default());
    let large = malloc(&registry, 3 * MIB);
    let small = malloc(&registry, 1000);
    let stats = torch_stats(&registry, 0);
    assert_eq!(pools(&stats, "allocation", "current"), [2, 1, 1]);
    assert_eq!(
        pools(&stats, "allocated_bytes", "current"),
        [3 * MIB as i64 + 1024, 1024, 3 * MIB as i64]
    );
    assert_eq!(
        pools(&stats, "requested_bytes", "current"),
        [3 * MIB as i64 + 1000, 1000, 3 * MIB as i64]
    );
    assert_eq!(pools(&stats, "active", "current"), [2, 1, 1]);
    // A 2 MiB segment for the small pool, a 20 MiB one for requests of 1 to 10 MiB.
    assert_eq!(pools(&stats, "segment", "current"), [2, 1, 1]);
    assert_eq!(
        pools(&stats, "reserved_bytes", "current"),
        [22 * MIB as i64, 2 * MIB as i64, 20 * MIB as i64]
    );
    assert_eq!(stats["num_device_alloc"], 2);
    // What is left of each segment is free and shares it: inactive split.
    assert_eq!(pools(&stats, "inactive_split", "current"), [2, 1, 1]);
    assert_eq!(
        pools(&stats, "inactive_split_bytes", "current"),
        [
            (22 * MIB - 3 * MIB - 1024) as i64,
            (2 * MIB - 1024) as i64,
            17 * MIB as i64
        ]
    );
    free(&registry, small);
    free(&registry, large);
    ffi::empty_cache(&registry);
    let after = torch_stats(&registry, 0);
    for array in [
        "allocation",
        "active",
        "segment",
        "inactive_split",
        "reserved_bytes",
    ] {
        assert_eq!(pools(&after, array, "current"), [0, 0, 0], "{array}");
        assert_eq!(
            pools(&after, array, "allocated"),
            pools(&after, array, "freed"),
            "{array}: everything counted in went out again"
        );
    }
    assert_eq!(after["num_device_free"], 2);
    assert!(after["num_sync_all_streams"] >= 1);
}

#[test]
fn with_expandable_segments_mappings_are_reserved_bytes_and_device_calls_not_segments() {
    let registry = expandable_registry();
    let small = malloc(&registry, 4096);
    let stats = torch_stats(&registry, 0);
    // Mapped for a small request: the small pool's, as PyTorch maps its small segments.
    let [all, small_pool, large_pool] = pools(&stats, "reserved_bytes", "current");
    assert!(
        small_pool > 0 && large_pool == 0 && all == small_pool,
        "{stats:?}"
    );
    let large = malloc(&registry, 64 * MIB);
    let stats = torch_stats(&registry, 0);
    let [all, small_pool, large_pool] = pools(&stats, "reserved_bytes", "current");
    assert!(large_pool >= 64 * MIB as i64 && all == small_pool + large_pool);
    assert!(
        stats["num_device_alloc"] >= 2,
        "one call per mapping operation"
    );
    // PyTorch counts no segment and no inactive split block in expandable segments.
    assert_eq!(pools(&stats, "segment", "allocated"), [0, 0, 0]);
    assert_eq!(pools(&stats, "inactive_split", "current"), [0, 0, 0]);
    assert_eq!(pools(&stats, "allocation", "current"), [2, 1, 1]);
    free(&registry, large);
    free(&registry, small);
    ffi::empty_cache(&registry);
    let after = torch_stats(&registry, 0);
    assert_eq!(pools(&after, "reserved_bytes", "current"), [0, 0, 0]);
    assert_eq!(
        pools(&after, "reserved_bytes", "freed"),
        pools(&after, "reserved_bytes", "allocated")
    );
    assert!(after["num_device_free"] >= 1);
    assert_eq!(pools(&after, "inactive_split", "allocated"), [0, 0, 0]);
}

#[test]
fn a_block_freed_while_another_stream_uses_it_stays_active_until_its_uses_complete() {
    let registry = registry(Config::default());
    let side_stream = 0x77usize as *mut c_void;
    let block = malloc(&registry, 3 * MIB);
    ffi::record_stream(&registry, block, side_stream);
    free(&registry, block);
    let stats = torch_stats(&registry, 0);
    assert_eq!(pools(&stats, "allocation", "current"), [0, 0, 0]);
    assert_eq!(
        pools(&stats, "active", "current"),
        [1, 0, 1],
        "awaiting the side stream"
    );
    assert_eq!(stats["active_bytes.all.current"], 3 * MIB as i64);
    // PyTorch's identity: a block becomes active only by being allocated.
    assert_eq!(
        pools(&stats, "active", "allocated"),
        pools(&stats, "allocation", "allocated")
    );
    ffi::empty_cache(&registry);
    let after = torch_stats(&registry, 0);
    assert_eq!(pools(&after, "active", "current"), [0, 0, 0]);
    assert_eq!(
        pools(&after, "active", "freed"),
        pools(&after, "active", "allocated")
    );
    assert_eq!(
        pools(&after, "active_bytes", "freed"),
        pools(&after, "active_bytes", "allocated")
    );
}

#[test]
fn oversize_blocks_and_segments_are_counted_against_max_split_size() {
    let registry = registry(Config {
        max_split_size: Some(32 * MIB as u64),
        ..Config::default()
    });
    let big = malloc(&registry, 40 * MIB);
    let small = malloc(&registry, 3 * MIB);
    let stats = torch_stats(&registry, 0);
    assert_eq!(stats["oversize_allocations.current"], 1);
    assert_eq!(stats["oversize_segments.current"], 1);
    free(&registry, big);
    let stats = torch_stats(&registry, 0);
    assert_eq!(stats["oversize_allocations.current"], 0);
    assert_eq!(stats["oversize_allocations.freed"], 1);
    assert_eq!(
        stats["oversize_segments.current"], 1,
        "cached, not released"
    );
    free(&registry, small);
    ffi::empty_cache(&registry);
    assert_eq!(torch_stats(&registry, 0)["oversize_segments.current"], 0);
}

#[test]
fn every_attempt_to_grow_again_after_releasing_the_cache_is_a_retry() {
    let registry = registry(Config {
        memory_limit: Some(24 * MIB as u64),
        ..Config::default()
    });
    let first = malloc(&registry, 12 * MIB);
    free(&registry, first);
    // 12 MiB cached + 14 MiB new would pass the limit: release, then grow again.
    let second = malloc(&registry, 14 * MIB);
    assert_eq!(torch_stats(&registry, 0)["num_alloc_retries"], 1);
    let third = malloc(&registry, 10 * MIB);
    free(&registry, third);
    // 14 MiB live + 12 MiB new passes the limit even once the 10 MiB cached are released:
    // a retry that fails, then an out-of-memory error.
    let fourth = ffi::malloc(&registry, 12 * MIB, 0, std::ptr::null_mut());
    assert!(fourth.is_null());
    let stats = torch_stats(&registry, 0);
    assert_eq!(stats["num_alloc_retries"], 2);
    assert_eq!(stats["num_ooms"], 1);
    free(&registry, second);
}

#[test]
fn accumulated_statistics_count_from_the_last_reset_while_current_and_peak_do_not_reset() {
    let registry = registry(Config::default());
    let a = ffi::malloc(&registry, 3 * MIB, 0, std::ptr::null_mut());
    let b = ffi::malloc(&registry, MIB, 0, std::ptr::null_mut());
    assert!(!a.is_null() && !b.is_null());
    ffi::free(&registry, a, 0, 0, std::ptr::null_mut());
    let before = torch_stats(&registry, 0);
    assert_eq!(before["allocation.all.allocated"], 2);
    assert_eq!(before["allocation.all.freed"], 1);
    assert_eq!(before["allocation.all.current"], 1);
    assert_eq!(before["allocated_bytes.all.current"], MIB as i64);
    assert_eq!(before["allocated_bytes.all.peak"], 4 * MIB as i64);
    assert_eq!(before["allocated_bytes.all.allocated"], 4 * MIB as i64);
    assert_eq!(before["allocated_bytes.all.freed"], 3 * MIB as i64);
    assert_eq!(before["requested_bytes.all.allocated"], 4 * MIB as i64);
    assert!(before["reserved_bytes.all.allocated"] >= 4 * MIB as i64);
    assert_eq!(before["segment.all.allocated"], before["num_device_alloc"]);
    assert_eq!(before["allocation.large_pool.allocated"], 1);
    assert_eq!(before["allocated_bytes.large_pool.peak"], 3 * MIB as i64);
    assert_eq!(before["allocated_bytes.small_pool.current"], MIB as i64);
    assert!(before["num_device_alloc"] >= 1);

    assert_eq!(stats::reset_accumulated_stats(&registry, 0), 0);
    let after = torch_stats(&registry, 0);
    for (key, value) in &after {
        let accumulated =
            key.ends_with(".allocated") || key.ends_with(".freed") || key.starts_with("num_");
        if accumulated {
            assert_eq!(*value, 0, "{key} after the reset");
        } else {
            assert_eq!(*value, before[key], "{key} changed by the reset");
        }
    }

    ffi::free(&registry, b, 0, 0, std::ptr::null_mut());
    let later = torch_stats(&registry, 0);
    assert_eq!(later["allocation.all.freed"], 1);
    assert_eq!(later["allocation.all.allocated"], 0);
    assert_eq!(later["allocation.all.current"], 0);
    assert_eq!(later["allocated_bytes.all.freed"], MIB as i64);
    assert_eq!(later["allocated_bytes.all.peak"], 4 * MIB as i64);
}

#[test]
fn max_split_size_reads_as_pytorchs_unset_value_or_the_configured_one() {
    let unset = registry(Config::default());
    assert_eq!(torch_stats(&unset, 0)["max_split_size"], -1);
    let set = registry(Config {
        max_split_size: Some(64 * MIB as u64),
        ..Config::default()
    });
    assert_eq!(torch_stats(&set, 0)["max_split_size"], 64 * MIB as i64);
}

#[test]
fn the_profiler_is_told_the_blocks_size_and_the_devices_totals() {
    let registry = registry(Config::default());
    let small = ffi::malloc(&registry, 1000, 0, std::ptr::null_mut());
    let large = ffi::malloc(&registry, 3 * MIB + 1, 0, std::ptr::null_mut());
    let (mut device, mut size, mut allocated, mut reserved) = (-1, 0u64, 0u64, 0u64);
    // SAFETY: every out pointer is writable for one value.
    let rc = unsafe {
        stats::allocation_usage(
            &registry,
            large,
            &mut device,
            &mut size,
            &mut allocated,
            &mut reserved,
        )
    };
    assert_eq!(rc, 0);
    assert_eq!(device, 0);
    assert!(
        size > 3 * MIB as u64,
        "the rounded block, not the request: {size}"
    );
    let counters = torch_stats(&registry, 0);
    assert_eq!(allocated as i64, counters["allocated_bytes.all.current"]);
    assert_eq!(reserved as i64, counters["reserved_bytes.all.current"]);
    assert!(allocated >= size + 1000);

    ffi::free(&registry, small, 0, 0, std::ptr::null_mut());
    // SAFETY: null out pointers are allowed.
    let freed = unsafe {
        stats::allocation_usage(
            &registry,
            small,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(freed, -1, "a freed pointer is no live allocation");
    // SAFETY: as above.
    let junk = unsafe {
        stats::allocation_usage(
            &registry,
            0x10 as *mut c_void,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(junk, -1);
}

#[test]
fn torch_stats_refuse_a_null_buffer_and_an_unknown_device() {
    let registry = registry(Config::default());
    // SAFETY: a null buffer with room for values is what is being refused.
    let null = unsafe { stats::torch_stats(&registry, 0, std::ptr::null_mut(), 4) };
    assert_eq!(null, -1);
    let mut values = [0i64; 4];
    // SAFETY: `values` has room for 4 values.
    let n = unsafe { stats::torch_stats(&registry, 0, values.as_mut_ptr(), 4) };
    assert_eq!(
        n,
        names().len() as i64,
        "the count even when the room is short"
    );
    // SAFETY: as above.
    let unknown = unsafe { stats::torch_stats(&registry, 99, values.as_mut_ptr(), 4) };
    assert_eq!(unknown, -1);
    assert_eq!(stats::reset_accumulated_stats(&registry, -5), -1);
}
