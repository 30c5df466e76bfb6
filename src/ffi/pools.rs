//! Memory pools across the C ABI: what a full PyTorch allocator needs of pools beyond
//! malloc and free (the native door, `python/streamalloc/csrc/`), and the pool hooks of
//! PyTorch's pluggable allocator. Looking inside (cache, blocks, snapshots) is in
//! [`introspect`](super::introspect).
//!
//! ```c
//! void*   streamalloc_malloc_in_pool(size_t size, int device, cudaStream_t stream, uint64_t id0, uint64_t id1);
//! int     streamalloc_pool_begin_allocate(int device, uint64_t id0, uint64_t id1);
//! int     streamalloc_pool_end_allocate(int device, uint64_t id0, uint64_t id1);
//! int     streamalloc_pool_incref(int device, uint64_t id0, uint64_t id1);
//! int     streamalloc_pool_release(int device, uint64_t id0, uint64_t id1);
//! int     streamalloc_pool_use_count(int device, uint64_t id0, uint64_t id1);
//! int64_t streamalloc_pool_live_allocations(int device, uint64_t id0, uint64_t id1, uint64_t* out, size_t capacity);
//! int64_t streamalloc_pool_checkpoint(int device, uint64_t id0, uint64_t id1, streamalloc_pool_block_t* out, size_t capacity);
//! int64_t streamalloc_pool_restore(int device, uint64_t id0, uint64_t id1, const streamalloc_pool_block_t* blocks, size_t count, uint64_t* freed, size_t freed_capacity);
//! int     streamalloc_empty_cache_pool(int device, uint64_t id0, uint64_t id1);
//! // PyTorch's pluggable hooks (set_begin_allocate_to_pool, set_end_allocate_to_pool_fn, set_release_pool):
//! void    streamalloc_begin_allocate_to_pool(int device, MempoolId_t id, std::function<bool(cudaStream_t)> filter);
//! void    streamalloc_end_allocate_to_pool(int device, MempoolId_t id);
//! void    streamalloc_release_pool(int device, MempoolId_t id);
//! ```
//!
//! A pool id is PyTorch's `MempoolId_t`, a pair of 64-bit integers, passed as two
//! arguments (a trivially copyable pair travels in two registers, so the pluggable hooks'
//! C++ signatures and these agree).
//!
//! # The pluggable hooks' routing
//! PyTorch hands `beginAllocateToPool` a C++ `std::function` filter that C cannot call;
//! the registry routes by what the filter stands for (`registry::routes` says how and
//! why). The native door evaluates the real filters.

pub use super::layout::{StreamallocBlockState, StreamallocPoolBlock, StreamallocSegmentInfo};
use super::{copy_out, device_call, engine_message, error, fail, or_fail};
use crate::registry::{self, DeviceError, Registry};
use std::ffi::{c_int, c_void};
use streamalloc_allocator::{Backend, DevicePtr, PoolBlock, PoolId, StreamId};

/// Allocates `size` bytes on `device` for `stream` from pool `(id0, id1)`; `(0, 0)` is
/// the default pool. Null for `size == 0` and on failure (see `streamalloc_last_error`);
/// never calls the error thrower.
#[no_mangle]
pub extern "C" fn streamalloc_malloc_in_pool(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    id0: u64,
    id1: u64,
) -> *mut c_void {
    malloc_in_pool(registry::global(), size, device, stream, id0, id1)
}

/// [`streamalloc_malloc_in_pool`] on `registry`.
#[inline]
pub fn malloc_in_pool<B: Backend>(
    registry: &Registry<B>,
    size: usize,
    device: c_int,
    stream: *mut c_void,
    id0: u64,
    id1: u64,
) -> *mut c_void {
    // Nothing here can panic: the registry contains panics in creating a device and in
    // the request's way through it (source, engine, fallback), and the report of a failure
    // guards itself.
    error::clear();
    if size == 0 {
        return std::ptr::null_mut();
    }
    let (stream, pool) = (StreamId(stream as usize as u64), PoolId(id0, id1));
    let Some(on) = registry.get(device) else {
        // A device not in use yet (created now) or unusable: the registry's whole way.
        return match registry.malloc_in(device, size as u64, stream, pool) {
            Ok(block) => block.ptr.0 as usize as *mut c_void,
            Err(err) => error::pool_malloc_failed(&err),
        };
    };
    // The fast path (the native door's every allocation): no error is built unless the
    // request fails.
    match on.malloc_in_ptr(size as u64, stream, pool) {
        Ok(ptr) => ptr.0 as usize as *mut c_void,
        Err(error) => error::pool_malloc_failed(&DeviceError {
            ordinal: device,
            error: *error,
        }),
    }
}

