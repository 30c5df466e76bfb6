//! The CUDA driver backend (feature `cuda`): the engine's [`Backend`] on a real GPU.
//!
//! # What it shares with its host process
//! - **The primary context.** PyTorch (the CUDA runtime) works in each device's primary
//!   context; the backend retains the same one (`cuDevicePrimaryCtxRetain`) and makes it
//!   current only when it must: a thread with no current context gets it set (as
//!   `cudaSetDevice` would); a thread whose current context is another one gets it pushed
//!   for the call and popped after.
//! - **Streams** are the caller's `CUstream` handles carried in [`StreamId`] (`0` is the
//!   legacy default stream). The backend never creates or destroys a stream.
//! - **Events** are created with `CU_EVENT_DISABLE_TIMING` (ordering only, the cheapest
//!   kind) and pooled by the engine; cross-stream reuse is a `cuStreamWaitEvent`.
//!
//! # CUDA graphs
//! A stream being captured is reported by [`Streams::is_capturing`](super::Streams::is_capturing)
//! (`cuStreamIsCapturing`; the legacy stream answering "implicit capture" counts as
//! capturing). The engine then never queries, waits or synchronises for that stream: it
//! hands out ready blocks of the stream itself, or grows the pool. Growing calls
//! `cuMemAlloc`, which the default (global) capture mode forbids, so segment allocation
//! switches the calling thread to the relaxed mode (`cuThreadExchangeStreamCaptureMode`)
//! for that one call and restores it. The memory is ordinary device memory that outlives
//! the graph; it is not part of the graph.
//!
//! # Loading
//! Nothing here touches the driver before [`driver::load`] succeeded, so a machine
//! without CUDA gets a typed [`CudaError`], never a panic. The allocators of a process,
//! one per device, are held by the C ABI's registry (the root crate's `registry`).
//!
//! # IPC
//! Expandable-segment memory is shared between processes mapping by mapping, as POSIX
//! file descriptors ([`ipc`]); that is no allocation policy, so it lives on
//! [`CudaBackend`], outside the [`Backend`] trait.

mod clock;
pub mod driver;
mod host;
pub mod ipc;
mod peers;
mod vmm;

pub use cudarc::driver::sys;

use self::clock::Clock;
use super::{BackendResult, Events, HostMemory, Segments, Streams, VirtualMemory};
use crate::config::TraceClock;
use crate::error::BackendError;
use crate::types::{DevicePtr, EventHandle, HostPtr, StreamId};
use std::ffi::c_int;

pub use self::driver::DriverError;

/// Why a [`CudaBackend`] could not be created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The driver could not be loaded or initialised.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The ordinal names no device.
    #[error("CUDA device {ordinal} does not exist ({count} visible)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: i32,
        /// Devices visible to this process.
        count: i32,
    },
    /// A driver call failed while setting the device up.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Number of CUDA devices visible to this process (loading the driver first).
pub fn device_count() -> Result<i32, CudaError> {
    driver::load()?;
    let mut count: c_int = 0;
    driver::check(
        // SAFETY: the driver is loaded and initialised; `count` is a valid out pointer.
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    )?;
    Ok(count)
}

