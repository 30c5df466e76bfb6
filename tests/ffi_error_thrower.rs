//! `streamalloc_set_error_thrower`: a failed `streamalloc_malloc` raises through the
//! registered function (PyTorch registers libc10's `torchCheckFail`, which throws a C++
//! exception). Here a Rust function that panics plays the thrower: the unwind must pass
//! through `streamalloc_malloc` (a `C-unwind` function) to the caller, carrying our
//! message. Without a GPU the failure is "no CUDA driver"; on a GPU machine the request is
//! made too large to succeed.

use std::ffi::{c_char, CStr};
use streamalloc::ffi;

unsafe extern "C-unwind" fn panicking_thrower(
    func: *const c_char,
    _file: *const c_char,
    _line: u32,
    message: *const c_char,
) {
    // SAFETY: the library passes NUL-terminated strings valid for the call.
    let (func, message) = unsafe { (CStr::from_ptr(func), CStr::from_ptr(message)) };
    panic!("{}: {}", func.to_string_lossy(), message.to_string_lossy());
}

#[test]
fn failed_malloc_raises_through_the_thrower() {
    // SAFETY: a function of the ErrorThrower type that unwinds.
    unsafe { ffi::streamalloc_set_error_thrower(Some(panicking_thrower)) };
    let raised = std::panic::catch_unwind(|| {
        ffi::streamalloc_malloc(1 << 50, 0, std::ptr::null_mut());
    });
    // SAFETY: null removes the thrower.
    unsafe { ffi::streamalloc_set_error_thrower(None) };
    let payload = raised.expect_err("the thrower was not called");
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        message.starts_with("streamalloc_malloc: streamalloc: device 0"),
        "{message}"
    );
    // Without a thrower the same failure is a null pointer again.
    assert!(ffi::streamalloc_malloc(1 << 50, 0, std::ptr::null_mut()).is_null());
    // A zero-byte request is not a failure and never raises.
    // SAFETY: as above.
    unsafe { ffi::streamalloc_set_error_thrower(Some(panicking_thrower)) };
    assert!(ffi::streamalloc_malloc(0, 0, std::ptr::null_mut()).is_null());
    // SAFETY: as above.
    unsafe { ffi::streamalloc_set_error_thrower(None) };
}
