//! The only door from the engine to a device.
//!
//! Everything the allocator needs from CUDA is a method of one of the capability groups
//! below; [`Backend`] is all of them together. The engine is generic over [`Backend`], so
//! the same policy code runs on the real driver (`cuda`, behind the `cuda` feature) and on
//! the deterministic simulator ([`sim`]) that every CI test uses.
//!
//! # The groups
//! | group | what the engine does with it |
//! | --- | --- |
//! | [`Clock`] | trace timestamps, and the time share reclaims may take |
//! | [`Segments`] | whole segments (`cuMemAlloc` / `cuMemFree`) and the device's size |
//! | [`Events`] | events recorded on free, queried in batches, waited for by the host |
//! | [`Streams`] | device-side waits, device synchronisation, graph capture |
//! | [`VirtualMemory`] | expandable segments and stitching (the VMM API) |
//! | [`HostMemory`] | page-locked host buffers and copies: sleeping memory's backup |
//!
//! CUDA IPC is a seventh group, [`ipc::IpcBackend`], outside [`Backend`]: it is no
//! allocation policy, and only the C ABI's IPC calls ask for it.
//!
//! No group has default bodies: a backend states every capability it has, and one it
//! lacks, it says so explicitly ([`forward_backend!`](crate::forward_backend)'s `unsupported`). A wrapper that
//! changes part of a device (a test that drops waits, a clock of another unit, segments
//! from another allocator) implements the groups it changes and forwards the rest with
//! [`forward_backend!`](crate::forward_backend); one that forgets a group is no [`Backend`] and does not compile,
//! rather than silently losing the capability (a wrapper that kept the old "unsupported"
//! defaults once switched expandable segments and stitching off on the GPU).
//!
//! # Contract
//! - Handles are opaque integers; only the backend that made one may interpret it.
//! - `free_segment` may only return once no stream can still touch the memory: the CUDA
//!   driver's `cuMemFree` synchronises the device, and the simulator does the same.
//! - `record_event` captures the work enqueued on the stream *so far*; re-recording an
//!   event replaces what it captured (waits already enqueued keep the old capture).
//! - Methods take `&self` and may be called from many threads; the allocator serialises
//!   its own calls under its lock.

mod forward;
pub mod ipc;
pub mod sim;

#[cfg(feature = "cuda")]
pub mod cuda;

use crate::config::TraceClock;
use crate::error::BackendError;
use crate::types::{DevicePtr, EventHandle, HostPtr, StreamId};
use std::sync::Arc;

/// Result of a backend call.
pub type BackendResult<T> = Result<T, BackendError>;

/// Everything the allocator needs from a device: every capability group (see the module
/// docs). Implemented for every type that has all of them.
pub trait Backend:
    Clock + Segments + Events + Streams + VirtualMemory + HostMemory + Send + Sync
{
}

impl<T> Backend for T where
    T: Clock + Segments + Events + Streams + VirtualMemory + HostMemory + Send + Sync + ?Sized
{
}

/// The time base of trace timestamps.
pub trait Clock {
    /// A monotonic clock in nanoseconds for trace timestamps. The simulator returns its
    /// virtual host time so traces are deterministic.
    fn now_ns(&self) -> u64;

    /// The same clock in its raw unit, for timestamps taken on the hot path and converted
    /// by [`Clock::ticks_to_ns`] only when read back (the conversion is then paid per
    /// snapshot, not per operation). Monotonic like [`Clock::now_ns`]; a clock whose unit
    /// is the nanosecond returns `now_ns()`.
    fn now_ticks(&self) -> u64;

    /// Converts a reading of [`Clock::now_ticks`] to [`Clock::now_ns`]'s time base.
    fn ticks_to_ns(&self, ticks: u64) -> u64;

    /// A monotonic clock in nanoseconds precise enough to time the engine's slow paths
    /// (driver calls of microseconds to milliseconds), whatever clock the trace uses: the
    /// trace's default clock ticks only every few milliseconds. Read off the hot path
    /// only. The simulator returns its virtual host time.
    fn precise_ns(&self) -> u64;

    /// Which clock [`Clock::now_ticks`] and [`Clock::now_ns`] read from now on; set once,
    /// by the allocator as it is created, before any reading. A clock with one source (the
    /// simulator's virtual time) ignores it.
    fn set_trace_clock(&self, clock: TraceClock);
}

