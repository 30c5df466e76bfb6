//! The only door from the engine to a device.
//!
//! Everything the allocator needs from CUDA is one method here: segments, events, waits,
//! a clock, virtual memory and, for sleeping memory's backup, host buffers and copies. The engine is generic over [`Backend`], so the same policy code runs on
//! the real driver (`cuda`, behind the `cuda` feature) and on the deterministic
//! simulator ([`sim`]) that every CI test uses.
//!
//! # Contract
//! - Handles are opaque integers; only the backend that made one may interpret it.
//! - `free_segment` may only return once no stream can still touch the memory: the CUDA
//!   driver's `cuMemFree` synchronises the device, and the simulator does the same.
//! - `record_event` captures the work enqueued on the stream *so far*; re-recording an
//!   event replaces what it captured (waits already enqueued keep the old capture).
//! - Methods take `&self` and may be called from many threads; the allocator serialises
//!   its own calls under its lock.

pub mod ipc;
pub mod sim;

#[cfg(feature = "cuda")]
pub mod cuda;

use crate::error::BackendError;
use crate::types::{DevicePtr, EventHandle, HostPtr, StreamId};
use std::sync::Arc;

/// Result of a backend call.
pub type BackendResult<T> = Result<T, BackendError>;

/// Operations the allocator needs from a device. See the module docs for the contract.
pub trait Backend: Send + Sync {
    /// Total bytes of device memory (used to resolve `memory_fraction`).
    fn total_memory(&self) -> BackendResult<u64>;

    /// Obtains `size` bytes of device memory. An exhausted device is reported with
    /// [`BackendError::out_of_memory`].
    fn alloc_segment(&self, size: u64) -> BackendResult<DevicePtr>;

    /// Returns a segment obtained from [`Backend::alloc_segment`]. Returns only once no
    /// stream can still use the memory.
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> BackendResult<()>;

    /// Creates an event for ordering only (timing disabled).
    fn create_event(&self) -> BackendResult<EventHandle>;

    /// Destroys an event created by [`Backend::create_event`].
    fn destroy_event(&self, event: EventHandle) -> BackendResult<()>;

    /// Captures the work enqueued on `stream` so far (`cuEventRecord`).
    fn record_event(&self, event: EventHandle, stream: StreamId) -> BackendResult<()>;

    /// True if the captured work has completed (`cuEventQuery`). Costly on real devices
    /// (~1.25 µs): the engine calls it rarely and in batches.
    fn query_event(&self, event: EventHandle) -> BackendResult<bool>;

    /// Blocks the host until the captured work has completed (`cuEventSynchronize`).
    fn synchronize_event(&self, event: EventHandle) -> BackendResult<()>;

    /// Makes `stream` wait, on the device, for the work captured by `event`
    /// (`cuStreamWaitEvent`): the host does not block.
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> BackendResult<()>;

    /// Blocks the host until all work on every stream of the device has completed.
    fn synchronize_device(&self) -> BackendResult<()>;

    /// True while `stream` is being captured into a CUDA graph, when event queries and
    /// device synchronisation are forbidden.
    fn is_capturing(&self, _stream: StreamId) -> BackendResult<bool> {
        Ok(false)
    }

    /// A monotonic clock in nanoseconds for trace timestamps. The simulator returns its
    /// virtual host time so traces are deterministic.
    fn now_ns(&self) -> u64;

    /// The same clock in its raw unit, for timestamps taken on the hot path and converted
    /// by [`Backend::ticks_to_ns`] only when read back (the conversion is then paid per
    /// snapshot, not per operation). Monotonic like [`Backend::now_ns`]; the defaults make
    /// a tick one nanosecond.
    #[inline]
    fn now_ticks(&self) -> u64 {
        self.now_ns()
    }

    /// Converts a reading of [`Backend::now_ticks`] to [`Backend::now_ns`]'s time base.
    #[inline]
    fn ticks_to_ns(&self, ticks: u64) -> u64 {
        ticks
    }

    // ---- Virtual memory (expandable segments) -----------------------------------------
    //
    // In the style of CUDA's VMM API: reserve a range of addresses with no memory behind it
    // (`cuMemAddressReserve`), then map and unmap physical pages of [`Backend::page_size`]
    // bytes into it (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`, and `cuMemUnmap` +
    // `cuMemRelease`). Backends that cannot do this keep the defaults, which report
    // "unsupported"; the allocator then falls back to whole segments.

