//! Misuse of every C entry point, on simulated devices: the code behind each
//! `streamalloc_*` export, driven on a `Registry<SimBackend>`, answers null pointers, bad
//! devices, bad sizes, pool calls out of order and junk with its documented failure value
//! and a last error saying why, never a crash; a success leaves the last error empty; and a
//! panic inside a device's engine makes that device refuse every later call.

use std::ffi::{c_int, c_void, CStr};
use streamalloc::ffi::pools::{
    self, StreamallocBlockState, StreamallocPoolBlock, StreamallocSegmentInfo,
};
use streamalloc::ffi::{self, error, introspect, p2p, stats, StreamallocStats};
use streamalloc::registry::Registry;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::Config;

const MIB: usize = 1 << 20;
const SENTINEL: &str = "(sentinel)";

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

fn null() -> *mut c_void {
    std::ptr::null_mut()
}

fn ptr(address: u64) -> *mut c_void {
    address as usize as *mut c_void
}

/// One entry point taking a device, called with harmless other arguments; true if its
/// return value says it failed (calls returning nothing: if the last error is set).
type DeviceCall = (&'static str, fn(&Registry<SimBackend>, c_int) -> bool);

fn device_calls() -> Vec<DeviceCall> {
    vec![
        ("malloc", |r, d| ffi::malloc(r, MIB, d, null()).is_null()),
        ("malloc_in_pool", |r, d| {
            pools::malloc_in_pool(r, MIB, d, null(), 0, 0).is_null()
        }),
        ("set_memory_fraction", |r, d| {
            ffi::set_memory_fraction(r, 0.5, d);
            !last_error().is_empty()
        }),
        ("reset_peak_stats", |r, d| ffi::reset_peak_stats(r, d) != 0),
        ("get_stats", |r, d| {
            let mut out = StreamallocStats::default();
            // SAFETY: a valid out pointer.
            unsafe { stats::get_stats(r, d, &mut out) != 0 }
        }),
        ("stats_json", |r, d| stats::stats_json(r, d).is_null()),
        ("dump_snapshot", |r, d| {
            // SAFETY: a NUL-terminated path.
            unsafe { ffi::dump_snapshot(r, c"/dev/null".as_ptr(), d) != 0 }
        }),
        ("pool_begin_allocate", |r, d| {
            pools::pool_begin_allocate(r, d, 1, 0) < 0
        }),
        ("pool_end_allocate", |r, d| {
            pools::pool_end_allocate(r, d, 1, 0) < 0
        }),
        ("pool_incref", |r, d| pools::pool_incref(r, d, 1, 0) < 0),
        ("pool_release", |r, d| pools::pool_release(r, d, 1, 0) < 0),
        // No pool exists where there is no device: 0, as the header says.
        ("pool_use_count", |r, d| {
            pools::pool_use_count(r, d, 1, 0) == 0
        }),
        ("pool_live_allocations", |r, d| {
            let mut out = [0u64; 4];
            // SAFETY: room for 4.
            unsafe { pools::pool_live_allocations(r, d, 1, 0, out.as_mut_ptr(), 4) < 0 }
        }),
        ("pool_checkpoint", |r, d| {
            let mut out = [StreamallocPoolBlock::default(); 4];
            // SAFETY: room for 4.
            unsafe { pools::pool_checkpoint(r, d, 1, 0, out.as_mut_ptr(), 4) < 0 }
        }),
        ("pool_restore", |r, d| {
            let mut freed = [0u64; 4];
            // SAFETY: no blocks; room for 4.
            unsafe {
                pools::pool_restore(r, d, 1, 0, std::ptr::null(), 0, freed.as_mut_ptr(), 4) < 0
            }
        }),
        ("empty_cache_pool", |r, d| {
            pools::empty_cache_pool(r, d, 0, 0) != 0
        }),
        ("cache_info", |r, d| {
            let mut largest = 0;
            // SAFETY: a valid out pointer.
            unsafe { introspect::cache_info(r, d, &mut largest) != 0 }
        }),
        ("memory_limit", |r, d| {
            introspect::memory_limit(r, d);
            !last_error().is_empty()
        }),
        ("snapshot_segments", |r, d| {
            let (mut segments, mut blocks) = (0usize, 0usize);
            // SAFETY: null arrays with capacity 0, valid count pointers.
            unsafe {
                introspect::snapshot_segments(
                    r,
                    d,
                    std::ptr::null_mut(),
                    0,
                    &mut segments,
                    std::ptr::null_mut(),
                    0,
                    &mut blocks,
                ) < 0
            }
        }),
        ("begin_allocate_to_pool", |r, d| {
            pools::begin_allocate_to_pool(r, d, 1, 0, null());
            !last_error().is_empty()
        }),
        ("end_allocate_to_pool", |r, d| {
            pools::end_allocate_to_pool(r, d, 1, 0);
            !last_error().is_empty()
        }),
        ("release_pool", |r, d| {
            pools::release_pool(r, d, 1, 0);
            !last_error().is_empty()
        }),
    ]
}

#[test]
fn every_entry_point_refuses_a_bad_device_number_with_its_message() {
    let registry = registry();
    for device in [-1, -3, 64, 1000, c_int::MIN] {
        for (name, call) in device_calls() {
            error::set(SENTINEL);
            assert!(call(&registry, device), "{name}({device}) succeeded");
            let message = last_error();
            assert!(
                message.contains(&format!("device index {device} is out of range")),
                "{name}({device}): {message:?}"
            );
        }
    }
    assert_eq!(registry.initialized().count(), 0, "no device was created");
}

#[test]
fn malloc_refuses_sizes_no_device_can_serve_and_treats_zero_as_nothing() {
    let registry = registry();
    error::set(SENTINEL);
    assert!(ffi::malloc(&registry, 0, 0, null()).is_null());
    assert_eq!(last_error(), "", "malloc(0) is no failure");
    for size in [usize::MAX, usize::MAX - 511, 1 << 50] {
        assert!(ffi::malloc(&registry, size, 0, null()).is_null());
        let message = last_error();
        assert!(
            message.starts_with("streamalloc: device 0: ")
                && (message.contains("invalid allocation size")
                    || message.contains("out of memory")),
            "malloc({size}): {message}"
        );
        assert!(pools::malloc_in_pool(&registry, size, 0, null(), 0, 0).is_null());
        assert!(!last_error().is_empty());
    }
    // Beyond the simulated device's memory: out of memory, with the report.
    assert!(ffi::malloc(&registry, 2 << 30, 0, null()).is_null());
    assert!(last_error().contains("out of memory"), "{}", last_error());
    // And the device still serves what fits.
    let block = ffi::malloc(&registry, MIB, 0, null());
    assert!(!block.is_null());
    assert_eq!(last_error(), "");
}

#[test]
fn frees_of_null_foreign_interior_and_freed_pointers_are_reported_and_counted() {
    let registry = registry();
    let block = ffi::malloc(&registry, MIB, 0, null());
    let device = registry.get(0).unwrap();
    let invalid = || device.allocator().stats().invalid_frees;

    ffi::free(&registry, null(), 0, 0, null());
    assert_eq!(last_error(), "", "free(NULL) is no failure");
    assert_eq!(invalid(), 0);

    let interior = ptr(block as u64 + 512);
    for bad in [ptr(0x1000), interior, ptr(u64::MAX)] {
        error::set(SENTINEL);
        ffi::free(&registry, bad, 0, 0, null());
        assert!(last_error().contains("unknown pointer"), "{}", last_error());
    }
    assert_eq!(invalid(), 3);
    assert_eq!(registry.invalid_frees(), 3);

    ffi::free(&registry, block, 0, 0, null());
    assert_eq!(last_error(), "");
    ffi::free(&registry, block, 0, 0, null());
    assert!(last_error().contains("unknown pointer"), "double free");
    assert_eq!(invalid(), 4);
    // Naming no device, or a bad one: the registry counts it, no device does.
    ffi::free(&registry, block, 0, -1, null());
    ffi::free(&registry, block, 0, 64, null());
    assert!(last_error().contains("unknown pointer"));
    assert_eq!((invalid(), registry.invalid_frees()), (4, 6));
    device.allocator().check_invariants().unwrap();
}

#[test]
fn a_wrong_device_free_is_served_where_the_block_lives_and_counted_as_invalid_nowhere() {
    let registry = registry();
    let on_one = ffi::malloc(&registry, MIB, 1, null());
    let on_zero = ffi::malloc(&registry, MIB, 0, null());
    assert!(!on_one.is_null() && !on_zero.is_null());
    error::set(SENTINEL);
    ffi::free(&registry, on_one, 0, 0, null());
    assert_eq!(last_error(), "", "served on device 1");
    for ordinal in [0, 1] {
        let device = registry.get(ordinal).unwrap();
        assert_eq!(
            device.allocator().stats().invalid_frees,
            0,
            "device {ordinal}"
        );
    }
    assert_eq!(registry.invalid_frees(), 0);
    assert_eq!(registry.get(1).unwrap().allocator().stats().frees, 1);
    // A device never created, named by a free, is not created by it.
    ffi::free(&registry, on_zero, 0, 5, null());
    assert_eq!(last_error(), "");
    assert!(registry.get(5).is_none());
}

#[test]
fn record_stream_of_a_pointer_nobody_handed_out_is_reported_and_counted() {
    let registry = registry();
    let block = ffi::malloc(&registry, MIB, 0, null());
    ffi::record_stream(&registry, null(), ptr(7));
    assert_eq!(last_error(), "");
    ffi::record_stream(&registry, ptr(0x1000), ptr(7));
    assert!(last_error().contains("unknown pointer"), "{}", last_error());
    assert_eq!(registry.unknown_record_streams(), 1);
    ffi::record_stream(&registry, block, ptr(7));
    assert_eq!(last_error(), "");
}

#[test]
fn marking_a_stream_volatile_needs_a_usable_device() {
    let registry = registry();
    assert_eq!(ffi::stream_volatile(&registry, 0, ptr(0x5000)), 0);
    assert_eq!(last_error(), "");
    assert_eq!(ffi::stream_volatile(&registry, -3, ptr(0x5000)), -1);
    assert!(
        !last_error().is_empty(),
        "a bad device is refused with a reason"
    );
}

#[test]
fn null_out_pointers_are_refused_or_skipped_as_documented() {
    let registry = registry();
    let block = ffi::malloc(&registry, MIB, 0, null());
    // SAFETY: every pointer is null or valid for what the function writes.
    unsafe {
        assert_eq!(stats::get_stats(&registry, 0, std::ptr::null_mut()), -1);
        assert!(last_error().contains("out is null"), "{}", last_error());
        assert_eq!(
            introspect::cache_info(&registry, 0, std::ptr::null_mut()),
            -1
        );
        assert!(last_error().contains("largest is null"));
        assert_eq!(ffi::dump_snapshot(&registry, std::ptr::null(), 0), -1);
        assert!(last_error().contains("path is null"));
        assert_eq!(
            ffi::dump_snapshot(&registry, c"/nonexistent/dir/s.json".as_ptr(), 0),
            -1
        );
        assert!(
            last_error().contains("cannot write snapshot"),
            "{}",
            last_error()
        );
        let mut freed = [0u64; 1];
        assert_eq!(
            pools::pool_restore(
                &registry,
                0,
                1,
                0,
                std::ptr::null(),
                2,
                freed.as_mut_ptr(),
                1
            ),
            -1
        );
        assert!(last_error().contains("blocks is null"));

        // Null outs are skipped where the function allows them.
        use std::ptr::null_mut;
        assert_eq!(
            introspect::block_info(
                &registry,
                block,
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut()
            ),
            0
        );
        assert_eq!(last_error(), "");
        assert_eq!(
            pools::pool_live_allocations(&registry, 0, 0, 0, null_mut(), 0),
            1,
            "counted without an array"
        );
        let (mut segments, mut blocks) = (0usize, 0usize);
        let fitted = introspect::snapshot_segments(
            &registry,
            0,
            null_mut(),
            0,
            &mut segments,
            null_mut(),
            0,
            &mut blocks,
        );
        assert_eq!((fitted, segments > 0, blocks > 0), (1, true, true));
        let mut rows = vec![StreamallocSegmentInfo::default(); segments];
        let mut block_rows = vec![StreamallocBlockState::default(); blocks];
        let fitted = introspect::snapshot_segments(
            &registry,
            0,
            rows.as_mut_ptr(),
            segments,
            null_mut(),
            block_rows.as_mut_ptr(),
            blocks,
            null_mut(),
        );
        assert_eq!(fitted, 0);
        assert_eq!(last_error(), "");

        // block_info of something that is not a live allocation.
        assert_eq!(
            introspect::block_info(
                &registry,
                ptr(0x1000),
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut()
            ),
            -1
        );
        assert!(last_error().contains("not a live allocation"));
    }
}

#[test]
fn pool_calls_out_of_order_fail_with_the_engines_reason_and_change_nothing() {
    let registry = registry();
    assert_eq!(pools::pool_release(&registry, 0, 3, 0), -1);
    assert!(last_error().contains("pool(3, 0)"), "{}", last_error());
    assert_eq!(pools::pool_end_allocate(&registry, 0, 3, 0), -1);
    assert!(!last_error().is_empty());
    assert!(pools::malloc_in_pool(&registry, MIB, 0, null(), 3, 0).is_null());
    assert!(last_error().contains("does not exist"), "{}", last_error());
    assert_eq!(pools::pool_use_count(&registry, 0, 3, 0), 0);
    assert_eq!(last_error(), "", "an unknown pool has no uses: no failure");
    let mut freed = [0u64; 4];
    // SAFETY: no blocks; room for 4.
    unsafe {
        assert_eq!(
            pools::pool_restore(
                &registry,
                0,
                0,
                0,
                std::ptr::null(),
                0,
                freed.as_mut_ptr(),
                4
            ),
            -1
        );
        assert!(last_error().contains("default pool"), "{}", last_error());
    }

    // A restore with too little room for the pool's live allocations changes nothing.
    assert_eq!(pools::pool_incref(&registry, 0, 3, 0), 1);
    let a = pools::malloc_in_pool(&registry, MIB, 0, null(), 3, 0);
    let b = pools::malloc_in_pool(&registry, MIB, 0, null(), 3, 0);
    assert!(!a.is_null() && !b.is_null());
    // SAFETY: no blocks; room for 1.
    let n = unsafe {
        pools::pool_restore(
            &registry,
            0,
            3,
            0,
            std::ptr::null(),
            0,
            freed.as_mut_ptr(),
            1,
        )
    };
    assert_eq!(n, -1);
    assert!(last_error().contains("room for 1"), "{}", last_error());
    let device = registry.get(0).unwrap();
    assert_eq!(
        device
            .allocator()
            .pool_live_allocations(streamalloc_allocator::PoolId(3, 0))
            .len(),
        2
    );
    // Junk blocks are refused before anything is freed.
    let junk = [StreamallocPoolBlock {
        address: 0x1000,
        size: 512,
        requested: 1,
        stream: 0,
    }];
    // SAFETY: one block; room for 4.
    let n =
        unsafe { pools::pool_restore(&registry, 0, 3, 0, junk.as_ptr(), 1, freed.as_mut_ptr(), 4) };
    assert_eq!(n, -1);
    assert!(
        last_error().contains("no longer lies in the pool's memory"),
        "{}",
        last_error()
    );
    assert_eq!(
        device
            .allocator()
            .pool_live_allocations(streamalloc_allocator::PoolId(3, 0))
            .len(),
        2
    );
    device.allocator().check_invariants().unwrap();
}

#[test]
fn a_restore_of_a_block_past_the_end_of_the_address_space_is_refused() {
    let registry = registry();
    assert_eq!(pools::pool_incref(&registry, 0, 3, 0), 1);
    let block = pools::malloc_in_pool(&registry, MIB, 0, null(), 3, 0) as u64;
    // Aligned, a multiple of the block size, and wrapping around to lie "inside" the
    // segment when added to its address.
    let wrapping = StreamallocPoolBlock {
        address: block,
        size: (u64::MAX - block + 1) + 512,
        requested: 1,
        stream: 0,
    };
    let mut freed = [0u64; 4];
    // SAFETY: one block; room for 4.
    let n = unsafe { pools::pool_restore(&registry, 0, 3, 0, &wrapping, 1, freed.as_mut_ptr(), 4) };
    assert_eq!(n, -1);
    assert!(
        last_error().contains("runs past the end of the address space"),
        "{}",
        last_error()
    );
    let device = registry.get(0).unwrap();
    assert!(device.poisoned().is_none());
    device.allocator().check_invariants().unwrap();
}

#[test]
fn a_panic_inside_a_devices_engine_makes_it_refuse_every_later_call() {
    let registry = registry();
    let kept = ffi::malloc(&registry, MIB, 0, null());
    let other = ffi::malloc(&registry, MIB, 1, null());
    let device = registry.get(0).unwrap();
    let backend = device.allocator().backend().clone();
    backend.panic_on_next("alloc_segment");

    // The call that panicked fails with the reason, and no panic reaches the caller.
    assert!(ffi::malloc(&registry, 64 * MIB, 0, null()).is_null());
    let poisoned = "streamalloc: device 0 is unusable after an internal panic: injected panic in alloc_segment";
    assert_eq!(last_error(), poisoned);

    // From then on nothing reaches device 0's engine.
    let stats = device.allocator().stats();
    let segments = backend.calls("alloc_segment") + backend.calls("synchronize_device");
    for (name, call) in device_calls() {
        error::set(SENTINEL);
        assert!(call(&registry, 0), "{name} succeeded on a poisoned device");
        assert_eq!(last_error(), poisoned, "{name}");
    }
    ffi::free(&registry, kept, 0, 0, null());
    assert_eq!(last_error(), poisoned, "free");
    ffi::empty_cache(&registry);
    assert_eq!(last_error(), poisoned, "empty_cache reports the device");
    assert_eq!(
        device.allocator().stats(),
        stats,
        "the engine's counters moved"
    );
    assert_eq!(
        backend.calls("alloc_segment") + backend.calls("synchronize_device"),
        segments,
        "the driver was called"
    );

    // Device 1 carries on.
    ffi::free(&registry, other, 0, 1, null());
    assert_eq!(last_error(), "");
    assert!(!ffi::malloc(&registry, MIB, 1, null()).is_null());
}

/// A call that should succeed; true if its return value says it did.
type SucceedingCall<'a> = Box<dyn Fn() -> bool + 'a>;

#[test]
fn every_call_clears_the_last_error_when_it_succeeds() {
    let registry = registry();
    let block = ffi::malloc(&registry, MIB, 0, null());
    // Snapshots go to regular files only (/dev/null is refused).
    let scratch = tempfile::tempdir().unwrap();
    let snapshot_path = scratch.path().join("snapshot.json");
    let snapshot_file = std::ffi::CString::new(snapshot_path.to_str().unwrap()).unwrap();
    let calls: Vec<(&str, SucceedingCall<'_>)> = vec![
        ("malloc", Box::new(|| !ffi::malloc(&registry, MIB, 0, null()).is_null())),
        ("free(NULL)", Box::new(|| {
            ffi::free(&registry, null(), 0, 0, null());
            true
        })),
        ("record_stream", Box::new(|| {
            ffi::record_stream(&registry, block, ptr(3));
            true
        })),
        ("empty_cache", Box::new(|| {
            ffi::empty_cache(&registry);
            true
        })),
        ("set_memory_fraction", Box::new(|| {
            ffi::set_memory_fraction(&registry, 1.0, 0);
            true
        })),
        ("reset_peak_stats", Box::new(|| ffi::reset_peak_stats(&registry, 0) == 0)),
        ("get_stats", Box::new(|| {
            let mut out = StreamallocStats::default();
            // SAFETY: a valid out pointer.
            unsafe { stats::get_stats(&registry, 0, &mut out) == 0 }
        })),
        ("stats_json", Box::new(|| !stats::stats_json(&registry, 0).is_null())),
        // SAFETY: a NUL-terminated path.
        ("dump_snapshot", Box::new(|| unsafe { ffi::dump_snapshot(&registry, snapshot_file.as_ptr(), 0) } == 0)),
        ("pool_incref", Box::new(|| pools::pool_incref(&registry, 0, 4, 0) > 0)),
        ("pool_use_count", Box::new(|| pools::pool_use_count(&registry, 0, 4, 0) > 0)),
        ("malloc_in_pool", Box::new(|| !pools::malloc_in_pool(&registry, MIB, 0, null(), 4, 0).is_null())),
        ("pool_live_allocations", Box::new(|| {
            let mut out = [0u64; 4];
            // SAFETY: room for 4.
            unsafe { pools::pool_live_allocations(&registry, 0, 4, 0, out.as_mut_ptr(), 4) >= 0 }
        })),
        ("pool_checkpoint", Box::new(|| {
            let mut out = [StreamallocPoolBlock::default(); 4];
            // SAFETY: room for 4.
            unsafe { pools::pool_checkpoint(&registry, 0, 4, 0, out.as_mut_ptr(), 4) >= 0 }
        })),
        ("pool_begin_allocate", Box::new(|| pools::pool_begin_allocate(&registry, 0, 4, 0) > 0)),
        ("pool_end_allocate", Box::new(|| pools::pool_end_allocate(&registry, 0, 4, 0) == 0)),
        ("empty_cache_pool", Box::new(|| pools::empty_cache_pool(&registry, 0, 0, 0) == 0)),
        ("cache_info", Box::new(|| {
            let mut largest = 0u64;
            // SAFETY: a valid out pointer.
            unsafe { introspect::cache_info(&registry, 0, &mut largest) == 0 }
        })),
        ("memory_limit", Box::new(|| introspect::memory_limit(&registry, 0) > 0)),
        // SAFETY: null outs are allowed.
        ("block_info", Box::new(|| unsafe {
            use std::ptr::null_mut;
            introspect::block_info(&registry, block, null_mut(), null_mut(), null_mut(), null_mut())
        } == 0)),
        ("begin_allocate_to_pool", Box::new(|| {
            pools::begin_allocate_to_pool(&registry, 0, 5, 0, null());
            true
        })),
        ("end_allocate_to_pool", Box::new(|| {
            pools::end_allocate_to_pool(&registry, 0, 5, 0);
            true
        })),
        ("release_pool", Box::new(|| {
            pools::release_pool(&registry, 0, 5, 0);
            true
        })),
        ("version", Box::new(|| !ffi::streamalloc_version().is_null())),
        ("torch_stat_name(0)", Box::new(|| !stats::streamalloc_torch_stat_name(0).is_null())),
        ("torch_stat_name(past the last)", Box::new(|| stats::streamalloc_torch_stat_name(1 << 20).is_null())),
        ("p2p_plan_free(NULL)", Box::new(|| {
            // SAFETY: null is allowed.
            unsafe { p2p::streamalloc_p2p_plan_free(std::ptr::null_mut()) };
            true
        })),
    ];
    for (name, call) in &calls {
        error::set(SENTINEL);
        assert!(call(), "{name} failed: {}", last_error());
        assert_eq!(last_error(), "", "{name} left the last error set");
    }
}

#[test]
fn the_p2p_planner_refuses_null_plans_and_junk_through_the_same_last_error() {
    // SAFETY: null handles and arrays are refused before being read.
    unsafe {
        assert!(
            p2p::streamalloc_p2p_plan_new(0, std::ptr::null(), std::ptr::null(), 0, 0, 0).is_null()
        );
        assert!(last_error().contains("world must be positive"));
        assert_eq!(
            CStr::from_ptr(p2p::streamalloc_p2p_last_error()).to_string_lossy(),
            last_error(),
            "one slot"
        );
        assert_eq!(
            p2p::streamalloc_p2p_plan_rows(std::ptr::null(), 0, std::ptr::null_mut(), 0),
            -1
        );
        assert!(last_error().contains("null plan"));
        let mut summary = [0u64; 8];
        assert_eq!(
            p2p::streamalloc_p2p_plan_summary(std::ptr::null(), 0, summary.as_mut_ptr()),
            -1
        );
        assert!(last_error().contains("null plan"));
        assert_eq!(p2p::streamalloc_p2p_plan_digest(std::ptr::null()), 0);
        assert!(last_error().contains("null plan"));
        let junk = [7u8; 5];
        let (pointers, lengths) = ([junk.as_ptr()], [junk.len()]);
        assert!(p2p::streamalloc_p2p_plan_new(
            1,
            pointers.as_ptr(),
            lengths.as_ptr(),
            1 << 20,
            2,
            0
        )
        .is_null());
        assert!(!last_error().is_empty());
        // A null description among valid arrays is an empty one, refused by decoding.
        let (pointers, lengths) = ([std::ptr::null::<u8>()], [16usize]);
        assert!(p2p::streamalloc_p2p_plan_new(
            1,
            pointers.as_ptr(),
            lengths.as_ptr(),
            1 << 20,
            2,
            0
        )
        .is_null());
        assert!(!last_error().is_empty());
    }
}

#[test]
fn the_exit_hooks_visit_only_the_devices_in_use() {
    let registry = registry();
    assert!(streamalloc::process::devices_in_use(&registry).is_empty());
    assert!(!ffi::malloc(&registry, MIB, 1, null()).is_null());
    assert_eq!(streamalloc::process::devices_in_use(&registry), vec![1]);
    // SAFETY: a negative capacity with a null array writes nothing.
    let count =
        unsafe { streamalloc::process::streamalloc_devices_in_use(std::ptr::null_mut(), -5) };
    assert_eq!(count, 0, "the CUDA registry of this process has no device");
    assert_eq!(last_error(), "");
}
