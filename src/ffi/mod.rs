//! The C ABI of `libstreamalloc.so`: PyTorch's pluggable-allocator hooks and a small C API.
//!
//! Every function delegates to the process-wide [`registry`] (one engine per device, see
//! `streamalloc_allocator::backend::cuda::registry`) and contains every panic
//! ([`error::guard`]). Failures are a null pointer or a negative return code, with the
//! message in `streamalloc_last_error()`.
//!
//! ```c
//! void* streamalloc_malloc(size_t size, int device, cudaStream_t stream);
//! void  streamalloc_set_error_thrower(void (*thrower)(const char*, const char*, uint32_t, const char*));
//! void  streamalloc_free(void* ptr, size_t size, int device, cudaStream_t stream);
//! void  streamalloc_record_stream(void* ptr, cudaStream_t stream);
//! void  streamalloc_empty_cache(void);
//! void  streamalloc_set_memory_fraction(double fraction, int device);
//! int   streamalloc_get_stats(int device, streamalloc_stats_t* out);
//! const char* streamalloc_stats_json(int device);
//! int   streamalloc_reset_peak_stats(int device);
//! int   streamalloc_dump_snapshot(const char* path, int device);
//! const char* streamalloc_last_error(void);
//! ```
//!
//! CUDA IPC of expandable-segment memory (`streamalloc_ipc_*`) is in [`ipc`].
//!
//! The first four are exactly the function types PyTorch's `CUDAPluggableAllocator`
//! stores (`malloc`, `free`, `set_record_stream_fn`, `set_reset_fn`,
//! `set_memory_fraction_fn`). `size_t` and PyTorch's `ssize_t` share one ABI.
//!
//! # Misuse
//! Freeing a pointer streamalloc did not hand out (or already freed) is reported on stderr
//! once and counted (`invalid_frees`); naming the wrong device is served on the right one
//! and reported once. Neither ever crashes or touches memory.
//!
//! # Cost
//! `malloc`/`free` do one registry lookup (an array index and an atomic load), then the
//! engine's fast path; nothing allocates or formats unless something fails.

pub mod error;
pub mod ipc;
pub mod pools;
pub mod stats;

use self::error::{guard, warn_once, Once};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use streamalloc_allocator::backend::cuda::registry::{self, Freed, RegistryError};
use streamalloc_allocator::{AllocError, DevicePtr, StreamId};

pub use self::stats::StreamallocStats;

#[inline]
fn stream_id(stream: *mut c_void) -> StreamId {
    StreamId(stream as usize as u64)
}

#[cold]
#[inline(never)]
fn unavailable(device: c_int, err: &RegistryError) {
    error::set(format_args!("streamalloc: device {device}: {err}"));
    warn_once(
        Once::Unavailable,
        format_args!("device {device} unavailable: {err}"),
    );
}

#[cold]
#[inline(never)]
fn malloc_failed(device: c_int, err: &AllocError) {
    error::set(format_args!("streamalloc: device {device}: {err}"));
    // Printed too: without a registered thrower, PyTorch's pluggable hook turns a null
    // pointer into a tensor at address 0, and the user would never see this report.
    eprintln!("streamalloc: device {device}: {err}");
}

/// A function that raises the caller's own error with a message and does not return,
/// e.g. libc10's `c10::detail::torchCheckFail(const char* func, const char* file,
/// uint32_t line, const char* msg)`, which throws a `c10::Error`.
pub type ErrorThrower =
    unsafe extern "C-unwind" fn(*const c_char, *const c_char, u32, *const c_char);

/// The registered [`ErrorThrower`] (0: none).
static THROWER: AtomicUsize = AtomicUsize::new(0);

/// Registers (or, with null, removes) a function that `streamalloc_malloc` calls with its
/// error message instead of returning null for a non-zero request.
///
/// PyTorch's pluggable hook does not check for null: a null pointer becomes a tensor at
/// address 0 and a later illegal-memory-access error. `streamalloc.torch.install()`
/// therefore registers libc10's `torchCheckFail`, so an out-of-memory raises a Python
/// `RuntimeError` carrying our report.
///
/// # Safety
/// `thrower` must be null or a function of the [`ErrorThrower`] type that unwinds with a
/// foreign (e.g. C++) exception or returns; it is called from the allocating thread.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_set_error_thrower(thrower: Option<ErrorThrower>) {
    error::clear();
    THROWER.store(thrower.map_or(0, |f| f as usize), Ordering::Release);
}

