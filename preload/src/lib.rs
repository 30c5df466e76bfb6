//! # libstreamalloc_preload.so
//!
//! An `LD_PRELOAD` interposer that serves a program's `cudaMalloc`, `cudaFree`,
//! `cudaMallocAsync` and `cudaFreeAsync` from streamalloc, without rebuilding the
//! program. It reaches programs that call the **shared** CUDA runtime (`libcudart.so`):
//! CUDA C built with `nvcc -cudart shared`, CuPy with its memory pool off, PyTorch with
//! `PYTORCH_NO_CUDA_MEMORY_CACHING=1`.
//!
//! ```sh
//! LD_PRELOAD=/path/to/libstreamalloc_preload.so STREAMALLOC_STATS_AT_EXIT=1 ./my_program
//! streamalloc run --preload --stats -- ./my_program      # the same, found for you
//! ```
//!
//! ## Why a separate library
//! `libstreamalloc.so` is loaded by PyTorch's pluggable-allocator hook, which calls
//! `cudaMalloc` underneath its own users; if that library also defined `cudaMalloc`, any
//! loader that opened it with `RTLD_GLOBAL` would silently reroute every later library's
//! allocations. Interposition is therefore opt-in, in its own file. It links the same
//! engine and registry (one allocator per device), and re-exports the whole C ABI of
//! `libstreamalloc.so` (`streamalloc_stats_json`, `streamalloc_dump_snapshot`, …) so a
//! preloaded program can read its counters. Do not load both libraries into one process:
//! each would have its own registry.
//!
//! ## What each call does
//! - **`cudaMalloc(&p, n)`**: a block from the current device's allocator (`cudaGetDevice`
//!   of the real runtime), tagged with the legacy default stream. `cudaMalloc` memory must
//!   be usable at once from *any* stream, so if serving it made the engine order reuse
//!   behind another stream's work (a block last freed by `cudaFreeAsync` on that stream),
//!   the device is synchronised before the pointer is returned.
//! - **`cudaFree(p)`**: the real `cudaFree` synchronises the device, and callers rely on it
//!   (they free right after launching the last kernel that reads the buffer, on any
//!   stream). The rule kept here is the simplest correct one: **synchronise the device that
//!   owns the block, then return it to the pool**. After that nothing queued on any stream
//!   can still touch it, so it is reusable at once by anyone.
//! - **`cudaMallocAsync(&p, n, s)`**: stream-ordered: a block for stream `s`; reusing a
//!   block of another stream is ordered after that stream's work by a device-side wait
//!   (no host synchronisation), as the engine does for PyTorch.
//! - **`cudaFreeAsync(p, s)`**: stream-ordered: the block's reuse is ordered after the work
//!   queued on `s` up to this call (`record_use(p, s)` then `free`), whichever stream it
//!   was allocated on. No synchronisation.
//! - **Streams being captured** into a CUDA graph (`cudaStreamIsCapturing` of the real
//!   runtime says so, or cannot answer): `cudaMallocAsync` and `cudaFreeAsync` go to the
//!   real functions, which record graph memory nodes. A block of our pool would be handed
//!   out once, at capture, while the graph uses it at every replay, after the program may
//!   have freed it and the pool given it to someone else. A graph allocation is not ours,
//!   so its `cudaFreeAsync`, captured or not, reaches the real function like any other
//!   foreign pointer. Freeing one of *our* blocks on a captured stream is refused with
//!   `cudaErrorStreamCaptureUnsupported` (900) and the block stays allocated: CUDA allows
//!   only graph allocations to be freed in a graph, and our pool cannot free at replay
//!   time.
//! - Pointers streamalloc did not hand out (made before the library loaded, by
//!   `cudaMallocManaged`, `cudaMallocHost`, `cudaMallocPitch`, `cudaMalloc3D`, a pool, …)
//!   go to the real `cudaFree` / `cudaFreeAsync` untouched; those allocation functions
//!   are not interposed at all. `cudaFree(NULL)` is passed to the real runtime (programs
//!   call it to create the context; it returns success). A zero-byte request is passed
//!   to the real runtime too.
//!
//! The real functions come from `dlsym(RTLD_NEXT, …)`, resolved once.
//!
//! ## Errors
//! Every entry point runs through the C ABI's one guard (`streamalloc::ffi::error::call`):
//! no panic crosses into C, and `streamalloc_last_error()` holds the reason for the last
//! failure on the thread ("" after a success). An allocation streamalloc cannot serve
//! returns `cudaErrorMemoryAllocation` (2) with the engine's report on stderr; a null
//! out-pointer or a failed free returns `cudaErrorInvalidValue` (1). If the device's
//! allocator cannot be created at all (no driver, a bad `STREAMALLOC_CONF`), or a panic
//! inside it made it unusable (see `streamalloc::registry`), that is reported once on
//! stderr and the calls pass through to the real runtime, so the program still runs, on
//! CUDA's allocator (frees of blocks the unusable allocator handed out then fail).
//!
//! ## Limits
//! - A statically linked runtime (`nvcc`'s default `-cudart static`) calls its own copy of
//!   `cudaMalloc`, which no preload can reach; nor can calls made through a handle from
//!   `dlopen(..., RTLD_LOCAL)`, or the driver API (`cuMemAlloc`).
//! - The per-thread default stream (`cudaStreamPerThread`) is one handle naming a
//!   different stream in each thread; streamalloc sees one stream. Use explicit streams
//!   with `cudaMallocAsync` across threads. Code compiled with `--default-stream
//!   per-thread` calls `cudaMallocAsync_ptsz` / `cudaFreeAsync_ptsz`, which are not
//!   interposed: those allocations (and their frees) stay CUDA's.
//! - `cudaMemPool*` attributes and `cudaMallocFromPoolAsync` are not interposed.
//!
//! ## Exit hooks
//! With `STREAMALLOC_STATS_AT_EXIT=1` the counters of every device used are printed on
//! stderr at exit; with `STREAMALLOC_SNAPSHOT=PATH` each device's snapshot is written
//! (see `streamalloc::process`).