/// Device `ordinal` and its primary context (PyTorch's), retained for the life of the
/// process: like RMM's per-thread events, driver calls during teardown are undefined.
pub fn retain_primary_context(ordinal: i32) -> Result<(sys::CUdevice, sys::CUcontext), CudaError> {
    let count = device_count()?;
    if ordinal < 0 || ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let mut device: sys::CUdevice = 0;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ordinal` is in range; every out pointer is valid for the call.
    unsafe {
        driver::check(sys::cuDeviceGet(&mut device, ordinal), "cuDeviceGet")?;
        driver::check(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
            "cuDevicePrimaryCtxRetain",
        )?;
    }
    Ok((device, ctx))
}

/// The [`Backend`] of one CUDA device, in its primary context. See the module docs.
#[derive(Debug)]
pub struct CudaBackend {
    ordinal: i32,
    /// The device's primary context (retained, never released: like RMM's per-thread
    /// events, driver calls during process teardown are undefined).
    ctx: Context,
    total: u64,
    clock: Clock,
    /// Page mapping for expandable segments; `None` where the device cannot map memory
    /// (the engine then uses whole segments).
    pages: Option<std::sync::Arc<vmm::PageMap>>,
    /// Other processes' memory opened here (CUDA IPC of expandable segments).
    imports: ipc::Imports,
    /// The stream of host copies (sleeping memory's backup), made on first use.
    copies: host::CopyStream,
}

/// A `CUcontext` that may be shared between threads (the driver allows it).
#[derive(Debug, Clone, Copy)]
struct Context(sys::CUcontext);

// SAFETY: a CUDA context handle is an opaque token the driver lets any thread make
// current; the backend never dereferences it.
unsafe impl Send for Context {}
// SAFETY: as above; it is only passed by value to driver calls.
unsafe impl Sync for Context {}

impl CudaBackend {
    /// The backend for device `ordinal`, in its primary context.
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        let (device, ctx) = retain_primary_context(ordinal)?;
        let mut total: usize = 0;
        driver::check(
            // SAFETY: `device` is a valid device handle; `total` is a valid out pointer.
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, device) },
            "cuDeviceTotalMem",
        )?;
        let mut backend = Self {
            ordinal,
            ctx: Context(ctx),
            total: total as u64,
            clock: Clock::new(),
            pages: None,
            imports: Default::default(),
            copies: Default::default(),
        };
        // Leave the context current on a thread that had none, as the runtime would.
        drop(backend.enter()?);
        backend.pages = vmm::PageMap::probe(ordinal, device).map(std::sync::Arc::new);
        if let Some(pages) = &backend.pages {
            peers::join(pages);
        }
        tracing::debug!(ordinal, total, "CUDA backend ready");
        Ok(backend)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The primary context's handle.
    pub fn context(&self) -> sys::CUcontext {
        self.ctx.0
    }

    /// Makes the primary context current for the duration of the returned guard.
    fn enter(&self) -> BackendResult<CtxGuard> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        driver::check(
            // SAFETY: valid out pointer; the driver is loaded (a backend exists).
            unsafe { sys::cuCtxGetCurrent(&mut current) },
            "cuCtxGetCurrent",
        )?;
        if current == self.ctx.0 {
            return Ok(CtxGuard { pushed: false });
        }
        if current.is_null() {
            driver::check(
                // SAFETY: the context is retained for the life of the process.
                unsafe { sys::cuCtxSetCurrent(self.ctx.0) },
                "cuCtxSetCurrent",
            )?;
            return Ok(CtxGuard { pushed: false });
        }
        driver::check(
            // SAFETY: as above; the guard pops it again.
            unsafe { sys::cuCtxPushCurrent_v2(self.ctx.0) },
            "cuCtxPushCurrent",
        )?;
        Ok(CtxGuard { pushed: true })
    }
}

/// Pops a context pushed by [`CudaBackend::enter`].
struct CtxGuard {
    pushed: bool,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: this guard pushed exactly one context on this thread.
            let code = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
            if code != sys::CUresult::CUDA_SUCCESS {
                tracing::error!(error = %driver::describe(code), "cuCtxPopCurrent failed");
            }
        }
    }
}

#[inline]
fn stream(id: StreamId) -> sys::CUstream {
    id.0 as usize as sys::CUstream
}

#[inline]
fn event(handle: EventHandle) -> sys::CUevent {
    handle.0 as usize as sys::CUevent
}

impl super::Clock for CudaBackend {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.clock.ticks_to_ns(self.clock.now_ticks())
    }

    #[inline]
    fn now_ticks(&self) -> u64 {
        self.clock.now_ticks()
    }

    fn ticks_to_ns(&self, ticks: u64) -> u64 {
        self.clock.ticks_to_ns(ticks)
    }

    fn precise_ns(&self) -> u64 {
        self.clock.precise_ns()
    }

    fn set_trace_clock(&self, clock: TraceClock) {
        self.clock.set(clock);
    }
}

impl Segments for CudaBackend {
    fn total_memory(&self) -> BackendResult<u64> {
        Ok(self.total)
    }

    fn free_memory(&self) -> BackendResult<u64> {
        let _ctx = self.enter()?;
        let (mut free, mut total): (usize, usize) = (0, 0);
        driver::check(
            // SAFETY: valid out pointers; the primary context is current.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok(free as u64)
    }

    fn alloc_segment(&self, size: u64) -> BackendResult<DevicePtr> {
        let _ctx = self.enter()?;
        let _relaxed = RelaxedCapture::enter()?;
        let mut ptr: sys::CUdeviceptr = 0;
        driver::check(
            // SAFETY: valid out pointer; the primary context is current.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, size as usize) },
            "cuMemAlloc",
        )?;
        Ok(DevicePtr(ptr))
    }

    fn free_segment(&self, ptr: DevicePtr, _size: u64) -> BackendResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `ptr` came from `alloc_segment` and the engine synchronised the device
        // before returning it (cuMemFree also synchronises).
        driver::check(unsafe { sys::cuMemFree_v2(ptr.0) }, "cuMemFree")
    }
}

impl Events for CudaBackend {
    fn create_event(&self) -> BackendResult<EventHandle> {
        let _ctx = self.enter()?;
        let mut handle: sys::CUevent = std::ptr::null_mut();
        driver::check(
            // SAFETY: valid out pointer; the primary context is current.
            unsafe {
                sys::cuEventCreate(
                    &mut handle,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            },
            "cuEventCreate",
        )?;
        Ok(EventHandle(handle as usize as u64))
    }

    fn destroy_event(&self, handle: EventHandle) -> BackendResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: the engine destroys only idle events it created here.
        driver::check(
            unsafe { sys::cuEventDestroy_v2(event(handle)) },
            "cuEventDestroy",
        )
    }

    fn record_event(&self, handle: EventHandle, on: StreamId) -> BackendResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: a live event of this context; the stream is the caller's handle (0 is
        // the current context's legacy stream, hence the context guard).
        driver::check(
            unsafe { sys::cuEventRecord(event(handle), stream(on)) },
            "cuEventRecord",
        )
    }

    fn query_event(&self, handle: EventHandle) -> BackendResult<bool> {
        // SAFETY: a live event created by this backend.
        let code = unsafe { sys::cuEventQuery(event(handle)) };
        match code {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            _ => driver::check(code, "cuEventQuery").map(|()| false),
        }
    }

    fn synchronize_event(&self, handle: EventHandle) -> BackendResult<()> {
        // SAFETY: a live event created by this backend.
        driver::check(
            unsafe { sys::cuEventSynchronize(event(handle)) },
            "cuEventSynchronize",
        )
    }
}

impl Streams for CudaBackend {
    fn stream_wait_event(&self, on: StreamId, handle: EventHandle) -> BackendResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: a live event; flags must be 0 for a plain wait.
        driver::check(
            unsafe { sys::cuStreamWaitEvent(stream(on), event(handle), 0) },
            "cuStreamWaitEvent",
        )
    }

    fn synchronize_device(&self) -> BackendResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: the primary context is current.
        driver::check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    fn is_capturing(&self, on: StreamId) -> BackendResult<bool> {
        let _ctx = self.enter()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: valid out pointer; the stream is the caller's handle.
        let code = unsafe { sys::cuStreamIsCapturing(stream(on), &mut status) };
        if code == sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT {
            // The legacy stream while another stream captures in global mode.
            return Ok(true);
        }
        driver::check(code, "cuStreamIsCapturing")?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }
}

impl VirtualMemory for CudaBackend {
    fn supports_virtual_memory(&self) -> bool {
        self.pages.is_some()
    }

    fn page_size(&self) -> u64 {
        self.pages
            .as_ref()
            .map_or(2 << 20, |pages| pages.page_size())
    }

    fn reserve_address_space(&self, size: u64) -> BackendResult<DevicePtr> {
        let _ctx = self.enter()?;
        self.page_map("cuMemAddressReserve")?.reserve(size)
    }

    fn release_address_space(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let _ctx = self.enter()?;
        self.page_map("cuMemAddressFree")?.release(ptr, size)
    }

    fn map_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let _ctx = self.enter()?;
        // Mapping is no stream operation, but the default capture mode forbids it too.
        let _relaxed = RelaxedCapture::enter()?;
        self.page_map("cuMemMap")?.map(ptr, size)
    }

    fn set_page_allocations(&self, on: bool) {
        if let Some(pages) = &self.pages {
            pages.set_page_allocations(on);
        }
    }

    fn alias_pages(&self, dst: DevicePtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        let _ctx = self.enter()?;
        let _relaxed = RelaxedCapture::enter()?;
        self.page_map("cuMemMap")?.alias(dst, src, size)
    }

    fn unmap_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let _ctx = self.enter()?;
        let _relaxed = RelaxedCapture::enter()?;
        self.page_map("cuMemUnmap")?.unmap(ptr, size)
    }

    fn map_pages_whole(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let _ctx = self.enter()?;
        let _relaxed = RelaxedCapture::enter()?;
        self.page_map("cuMemMap")?.map_whole(ptr, size)
    }
}

impl HostMemory for CudaBackend {
    fn alloc_host(&self, size: u64) -> BackendResult<HostPtr> {
        self.host_alloc(size)
    }

    fn free_host(&self, ptr: HostPtr, size: u64) -> BackendResult<()> {
        self.host_free(ptr, size)
    }

    fn copy_to_host(&self, dst: HostPtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        self.host_copy_to_host(dst, src, size)
    }

    fn copy_to_device(&self, dst: DevicePtr, src: HostPtr, size: u64) -> BackendResult<()> {
        self.host_copy_to_device(dst, src, size)
    }

    fn synchronize_copies(&self) -> BackendResult<()> {
        self.host_synchronize_copies()
    }
}

impl CudaBackend {
    fn page_map(&self, operation: &'static str) -> BackendResult<&vmm::PageMap> {
        self.pages.as_deref().ok_or_else(|| {
            BackendError::new(
                operation,
                "this device does not support virtual memory management",
            )
        })
    }
}

/// Switches the calling thread to the relaxed stream-capture mode, so `cuMemAlloc` is
/// allowed while some stream captures; restores the previous mode on drop.
struct RelaxedCapture {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCapture {
    fn enter() -> BackendResult<Self> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        driver::check(
            // SAFETY: valid in/out pointer.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
            "cuThreadExchangeStreamCaptureMode",
        )?;
        Ok(Self { previous: mode })
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: valid in/out pointer; restores the mode this guard replaced.
        let code = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        if code != sys::CUresult::CUDA_SUCCESS {
            tracing::error!(error = %driver::describe(code), "restoring the capture mode failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_a_typed_error_not_a_panic() {
        match CudaBackend::new(0) {
            Ok(backend) => eprintln!(
                "skipped: a CUDA device is present (device 0, {} bytes)",
                backend.total_memory().unwrap()
            ),
            Err(err) => {
                let text = err.to_string();
                assert!(!text.is_empty());
                // A second attempt answers the same way, without retrying the load.
                assert_eq!(CudaBackend::new(0).unwrap_err().to_string(), text);
            }
        }
    }

    #[test]
    fn bad_ordinal_is_rejected() {
        match CudaBackend::new(-1) {
            Err(CudaError::NoSuchDevice { ordinal: -1, .. }) | Err(CudaError::Driver(_)) => {}
            other => panic!("expected an error, got {other:?}"),
        }
    }
}