/// Hands this thread's last error to the registered thrower, if any.
#[cold]
#[inline(never)]
fn throw_last_error() {
    let raw = THROWER.load(Ordering::Acquire);
    if raw != 0 {
        // SAFETY: only `streamalloc_set_error_thrower` stores here, from a valid
        // `ErrorThrower` (see its # Safety).
        let thrower: ErrorThrower = unsafe { std::mem::transmute::<usize, ErrorThrower>(raw) };
        // SAFETY: every argument is a NUL-terminated string that outlives the call (the
        // message is this thread's last error, untouched until the thrower returns). No
        // lock is held and no `catch_unwind` encloses this frame, so a C++ exception may
        // unwind through it (`C-unwind`).
        unsafe {
            thrower(
                c"streamalloc_malloc".as_ptr(),
                c"libstreamalloc.so".as_ptr(),
                0,
                error::last(),
            )
        };
    }
}

/// Allocates `size` bytes on `device` for use on `stream` (PyTorch's pluggable `malloc`).
/// Returns null for `size == 0` and on failure (then see `streamalloc_last_error`), or,
/// on failure with a thrower registered (`streamalloc_set_error_thrower`), raises through
/// it.
#[no_mangle]
pub extern "C-unwind" fn streamalloc_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    error::clear();
    if size == 0 {
        return std::ptr::null_mut();
    }
    let ptr = if pools::routing() {
        malloc_routed(size, device, stream)
    } else {
        malloc_guarded(size, device, stream)
    };
    if ptr.is_null() {
        throw_last_error();
    }
    ptr
}

/// A request while the pluggable door allocates to a pool: to that pool if the routing
/// rule says so (see [`pools`]), else as usual.
#[cold]
fn malloc_routed(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let route = guard(Err("panic while routing".to_string()), || {
        pools::routed_pool(device, stream_id(stream))
    });
    match route {
        Ok(Some(pool)) => {
            let ptr = pools::streamalloc_malloc_in_pool(size, device, stream, pool.0, pool.1);
            if ptr.is_null() {
                eprintln!("{}", error::last_string());
            }
            ptr
        }
        Ok(None) => malloc_guarded(size, device, stream),
        Err(message) => {
            error::set(&message);
            eprintln!("{message}");
            std::ptr::null_mut()
        }
    }
}

#[inline]
fn malloc_guarded(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        match registry::global().device(device) {
            Ok(allocator) => match allocator.malloc(size as u64, stream_id(stream)) {
                Ok(block) => block.ptr.0 as usize as *mut c_void,
                Err(err) => {
                    malloc_failed(device, &err);
                    std::ptr::null_mut()
                }
            },
            Err(err) => {
                unavailable(device, err);
                std::ptr::null_mut()
            }
        }
    })
}

/// Returns `ptr` (PyTorch's pluggable `free`). `size` and `stream` are ignored: the
/// engine knows both. A null `ptr` is ignored. A negative `device` means whichever device
/// handed `ptr` out (a deleter that knows only the pointer).
#[no_mangle]
pub extern "C" fn streamalloc_free(
    ptr: *mut c_void,
    _size: usize,
    device: c_int,
    _stream: *mut c_void,
) {
    error::clear();
    if ptr.is_null() {
        return;
    }
    guard((), || {
        match registry::global().free(DevicePtr(ptr as usize as u64), device) {
            Ok(Freed::Here) => {}
            Ok(Freed::OnDevice(_)) if device < 0 => {}
            Ok(Freed::OnDevice(owner)) => warn_once(
                Once::WrongDevice,
                format_args!("free of {ptr:p} named device {device}, but it belongs to device {owner}; freed there"),
            ),
            Err(err @ AllocError::UnknownPointer(_)) => {
                error::set(&err);
                warn_once(Once::InvalidFree, format_args!("free on device {device}: {err}"));
            }
            Err(err) => {
                error::set(&err);
                eprintln!("streamalloc: free of {ptr:p} on device {device}: {err}");
            }
        }
    })
}