/// A capture into pool `(id0, id1)` (or a `use_mem_pool` context) begins: creates the
/// pool or adds a use, and until the matching end the engine makes no event query, wait or
/// synchronisation a capture forbids, on any stream. Returns the new use count, or -1.
#[no_mangle]
pub extern "C" fn streamalloc_pool_begin_allocate(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_begin_allocate(registry::global(), device, id0, id1)
}

/// [`streamalloc_pool_begin_allocate`] on `registry`.
pub fn pool_begin_allocate<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
) -> c_int {
    device_call(registry, device, -1, |allocator| {
        allocator
            .begin_allocate_to_pool(PoolId(id0, id1))
            .map(use_count)
            .map_err(|err| engine_message(device, err))
    })
}

/// A use count as C's `int` (saturated: a count beyond `INT_MAX` is no error).
fn use_count(uses: u32) -> c_int {
    c_int::try_from(uses).unwrap_or(c_int::MAX)
}

/// Ends the newest begin of pool `(id0, id1)` (the pool keeps its use). 0, or -1.
#[no_mangle]
pub extern "C" fn streamalloc_pool_end_allocate(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_end_allocate(registry::global(), device, id0, id1)
}

/// [`streamalloc_pool_end_allocate`] on `registry`.
pub fn pool_end_allocate<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
) -> c_int {
    device_call(registry, device, -1, |allocator| {
        allocator
            .end_allocate_to_pool(PoolId(id0, id1))
            .map(|()| 0)
            .map_err(|err| engine_message(device, err))
    })
}

/// Creates pool `(id0, id1)` with one use, or adds one. Returns the new use count, or -1.
#[no_mangle]
pub extern "C" fn streamalloc_pool_incref(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_incref(registry::global(), device, id0, id1)
}

/// [`streamalloc_pool_incref`] on `registry`.
pub fn pool_incref<B: Backend>(registry: &Registry<B>, device: c_int, id0: u64, id1: u64) -> c_int {
    device_call(registry, device, -1, |allocator| {
        allocator
            .create_or_incref_pool(PoolId(id0, id1))
            .map(use_count)
            .map_err(|err| engine_message(device, err))
    })
}

/// Drops a use of pool `(id0, id1)`. Returns the remaining use count, or -1.
#[no_mangle]
pub extern "C" fn streamalloc_pool_release(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_release(registry::global(), device, id0, id1)
}

/// [`streamalloc_pool_release`] on `registry`.
pub fn pool_release<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
) -> c_int {
    device_call(registry, device, -1, |allocator| {
        allocator
            .release_pool(PoolId(id0, id1))
            .map(use_count)
            .map_err(|err| engine_message(device, err))
    })
}

/// The use count of pool `(id0, id1)`, 0 if it does not exist (on a device that is
/// unavailable no pool exists), as the header documents.
#[no_mangle]
pub extern "C" fn streamalloc_pool_use_count(device: c_int, id0: u64, id1: u64) -> c_int {
    pool_use_count(registry::global(), device, id0, id1)
}

/// [`streamalloc_pool_use_count`] on `registry`.
pub fn pool_use_count<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
) -> c_int {
    device_call(registry, device, 0, |allocator| {
        Ok(use_count(allocator.pool_use_count(PoolId(id0, id1))))
    })
}

/// Writes the addresses of pool `(id0, id1)`'s live allocations (up to `capacity`) to
/// `out` and returns how many there are, or -1.
///
/// # Safety
/// `out` must be null or writable for `capacity` `uint64_t`s.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_pool_live_allocations(
    device: c_int,
    id0: u64,
    id1: u64,
    out: *mut u64,
    capacity: usize,
) -> i64 {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { pool_live_allocations(registry::global(), device, id0, id1, out, capacity) }
}