/// Whole segments of device memory.
pub trait Segments {
    /// Total bytes of device memory (used to resolve `memory_fraction`).
    fn total_memory(&self) -> BackendResult<u64>;

    /// Bytes of device memory free now, whoever holds the rest: other processes included
    /// (`cuMemGetInfo`). Without a limit it is the headroom that binds; asked only when
    /// memory is about to be mapped, never on the hot path.
    fn free_memory(&self) -> BackendResult<u64>;

    /// Obtains `size` bytes of device memory. An exhausted device is reported with
    /// [`BackendError::out_of_memory`].
    fn alloc_segment(&self, size: u64) -> BackendResult<DevicePtr>;

    /// Returns a segment obtained from [`Segments::alloc_segment`]. Returns only once no
    /// stream can still use the memory.
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> BackendResult<()>;
}

/// Events: what a freed block carries until the streams that used it are done.
pub trait Events {
    /// Creates an event for ordering only (timing disabled).
    fn create_event(&self) -> BackendResult<EventHandle>;

    /// Destroys an event created by [`Events::create_event`].
    fn destroy_event(&self, event: EventHandle) -> BackendResult<()>;

    /// Captures the work enqueued on `stream` so far (`cuEventRecord`).
    fn record_event(&self, event: EventHandle, stream: StreamId) -> BackendResult<()>;

    /// True if the captured work has completed (`cuEventQuery`). Costly on real devices
    /// (~1.25 µs): the engine calls it rarely and in batches.
    fn query_event(&self, event: EventHandle) -> BackendResult<bool>;

    /// Blocks the host until the captured work has completed (`cuEventSynchronize`).
    fn synchronize_event(&self, event: EventHandle) -> BackendResult<()>;
}

/// Streams: ordering on the device, synchronising with it, and graph capture.
pub trait Streams {
    /// Makes `stream` wait, on the device, for the work captured by `event`
    /// (`cuStreamWaitEvent`): the host does not block.
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> BackendResult<()>;

    /// Blocks the host until all work on every stream of the device has completed.
    fn synchronize_device(&self) -> BackendResult<()>;

    /// True while `stream` is being captured into a CUDA graph, when event queries and
    /// device synchronisation are forbidden. A device without graphs answers `false`.
    fn is_capturing(&self, stream: StreamId) -> BackendResult<bool>;
}

/// Virtual memory, for expandable segments and stitching.
///
/// In the style of CUDA's VMM API: reserve a range of addresses with no memory behind it
/// (`cuMemAddressReserve`), then map and unmap physical pages of
/// [`VirtualMemory::page_size`] bytes into it (`cuMemCreate` + `cuMemMap` +
/// `cuMemSetAccess`, and `cuMemUnmap` + `cuMemRelease`). A backend without it says so with
/// [`forward_backend!`](crate::forward_backend)'s `unsupported VirtualMemory` (or answers `false` from
/// [`VirtualMemory::supports_virtual_memory`]); the allocator then falls back to whole
/// segments.
pub trait VirtualMemory {
    /// True if the backend implements the methods below.
    fn supports_virtual_memory(&self) -> bool;

    /// Granularity of [`VirtualMemory::map_pages`] and [`VirtualMemory::unmap_pages`]:
    /// every address and length passed to them is a multiple of it.
    fn page_size(&self) -> u64;

    /// Reserves `size` bytes of address space with nothing mapped (`cuMemAddressReserve`).
    /// Costs no device memory; touching it before [`VirtualMemory::map_pages`] is an error.
    fn reserve_address_space(&self, size: u64) -> BackendResult<DevicePtr>;

    /// Releases a reservation made by [`VirtualMemory::reserve_address_space`]; nothing in
    /// it may still be mapped (`cuMemAddressFree`).
    fn release_address_space(&self, ptr: DevicePtr, size: u64) -> BackendResult<()>;

    /// Backs `[ptr, ptr + size)` of a reservation with fresh physical pages and makes them
    /// accessible. An exhausted device is reported with [`BackendError::out_of_memory`].
    fn map_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()>;

