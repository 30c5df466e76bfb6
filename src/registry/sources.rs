//! Pools whose segments come from a caller's allocator (PyTorch's
//! `torch.cuda.MemPool(allocator=...)`, e.g. ProcessGroupNCCL's `ncclMemAlloc` buffers for
//! user-buffer registration).
//!
//! The engine asks its [`Backend`] for whole segments and returns them to it; it splits
//! and caches what lies between. So a pool served from another allocator needs no engine
//! change, only a backend that knows where a segment should come from: [`WithSources`]
//! wraps a device's backend and, while a request of a pool with a [`SegmentSource`] runs
//! on this thread (`Sources::with_source`), takes the segments the engine asks for from that
//! source, remembers them, and gives each back to the source that made it when the engine
//! frees it (`empty_cache`, the pool's release, an out-of-memory retry). Every other call
//! goes to the wrapped backend.
//!
//! Expandable segments map pages through the VMM API instead of asking for segments, so a
//! pool with a source grows by whole segments whatever the device's growth
//! (`Allocator::set_pool_whole_segments`), as PyTorch's allocator does for such pools.

use super::{CallError, Device};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};
use streamalloc_allocator::backend::{BackendResult, Segments};
use streamalloc_allocator::{AllocError, Backend, BackendError, DevicePtr, PoolId};

/// Allocates `size` bytes on `device` for a pool segment; null if it cannot.
pub type SegmentAlloc =
    unsafe extern "C" fn(ctx: *mut c_void, size: usize, device: c_int) -> *mut c_void;
/// Frees what the matching [`SegmentAlloc`] returned, `size` bytes at `ptr` on `device`.
pub type SegmentFree =
    unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, size: usize, device: c_int);

/// Where a pool's segments come from: two callbacks and the context they are given.
#[derive(Clone, Copy, Debug)]
pub struct SegmentSource {
    /// Makes a segment.
    pub alloc: SegmentAlloc,
    /// Frees a segment.
    pub free: SegmentFree,
    /// Handed to both, as the caller's own state (an address, kept as an integer so that
    /// the source can cross threads).
    pub ctx: usize,
}

thread_local! {
    /// The source of the request running on this thread, if its pool has one.
    static ACTIVE: Cell<Option<SegmentSource>> = const { Cell::new(None) };
}

/// A device's backend whose segments come from the active [`SegmentSource`] while there
/// is one (see the module docs).
#[derive(Debug)]
pub struct WithSources<B> {
    inner: B,
    ordinal: c_int,
    /// Segments a source made and the engine still holds: address -> (source, size).
    external: Mutex<BTreeMap<u64, (SegmentSource, u64)>>,
}

impl<B> WithSources<B> {
    /// Wraps `inner`, the backend of device `ordinal`.
    pub fn new(inner: B, ordinal: c_int) -> Self {
        Self {
            inner,
            ordinal,
            external: Mutex::new(BTreeMap::new()),
        }
    }

    /// The segments a source made that the engine still holds: (address, size).
    pub fn external_segments(&self) -> Vec<(u64, u64)> {
        let external = self.external.lock().unwrap_or_else(|p| p.into_inner());
        external
            .iter()
            .map(|(&addr, &(_, size))| (addr, size))
            .collect()
    }
}

impl<B> Deref for WithSources<B> {
    type Target = B;

    fn deref(&self) -> &B {
        &self.inner
    }
}

// IPC goes to the wrapped device too: a source's segments are whole segments, shared with
// `cudaIpcGetMemHandle` by the door, never through `IpcBackend`.
streamalloc_allocator::forward_backend! {
    impl[B] for WithSources<B> as this => &this.inner, B;
    Clock, Events, Streams, VirtualMemory, HostMemory, IpcBackend
}

/// Segments come from the active source, if there is one (see the module docs).
impl<B: Segments> Segments for WithSources<B> {
    fn total_memory(&self) -> BackendResult<u64> {
        self.inner.total_memory()
    }
    fn free_memory(&self) -> BackendResult<u64> {
        self.inner.free_memory()
    }
    fn alloc_segment(&self, size: u64) -> BackendResult<DevicePtr> {
        let Some(source) = ACTIVE.with(Cell::get) else {
            return self.inner.alloc_segment(size);
        };
        let bytes = usize::try_from(size)
            .map_err(|_| BackendError::new("pool allocator", "segment size overflows usize"))?;
        // SAFETY: the source's owner registered these callbacks for this pool and keeps
        // `ctx` valid while the pool may allocate (streamalloc_pool_set_segment_source).
        let ptr = unsafe { (source.alloc)(source.ctx as *mut c_void, bytes, self.ordinal) };
        if ptr.is_null() {
            return Err(BackendError::out_of_memory(
                "pool allocator",
                format!("the pool's allocator returned no memory for {size} bytes"),
            ));
        }
        let addr = ptr as usize as u64;
        let mut external = self.external.lock().unwrap_or_else(|p| p.into_inner());
        external.insert(addr, (source, size));
        Ok(DevicePtr(addr))
    }
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        let made_by = {
            let mut external = self.external.lock().unwrap_or_else(|p| p.into_inner());
            external.remove(&ptr.0)
        };
        let Some((source, made_size)) = made_by else {
            return self.inner.free_segment(ptr, size);
        };
        debug_assert_eq!(made_size, size, "a segment freed with another size");
        // SAFETY: `ptr` was made by this source's alloc with `made_size` bytes and the
        // engine holds no block of it any more; `ctx` is valid as for alloc_segment.
        unsafe {
            (source.free)(
                source.ctx as *mut c_void,
                ptr.0 as usize as *mut c_void,
                made_size as usize,
                self.ordinal,
            );
        }
        Ok(())
    }
}

// ---- Which pools have a source ----------------------------------------------------------

/// The pools of a device that have a source.
#[derive(Debug, Default)]
pub(super) struct Sources {
    map: RwLock<BTreeMap<PoolId, SegmentSource>>,
    /// False until a source is set: requests of ordinary pools then skip the lookup.
    any: AtomicBool,
}

impl Sources {
    /// Runs `body` (one engine request of `pool`) with the pool's segment source active on
    /// this thread, if it has one.
    #[inline]
    pub(super) fn with_source<T>(&self, pool: PoolId, body: impl FnOnce() -> T) -> T {
        if pool.is_default() || !self.any.load(Ordering::Acquire) {
            return body();
        }
        let source = {
            let map = self.map.read().unwrap_or_else(|p| p.into_inner());
            map.get(&pool).copied()
        };
        let Some(source) = source else {
            return body();
        };
        /// Clears the active source however `body` ends.
        struct Restore(Option<SegmentSource>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0;
                let _ = ACTIVE.try_with(|active| active.set(previous));
            }
        }
        let _restore = Restore(ACTIVE.with(|active| active.replace(Some(source))));
        body()
    }
}

impl<B: Backend> Device<WithSources<B>> {
    /// Makes `pool` take its segments from `source` from now on, whole, whatever
    /// `expandable_segments` says for the other pools; it must exist and not have
    /// allocated yet. The engine splits and caches them like its own and hands each back
    /// to the source when it releases it. The default pool is refused.
    pub fn set_segment_source(&self, pool: PoolId, source: SegmentSource) -> Result<(), CallError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("given a segment source").into());
        }
        self.run(|allocator| allocator.set_pool_whole_segments(pool))??;
        let sources = &self.sources;
        let mut map = sources.map.write().unwrap_or_else(|p| p.into_inner());
        map.insert(pool, source);
        sources.any.store(true, Ordering::Release);
        Ok(())
    }
}
