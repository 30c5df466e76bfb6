//! The one way a backend wrapper forwards the capability groups it does not change, and
//! the one way a backend says it lacks one.
//!
//! A wrapper (a test's device that drops waits, a clock of another unit, segments taken
//! from another allocator) changes one or two groups of [`Backend`](super::Backend) and
//! must pass every other call through untouched. Written out by hand, each such wrapper
//! repeated some thirty methods, and one that missed a method with a default body lost that
//! capability without a word. So the groups have no default bodies, and
//! [`forward_backend!`](crate::forward_backend) writes the forwarding impls: the wrapper
//! lists the groups it forwards, implements the ones it changes, and a group it forgets
//! leaves it no `Backend`, which does not compile where it is used as one.

/// Implements capability groups of [`Backend`](crate::Backend) for a wrapper by calling
/// the same methods on the backend inside it, and (after `unsupported`) implements the
/// groups a backend lacks as "not supported by this backend".
///
/// ```text
/// forward_backend! {
///     impl[GENERICS] for WRAPPER as THIS => INNER_REF, INNER_TYPE;
///     GROUP, GROUP, ...            // forwarded to INNER_REF (an expression over THIS)
///     ; unsupported GROUP, ...     // optional: VirtualMemory and/or HostMemory
/// }
/// ```
/// The groups are `Clock`, `Segments`, `Events`, `Streams`, `VirtualMemory`,
/// `HostMemory` and `IpcBackend` (CUDA IPC, outside `Backend`). A forwarded group is
/// implemented where `INNER_TYPE` implements it.
///
/// ```
/// use streamalloc_allocator::backend::sim::SimBackend;
/// use streamalloc_allocator::backend::{BackendResult, Streams};
/// use streamalloc_allocator::{forward_backend, Allocator, Config, EventHandle, StreamId};
///
/// /// The simulator, but a device-side wait is never made (a planted bug).
/// struct DropWaits(SimBackend);
///
/// forward_backend! {
///     impl[] for DropWaits as this => &this.0, SimBackend;
///     Clock, Segments, Events, VirtualMemory, HostMemory
/// }
///
/// impl Streams for DropWaits {
///     fn stream_wait_event(&self, _: StreamId, _: EventHandle) -> BackendResult<()> {
///         Ok(())
///     }
///     fn synchronize_device(&self) -> BackendResult<()> {
///         self.0.synchronize_device()
///     }
///     fn is_capturing(&self, stream: StreamId) -> BackendResult<bool> {
///         self.0.is_capturing(stream)
///     }
/// }
///
/// let allocator = Allocator::new(DropWaits(SimBackend::new(1 << 30)), Config::default());
/// assert!(allocator.is_ok());
/// ```
#[macro_export]
macro_rules! forward_backend {
    (
        impl $generics:tt for $wrapper:ty as $this:ident => $inner:expr, $inner_ty:ty;
        $($group:ident),+ $(,)?
        $(; unsupported $($lacking:ident),+ $(,)?)?
    ) => {
        $(
            $crate::forward_backend!(
                @forward $group $generics $wrapper, $this, $inner, $inner_ty
            );
        )+
        $($(
            $crate::forward_backend!(@unsupported $lacking $generics $wrapper);
        )+)?
    };

    (@forward Clock [$($g:tt)*] $w:ty, $this:ident, $inner:expr, $it:ty) => {
        impl<$($g)*> $crate::backend::Clock for $w where $it: $crate::backend::Clock {
            #[inline]
            fn now_ns(&self) -> u64 {
                let $this = self;
                $crate::backend::Clock::now_ns($inner)
            }
            #[inline]
            fn now_ticks(&self) -> u64 {
                let $this = self;
                $crate::backend::Clock::now_ticks($inner)
            }
            #[inline]
            fn ticks_to_ns(&self, ticks: u64) -> u64 {
                let $this = self;
                $crate::backend::Clock::ticks_to_ns($inner, ticks)
            }
            #[inline]
            fn precise_ns(&self) -> u64 {
                let $this = self;
                $crate::backend::Clock::precise_ns($inner)
            }
            fn set_trace_clock(&self, clock: $crate::config::TraceClock) {
                let $this = self;
                $crate::backend::Clock::set_trace_clock($inner, clock)
            }
        }
    };

    (@forward Segments [$($g:tt)*] $w:ty, $this:ident, $inner:expr, $it:ty) => {
        impl<$($g)*> $crate::backend::Segments for $w where $it: $crate::backend::Segments {
            #[inline]
            fn total_memory(&self) -> $crate::backend::BackendResult<u64> {
                let $this = self;
                $crate::backend::Segments::total_memory($inner)
            }
            #[inline]
            fn free_memory(&self) -> $crate::backend::BackendResult<u64> {
                let $this = self;
                $crate::backend::Segments::free_memory($inner)
            }
            #[inline]
            fn alloc_segment(&self, size: u64) -> $crate::backend::BackendResult<$crate::DevicePtr> {
                let $this = self;
                $crate::backend::Segments::alloc_segment($inner, size)
            }
            #[inline]
            fn free_segment(
                &self,
                ptr: $crate::DevicePtr,
                size: u64,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::Segments::free_segment($inner, ptr, size)
            }
        }
    };

    (@forward Events [$($g:tt)*] $w:ty, $this:ident, $inner:expr, $it:ty) => {
        impl<$($g)*> $crate::backend::Events for $w where $it: $crate::backend::Events {
            #[inline]
            fn create_event(&self) -> $crate::backend::BackendResult<$crate::EventHandle> {
                let $this = self;
                $crate::backend::Events::create_event($inner)
            }
            #[inline]
            fn destroy_event(&self, event: $crate::EventHandle) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::Events::destroy_event($inner, event)
            }
            #[inline]
            fn record_event(
                &self,
                event: $crate::EventHandle,
                stream: $crate::StreamId,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::Events::record_event($inner, event, stream)
            }
            #[inline]
            fn query_event(&self, event: $crate::EventHandle) -> $crate::backend::BackendResult<bool> {
                let $this = self;
                $crate::backend::Events::query_event($inner, event)
            }
            #[inline]
            fn synchronize_event(
                &self,
                event: $crate::EventHandle,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::Events::synchronize_event($inner, event)
            }
        }
    };

    (@forward Streams [$($g:tt)*] $w:ty, $this:ident, $inner:expr, $it:ty) => {
        impl<$($g)*> $crate::backend::Streams for $w where $it: $crate::backend::Streams {
            #[inline]
            fn stream_wait_event(
                &self,
                stream: $crate::StreamId,
                event: $crate::EventHandle,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::Streams::stream_wait_event($inner, stream, event)
            }
            #[inline]
            fn synchronize_device(&self) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::Streams::synchronize_device($inner)
            }
            #[inline]
            fn is_capturing(&self, stream: $crate::StreamId) -> $crate::backend::BackendResult<bool> {
                let $this = self;
                $crate::backend::Streams::is_capturing($inner, stream)
            }
        }
    };

    (@forward VirtualMemory [$($g:tt)*] $w:ty, $this:ident, $inner:expr, $it:ty) => {
        impl<$($g)*> $crate::backend::VirtualMemory for $w
        where
            $it: $crate::backend::VirtualMemory,
        {
            #[inline]
            fn supports_virtual_memory(&self) -> bool {
                let $this = self;
                $crate::backend::VirtualMemory::supports_virtual_memory($inner)
            }
            #[inline]
            fn page_size(&self) -> u64 {
                let $this = self;
                $crate::backend::VirtualMemory::page_size($inner)
            }
            #[inline]
            fn reserve_address_space(
                &self,
                size: u64,
            ) -> $crate::backend::BackendResult<$crate::DevicePtr> {
                let $this = self;
                $crate::backend::VirtualMemory::reserve_address_space($inner, size)
            }
            #[inline]
            fn release_address_space(
                &self,
                ptr: $crate::DevicePtr,
                size: u64,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::VirtualMemory::release_address_space($inner, ptr, size)
            }
            #[inline]
            fn map_pages(&self, ptr: $crate::DevicePtr, size: u64) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::VirtualMemory::map_pages($inner, ptr, size)
            }
            #[inline]
            fn set_page_allocations(&self, on: bool) {
                let $this = self;
                $crate::backend::VirtualMemory::set_page_allocations($inner, on)
            }
            #[inline]
            fn alias_pages(
                &self,
                dst: $crate::DevicePtr,
                src: $crate::DevicePtr,
                size: u64,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::VirtualMemory::alias_pages($inner, dst, src, size)
            }
            #[inline]
            fn unmap_pages(&self, ptr: $crate::DevicePtr, size: u64) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::VirtualMemory::unmap_pages($inner, ptr, size)
            }
            #[inline]
            fn map_pages_whole(
                &self,
                ptr: $crate::DevicePtr,
                size: u64,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::VirtualMemory::map_pages_whole($inner, ptr, size)
            }
        }
    };

    (@forward HostMemory [$($g:tt)*] $w:ty, $this:ident, $inner:expr, $it:ty) => {
        impl<$($g)*> $crate::backend::HostMemory for $w where $it: $crate::backend::HostMemory {
            #[inline]
            fn alloc_host(&self, size: u64) -> $crate::backend::BackendResult<$crate::HostPtr> {
                let $this = self;
                $crate::backend::HostMemory::alloc_host($inner, size)
            }
            #[inline]
            fn free_host(&self, ptr: $crate::HostPtr, size: u64) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::HostMemory::free_host($inner, ptr, size)
            }
            #[inline]
            fn copy_to_host(
                &self,
                dst: $crate::HostPtr,
                src: $crate::DevicePtr,
                size: u64,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::HostMemory::copy_to_host($inner, dst, src, size)
            }
            #[inline]
            fn copy_to_device(
                &self,
                dst: $crate::DevicePtr,
                src: $crate::HostPtr,
                size: u64,
            ) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::HostMemory::copy_to_device($inner, dst, src, size)
            }
            #[inline]
            fn synchronize_copies(&self) -> $crate::backend::BackendResult<()> {
                let $this = self;
                $crate::backend::HostMemory::synchronize_copies($inner)
            }
        }
    };

    (@forward IpcBackend [$($g:tt)*] $w:ty, $this:ident, $inner:expr, $it:ty) => {
        impl<$($g)*> $crate::backend::ipc::IpcBackend for $w
        where
            $it: $crate::backend::ipc::IpcBackend,
        {
            #[inline]
            fn ipc_export(
                &self,
                ptr: $crate::DevicePtr,
                size: u64,
            ) -> Result<Vec<$crate::backend::ipc::ExportedMapping>, $crate::backend::ipc::IpcError> {
                let $this = self;
                $crate::backend::ipc::IpcBackend::ipc_export($inner, ptr, size)
            }
            #[inline]
            fn ipc_import(
                &self,
                pid: i32,
                mappings: &[$crate::backend::ipc::ForeignMapping],
            ) -> Result<$crate::DevicePtr, $crate::backend::ipc::IpcError> {
                let $this = self;
                $crate::backend::ipc::IpcBackend::ipc_import($inner, pid, mappings)
            }
            #[inline]
            fn ipc_import_size(&self, ptr: $crate::DevicePtr) -> Option<u64> {
                let $this = self;
                $crate::backend::ipc::IpcBackend::ipc_import_size($inner, ptr)
            }
            #[inline]
            fn ipc_close(&self, ptr: $crate::DevicePtr) -> Result<(), $crate::backend::ipc::IpcError> {
                let $this = self;
                $crate::backend::ipc::IpcBackend::ipc_close($inner, ptr)
            }
        }
    };

    (@unsupported VirtualMemory [$($g:tt)*] $w:ty) => {
        /// No virtual memory: expandable segments fall back to whole segments.
        impl<$($g)*> $crate::backend::VirtualMemory for $w {
            fn supports_virtual_memory(&self) -> bool {
                false
            }
            fn page_size(&self) -> u64 {
                2 << 20
            }
            fn reserve_address_space(
                &self,
                _size: u64,
            ) -> $crate::backend::BackendResult<$crate::DevicePtr> {
                Err($crate::backend::unsupported("cuMemAddressReserve"))
            }
            fn release_address_space(
                &self,
                _ptr: $crate::DevicePtr,
                _size: u64,
            ) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported("cuMemAddressFree"))
            }
            fn map_pages(&self, _ptr: $crate::DevicePtr, _size: u64) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported("cuMemMap"))
            }
            fn set_page_allocations(&self, _on: bool) {}
            fn alias_pages(
                &self,
                _dst: $crate::DevicePtr,
                _src: $crate::DevicePtr,
                _size: u64,
            ) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported("cuMemMap"))
            }
            fn unmap_pages(&self, _ptr: $crate::DevicePtr, _size: u64) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported("cuMemUnmap"))
            }
            fn map_pages_whole(
                &self,
                _ptr: $crate::DevicePtr,
                _size: u64,
            ) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported("cuMemCreate"))
            }
        }
    };

    (@unsupported HostMemory [$($g:tt)*] $w:ty) => {
        /// No page-locked host memory: sleeping with a backup is refused.
        impl<$($g)*> $crate::backend::HostMemory for $w {
            fn alloc_host(&self, _size: u64) -> $crate::backend::BackendResult<$crate::HostPtr> {
                Err($crate::backend::unsupported_host("cuMemHostAlloc"))
            }
            fn free_host(&self, _ptr: $crate::HostPtr, _size: u64) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported_host("cuMemFreeHost"))
            }
            fn copy_to_host(
                &self,
                _dst: $crate::HostPtr,
                _src: $crate::DevicePtr,
                _size: u64,
            ) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported_host("cuMemcpyDtoHAsync"))
            }
            fn copy_to_device(
                &self,
                _dst: $crate::DevicePtr,
                _src: $crate::HostPtr,
                _size: u64,
            ) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported_host("cuMemcpyHtoDAsync"))
            }
            fn synchronize_copies(&self) -> $crate::backend::BackendResult<()> {
                Err($crate::backend::unsupported_host("cuStreamSynchronize"))
            }
        }
    };
}