    /// True if the backend implements the virtual-memory methods below.
    fn supports_virtual_memory(&self) -> bool {
        false
    }

    /// Granularity of [`Backend::map_pages`] and [`Backend::unmap_pages`]: every address
    /// and length passed to them is a multiple of it.
    fn page_size(&self) -> u64 {
        2 << 20
    }

    /// Reserves `size` bytes of address space with nothing mapped (`cuMemAddressReserve`).
    /// Costs no device memory; touching it before [`Backend::map_pages`] is an error.
    fn reserve_address_space(&self, _size: u64) -> BackendResult<DevicePtr> {
        Err(unsupported("cuMemAddressReserve"))
    }

    /// Releases a reservation made by [`Backend::reserve_address_space`]; nothing in it
    /// may still be mapped (`cuMemAddressFree`).
    fn release_address_space(&self, _ptr: DevicePtr, _size: u64) -> BackendResult<()> {
        Err(unsupported("cuMemAddressFree"))
    }

    /// Backs `[ptr, ptr + size)` of a reservation with fresh physical pages and makes them
    /// accessible. An exhausted device is reported with [`BackendError::out_of_memory`].
    fn map_pages(&self, _ptr: DevicePtr, _size: u64) -> BackendResult<()> {
        Err(unsupported("cuMemMap"))
    }

    /// Makes every later [`Backend::map_pages`] back each page with its own physical
    /// allocation (on), or the whole range with one (off, the default). Drivers map an
    /// allocation a second time only whole (`cuMemMap` of part of an allocation, or at a
    /// non-zero offset, answers `CUDA_ERROR_NOT_SUPPORTED`, measured on an H100 with driver
    /// 580), so stitching needs one allocation per page; the cost is one `cuMemCreate` and
    /// one `cuMemMap` per page where one per mapping would do.
    fn set_page_allocations(&self, _on: bool) {}

    /// Maps the physical pages now mapped at `[src, src + size)` (whole allocations, see
    /// [`Backend::set_page_allocations`], possibly several) a second time, at `[dst, dst + size)` of a reservation, and makes
    /// them accessible there (`cuMemMap` of each allocation handle at an offset, then
    /// `cuMemSetAccess`). Allocates no memory: this is how a stitched range is made from
    /// free pages scattered over a reservation. Undone with [`Backend::unmap_pages`] over
    /// the whole of `[dst, dst + size)`.
    fn alias_pages(&self, _dst: DevicePtr, _src: DevicePtr, _size: u64) -> BackendResult<()> {
        Err(unsupported("cuMemMap"))
    }

    /// Unmaps `[ptr, ptr + size)`, whole mappings made by [`Backend::map_pages`] or
    /// [`Backend::alias_pages`], and releases the physical pages no other mapping holds.
    /// Unlike `cuMemFree`, the driver does not synchronise: the caller must first make
    /// sure (by synchronising, or by events seen complete) that no stream can still use
    /// the range. The simulator reports a race otherwise.
    fn unmap_pages(&self, _ptr: DevicePtr, _size: u64) -> BackendResult<()> {
        Err(unsupported("cuMemUnmap"))
    }

    /// Like [`Backend::map_pages`], but backs the whole range with one physical allocation
    /// whatever [`Backend::set_page_allocations`] says: for memory that is never stitched
    /// and goes back to the device whole (a sleeping memory pool, see `allocator::sleep`),
    /// where each allocation costs a driver call to make and another to release.
    fn map_pages_whole(&self, _ptr: DevicePtr, _size: u64) -> BackendResult<()> {
        Err(unsupported("cuMemCreate"))
    }

    // ---- Host memory (the backup of sleeping memory) -----------------------------------
    //
    // Page-locked host buffers and copies between them and device memory, on one stream
    // of the backend's own (`cuMemHostAlloc`, `cuMemcpyDtoHAsync`, `cuMemcpyHtoDAsync`,
    // `cuStreamSynchronize`). A copy is ordered after the work the host has seen complete
    // when it is issued, and nothing else: the caller waits for the memory's users first.
    // Backends without them keep the defaults, and sleeping with a backup is refused.

    /// Allocates `size` bytes of page-locked host memory.
    fn alloc_host(&self, _size: u64) -> BackendResult<HostPtr> {
        Err(unsupported_host("cuMemHostAlloc"))
    }

