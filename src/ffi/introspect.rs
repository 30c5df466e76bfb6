//! Looking inside the allocator across the C ABI, for the native door and PyTorch's
//! introspection: the largest cached block, the limit, the segment under a pointer (CUDA
//! IPC), the snapshot as flat arrays.
//!
//! ```c
//! int     streamalloc_cache_info(int device, uint64_t* largest);
//! int     streamalloc_block_info(void* ptr, int* device, uint64_t* base, uint64_t* size, int* expandable);
//! int     streamalloc_snapshot_segments(int device, streamalloc_segment_info_t* segments, size_t segment_capacity, size_t* segment_count, streamalloc_block_state_t* blocks, size_t block_capacity, size_t* block_count);
//! uint64_t streamalloc_memory_limit(int device);
//! ```

use super::layout::{StreamallocBlockState, StreamallocSegmentInfo};
use super::{copy_out, device_call, error, fail};
use crate::registry::{self, Device, Registry};
use std::ffi::{c_int, c_void};
use streamalloc_allocator::snapshot::{BlockState, Snapshot};
use streamalloc_allocator::{AllocationSite, Backend, DevicePtr};

/// The largest free cached block of `device`'s default pool, in `*largest`. 0, or -1.
///
/// # Safety
/// `largest` must be null or writable for one `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_cache_info(device: c_int, largest: *mut u64) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { cache_info(registry::global(), device, largest) }
}

/// [`streamalloc_cache_info`] on `registry`.
///
/// # Safety
/// As [`streamalloc_cache_info`].
pub unsafe fn cache_info<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    largest: *mut u64,
) -> c_int {
    if largest.is_null() {
        return error::call(-1, || fail(-1, "streamalloc_cache_info: largest is null"));
    }
    device_call(registry, device, -1, |allocator| {
        // SAFETY: `largest` is non-null and writable (see # Safety).
        unsafe { largest.write(allocator.largest_free_block()) };
        Ok(0)
    })
}

/// The reserved-bytes limit of `device` (0: none, or the device is unavailable).
#[no_mangle]
pub extern "C" fn streamalloc_memory_limit(device: c_int) -> u64 {
    memory_limit(registry::global(), device)
}

/// [`streamalloc_memory_limit`] on `registry`.
pub fn memory_limit<B: Backend>(registry: &Registry<B>, device: c_int) -> u64 {
    device_call(registry, device, 0, |allocator| {
        Ok(allocator.memory_limit().unwrap_or(0))
    })
}

/// The device that handed out the live allocation at `ptr`, and where it lies. Devices
/// made unusable by a panic are not searched.
pub(super) fn allocation_owner<B: Backend>(
    registry: &Registry<B>,
    ptr: u64,
) -> Option<(&Device<B>, AllocationSite)> {
    registry.initialized().find_map(|device| {
        let site = device.run(|allocator| allocator.allocation_at(DevicePtr(ptr)));
        Some((device, site.ok()??))
    })
}

/// For the live allocation at `ptr`: its device and the base, size and kind of the
/// segment it lies in. 0, or -1 if no device's allocator handed `ptr` out.
///
/// # Safety
/// Each out pointer must be null or writable for one value of its type.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_block_info(
    ptr: *mut c_void,
    device: *mut c_int,
    base: *mut u64,
    size: *mut u64,
    expandable: *mut c_int,
) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { block_info(registry::global(), ptr, device, base, size, expandable) }
}

/// [`streamalloc_block_info`] on `registry`.
///
/// # Safety
/// As [`streamalloc_block_info`].
pub unsafe fn block_info<B: Backend>(
    registry: &Registry<B>,
    ptr: *mut c_void,
    device: *mut c_int,
    base: *mut u64,
    size: *mut u64,
    expandable: *mut c_int,
) -> c_int {
    error::call(-1, || {
        let Some((owner, site)) = allocation_owner(registry, ptr as usize as u64) else {
            return fail(
                -1,
                format_args!(
                    "streamalloc_block_info: {ptr:p} is not a live allocation of streamalloc"
                ),
            );
        };
        // SAFETY: each pointer is null or writable for one value (see # Safety).
        unsafe {
            if !device.is_null() {
                device.write(owner.ordinal());
            }
            if !base.is_null() {
                base.write(site.segment.0);
            }
            if !size.is_null() {
                size.write(site.segment_size);
            }
            if !expandable.is_null() {
                expandable.write(c_int::from(site.expandable));
            }
        }
        0
    })
}

/// Segments and blocks of `device` as flat arrays (see the module docs). Fills up to the
/// capacities and always writes the true counts; returns 0 if everything fitted, 1 if
/// not, -1 on error.
///
/// # Safety
/// `segments` / `blocks` must be null or writable for their capacities; the count
/// pointers must be null or writable for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_snapshot_segments(
    device: c_int,
    segments: *mut StreamallocSegmentInfo,
    segment_capacity: usize,
    segment_count: *mut usize,
    blocks: *mut StreamallocBlockState,
    block_capacity: usize,
    block_count: *mut usize,
) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe {
        snapshot_segments(
            registry::global(),
            device,
            segments,
            segment_capacity,
            segment_count,
            blocks,
            block_capacity,
            block_count,
        )
    }
}

