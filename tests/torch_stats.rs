//! PyTorch's `memory_stats()` as the library answers it (`streamalloc_torch_stat_name`,
//! `streamalloc_torch_stats`, `streamalloc_reset_accumulated_stats`), on simulated
//! devices: every name is one of PyTorch's keys, the values follow PyTorch's meaning
//! (`allocated`/`freed` accumulate until reset, `current` and `peak` never reset), and
//! what the profiler is told of an allocation is its block's size and the device's totals.

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
fn every_statistic_is_named_as_pytorch_names_it_once() {
    let names = names();
    let unique: BTreeSet<String> = names.iter().cloned().collect();
    assert_eq!(unique.len(), names.len(), "a name listed twice: {names:?}");
    let pytorchs = pytorchs_keys();
    let unknown: Vec<&String> = unique.difference(&pytorchs).collect();
    assert!(unknown.is_empty(), "not PyTorch's keys: {unknown:?}");
    for key in [
        "allocated_bytes.all.current",
        "allocated_bytes.all.allocated",
        "reserved_bytes.all.peak",
        "requested_bytes.all.freed",
        "allocation.all.current",
        "num_sync_all_streams",
        "max_split_size",
    ] {
        assert!(unique.contains(key), "{key} is missing");
    }
    assert!(stats::streamalloc_torch_stat_name(names.len()).is_null());
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
