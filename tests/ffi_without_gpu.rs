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
    let before = streamalloc_allocator::backend::cuda::registry::global().invalid_frees();
    ffi::streamalloc_free(0x1000 as *mut c_void, 16, 0, stream);
    ffi::streamalloc_free(0x1000 as *mut c_void, 16, -1, stream);
    ffi::streamalloc_free(std::ptr::null_mut(), 0, 0, stream);
    let after = streamalloc_allocator::backend::cuda::registry::global().invalid_frees();
    assert_eq!(after - before, 2);
    assert!(last_error().contains("unknown pointer"), "{}", last_error());
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

#[test]
fn version_is_the_crate_version() {
    // SAFETY: a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr(ffi::streamalloc_version()) };
    assert_eq!(version.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}