#![warn(missing_docs, rust_2018_idioms)]

use std::ffi::{c_int, c_void, CStr};
use std::fmt::Display;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Once, OnceLock};
use streamalloc::ffi::error;
use streamalloc::registry::sources::WithSources;
use streamalloc::registry::{self, CudaAllocator, Device};
use streamalloc_allocator::backend::cuda::CudaBackend;
use streamalloc_allocator::backend::Streams;
use streamalloc_allocator::{Config, DevicePtr, StreamId};

/// A device of the process's registry.
type CudaDevice = Device<WithSources<CudaBackend>>;

/// `cudaError_t`.
pub type CudaError = c_int;
/// `cudaSuccess`.
pub const CUDA_SUCCESS: CudaError = 0;
/// `cudaErrorInvalidValue`.
pub const CUDA_ERROR_INVALID_VALUE: CudaError = 1;
/// `cudaErrorMemoryAllocation`.
pub const CUDA_ERROR_MEMORY_ALLOCATION: CudaError = 2;
/// `cudaErrorInitializationError`: the real runtime function could not be found.
pub const CUDA_ERROR_INITIALIZATION: CudaError = 3;
/// `cudaErrorStreamCaptureUnsupported`: freeing one of our blocks inside a capture.
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CudaError = 900;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> CudaError;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> CudaError;
type MallocAsyncFn = unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> CudaError;
type FreeAsyncFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> CudaError;
type GetDeviceFn = unsafe extern "C" fn(*mut c_int) -> CudaError;
type StreamIsCapturingFn = unsafe extern "C" fn(*mut c_void, *mut c_int) -> CudaError;

// ---- The real runtime ----

/// Looks `name` up in the libraries loaded after this one (the real `libcudart.so`).
fn next_symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT is valid from a shared object.
    let found = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if found.is_null() {
        warn_once(
            &MISSING_REAL,
            format_args!(
                "{} not found in the libraries after the preload (is the program linked against libcudart.so?)",
                name.to_string_lossy()
            ),
        );
        None
    } else {
        Some(found)
    }
}