/// [`streamalloc_pool_live_allocations`] on `registry`.
///
/// # Safety
/// As [`streamalloc_pool_live_allocations`].
pub unsafe fn pool_live_allocations<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
    out: *mut u64,
    capacity: usize,
) -> i64 {
    device_call(registry, device, -1, |allocator| {
        let live: Vec<u64> = allocator
            .pool_live_allocations(PoolId(id0, id1))
            .iter()
            .map(|ptr| ptr.0)
            .collect();
        // SAFETY: forwarded from this function's # Safety.
        Ok(unsafe { copy_out(&live, out, capacity) })
    })
}

/// Writes pool `(id0, id1)`'s live allocations with sizes and streams (up to `capacity`)
/// to `out` and returns how many there are, or -1.
///
/// # Safety
/// `out` must be null or writable for `capacity` `streamalloc_pool_block_t`s.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_pool_checkpoint(
    device: c_int,
    id0: u64,
    id1: u64,
    out: *mut StreamallocPoolBlock,
    capacity: usize,
) -> i64 {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { pool_checkpoint(registry::global(), device, id0, id1, out, capacity) }
}

/// [`streamalloc_pool_checkpoint`] on `registry`.
///
/// # Safety
/// As [`streamalloc_pool_checkpoint`].
pub unsafe fn pool_checkpoint<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
    out: *mut StreamallocPoolBlock,
    capacity: usize,
) -> i64 {
    device_call(registry, device, -1, |allocator| {
        let blocks: Vec<StreamallocPoolBlock> = allocator
            .pool_checkpoint(PoolId(id0, id1))
            .iter()
            .map(|b| StreamallocPoolBlock {
                address: b.ptr.0,
                size: b.size,
                requested: b.requested,
                stream: b.stream.0,
            })
            .collect();
        // SAFETY: forwarded from this function's # Safety.
        Ok(unsafe { copy_out(&blocks, out, capacity) })
    })
}

/// Puts pool `(id0, id1)` back to the checkpoint `blocks[..count]`: every live
/// allocation of the pool is freed (addresses written to `freed`, which needs room for
/// all of them) and the checkpoint's blocks are allocated again at their addresses.
/// Returns the number freed, or -1 (nothing changed if the room was too small or the
/// checkpoint no longer fits the pool's memory).
///
/// # Safety
/// `blocks` must be readable for `count` elements and `freed` writable for
/// `freed_capacity` `uint64_t`s (either may be null when its count is 0).
#[no_mangle]
pub unsafe extern "C" fn streamalloc_pool_restore(
    device: c_int,
    id0: u64,
    id1: u64,
    blocks: *const StreamallocPoolBlock,
    count: usize,
    freed: *mut u64,
    freed_capacity: usize,
) -> i64 {
    // SAFETY: forwarded from this function's # Safety.
    unsafe {
        pool_restore(
            registry::global(),
            device,
            id0,
            id1,
            blocks,
            count,
            freed,
            freed_capacity,
        )
    }
}

/// [`streamalloc_pool_restore`] on `registry`.
///
/// # Safety
/// As [`streamalloc_pool_restore`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn pool_restore<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
    blocks: *const StreamallocPoolBlock,
    count: usize,
    freed: *mut u64,
    freed_capacity: usize,
) -> i64 {
    if count > 0 && blocks.is_null() {
        return error::call(-1, || fail(-1, "streamalloc_pool_restore: blocks is null"));
    }
    let checkpoint: Vec<PoolBlock> = if count == 0 {
        Vec::new()
    } else {
        // SAFETY: `blocks` is non-null and readable for `count` elements (see # Safety).
        unsafe { std::slice::from_raw_parts(blocks, count) }
            .iter()
            .map(|b| PoolBlock {
                ptr: DevicePtr(b.address),
                size: b.size,
                requested: b.requested,
                stream: StreamId(b.stream),
            })
            .collect()
    };
    device_call(registry, device, -1, |allocator| {
        let pool = PoolId(id0, id1);
        let live = allocator.pool_live_allocations(pool).len();
        if live > freed_capacity || (live > 0 && freed.is_null()) {
            return Err(format!(
                "streamalloc_pool_restore: {pool} has {live} live allocations, room for {freed_capacity}"
            ));
        }
        let addresses: Vec<u64> = allocator
            .restore_pool(pool, &checkpoint)
            .map_err(|err| engine_message(device, err))?
            .iter()
            .map(|ptr| ptr.0)
            .collect();
        // SAFETY: `freed` has room for `live` addresses, as many as were freed (checked
        // above under the same engine state: pool calls of one device are serialised by
        // the caller's allocator lock).
        Ok(unsafe { copy_out(&addresses, freed, freed_capacity) })
    })
}

