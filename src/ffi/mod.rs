//! The C ABI of `libstreamalloc.so`: PyTorch's pluggable-allocator hooks and a small C API.
//!
//! Each export `streamalloc_X(args)` is a thin wrapper: `X(registry::global(), args)`, where
//! `X` is generic over the registry's backend. So the very code C reaches runs on
//! simulated devices too (`Registry::simulated`): the misuse tests and the `c_abi` fuzz
//! target drive it there. Every call goes through [`error::call`] (the last error cleared
//! on entry, no panic across the boundary) and every engine call through the registry's
//! `Device::run` (a panic inside makes that device unusable, see [`crate::registry`]). No
//! policy lives here: which pool a request goes to, where its segments come from and what
//! serves it at out-of-memory are the registry's (`registry::Device`); an export checks
//! its C arguments, calls the registry and translates the answer.
//! Failures are a null pointer or a negative return code, with the message in
//! `streamalloc_last_error()`.
//!
//! ```c
//! void* streamalloc_malloc(size_t size, int device, cudaStream_t stream);
//! void  streamalloc_set_error_thrower(void (*thrower)(const char*, const char*, uint32_t, const char*));
//! void  streamalloc_free(void* ptr, size_t size, int device, cudaStream_t stream);
//! void  streamalloc_record_stream(void* ptr, cudaStream_t stream);
//! int   streamalloc_stream_volatile(int device, cudaStream_t stream);
//! void  streamalloc_empty_cache(void);
//! void  streamalloc_set_memory_fraction(double fraction, int device);
//! int   streamalloc_get_stats(int device, streamalloc_stats_t* out);
//! const char* streamalloc_stats_json(int device);
//! int   streamalloc_reset_peak_stats(int device);
//! int   streamalloc_dump_snapshot(const char* path, int device);
//! const char* streamalloc_last_error(void);
//! ```
//!
//! Memory pools are in [`pools`] and [`pool_rules`], looking inside in [`introspect`],
//! sleep and wake of tagged pools in
//! [`sleep`], counters in [`stats`], CUDA IPC of
//! expandable-segment memory (`streamalloc_ipc_*`, CUDA only) in [`ipc`], the p2p planner
//! in [`p2p`], the structs shared with C in [`layout`].
//!
//! The first four are exactly the function types PyTorch's `CUDAPluggableAllocator`
//! stores (`malloc`, `free`, `set_record_stream_fn`, `set_reset_fn`,
//! `set_memory_fraction_fn`). `size_t` and PyTorch's `ssize_t` share one ABI.
//!
//! # Misuse
//! Freeing a pointer streamalloc did not hand out (or already freed) is reported on stderr
//! once and counted (`invalid_frees`); naming the wrong device is served on the right one,
//! reported once and not counted. Neither ever crashes or touches memory.
//!
//! # Cost
//! `malloc`/`free` (and the native door's `streamalloc_malloc_in_pool`) do one registry
//! lookup (an array index and an atomic load, then the device's poison flag), then the
//! request's way through the registry (for the default pool, one load of the routing state
//! and the engine's fast path) under the device's one guard (`Device::run`, which no panic
//! leaves); clearing the last error is one load of a process-wide flag until some thread
//! has set one. Nothing allocates or formats unless something fails, and every failure,
//! like every call that must create a device or look for a pointer's owner, goes to an
//! out-of-line path under the full guard.

pub mod error;
pub mod introspect;
pub mod ipc;
pub mod ipc_handle;
pub mod layout;
pub mod p2p;
pub mod pool_rules;
pub mod pools;
pub mod sleep;
pub mod stats;
/// The C ABI's fuzz harness (feature `testing`): not part of the library's API.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use self::error::{warn_once, Once};
use crate::registry::{self, CallError, DeviceError, Freed, Registry};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt::Display;
use std::sync::atomic::{AtomicUsize, Ordering};
use streamalloc_allocator::{AllocError, Allocator, Backend, DevicePtr, StreamId};

pub use self::stats::StreamallocStats;

#[inline]
fn stream_id(stream: *mut c_void) -> StreamId {
    StreamId(stream as usize as u64)
}

/// Sets `message` as the last error and returns `fallback`.
#[cold]
pub(crate) fn fail<T>(fallback: T, message: impl Display) -> T {
    error::set(message);
    fallback
}

/// Runs `body` on `device`'s allocator (created on first use) through `Device::run`; an
/// unavailable or poisoned device becomes its message.
#[inline]
pub(crate) fn on_device<B: Backend, T>(
    registry: &Registry<B>,
    device: c_int,
    body: impl FnOnce(&Allocator<B>) -> Result<T, String>,
) -> Result<T, String> {
    registry
        .device(device)
        .and_then(|d| d.run(body))
        .map_err(|err| error::unavailable_message(device, &err))?
}

