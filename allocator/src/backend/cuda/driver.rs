//! Loading the CUDA driver without ever panicking.
//!
//! cudarc's `dynamic-loading` resolves `libcuda` and each symbol on first use and panics
//! when either is missing. Every entry into the driver therefore goes through [`load`]
//! first: it probes the library with cudarc's non-panicking `is_culib_present`, resolves
//! every symbol the backend uses (inside `catch_unwind`, as a second guard), and calls
//! `cuInit` — once per process. Afterwards the symbols are known to exist, so the lazy
//! lookups in `cudarc::driver::sys` cannot panic.
//!
//! The rest of the backend calls `sys` directly and turns `CUresult`s into
//! [`BackendError`]s with [`check`].

use crate::error::BackendError;
use cudarc::driver::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

/// Every driver symbol the backend (and the GPU test program) calls, under the names
/// cudarc's loader asks `dlsym` for.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuStreamIsCapturing",
    "cuThreadExchangeStreamCaptureMode",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuMemsetD8Async",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphDestroy",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
];

/// Why the driver could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// No `libcuda` could be opened.
    #[error("the CUDA driver (libcuda.so) could not be loaded: no NVIDIA driver on this machine, or it is not on the library path")]
    NotFound,
    /// The library lacks a symbol the backend needs (a driver older than CUDA 12).
    #[error("the CUDA driver lacks `{0}`: it is too old for streamalloc")]
    MissingSymbol(String),
    /// `cuInit` failed (for example, no device visible).
    #[error("cuInit failed: {0}")]
    Init(String),
}

/// Loads and initialises the driver once; later calls return the first answer.
pub fn load() -> Result<(), DriverError> {
    static LOADED: OnceLock<Result<(), DriverError>> = OnceLock::new();
    LOADED.get_or_init(load_uncached).clone()
}

fn load_uncached() -> Result<(), DriverError> {
    // SAFETY: `is_culib_present` only calls `dlopen`/`dlclose` on candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(DriverError::NotFound);
    }
    let probed = std::panic::catch_unwind(|| {
        // SAFETY: the library is present (checked above), so `culib` opens it instead of
        // panicking; `get` only looks a symbol up.
        let lib = unsafe { sys::culib() };
        for name in SYMBOLS {
            // SAFETY: the symbol is looked up, never called, through this pointer type.
            if unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err() {
                return Err(DriverError::MissingSymbol((*name).to_string()));
            }
        }
        Ok(())
    });
    probed.unwrap_or(Err(DriverError::NotFound))?;
    // SAFETY: every symbol exists; cuInit(0) has no preconditions.
    let code = unsafe { sys::cuInit(0) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(DriverError::Init(describe(code)));
    }
    Ok(())
}

/// `CUDA_ERROR_X: message` for a result code. Only called once the driver is loaded.
pub fn describe(code: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls write a pointer to a static string (or leave it null on an
    // unknown code); the driver is loaded whenever a CUresult exists to describe.
    unsafe {
        sys::cuGetErrorName(code, &mut name);
        sys::cuGetErrorString(code, &mut text);
    }
    let read = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{code:?}")
        } else {
            // SAFETY: non-null pointers from the driver are static NUL-terminated strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{}: {}", read(name), read(text))
}

/// `Ok` for `CUDA_SUCCESS`, otherwise a [`BackendError`] for `operation` (an
/// out-of-memory one for `CUDA_ERROR_OUT_OF_MEMORY`).
#[inline]
pub fn check(code: sys::CUresult, operation: &'static str) -> Result<(), BackendError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(failure(code, operation))
    }
}

#[cold]
#[inline(never)]
fn failure(code: sys::CUresult, operation: &'static str) -> BackendError {
    if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        BackendError::out_of_memory(operation, describe(code))
    } else {
        BackendError::new(operation, describe(code))
    }
}