macro_rules! real {
    ($name:ident, $ty:ty, $symbol:literal) => {
        fn $name() -> Option<$ty> {
            static SLOT: OnceLock<Option<usize>> = OnceLock::new();
            let address = (*SLOT.get_or_init(|| next_symbol($symbol).map(|p| p as usize)))?;
            // SAFETY: the address is the runtime's function of this name, whose C
            // signature is `$ty` (CUDA runtime API).
            Some(unsafe { std::mem::transmute::<usize, $ty>(address) })
        }
    };
}

real!(real_malloc, MallocFn, c"cudaMalloc");
real!(real_free, FreeFn, c"cudaFree");
real!(real_malloc_async, MallocAsyncFn, c"cudaMallocAsync");
real!(real_free_async, FreeAsyncFn, c"cudaFreeAsync");
real!(real_get_device, GetDeviceFn, c"cudaGetDevice");
real!(
    real_stream_is_capturing,
    StreamIsCapturingFn,
    c"cudaStreamIsCapturing"
);

// ---- Reporting ----

static MISSING_REAL: AtomicBool = AtomicBool::new(false);
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);
static FAILED_FREE: AtomicBool = AtomicBool::new(false);
static FREE_IN_CAPTURE: AtomicBool = AtomicBool::new(false);

#[cold]
fn warn_once(flag: &AtomicBool, message: std::fmt::Arguments<'_>) {
    if !flag.swap(true, Ordering::Relaxed) {
        eprintln!("streamalloc preload: {message}");
    }
}

extern "C" fn exit_hook() {
    error::call(0, || streamalloc::process::at_exit(registry::global()));
}

/// Registers the exit hook on the first call that reaches the engine (after the runtime
/// initialised, so the hook runs before the runtime's own teardown).
fn register_exit_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registering a plain `extern "C" fn()`; it only reads host state.
        unsafe { libc::atexit(exit_hook) };
    });
}

// ---- Routing ----

/// The current device, or the real runtime's error code. `Ok(None)`: its allocator
/// cannot be created, or a panic made it unusable; the caller passes through.
fn current_device() -> Result<Option<&'static CudaDevice>, CudaError> {
    let get_device = real_get_device().ok_or(CUDA_ERROR_INITIALIZATION)?;
    let mut ordinal: c_int = 0;
    // SAFETY: a valid out pointer for the real cudaGetDevice.
    let code = unsafe { get_device(&mut ordinal) };
    if code != CUDA_SUCCESS {
        return Err(code);
    }
    static DEFAULTS: Once = Once::new();
    DEFAULTS.call_once(|| {
        // Whole segments unless STREAMALLOC_CONF asks otherwise: programs here may hand our
        // pointers to cudaIpcGetMemHandle, which cannot export memory mapped through the
        // VMM API. (An error in STREAMALLOC_CONF is reported by `device` below.)
        let _ = registry::global().config_over(Config {
            expandable_segments: false,
            ..Config::default()
        });
    });
    let device = registry::global().device(ordinal);
    match device.as_ref().map(|device| device.poisoned()) {
        Ok(None) => {
            register_exit_hook();
            Ok(device.ok())
        }
        Ok(Some(err)) | Err(err) => {
            warn_once(
                &UNAVAILABLE,
                format_args!("device {ordinal}: {err}; using CUDA's own allocator"),
            );
            Ok(None)
        }
    }
}

/// The device whose allocator handed out `ptr`, if any.
fn owner(ptr: *mut c_void) -> Option<&'static CudaDevice> {
    let ptr = DevicePtr(ptr as usize as u64);
    registry::global()
        .initialized()
        .find(|device| device.run(|allocator| allocator.owns(ptr)) == Ok(true))
}

/// Whether `stream` may be part of a graph being captured: the real
/// `cudaStreamIsCapturing` reports an active or invalidated capture, or fails (the legacy
/// stream while another stream captures in global mode answers
/// `cudaErrorStreamCaptureImplicit`). Such a stream's stream-ordered calls belong to the
/// real runtime, which records them as graph nodes or returns the right error; a runtime
/// without the function has no graphs to capture.
fn maybe_capturing(stream: *mut c_void) -> bool {
    let Some(is_capturing) = real_stream_is_capturing() else {
        return false;
    };
    // cudaStreamCaptureStatusNone is 0.
    let mut status: c_int = 0;
    // SAFETY: a valid out pointer; `stream` is the caller's handle, passed unchanged.
    let code = unsafe { is_capturing(stream, &mut status) };
    code != CUDA_SUCCESS || status != 0
}