/// Notes that `stream` uses `ptr` (PyTorch's `record_stream`): its reuse after the free
/// will be ordered after the work `stream` has queued by then.
#[no_mangle]
pub extern "C" fn streamalloc_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    error::clear();
    if ptr.is_null() {
        return;
    }
    guard((), || {
        if let Err(err) =
            registry::global().record_use(DevicePtr(ptr as usize as u64), stream_id(stream))
        {
            error::set(&err);
            warn_once(
                Once::UnknownRecordStream,
                format_args!("record_stream: {err}"),
            );
        }
    })
}

/// Synchronises each device in use and returns its wholly free segments to the driver
/// (PyTorch's `empty_cache`).
#[no_mangle]
pub extern "C" fn streamalloc_empty_cache() {
    error::clear();
    guard((), || {
        for (device, allocator) in registry::global().initialized() {
            if let Err(err) = allocator.empty_cache() {
                error::set(format_args!(
                    "streamalloc: empty_cache on device {device}: {err}"
                ));
                eprintln!("streamalloc: empty_cache on device {device}: {err}");
            }
        }
    })
}

/// Limits the memory reserved on `device` to `fraction` of its total (PyTorch's
/// `set_per_process_memory_fraction`). A fraction outside (0, 1] is refused.
#[no_mangle]
pub extern "C" fn streamalloc_set_memory_fraction(fraction: f64, device: c_int) {
    error::clear();
    guard((), || {
        if let Err(message) = set_memory_fraction(fraction, device) {
            error::set(&message);
            eprintln!("{message}");
        }
    })
}

fn set_memory_fraction(fraction: f64, device: c_int) -> Result<(), String> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(format!(
            "streamalloc: memory fraction {fraction} is not in (0, 1]"
        ));
    }
    let allocator = registry::global()
        .device(device)
        .map_err(|err| format!("streamalloc: device {device}: {err}"))?;
    use streamalloc_allocator::Backend;
    let total = allocator
        .backend()
        .total_memory()
        .map_err(|err| format!("streamalloc: {err}"))?;
    allocator
        .set_memory_limit(Some((total as f64 * fraction) as u64))
        .map_err(|err| format!("streamalloc: set_memory_fraction on device {device}: {err}"))
}

/// Sets every peak counter of `device` to its current value. Returns 0, or -1 if the
/// device is unavailable.
#[no_mangle]
pub extern "C" fn streamalloc_reset_peak_stats(device: c_int) -> c_int {
    error::clear();
    guard(-1, || match registry::global().device(device) {
        Ok(allocator) => {
            allocator.reset_peak_stats();
            0
        }
        Err(err) => {
            unavailable(device, err);
            -1
        }
    })
}

/// Writes `device`'s snapshot (segments, blocks, trace ring, stats, configuration) as
/// JSON to `path`. Returns 0, or -1 with the reason in `streamalloc_last_error`.
///
/// # Safety
/// `path` must be null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_dump_snapshot(path: *const c_char, device: c_int) -> c_int {
    error::clear();
    if path.is_null() {
        error::set("streamalloc_dump_snapshot: path is null");
        return -1;
    }
    // SAFETY: the caller passes a valid NUL-terminated string (see # Safety).
    let path = unsafe { CStr::from_ptr(path) }
        .to_string_lossy()
        .into_owned();
    guard(-1, || match dump_snapshot(&path, device) {
        Ok(()) => 0,
        Err(message) => {
            error::set(message);
            -1
        }
    })
}

fn dump_snapshot(path: &str, device: c_int) -> Result<(), String> {
    let allocator = registry::global()
        .device(device)
        .map_err(|err| format!("streamalloc: device {device}: {err}"))?;
    let snapshot = allocator.snapshot();
    let file = std::fs::File::create(path)
        .map_err(|err| format!("streamalloc: cannot create snapshot file {path}: {err}"))?;
    let mut writer = std::io::BufWriter::new(file);
    serde_json::to_writer(&mut writer, &snapshot)
        .map_err(|err| format!("streamalloc: writing snapshot {path}: {err}"))?;
    use std::io::Write;
    writer
        .flush()
        .map_err(|err| format!("streamalloc: writing snapshot {path}: {err}"))
}

/// The message of the previous call on this thread if it failed, "" if it succeeded. The
/// pointer stays valid until the next call on the same thread.
#[no_mangle]
pub extern "C" fn streamalloc_last_error() -> *const c_char {
    error::last()
}

/// The library's version, e.g. "0.1.0" (a static string).
#[no_mangle]
pub extern "C" fn streamalloc_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