/// [`streamalloc_snapshot_segments`] on `registry`.
///
/// # Safety
/// As [`streamalloc_snapshot_segments`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn snapshot_segments<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    segments: *mut StreamallocSegmentInfo,
    segment_capacity: usize,
    segment_count: *mut usize,
    blocks: *mut StreamallocBlockState,
    block_capacity: usize,
    block_count: *mut usize,
) -> c_int {
    device_call(registry, device, -1, |allocator| {
        let (segment_rows, block_rows) = snapshot_rows(&allocator.snapshot());
        // SAFETY: forwarded from this function's # Safety.
        unsafe {
            copy_out(&segment_rows, segments, segment_capacity);
            copy_out(&block_rows, blocks, block_capacity);
            if !segment_count.is_null() {
                segment_count.write(segment_rows.len());
            }
            if !block_count.is_null() {
                block_count.write(block_rows.len());
            }
        }
        let fitted = segment_rows.len() <= segment_capacity && block_rows.len() <= block_capacity;
        Ok(if fitted { 0 } else { 1 })
    })
}

/// The snapshot's rows: an expandable segment becomes one row per run of mapped blocks
/// (the engine's snapshot lists only mapped blocks, so a gap in addresses ends a run); a
/// sleeping pool's segments are left out.
pub fn snapshot_rows(
    snapshot: &Snapshot,
) -> (Vec<StreamallocSegmentInfo>, Vec<StreamallocBlockState>) {
    let (mut segment_rows, mut block_rows) = (Vec::new(), Vec::<StreamallocBlockState>::new());
    // A sleeping pool's segments hold no memory (PyTorch's snapshot lists reserved memory).
    for segment in snapshot.segments.iter().filter(|s| !s.asleep) {
        let expandable = segment.expandable;
        let row = |first: usize, address: u64| StreamallocSegmentInfo {
            address,
            total_size: 0,
            stream: segment.stream.0,
            pool_id0: segment.mempool.0,
            pool_id1: segment.mempool.1,
            is_large: segment.pool as u32,
            is_expandable: u32::from(expandable),
            first_block: first as u64,
            block_count: 0,
        };
        let mut current: Option<StreamallocSegmentInfo> = None;
        for block in &segment.blocks {
            let continues = current
                .as_ref()
                .is_some_and(|c| c.address + c.total_size == block.addr.0);
            if !continues {
                segment_rows.extend(current.take());
                current = Some(row(block_rows.len(), block.addr.0));
            }
            let run = current.as_mut().expect("a run is open");
            run.total_size += block.size;
            run.block_count += 1;
            block_rows.push(StreamallocBlockState {
                address: block.addr.0,
                size: block.size,
                requested_size: block.requested,
                stream: block.stream.0,
                state: match block.state {
                    BlockState::Inactive => 0,
                    BlockState::ActiveAllocated => 1,
                    BlockState::ActivePendingFree => 2,
                },
                reserved: 0,
            });
        }
        segment_rows.extend(current);
    }
    (segment_rows, block_rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    use streamalloc_allocator::backend::sim::SimBackend;
    use streamalloc_allocator::{Allocator, Config, PoolId};

    #[test]
    fn snapshot_rows_split_expandable_segments_into_mapped_runs_and_carry_pools() {
        let device = SimBackend::new(1 << 30);
        let config = Config {
            expandable_segments: true,
            ..Config::default()
        };
        let allocator = Allocator::new(device.clone(), config).unwrap();
        let stream = device.create_stream();
        let graph = PoolId(4, 2);
        allocator.create_or_incref_pool(graph).unwrap();
        let eager = allocator.malloc(200 << 20, stream).unwrap();
        let captured = allocator.malloc_in(3 << 20, stream, graph).unwrap();
        let (segments, blocks) = snapshot_rows(&allocator.snapshot());
        assert!(segments.iter().all(|s| s.is_expandable == 1));
        for segment in &segments {
            let rows = &blocks[segment.first_block as usize..][..segment.block_count as usize];
            assert_eq!(rows[0].address, segment.address);
            assert_eq!(rows.iter().map(|b| b.size).sum::<u64>(), segment.total_size);
        }
        let owner = |ptr: DevicePtr| {
            segments
                .iter()
                .find(|s| s.address <= ptr.0 && ptr.0 < s.address + s.total_size)
                .map(|s| (s.pool_id0, s.pool_id1))
        };
        assert_eq!(owner(eager.ptr), Some((0, 0)));
        assert_eq!(owner(captured.ptr), Some((4, 2)));
        let state_of = |ptr: DevicePtr| blocks.iter().find(|b| b.address == ptr.0).map(|b| b.state);
        assert_eq!(state_of(captured.ptr), Some(1));
    }
}
