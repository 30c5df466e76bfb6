//! The one door to run-time loaded NVIDIA libraries: loading them without ever panicking,
//! and turning their result codes into errors.
//!
//! cudarc's `dynamic-loading` resolves a library and each symbol on first use and panics
//! when either is missing. Every library this workspace calls (the CUDA driver here, NCCL
//! in `streamalloc-p2p`) is therefore probed once by [`probe_library`] before any call: it
//! asks cudarc's non-panicking `is_culib_present`, then resolves every symbol the caller
//! uses (inside `catch_unwind`, as a second guard). Afterwards the symbols are known to
//! exist, so cudarc's lazy lookups cannot panic. A failure is a [`LibraryError`] naming
//! the library and, where one is missing, the symbol.
//!
//! Result codes go through one thin layer, [`Status`]: `check(code)` is `Ok` on success and
//! otherwise carries the code, which the library itself describes. The `unsafe` calls that
//! ask a library for its error text live here (and in each library's [`Status`] impl)
//! only.
//!
//! For the driver, [`load`] probes `libcuda` and calls `cuInit`, once per process; the
//! backend then calls `sys` directly and turns `CUresult`s into [`BackendError`]s with
//! [`check`].

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
    "cuDeviceCanAccessPeer",
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
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
];

/// A library loaded at run time, as its errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Library {
    /// How messages name it, file included: `the CUDA driver (libcuda.so)`.
    pub name: &'static str,
    /// Why it is usually absent, for the not-found message.
    pub absent: &'static str,
    /// The oldest version with every symbol used, for the missing-symbol message.
    pub needs: &'static str,
}

/// The CUDA driver, as [`LibraryError`]s name it.
pub const CUDA_DRIVER: Library = Library {
    name: "the CUDA driver (libcuda.so)",
    absent: "no NVIDIA driver on this machine, or it is not on the library path",
    needs: "a driver for CUDA 12 or newer",
};

/// Why a run-time loaded library cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LibraryError {
    /// No candidate file of the library could be opened.
    #[error("{} could not be loaded: {}", .library.name, .library.absent)]
    NotFound {
        /// The library.
        library: Library,
    },
    /// The library lacks a symbol the caller needs (an older version).
    #[error(
        "{} lacks `{symbol}`: it is too old for streamalloc (needs {})",
        .library.name,
        .library.needs
    )]
    MissingSymbol {
        /// The library.
        library: Library,
        /// The first missing symbol.
        symbol: &'static str,
    },
}

/// Probes `library` without panicking: `present` (cudarc's `is_culib_present` for it)
/// must say a file opens, then every name of `symbols` must resolve in the handle `open`
/// (cudarc's `culib`) returns. Calls nothing in the library.
pub fn probe_library(
    library: Library,
    present: unsafe fn() -> bool,
    open: unsafe fn() -> &'static libloading::Library,
    symbols: &[&'static str],
) -> Result<(), LibraryError> {
    // SAFETY: `present` is a cudarc `is_culib_present`, which only calls
    // `dlopen`/`dlclose` on candidate names.
    if !unsafe { present() } {
        return Err(LibraryError::NotFound { library });
    }
    let probed = std::panic::catch_unwind(|| {
        // SAFETY: the library is present (checked above), so `open` (a cudarc `culib`)
        // opens it instead of panicking; should it panic anyway, `catch_unwind` holds it.
        let lib = unsafe { open() };
        for &symbol in symbols {
            // SAFETY: the symbol is looked up, never called, through this pointer type.
            if unsafe { lib.get::<*const ()>(symbol.as_bytes()) }.is_err() {
                return Err(LibraryError::MissingSymbol { library, symbol });
            }
        }
        Ok(())
    });
    probed.unwrap_or(Err(LibraryError::NotFound { library }))
}

/// A library's result code: one value means success, any other is a failure the library
/// can describe once loaded.
pub trait Status: Copy {
    /// Whether the code is the library's success.
    fn is_success(self) -> bool;

    /// The library's own description of the code. Only called once the library is
    /// loaded (a code exists only then).
    fn describe(self) -> String;

    /// `Ok` for success, otherwise the code, to describe or match on.
    #[inline]
    fn check(self) -> Result<(), Self> {
        if self.is_success() {
            Ok(())
        } else {
            Err(self)
        }
    }
}

impl Status for sys::CUresult {
    #[inline]
    fn is_success(self) -> bool {
        self == sys::CUresult::CUDA_SUCCESS
    }

    fn describe(self) -> String {
        describe(self)
    }
}

/// Why the driver could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// `libcuda` is missing or lacks a symbol the backend needs.
    #[error(transparent)]
    Library(#[from] LibraryError),
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
    probe_library(CUDA_DRIVER, sys::is_culib_present, sys::culib, SYMBOLS)?;
    // SAFETY: every symbol exists; cuInit(0) has no preconditions.
    unsafe { sys::cuInit(0) }
        .check()
        .map_err(|code| DriverError::Init(describe(code)))
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
    code.check().map_err(|code| failure(code, operation))
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