/// Synchronises `device` and returns cached memory: with pool `(0, 0)`, that of the
/// default pool and of released pools; otherwise that pool's only. 0, or -1.
#[no_mangle]
pub extern "C" fn streamalloc_empty_cache_pool(device: c_int, id0: u64, id1: u64) -> c_int {
    empty_cache_pool(registry::global(), device, id0, id1)
}

/// [`streamalloc_empty_cache_pool`] on `registry`.
pub fn empty_cache_pool<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
) -> c_int {
    device_call(registry, device, -1, |allocator| {
        allocator
            .empty_pool_cache(PoolId(id0, id1))
            .map(|_| 0)
            .map_err(|err| format!("streamalloc: empty_cache on device {device}: {err}"))
    })
}

// ---- The pluggable door's pool hooks ---------------------------------------------------

/// PyTorch's pluggable `beginAllocateToPool` hook: begins allocating to pool `(id0,
/// id1)` (see [`streamalloc_pool_begin_allocate`]) and routes this thread's requests and
/// those on capturing streams to it until [`streamalloc_end_allocate_to_pool`]. The C++
/// `std::function` filter is not called (see the module docs).
#[no_mangle]
pub extern "C" fn streamalloc_begin_allocate_to_pool(
    device: c_int,
    id0: u64,
    id1: u64,
    filter: *mut c_void,
) {
    begin_allocate_to_pool(registry::global(), device, id0, id1, filter)
}

/// [`streamalloc_begin_allocate_to_pool`] on `registry`.
pub fn begin_allocate_to_pool<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    id0: u64,
    id1: u64,
    _filter: *mut c_void,
) {
    error::call((), || {
        let begun = registry.on(device, |d| d.begin_routing(PoolId(id0, id1)));
        if or_fail(-1, begun.map(use_count)) < 0 {
            eprintln!("{}", error::last_string());
        }
    })
}

/// PyTorch's pluggable `endAllocateToPool` hook: requests stop going to pool `(id0,
/// id1)` (its memory stays reserved for it until released).
#[no_mangle]
pub extern "C" fn streamalloc_end_allocate_to_pool(device: c_int, id0: u64, id1: u64) {
    end_allocate_to_pool(registry::global(), device, id0, id1)
}

/// [`streamalloc_end_allocate_to_pool`] on `registry`.
pub fn end_allocate_to_pool<B: Backend>(registry: &Registry<B>, device: c_int, id0: u64, id1: u64) {
    error::call((), || {
        let ended = registry.on(device, |d| d.end_routing(PoolId(id0, id1)));
        if or_fail(-1, ended.map(|()| 0)) < 0 {
            eprintln!("{}", error::last_string());
        }
    })
}

/// PyTorch's pluggable `releasePool` hook: drops a use of pool `(id0, id1)`.
#[no_mangle]
pub extern "C" fn streamalloc_release_pool(device: c_int, id0: u64, id1: u64) {
    release_pool(registry::global(), device, id0, id1)
}

/// [`streamalloc_release_pool`] on `registry`.
pub fn release_pool<B: Backend>(registry: &Registry<B>, device: c_int, id0: u64, id1: u64) {
    error::call((), || {
        if pool_release(registry, device, id0, id1) < 0 {
            eprintln!("{}", error::last_string());
        }
    })
}