/// One C call on `device` ([`error::call`] around [`on_device`]): an `Err` becomes
/// `fallback` plus the message.
#[inline]
pub(crate) fn device_call<B: Backend, T: Copy>(
    registry: &Registry<B>,
    device: c_int,
    fallback: T,
    body: impl FnOnce(&Allocator<B>) -> Result<T, String>,
) -> T {
    error::call(fallback, || {
        on_device(registry, device, body).unwrap_or_else(|message| fail(fallback, message))
    })
}

/// The value of a registry call, or, for its error, `fallback` plus the message.
#[inline]
pub(crate) fn or_fail<T>(fallback: T, result: Result<T, DeviceError>) -> T {
    result.unwrap_or_else(|err| fail(fallback, format_args!("streamalloc: {err}")))
}

/// The engine's error on `device`, as a C caller reads it.
#[cold]
pub(crate) fn engine_message(device: c_int, err: AllocError) -> String {
    format!("streamalloc: device {device}: {err}")
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
/// `RuntimeError` carrying our report, begun as PyTorch's are ([`OUT_OF_MEMORY_PREFIX`]).
///
/// # Safety
/// `thrower` must be null or a function of the [`ErrorThrower`] type that unwinds with a
/// foreign (e.g. C++) exception or returns; it is called from the allocating thread.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_set_error_thrower(thrower: Option<ErrorThrower>) {
    error::call((), || {
        THROWER.store(thrower.map_or(0, |f| f as usize), Ordering::Release);
    })
}

/// How PyTorch's out-of-memory errors begin, and so how ours raised through the thrower do.
pub const OUT_OF_MEMORY_PREFIX: &str = "CUDA out of memory. ";

/// An out-of-memory report worded as PyTorch's own begin (`None` for other errors):
/// programs that catch an out-of-memory to retry with less (batch size finders) look for
/// that text in the `RuntimeError`.
fn worded_as_pytorch(message: &str) -> Option<String> {
    (message.contains("out of memory") && !message.starts_with(OUT_OF_MEMORY_PREFIX))
        .then(|| format!("{OUT_OF_MEMORY_PREFIX}{message}"))
}

/// Hands this thread's last error to the registered thrower, if any.
#[cold]
#[inline(never)]
fn throw_last_error() {
    let raw = THROWER.load(Ordering::Acquire);
    if raw != 0 {
        if let Some(worded) = worded_as_pytorch(&error::last_string()) {
            error::set(worded);
        }
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
    let ptr = malloc(registry::global(), size, device, stream);
    if ptr.is_null() && size != 0 {
        // Outside the guard: the thrower unwinds with a foreign exception.
        throw_last_error();
    }
    ptr
}

/// [`streamalloc_malloc`] on `registry`, without the thrower. Where the memory comes from
/// is the registry's to say (`registry::Device`); this translates.
#[inline]
pub fn malloc<B: Backend>(
    registry: &Registry<B>,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // Nothing here can panic: the registry contains panics in creating a device and in
    // the request's way through it (route, source, engine, fallback), and the report of a
    // failure guards itself.
    error::clear();
    if size == 0 {
        return std::ptr::null_mut();
    }
    let Some(on) = registry.get(device) else {
        // A device not in use yet (created now) or unusable: the registry's whole way.
        return match registry.malloc(device, size as u64, stream_id(stream)) {
            Ok(block) => block.ptr.0 as usize as *mut c_void,
            Err(err) => error::malloc_failed(&err),
        };
    };
    // The fast path, a device in use: no error is built unless the request fails.
    match on.malloc_ptr(size as u64, stream_id(stream)) {
        Ok(ptr) => ptr.0 as usize as *mut c_void,
        Err(error) => error::malloc_failed(&DeviceError {
            ordinal: device,
            error: *error,
        }),
    }
}

/// Reports a failure found on a fast path under the guard: its messages are formatted.
#[cold]
#[inline(never)]
pub(crate) fn guarded<T>(on_panic: T, report: impl FnOnce() -> T) -> T {
    error::call(on_panic, report)
}

/// Returns `ptr` (PyTorch's pluggable `free`). `size` and `stream` are ignored: the
/// engine knows both. A null `ptr` is ignored. A negative `device` means whichever device
/// handed `ptr` out (a deleter that knows only the pointer).
#[no_mangle]
pub extern "C" fn streamalloc_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    free(registry::global(), ptr, size, device, stream)
}