/// Reports a failure: the message on stderr and as the last error, and `code`.
#[cold]
fn failed(code: CudaError, message: impl Display) -> CudaError {
    let message = format!("streamalloc preload: {message}");
    eprintln!("{message}");
    error::set(message);
    code
}

/// Refuses a call with `cudaErrorInvalidValue`, the reason only in the last error (as the
/// runtime, which prints nothing).
#[cold]
fn refused(message: &str) -> CudaError {
    error::set(format_args!("streamalloc preload: {message}"));
    CUDA_ERROR_INVALID_VALUE
}

/// Serves an allocation of `size` bytes for `stream` (`None`: `cudaMalloc`, usable from
/// any stream at once).
///
/// # Safety
/// `dev_ptr` is non-null and writable.
unsafe fn allocate(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: Option<*mut c_void>,
    device: &CudaDevice,
) -> CudaError {
    let served = device.run(|allocator| serve(allocator, size, stream));
    match served {
        Ok(Ok(ptr)) => {
            // SAFETY: non-null and writable (see # Safety).
            unsafe { dev_ptr.write(ptr as usize as *mut c_void) };
            CUDA_SUCCESS
        }
        Ok(Err(message)) => failed(CUDA_ERROR_MEMORY_ALLOCATION, message),
        Err(err) => failed(CUDA_ERROR_MEMORY_ALLOCATION, err),
    }
}

/// The largest of the runtime's stream handles that name no stream of the program:
/// `0` (the legacy default stream), `cudaStreamLegacy` (1), `cudaStreamPerThread` (2).
const CUDA_STREAM_PER_THREAD: u64 = 2;

/// A block of `size` bytes for `stream` (see [`allocate`]).
fn serve(
    allocator: &CudaAllocator,
    size: usize,
    stream: Option<*mut c_void>,
) -> Result<u64, String> {
    let tag = StreamId(stream.map_or(0, |s| s as usize as u64));
    if tag.0 > CUDA_STREAM_PER_THREAD {
        // A stream the program made: it may destroy it while blocks freed on it are
        // cached, so the engine must not name it later (each free fences itself).
        allocator.mark_stream_volatile(tag);
    }
    let waits_before = stream
        .is_none()
        .then(|| allocator.stats().cross_stream_waits);
    let block = allocator
        .malloc(size as u64, tag)
        .map_err(|err| err.to_string())?;
    if let Some(before) = waits_before {
        if allocator.stats().cross_stream_waits != before {
            // Reuse was ordered on the device behind another stream's work; a cudaMalloc
            // caller may use the block on any stream right away.
            if let Err(err) = allocator.backend().synchronize_device() {
                let _ = allocator.free(block.ptr);
                return Err(format!("synchronising before reuse: {err}"));
            }
        }
    }
    Ok(block.ptr.0)
}

fn free_failed(ptr: *mut c_void, err: &dyn Display) -> CudaError {
    let message = format!("streamalloc preload: free of {ptr:p}: {err}");
    warn_once(&FAILED_FREE, format_args!("free of {ptr:p}: {err}"));
    error::set(message);
    CUDA_ERROR_INVALID_VALUE
}

// ---- The interposed functions ----

/// `cudaError_t cudaMalloc(void** devPtr, size_t size)`, served by streamalloc.
///
/// # Safety
/// As the CUDA runtime's: `dev_ptr` is null (rejected) or writable.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> CudaError {
    error::call(CUDA_ERROR_MEMORY_ALLOCATION, || {
        if dev_ptr.is_null() {
            return refused("cudaMalloc: devPtr is null");
        }
        match current_device() {
            Ok(Some(device)) if size > 0 => {
                // SAFETY: checked non-null above; writable per the caller's contract.
                unsafe { allocate(dev_ptr, size, None, device) }
            }
            Ok(_) => match real_malloc() {
                // SAFETY: forwarding the caller's arguments unchanged.
                Some(real) => unsafe { real(dev_ptr, size) },
                None => CUDA_ERROR_INITIALIZATION,
            },
            Err(code) => code,
        }
    })
}

