//! Page-locked host memory and copies to and from it (`cuMemHostAlloc`, `cuMemFreeHost`,
//! `cuMemcpyDtoHAsync`, `cuMemcpyHtoDAsync`, `cuStreamSynchronize`): the backup of a
//! sleeping memory pool.
//!
//! Copies run on one stream of the backend's own, created on first use in the device's
//! primary context with `CU_STREAM_NON_BLOCKING`, so that they never wait for, or hold up,
//! the legacy default stream: the engine has already waited on the host for the work that
//! uses the memory, and synchronises this stream before it unmaps or hands memory back.
//! One stream, because a single direction of the PCIe link is saturated by one copy at a
//! time of the sizes the engine issues (one per contiguous run of live blocks).

use super::{driver, sys, CudaBackend};
use crate::backend::BackendResult;
use crate::error::BackendError;
use crate::types::{DevicePtr, HostPtr};
use std::sync::OnceLock;

/// The backend's copy stream, created once.
#[derive(Debug, Default)]
pub(super) struct CopyStream(OnceLock<Stream>);

/// A `CUstream` the backend created (never destroyed: like the retained context, driver
/// calls during process teardown are undefined).
#[derive(Debug, Clone, Copy)]
struct Stream(sys::CUstream);

// SAFETY: a stream handle is an opaque token the driver lets any thread use; it is only
// passed by value to driver calls.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl CudaBackend {
    /// The copy stream, created on first use (the primary context is current).
    fn copy_stream(&self) -> BackendResult<sys::CUstream> {
        if let Some(stream) = self.copies.0.get() {
            return Ok(stream.0);
        }
        let mut stream: sys::CUstream = std::ptr::null_mut();
        driver::check(
            // SAFETY: valid out pointer; the caller made the primary context current.
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        )?;
        match self.copies.0.set(Stream(stream)) {
            Ok(()) => Ok(stream),
            Err(_) => {
                // Another thread made one first: keep theirs.
                // SAFETY: created above, never used.
                unsafe { sys::cuStreamDestroy_v2(stream) };
                Ok(self.copies.0.get().expect("set by the other thread").0)
            }
        }
    }

    pub(super) fn host_alloc(&self, size: u64) -> BackendResult<HostPtr> {
        let _ctx = self.enter()?;
        let bytes = usize::try_from(size)
            .map_err(|_| BackendError::new("cuMemHostAlloc", "size overflows usize"))?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        driver::check(
            // SAFETY: valid out pointer; flags 0 is page-locked memory of this context.
            unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, 0) },
            "cuMemHostAlloc",
        )?;
        Ok(HostPtr(ptr as usize as u64))
    }

    pub(super) fn host_free(&self, ptr: HostPtr, _size: u64) -> BackendResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `ptr` came from `host_alloc` and the engine synchronised the copy stream
        // before freeing it.
        driver::check(
            unsafe { sys::cuMemFreeHost(ptr.0 as usize as *mut std::ffi::c_void) },
            "cuMemFreeHost",
        )
    }

    pub(super) fn host_copy_to_host(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        size: u64,
    ) -> BackendResult<()> {
        let _ctx = self.enter()?;
        let stream = self.copy_stream()?;
        driver::check(
            // SAFETY: `dst` lies inside a buffer of `host_alloc` of at least `size` bytes
            // from there and `src` is mapped device memory (the engine's contract); the
            // host buffer outlives the copy (it is freed only after a synchronisation).
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.0 as usize as *mut std::ffi::c_void,
                    src.0,
                    size as usize,
                    stream,
                )
            },
            "cuMemcpyDtoHAsync",
        )
    }

    pub(super) fn host_copy_to_device(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        size: u64,
    ) -> BackendResult<()> {
        let _ctx = self.enter()?;
        let stream = self.copy_stream()?;
        driver::check(
            // SAFETY: as for `host_copy_to_host`, the other way round.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst.0,
                    src.0 as usize as *const std::ffi::c_void,
                    size as usize,
                    stream,
                )
            },
            "cuMemcpyHtoDAsync",
        )
    }

    pub(super) fn host_synchronize_copies(&self) -> BackendResult<()> {
        let Some(stream) = self.copies.0.get() else {
            return Ok(());
        };
        let _ctx = self.enter()?;
        // SAFETY: a stream this backend created and never destroys.
        driver::check(
            unsafe { sys::cuStreamSynchronize(stream.0) },
            "cuStreamSynchronize",
        )
    }
}