    /// Makes every later [`VirtualMemory::map_pages`] back each page with its own physical
    /// allocation (on), or the whole range with one (off, the initial state). Drivers map
    /// an allocation a second time only whole (`cuMemMap` of part of an allocation, or at
    /// a non-zero offset, answers `CUDA_ERROR_NOT_SUPPORTED`, measured on an H100 with
    /// driver 580), so stitching needs one allocation per page; the cost is one
    /// `cuMemCreate` and one `cuMemMap` per page where one per mapping would do.
    fn set_page_allocations(&self, on: bool);

    /// Maps the physical pages now mapped at `[src, src + size)` (whole allocations, see
    /// [`VirtualMemory::set_page_allocations`], possibly several) a second time, at
    /// `[dst, dst + size)` of a reservation, and makes them accessible there (`cuMemMap` of
    /// each allocation handle at an offset, then `cuMemSetAccess`). Allocates no memory:
    /// this is how a stitched range is made from free pages scattered over a reservation.
    /// Undone with [`VirtualMemory::unmap_pages`] over the whole of `[dst, dst + size)`.
    fn alias_pages(&self, dst: DevicePtr, src: DevicePtr, size: u64) -> BackendResult<()>;

    /// Unmaps `[ptr, ptr + size)`, whole mappings made by [`VirtualMemory::map_pages`] or
    /// [`VirtualMemory::alias_pages`], and releases the physical pages no other mapping
    /// holds. Unlike `cuMemFree`, the driver does not synchronise: the caller must first
    /// make sure (by synchronising, or by events seen complete) that no stream can still
    /// use the range. The simulator reports a race otherwise.
    fn unmap_pages(&self, ptr: DevicePtr, size: u64) -> BackendResult<()>;

    /// Like [`VirtualMemory::map_pages`], but backs the whole range with one physical
    /// allocation whatever [`VirtualMemory::set_page_allocations`] says: for memory that is
    /// never stitched and goes back to the device whole (a sleeping memory pool, see
    /// `allocator::sleep`), where each allocation costs a driver call to make and another
    /// to release.
    fn map_pages_whole(&self, ptr: DevicePtr, size: u64) -> BackendResult<()>;
}

/// Page-locked host memory and copies: the backup of sleeping memory.
///
/// Page-locked host buffers and copies between them and device memory, on one stream of
/// the backend's own (`cuMemHostAlloc`, `cuMemcpyDtoHAsync`, `cuMemcpyHtoDAsync`,
/// `cuStreamSynchronize`). A copy is ordered after the work the host has seen complete
/// when it is issued, and nothing else: the caller waits for the memory's users first. A
/// backend without them says so with [`forward_backend!`](crate::forward_backend)'s `unsupported HostMemory`, and
/// sleeping with a backup is refused.
pub trait HostMemory {
    /// Allocates `size` bytes of page-locked host memory.
    fn alloc_host(&self, size: u64) -> BackendResult<HostPtr>;

    /// Frees a buffer of [`HostMemory::alloc_host`]; no copy may still use it (the caller
    /// synchronised the copies first).
    fn free_host(&self, ptr: HostPtr, size: u64) -> BackendResult<()>;

    /// Enqueues a copy of `[src, src + size)` of device memory to `dst`, inside a buffer of
    /// [`HostMemory::alloc_host`], on the backend's copy stream.
    fn copy_to_host(&self, dst: HostPtr, src: DevicePtr, size: u64) -> BackendResult<()>;

    /// Enqueues a copy of `size` bytes of the host buffer at `src` to device memory at
    /// `dst`, on the backend's copy stream.
    fn copy_to_device(&self, dst: DevicePtr, src: HostPtr, size: u64) -> BackendResult<()>;

    /// Blocks the host until every copy enqueued so far has completed.
    fn synchronize_copies(&self) -> BackendResult<()>;
}

/// The error of a virtual-memory call on a backend without virtual memory.
#[doc(hidden)]
pub fn unsupported(operation: &'static str) -> BackendError {
    BackendError::new(operation, "virtual memory is not supported by this backend")
}

/// The error of a host-memory call on a backend without host memory.
#[doc(hidden)]
pub fn unsupported_host(operation: &'static str) -> BackendError {
    BackendError::new(
        operation,
        "host memory and copies are not supported by this backend",
    )
}

crate::forward_backend! {
    impl[B: ?Sized] for Arc<B> as shared => &**shared, B;
    Clock, Segments, Events, Streams, VirtualMemory, HostMemory, IpcBackend
}