/// `cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t stream)`,
/// served by streamalloc in stream order, or by the real function on a stream being
/// captured.
///
/// # Safety
/// As the CUDA runtime's: `dev_ptr` is null (rejected) or writable; `stream` is a valid
/// stream handle of the current device, or 0.
#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: *mut c_void,
) -> CudaError {
    error::call(CUDA_ERROR_MEMORY_ALLOCATION, || {
        if dev_ptr.is_null() {
            return refused("cudaMallocAsync: devPtr is null");
        }
        match current_device() {
            Ok(Some(device)) if size > 0 && !maybe_capturing(stream) => {
                // SAFETY: checked non-null above; writable per the caller's contract.
                unsafe { allocate(dev_ptr, size, Some(stream), device) }
            }
            // Captured streams get a graph allocation from the real runtime.
            Ok(_) => match real_malloc_async() {
                // SAFETY: forwarding the caller's arguments unchanged.
                Some(real) => unsafe { real(dev_ptr, size, stream) },
                None => CUDA_ERROR_INITIALIZATION,
            },
            Err(code) => code,
        }
    })
}

/// `cudaError_t cudaFree(void* devPtr)`: our blocks are returned after synchronising
/// their device (as the real `cudaFree` does); anything else goes to the real function.
///
/// # Safety
/// As the CUDA runtime's.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> CudaError {
    error::call(CUDA_ERROR_INVALID_VALUE, || {
        let ours = if ptr.is_null() { None } else { owner(ptr) };
        let Some(device) = ours else {
            return match real_free() {
                // SAFETY: forwarding the caller's pointer, which is not ours.
                Some(real) => unsafe { real(ptr) },
                None => CUDA_ERROR_INITIALIZATION,
            };
        };
        let freed = device.run(|allocator| {
            allocator
                .backend()
                .synchronize_device()
                .map_err(|err| err.to_string())?;
            allocator
                .free(DevicePtr(ptr as usize as u64))
                .map_err(|err| err.to_string())
        });
        match freed {
            Ok(Ok(())) => CUDA_SUCCESS,
            Ok(Err(message)) => free_failed(ptr, &message),
            Err(err) => free_failed(ptr, &err),
        }
    })
}

/// `cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t stream)`: our blocks become
/// reusable after the work queued on `stream` so far (refused on a stream being
/// captured); anything else, graph allocations included, goes to the real function.
///
/// # Safety
/// As the CUDA runtime's.
#[no_mangle]
pub unsafe extern "C" fn cudaFreeAsync(ptr: *mut c_void, stream: *mut c_void) -> CudaError {
    error::call(CUDA_ERROR_INVALID_VALUE, || {
        let ours = if ptr.is_null() { None } else { owner(ptr) };
        let Some(device) = ours else {
            return match real_free_async() {
                // SAFETY: forwarding the caller's arguments; the pointer is not ours.
                Some(real) => unsafe { real(ptr, stream) },
                None => CUDA_ERROR_INITIALIZATION,
            };
        };
        if maybe_capturing(stream) {
            // The free would happen at each replay, which our pool cannot follow; CUDA
            // itself frees only graph allocations inside a graph. The block stays ours
            // and allocated, so nothing can reuse it under the graph.
            let message = format!(
                "cudaFreeAsync({ptr:p}) on a stream being captured: the block was not allocated in the graph; refused (free it outside the capture)"
            );
            warn_once(&FREE_IN_CAPTURE, format_args!("{message}"));
            error::set(message);
            return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
        let block = DevicePtr(ptr as usize as u64);
        let freed = device.run(|allocator| {
            allocator
                .record_use(block, StreamId(stream as usize as u64))
                .and_then(|()| allocator.free(block))
        });
        match freed {
            Ok(Ok(())) => CUDA_SUCCESS,
            Ok(Err(err)) => free_failed(ptr, &err),
            Err(err) => free_failed(ptr, &err),
        }
    })
}

/// `int streamalloc_preload_active(void)`: 1. Lets a program check with
/// `dlsym(RTLD_DEFAULT, "streamalloc_preload_active")` that the interposer is loaded.
#[no_mangle]
pub extern "C" fn streamalloc_preload_active() -> c_int {
    error::call(1, || 1)
}
