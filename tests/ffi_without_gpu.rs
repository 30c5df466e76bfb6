//! The C ABI on a machine without CUDA (CI): every entry point answers with a null pointer
//! or an error code and a readable `streamalloc_last_error()`, never a panic or a crash.
//! On a machine with a GPU these checks are skipped (`streamalloc-gpu-test` covers it).

use std::ffi::{c_void, CStr, CString};
use streamalloc::ffi::{self, StreamallocStats};
use streamalloc_allocator::backend::cuda::driver;

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(ffi::streamalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Held by the tests that free foreign pointers: the registry counts invalid frees for the
/// whole process, and tests run on parallel threads.
static INVALID_FREES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn no_gpu() -> bool {
    match driver::load() {
        Ok(()) => {
            eprintln!("skipped: a CUDA driver is present; run streamalloc-gpu-test instead");
            false
        }
        Err(_) => true,
    }
}

#[test]
fn every_entry_point_fails_cleanly_without_cuda() {
    if !no_gpu() {
        return;
    }
    let stream = std::ptr::null_mut::<c_void>();
    assert!(ffi::streamalloc_malloc(0, 0, stream).is_null());
    let ptr = ffi::streamalloc_malloc(1 << 20, 0, stream);
    assert!(ptr.is_null());
    let message = last_error();
    assert!(message.contains("device 0"), "{message}");
    assert!(message.contains("CUDA driver"), "{message}");

    assert!(ffi::streamalloc_malloc(1 << 20, -3, stream).is_null());
    assert!(last_error().contains("out of range"), "{}", last_error());
    assert!(ffi::streamalloc_malloc(1 << 20, 1000, stream).is_null());

    // Frees and record_stream of pointers nobody handed out are counted, not fatal.
    let counting = INVALID_FREES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let before = streamalloc::registry::global().invalid_frees();
    ffi::streamalloc_free(0x1000 as *mut c_void, 16, 0, stream);
    ffi::streamalloc_free(0x1000 as *mut c_void, 16, -1, stream);
    assert!(last_error().contains("unknown pointer"), "{}", last_error());
    ffi::streamalloc_free(std::ptr::null_mut(), 0, 0, stream);
    let after = streamalloc::registry::global().invalid_frees();
    assert_eq!(after - before, 2);
    drop(counting);
    ffi::streamalloc_record_stream(0x1000 as *mut c_void, stream);

    ffi::streamalloc_empty_cache();
    ffi::streamalloc_set_memory_fraction(0.5, 0);
    assert!(last_error().contains("device 0"), "{}", last_error());
    ffi::streamalloc_set_memory_fraction(1.5, 0);
    assert!(last_error().contains("not in (0, 1]"), "{}", last_error());

    assert_eq!(ffi::streamalloc_reset_peak_stats(0), -1);
    let mut stats = StreamallocStats::default();
    // SAFETY: a valid out pointer, then a null one (refused).
    unsafe {
        assert_eq!(ffi::stats::streamalloc_get_stats(0, &mut stats), -1);
        assert_eq!(
            ffi::stats::streamalloc_get_stats(0, std::ptr::null_mut()),
            -1
        );
    }
    assert!(ffi::stats::streamalloc_stats_json(0).is_null());

    let path = CString::new("/nonexistent/dir/snapshot.json").unwrap();
    // SAFETY: valid C strings or null.
    unsafe {
        assert_eq!(ffi::streamalloc_dump_snapshot(path.as_ptr(), 0), -1);
        assert_eq!(ffi::streamalloc_dump_snapshot(std::ptr::null(), 0), -1);
    }
    assert!(last_error().contains("path is null"));
}

#[test]
fn last_error_is_per_thread() {
    if !no_gpu() {
        return;
    }
    assert!(ffi::streamalloc_malloc(64, 0, std::ptr::null_mut()).is_null());
    assert!(!last_error().is_empty());
    let other = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(other, "");
}

/// Every call sets or clears the last error: a success after a failure never leaves the
/// failure's message behind (with or without a GPU: these calls fail or succeed either way).
#[test]
fn last_error_is_cleared_by_success_and_set_by_failure() {
    let stream = std::ptr::null_mut::<c_void>();
    ffi::streamalloc_set_memory_fraction(1.5, 0);
    assert!(last_error().contains("not in (0, 1]"), "{}", last_error());
    assert!(ffi::streamalloc_malloc(0, 0, stream).is_null());
    assert_eq!(last_error(), "", "malloc(0) succeeded");

    assert_eq!(
        // SAFETY: null is refused with an error.
        unsafe { ffi::streamalloc_dump_snapshot(std::ptr::null(), 0) },
        -1
    );
    assert!(last_error().contains("path is null"), "{}", last_error());
    ffi::streamalloc_free(std::ptr::null_mut(), 0, 0, stream);
    assert_eq!(last_error(), "", "free(NULL) succeeded");

    ffi::streamalloc_set_memory_fraction(-1.0, 0);
    assert!(!last_error().is_empty());
    ffi::streamalloc_record_stream(std::ptr::null_mut(), stream);
    assert_eq!(last_error(), "", "record_stream(NULL) succeeded");

    ffi::streamalloc_set_memory_fraction(f64::NAN, 0);
    assert!(!last_error().is_empty());
    // SAFETY: null removes the thrower.
    unsafe { ffi::streamalloc_set_error_thrower(None) };
    assert_eq!(last_error(), "");

    // Reading the error is not a call that clears it; asking the version is a call like
    // any other, and clears it.
    ffi::streamalloc_set_memory_fraction(2.0, 0);
    let first = last_error();
    assert!(!first.is_empty());
    assert_eq!(last_error(), first);
    let _ = ffi::streamalloc_version();
    assert_eq!(last_error(), "");

    if no_gpu() {
        // A failure replaces an older message with its own.
        assert!(ffi::streamalloc_malloc(1 << 20, -3, stream).is_null());
        assert!(last_error().contains("out of range"), "{}", last_error());
        assert_eq!(ffi::streamalloc_reset_peak_stats(0), -1);
        assert!(!last_error().contains("out of range"), "{}", last_error());
        assert!(!last_error().is_empty());
    }
}

#[test]
fn version_is_the_crate_version() {
    // SAFETY: a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr(ffi::streamalloc_version()) };
    assert_eq!(version.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

#[test]
fn pool_and_introspection_entry_points_fail_cleanly_without_cuda() {
    if !no_gpu() {
        return;
    }
    use streamalloc::ffi::introspect::*;
    use streamalloc::ffi::pools::*;
    let stream = std::ptr::null_mut::<c_void>();
    assert!(streamalloc_malloc_in_pool(1 << 20, 0, stream, 1, 0).is_null());
    assert!(last_error().contains("device 0"), "{}", last_error());
    assert_eq!(streamalloc_pool_incref(0, 1, 0), -1);
    assert_eq!(streamalloc_pool_release(0, 1, 0), -1);
    // The header: 0 for a pool that does not exist, and none exists without a device.
    assert_eq!(streamalloc_pool_use_count(0, 1, 0), 0);
    assert_eq!(streamalloc_empty_cache_pool(0, 0, 0), -1);
    assert_eq!(streamalloc_memory_limit(0), 0);
    let mut out = [0u64; 4];
    // SAFETY: `out` has room for 4 values; the null block list has count 0.
    unsafe {
        assert_eq!(
            streamalloc_pool_live_allocations(0, 1, 0, out.as_mut_ptr(), 4),
            -1
        );
        assert_eq!(
            streamalloc_pool_restore(0, 1, 0, std::ptr::null(), 0, out.as_mut_ptr(), 4),
            -1
        );
        assert_eq!(streamalloc_cache_info(0, out.as_mut_ptr()), -1);
        assert_eq!(streamalloc_cache_info(0, std::ptr::null_mut()), -1);
        assert!(last_error().contains("null"), "{}", last_error());
        let (mut device, mut expandable) = (0, 0);
        assert_eq!(
            streamalloc_block_info(
                0x1000 as *mut c_void,
                &mut device,
                &mut out[0],
                &mut out[1],
                &mut expandable
            ),
            -1
        );
        assert!(
            last_error().contains("not a live allocation"),
            "{}",
            last_error()
        );
        let (mut segments, mut blocks) = (0usize, 0usize);
        assert_eq!(
            streamalloc_snapshot_segments(
                0,
                std::ptr::null_mut(),
                0,
                &mut segments,
                std::ptr::null_mut(),
                0,
                &mut blocks
            ),
            -1
        );
    }
    // The pluggable hooks report instead of crashing, and leave no route behind.
    streamalloc_begin_allocate_to_pool(0, 1, 0, std::ptr::null_mut());
    streamalloc_end_allocate_to_pool(0, 1, 0);
    streamalloc_release_pool(0, 1, 0);
    assert!(ffi::streamalloc_malloc(1 << 20, 0, stream).is_null());
}

#[test]
fn pytorch_statistics_and_pool_source_entry_points_fail_cleanly_without_cuda() {
    if !no_gpu() {
        return;
    }
    use streamalloc::ffi::{pool_rules, stats};
    let mut values = [0i64; 4];
    // SAFETY: `values` has room for 4 values.
    let n = unsafe { stats::streamalloc_torch_stats(0, values.as_mut_ptr(), 4) };
    assert_eq!(n, -1);
    assert!(last_error().contains("device 0"), "{}", last_error());
    assert_eq!(stats::streamalloc_reset_accumulated_stats(0), -1);
    assert!(
        !stats::streamalloc_torch_stat_name(0).is_null(),
        "names need no device"
    );
    let (mut device, mut size) = (0, 0u64);
    // SAFETY: the out pointers are writable or null.
    let usage = unsafe {
        stats::streamalloc_allocation_usage(
            0x1000 as *mut c_void,
            &mut device,
            &mut size,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(usage, -1);
    assert!(
        last_error().contains("not a live allocation"),
        "{}",
        last_error()
    );
    assert_eq!(pool_rules::streamalloc_pool_set_use_on_oom(0, 1, 0, 1), -1);
    // SAFETY: null callbacks are refused before anything is called.
    let source = unsafe {
        pool_rules::streamalloc_pool_set_segment_source(0, 1, 0, None, None, std::ptr::null_mut())
    };
    assert_eq!(source, -1);
    assert!(last_error().contains("null"), "{}", last_error());
}

#[test]
fn calls_from_thread_local_destructors_after_the_error_slot_is_gone_do_not_abort() {
    // At exit, PyTorch frees tensors from its own thread-local and static destructors
    // (CUDA IPC bookkeeping); by then the library's last-error slot may be destroyed. Its
    // destructor is registered after this one (the first C call touches it), so it runs
    // first, and the free below finds it gone.
    struct FreesAtThreadExit;
    impl Drop for FreesAtThreadExit {
        fn drop(&mut self) {
            ffi::streamalloc_free(0x1000 as *mut c_void, 16, 0, std::ptr::null_mut());
            ffi::streamalloc_record_stream(0x1000 as *mut c_void, std::ptr::null_mut());
            assert!(!ffi::streamalloc_last_error().is_null());
        }
    }
    thread_local! {
        static AT_EXIT: FreesAtThreadExit = const { FreesAtThreadExit };
    }
    let _counting = INVALID_FREES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let status = std::thread::spawn(|| {
        AT_EXIT.with(|_| {});
        ffi::streamalloc_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
    })
    .join();
    assert!(status.is_ok());
}