/// [`streamalloc_free`] on `registry`.
#[inline]
pub fn free<B: Backend>(
    registry: &Registry<B>,
    ptr: *mut c_void,
    _size: usize,
    device: c_int,
    _stream: *mut c_void,
) {
    // The fast path: the pointer can only be one device's (the one named, or the only one
    // when none is named). Nothing in it can panic but the engine, which `Device::run`
    // guards.
    error::clear();
    if ptr.is_null() {
        return;
    }
    let address = DevicePtr(ptr as usize as u64);
    if let Some(owner) = registry.sole_device(device) {
        match owner.run_boxed(|allocator| allocator.free_if_owned(address)) {
            Ok(true) => {}
            Ok(false) => free_guarded(registry, ptr, device),
            Err(err) => guarded((), || report_free(ptr, device, Err(*err))),
        }
        return;
    }
    free_guarded(registry, ptr, device)
}

/// [`free`] in full: the pointer's owner looked for among the devices, a pointer nobody
/// owns counted.
#[cold]
#[inline(never)]
fn free_guarded<B: Backend>(registry: &Registry<B>, ptr: *mut c_void, device: c_int) {
    error::call((), || {
        report_free(
            ptr,
            device,
            registry.free(DevicePtr(ptr as usize as u64), device),
        )
    })
}

/// Tells the caller where a free went: silently for its device, or once per kind of
/// misuse, and the last error on failure.
fn report_free(ptr: *mut c_void, device: c_int, freed: Result<Freed, CallError>) {
    {
        match freed {
            Ok(Freed::Here) => {}
            Ok(Freed::OnDevice(_)) if device < 0 => {}
            Ok(Freed::OnDevice(owner)) => warn_once(
                Once::WrongDevice,
                format_args!("free of {ptr:p} named device {device}, but it belongs to device {owner}; freed there"),
            ),
            Err(CallError::Engine(err @ AllocError::UnknownPointer(_))) => {
                error::set(&err);
                warn_once(Once::InvalidFree, format_args!("free on device {device}: {err}"));
            }
            Err(CallError::Unavailable(err)) => error::unavailable(device, &err),
            Err(CallError::Engine(err)) => {
                error::set(&err);
                eprintln!("streamalloc: free of {ptr:p} on device {device}: {err}");
            }
        }
    }
}

/// Notes that `stream` uses `ptr` (PyTorch's `record_stream`): its reuse after the free
/// will be ordered after the work `stream` has queued by then.
#[no_mangle]
pub extern "C" fn streamalloc_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    record_stream(registry::global(), ptr, stream)
}