    /// Frees a buffer of [`Backend::alloc_host`]; no copy may still use it (the caller
    /// synchronised the copies first).
    fn free_host(&self, _ptr: HostPtr, _size: u64) -> BackendResult<()> {
        Err(unsupported_host("cuMemFreeHost"))
    }

    /// Enqueues a copy of `[src, src + size)` of device memory to `dst`, inside a buffer of
    /// [`Backend::alloc_host`], on the backend's copy stream.
    fn copy_to_host(&self, _dst: HostPtr, _src: DevicePtr, _size: u64) -> BackendResult<()> {
        Err(unsupported_host("cuMemcpyDtoHAsync"))
    }

    /// Enqueues a copy of `size` bytes of the host buffer at `src` to device memory at
    /// `dst`, on the backend's copy stream.
    fn copy_to_device(&self, _dst: DevicePtr, _src: HostPtr, _size: u64) -> BackendResult<()> {
        Err(unsupported_host("cuMemcpyHtoDAsync"))
    }

    /// Blocks the host until every copy enqueued so far has completed.
    fn synchronize_copies(&self) -> BackendResult<()> {
        Err(unsupported_host("cuStreamSynchronize"))
    }
}

/// The error of a virtual-memory call on a backend without virtual memory.
fn unsupported(operation: &'static str) -> BackendError {
    BackendError::new(operation, "virtual memory is not supported by this backend")
}

/// The error of a host-memory call on a backend without host memory.
fn unsupported_host(operation: &'static str) -> BackendError {
    BackendError::new(
        operation,
        "host memory and copies are not supported by this backend",
    )
}

impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn total_memory(&self) -> BackendResult<u64> {
        (**self).total_memory()
    }
    fn alloc_segment(&self, size: u64) -> BackendResult<DevicePtr> {
        (**self).alloc_segment(size)
    }
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        (**self).free_segment(ptr, size)
    }
    fn create_event(&self) -> BackendResult<EventHandle> {
        (**self).create_event()
    }
    fn destroy_event(&self, event: EventHandle) -> BackendResult<()> {
        (**self).destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> BackendResult<()> {
        (**self).record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> BackendResult<bool> {
        (**self).query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> BackendResult<()> {
        (**self).synchronize_event(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> BackendResult<()> {
        (**self).stream_wait_event(stream, event)
    }
    fn synchronize_device(&self) -> BackendResult<()> {
        (**self).synchronize_device()
    }
    fn is_capturing(&self, stream: StreamId) -> BackendResult<bool> {
        (**self).is_capturing(stream)
    }
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }
    #[inline]
    fn now_ticks(&self) -> u64 {
        (**self).now_ticks()
    }
    fn ticks_to_ns(&self, ticks: u64) -> u64 {
        (**self).ticks_to_ns(ticks)
    }
    fn supports_virtual_memory(&self) -> bool {
        (**self).supports_virtual_memory()
    }
    fn page_size(&self) -> u64 {
        (**self).page_size()
    }
    fn reserve_address_space(&self, size: u64) -> BackendResult<DevicePtr> {
        (**self).reserve_address_space(size)
    }
    fn release_address_space(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        (**self).release_address_space(ptr, size)
    }
    fn map_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        (**self).map_pages(ptr, size)
    }
    fn set_page_allocations(&self, on: bool) {
        (**self).set_page_allocations(on)
    }
    fn alias_pages(&self, dst: DevicePtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        (**self).alias_pages(dst, src, size)
    }
    fn unmap_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        (**self).unmap_pages(ptr, size)
    }
    fn map_pages_whole(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        (**self).map_pages_whole(ptr, size)
    }
    fn alloc_host(&self, size: u64) -> BackendResult<HostPtr> {
        (**self).alloc_host(size)
    }
    fn free_host(&self, ptr: HostPtr, size: u64) -> BackendResult<()> {
        (**self).free_host(ptr, size)
    }
    fn copy_to_host(&self, dst: HostPtr, src: DevicePtr, size: u64) -> BackendResult<()> {
        (**self).copy_to_host(dst, src, size)
    }
    fn copy_to_device(&self, dst: DevicePtr, src: HostPtr, size: u64) -> BackendResult<()> {
        (**self).copy_to_device(dst, src, size)
    }
    fn synchronize_copies(&self) -> BackendResult<()> {
        (**self).synchronize_copies()
    }
}