/// [`streamalloc_record_stream`] on `registry`.
pub fn record_stream<B: Backend>(registry: &Registry<B>, ptr: *mut c_void, stream: *mut c_void) {
    error::call((), || {
        if ptr.is_null() {
            return;
        }
        if let Err(err) = registry.record_use(DevicePtr(ptr as usize as u64), stream_id(stream)) {
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
    empty_cache(registry::global())
}

/// [`streamalloc_empty_cache`] on `registry`.
pub fn empty_cache<B: Backend>(registry: &Registry<B>) {
    error::call((), || {
        for device in registry.initialized() {
            let ordinal = device.ordinal();
            match device.run(|allocator| allocator.empty_cache()) {
                Ok(Ok(_)) => {}
                Ok(Err(err)) => {
                    error::set(format_args!(
                        "streamalloc: empty_cache on device {ordinal}: {err}"
                    ));
                    eprintln!("streamalloc: empty_cache on device {ordinal}: {err}");
                }
                Err(err) => error::unavailable(ordinal, &err),
            }
        }
    })
}

/// Limits the memory reserved on `device` to `fraction` of its total (PyTorch's
/// `set_per_process_memory_fraction`). A fraction outside (0, 1] is refused.
#[no_mangle]
pub extern "C" fn streamalloc_set_memory_fraction(fraction: f64, device: c_int) {
    set_memory_fraction(registry::global(), fraction, device)
}

/// [`streamalloc_set_memory_fraction`] on `registry`.
pub fn set_memory_fraction<B: Backend>(registry: &Registry<B>, fraction: f64, device: c_int) {
    error::call((), || {
        let set = if fraction > 0.0 && fraction <= 1.0 {
            on_device(registry, device, |allocator| {
                let total = allocator
                    .backend()
                    .total_memory()
                    .map_err(|err| format!("streamalloc: {err}"))?;
                allocator
                    .set_memory_limit(Some((total as f64 * fraction) as u64))
                    .map_err(|err| {
                        format!("streamalloc: set_memory_fraction on device {device}: {err}")
                    })
            })
        } else {
            Err(format!(
                "streamalloc: memory fraction {fraction} is not in (0, 1]"
            ))
        };
        if let Err(message) = set {
            // Callers may retry on every step: the first failure is printed, later ones
            // only logged, and each is the last error for `streamalloc_last_error`.
            static REPORTED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if REPORTED.swap(true, Ordering::Relaxed) {
                tracing::debug!(%message, "set_memory_fraction failed");
            } else {
                tracing::warn!(%message, "set_memory_fraction failed");
                eprintln!("{message} (reported once; later failures only through tracing)");
            }
            error::set(message);
        }
    })
}

/// Sets every peak counter of `device` to its current value. Returns 0, or -1 if the
/// device is unavailable.
#[no_mangle]
pub extern "C" fn streamalloc_reset_peak_stats(device: c_int) -> c_int {
    reset_peak_stats(registry::global(), device)
}

/// [`streamalloc_reset_peak_stats`] on `registry`.
pub fn reset_peak_stats<B: Backend>(registry: &Registry<B>, device: c_int) -> c_int {
    device_call(registry, device, -1, |allocator| {
        allocator.reset_peak_stats();
        Ok(0)
    })
}

/// Marks `stream` of `device` as one its owner may destroy while blocks freed on it are
/// cached (a library's stream under PyTorch's `ExternalStream`, a stream a CUDA program
/// creates): each free on it records its fence at once and no later call names it.
/// PyTorch's pooled streams need no mark. Returns 0, or -1 with the reason in
/// `streamalloc_last_error`.
#[no_mangle]
pub extern "C" fn streamalloc_stream_volatile(device: c_int, stream: *mut c_void) -> c_int {
    stream_volatile(registry::global(), device, stream)
}

/// [`streamalloc_stream_volatile`] on `registry`.
pub fn stream_volatile<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    device_call(registry, device, -1, |allocator| {
        allocator.mark_stream_volatile(stream_id(stream));
        Ok(0)
    })
}

/// Writes `device`'s snapshot (segments, blocks, trace ring, stats, configuration) as
/// JSON to `path`. Returns 0, or -1 with the reason in `streamalloc_last_error`.
///
/// # Safety
/// `path` must be null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_dump_snapshot(path: *const c_char, device: c_int) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { dump_snapshot(registry::global(), path, device) }
}

/// [`streamalloc_dump_snapshot`] on `registry`.
///
/// # Safety
/// As [`streamalloc_dump_snapshot`].
pub unsafe fn dump_snapshot<B: Backend>(
    registry: &Registry<B>,
    path: *const c_char,
    device: c_int,
) -> c_int {
    error::call(-1, || {
        if path.is_null() {
            return fail(-1, "streamalloc_dump_snapshot: path is null");
        }
        // SAFETY: the caller passes a valid NUL-terminated string (see # Safety).
        let path = unsafe { CStr::from_ptr(path) }
            .to_string_lossy()
            .into_owned();
        let snapshot = match on_device(registry, device, |allocator| Ok(allocator.snapshot())) {
            Ok(snapshot) => snapshot,
            Err(message) => return fail(-1, message),
        };
        match write_json(&path, &snapshot) {
            Ok(()) => 0,
            Err(message) => fail(-1, message),
        }
    })
}

/// Copies `items` into `out` (room for `capacity`) and returns how many there are.
///
/// # Safety
/// `out` must be null or writable for `capacity` elements.
pub(crate) unsafe fn copy_out<T: Copy>(items: &[T], out: *mut T, capacity: usize) -> i64 {
    if !out.is_null() {
        let count = items.len().min(capacity);
        // SAFETY: `out` is writable for `capacity >= count` elements (see # Safety), and
        // `items` cannot overlap memory the caller owns.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, count) };
    }
    items.len() as i64
}

/// Writes `value` as JSON to the file `path`, by the rule of every output
/// ([`streamalloc_viz::output`]): a regular file (or a new one), written whole beside it and
/// renamed, so that a failure midway leaves an existing file as it was.
pub(crate) fn write_json(path: &str, value: &impl serde::Serialize) -> Result<(), String> {
    streamalloc_viz::output::write_whole(std::path::Path::new(path), |out| {
        serde_json::to_writer(out, value).map_err(|err| streamalloc_viz::VizError::Write {
            path: path.into(),
            what: err.to_string(),
        })
    })
    .map_err(|err| format!("streamalloc: cannot write snapshot {err}"))
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
    // Like every call, it clears the last error.
    let version: *const c_char = concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast();
    error::call(version, || version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_raised_through_the_thrower_reads_as_pytorch_s() {
        let report =
            "streamalloc: device 1: out of memory: tried to allocate 27.96 GiB on stream:0x0";
        let worded = worded_as_pytorch(report).expect("an out-of-memory is reworded");
        // What batch size finders (accelerate, Lightning) look for.
        assert!(worded.contains("CUDA out of memory."), "{worded}");
        assert!(
            worded.ends_with(report),
            "our report is kept whole: {worded}"
        );
        assert_eq!(worded_as_pytorch(&worded), None, "worded once");
        assert_eq!(
            worded_as_pytorch("streamalloc: device 3 unavailable: no such device"),
            None,
            "other failures keep their own words"
        );
    }
}
