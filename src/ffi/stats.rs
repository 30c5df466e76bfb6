//! Counters across the C ABI: a flat `#[repr(C)]` struct for C callers and a JSON string
//! for Python (whose `memory_stats()` maps it to PyTorch's key names).

use super::layout::c_struct;
use super::{device_call, error, on_device};
use crate::registry::{self, Registry};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Mutex;
use streamalloc_allocator::{Backend, Stats};

c_struct! {
/// `streamalloc_stats_t`: the engine's [`Stats`], flattened. Byte gauges come as
/// `*_current` / `*_peak` pairs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamallocStats as "streamalloc_stats_t" {
    /// Bytes in blocks handed out (rounded sizes), now.
    pub allocated_current: u64,
    /// Peak of `allocated_current`.
    pub allocated_peak: u64,
    /// Bytes callers asked for, now.
    pub requested_current: u64,
    /// Peak of `requested_current`.
    pub requested_peak: u64,
    /// Bytes obtained from the device, now.
    pub reserved_current: u64,
    /// Peak of `reserved_current`.
    pub reserved_peak: u64,
    /// Allocated plus freed-but-pending bytes, now.
    pub active_current: u64,
    /// Peak of `active_current`.
    pub active_peak: u64,
    /// Free bytes still carrying other streams' events, now.
    pub pending_free_current: u64,
    /// Peak of `pending_free_current`.
    pub pending_free_peak: u64,
    /// Blocks handed out.
    pub allocs: u64,
    /// Blocks returned.
    pub frees: u64,
    /// Segments obtained from the device.
    pub segment_allocs: u64,
    /// Segments returned to the device.
    pub segment_frees: u64,
    /// Device-side waits made to reuse blocks across streams.
    pub cross_stream_waits: u64,
    /// Events recorded.
    pub events_recorded: u64,
    /// Event queries.
    pub event_queries: u64,
    /// Events recorded and still referenced.
    pub events_outstanding: u64,
    /// Event objects created.
    pub events_created: u64,
    /// Event objects destroyed.
    pub events_destroyed: u64,
    /// Requests that failed for lack of memory.
    pub ooms: u64,
    /// Requests served only after releasing cached memory.
    pub retries: u64,
    /// Frees of unknown or already freed pointers.
    pub invalid_frees: u64,
    /// Reserved-bytes limit in force (0: none).
    pub memory_limit: u64,
    /// Device-wide synchronisations made (to release memory or to unmap pages).
    pub device_syncs: u64,
    /// Bytes mapped into expandable segments, in all.
    pub page_map_bytes: u64,
    /// Bytes unmapped from expandable segments, in all.
    pub page_unmap_bytes: u64,
    /// Stitched ranges made (free pages mapped a second time into one range).
    pub stitches: u64,
    /// Bytes mapped into stitched ranges (no memory reserved by them).
    pub stitched_map_bytes: u64,
    /// Stitched ranges taken again without mapping.
    pub stitch_revivals: u64,
    /// Stitched ranges unmapped.
    pub stitch_evictions: u64,
}
}

impl StreamallocStats {
    /// Flattens `stats`.
    pub fn new(stats: &Stats, limit: Option<u64>) -> Self {
        Self {
            allocated_current: stats.allocated_bytes.current,
            allocated_peak: stats.allocated_bytes.peak,
            requested_current: stats.requested_bytes.current,
            requested_peak: stats.requested_bytes.peak,
            reserved_current: stats.reserved_bytes.current,
            reserved_peak: stats.reserved_bytes.peak,
            active_current: stats.active_bytes.current,
            active_peak: stats.active_bytes.peak,
            pending_free_current: stats.pending_free_bytes.current,
            pending_free_peak: stats.pending_free_bytes.peak,
            allocs: stats.allocs,
            frees: stats.frees,
            segment_allocs: stats.segment_allocs,
            segment_frees: stats.segment_frees,
            cross_stream_waits: stats.cross_stream_waits,
            events_recorded: stats.events_recorded,
            event_queries: stats.event_queries,
            events_outstanding: stats.events_outstanding,
            events_created: stats.events_created,
            events_destroyed: stats.events_destroyed,
            ooms: stats.ooms,
            retries: stats.retries,
            invalid_frees: stats.invalid_frees,
            memory_limit: limit.unwrap_or(0),
            device_syncs: stats.device_syncs,
            page_map_bytes: stats.page_map_bytes,
            page_unmap_bytes: stats.page_unmap_bytes,
            stitches: stats.stitches,
            stitched_map_bytes: stats.stitched_map_bytes,
            stitch_revivals: stats.stitch_revivals,
            stitch_evictions: stats.stitch_evictions,
        }
    }
}

/// Fills `*out` with `device`'s counters. Returns 0, or -1 (device unavailable, or `out`
/// null) with the reason in `streamalloc_last_error`.
///
/// # Safety
/// `out` must be null or point to writable memory for one `streamalloc_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_get_stats(device: c_int, out: *mut StreamallocStats) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { get_stats(registry::global(), device, out) }
}

/// [`streamalloc_get_stats`] on `registry`.
///
/// # Safety
/// As [`streamalloc_get_stats`].
pub unsafe fn get_stats<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    out: *mut StreamallocStats,
) -> c_int {
    if out.is_null() {
        return error::call(-1, || super::fail(-1, "streamalloc_get_stats: out is null"));
    }
    device_call(registry, device, -1, |allocator| {
        let stats = StreamallocStats::new(&allocator.stats(), allocator.memory_limit());
        // SAFETY: `out` is non-null and writable (see # Safety).
        unsafe { out.write(stats) };
        Ok(0)
    })
}

thread_local! {
    static JSON: RefCell<CString> = RefCell::new(CString::default());
}

/// `device`'s counters as a JSON object: `{"device", "stats": {...}, "memory_limit",
/// "process": {"invalid_frees", "unknown_record_streams"}}`. Returns null on failure. The
/// string stays valid until the next call on the same thread.
#[no_mangle]
pub extern "C" fn streamalloc_stats_json(device: c_int) -> *const c_char {
    stats_json(registry::global(), device)
}

/// [`streamalloc_stats_json`] on `registry`.
pub fn stats_json<B: Backend>(registry: &Registry<B>, device: c_int) -> *const c_char {
    error::call(std::ptr::null(), || {
        match stats_json_text(registry, device) {
            Ok(text) => JSON
                .try_with(|slot| {
                    *slot.borrow_mut() = CString::new(text).unwrap_or_default();
                    slot.borrow().as_ptr()
                })
                .unwrap_or_else(|_| {
                    super::fail(
                        std::ptr::null(),
                        "streamalloc_stats_json: called while this thread exits",
                    )
                }),
            Err(message) => super::fail(std::ptr::null(), message),
        }
    })
}

/// The JSON text of [`streamalloc_stats_json`].
pub fn stats_json_text<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
) -> Result<String, String> {
    let (stats, limit) = on_device(registry, device, |allocator| {
        Ok((allocator.stats(), allocator.memory_limit()))
    })?;
    let value = serde_json::json!({
        "device": device,
        "stats": stats,
        "memory_limit": limit,
        "process": {
            "invalid_frees": registry.invalid_frees(),
            "unknown_record_streams": registry.unknown_record_streams(),
        },
    });
    Ok(value.to_string())
}

// ---- PyTorch's names ------------------------------------------------------------------
//
// `torch.cuda.memory_stats()` flattens PyTorch's `DeviceStats` into keys such as
// `allocated_bytes.all.peak`. Both doors answer it from the one table below: the native
// door (C++) parses each name into the `DeviceStats` member it fills, the pluggable door
// (Python) zips the names with the values. A key of PyTorch's missing here reads 0 there.

/// The counters a PyTorch statistic is computed from: the engine's now, and the
/// engine's at the last `reset_accumulated_memory_stats()` (PyTorch's `allocated` and
/// `freed` count from then; `current` and `peak` do not reset).
#[derive(Clone, Copy, Debug)]
pub struct TorchSource<'a> {
    /// The engine's counters now.
    pub now: &'a Stats,
    /// The engine's counters when the accumulated ones were last reset.
    pub since: &'a Stats,
    /// The engine's `max_split_size`, if configured.
    pub max_split_size: Option<u64>,
}

type TorchValue = fn(&TorchSource<'_>) -> u64;

/// PyTorch's key of each statistic streamalloc keeps, with how it is computed, in the
/// order `streamalloc_torch_stat_name` lists them.
pub const TORCH_STATS: &[(&CStr, TorchValue)] = &[
    (c"allocation.all.current", |s| s.now.allocs - s.now.frees),
    (c"allocation.all.allocated", |s| {
        s.now.allocs - s.since.allocs
    }),
    (c"allocation.all.freed", |s| s.now.frees - s.since.frees),
    (c"segment.all.current", |s| {
        s.now.segment_allocs - s.now.segment_frees
    }),
    (c"segment.all.allocated", |s| {
        s.now.segment_allocs - s.since.segment_allocs
    }),
    (c"segment.all.freed", |s| {
        s.now.segment_frees - s.since.segment_frees
    }),
    (c"allocated_bytes.all.current", |s| {
        s.now.allocated_bytes.current
    }),
    (c"allocated_bytes.all.peak", |s| s.now.allocated_bytes.peak),
    (c"allocated_bytes.all.allocated", |s| {
        s.now.allocated_bytes.allocated - s.since.allocated_bytes.allocated
    }),
    (c"allocated_bytes.all.freed", |s| {
        s.now.allocated_bytes.freed - s.since.allocated_bytes.freed
    }),
    (c"reserved_bytes.all.current", |s| {
        s.now.reserved_bytes.current
    }),
    (c"reserved_bytes.all.peak", |s| s.now.reserved_bytes.peak),
    (c"reserved_bytes.all.allocated", |s| {
        s.now.reserved_bytes.allocated - s.since.reserved_bytes.allocated
    }),
    (c"reserved_bytes.all.freed", |s| {
        s.now.reserved_bytes.freed - s.since.reserved_bytes.freed
    }),
    (c"active_bytes.all.current", |s| s.now.active_bytes.current),
    (c"active_bytes.all.peak", |s| s.now.active_bytes.peak),
    (c"active_bytes.all.allocated", |s| {
        s.now.active_bytes.allocated - s.since.active_bytes.allocated
    }),
    (c"active_bytes.all.freed", |s| {
        s.now.active_bytes.freed - s.since.active_bytes.freed
    }),
    (c"requested_bytes.all.current", |s| {
        s.now.requested_bytes.current
    }),
    (c"requested_bytes.all.peak", |s| s.now.requested_bytes.peak),
    (c"requested_bytes.all.allocated", |s| {
        s.now.requested_bytes.allocated - s.since.requested_bytes.allocated
    }),
    (c"requested_bytes.all.freed", |s| {
        s.now.requested_bytes.freed - s.since.requested_bytes.freed
    }),
    (c"num_alloc_retries", |s| s.now.retries - s.since.retries),
    (c"num_ooms", |s| s.now.ooms - s.since.ooms),
    (c"num_sync_all_streams", |s| {
        s.now.device_syncs - s.since.device_syncs
    }),
    (c"num_device_alloc", |s| {
        s.now.segment_allocs - s.since.segment_allocs
    }),
    (c"num_device_free", |s| {
        s.now.segment_frees - s.since.segment_frees
    }),
    // PyTorch's unset max_split_size is SIZE_MAX, which reads -1 as an int64.
    (c"max_split_size", |s| s.max_split_size.unwrap_or(u64::MAX)),
];

/// The values of [`TORCH_STATS`] for `source`, in order, as PyTorch's `int64_t`s.
pub fn torch_stat_values(source: &TorchSource<'_>) -> Vec<i64> {
    TORCH_STATS
        .iter()
        .map(|(_, value)| value(source) as i64)
        .collect()
}

/// A registry's counters at the last reset of PyTorch's accumulated statistics, by
/// device (none: never reset).
#[derive(Debug)]
pub(crate) struct AccumulatedSince {
    map: Mutex<BTreeMap<c_int, Stats>>,
}

impl AccumulatedSince {
    pub(crate) const fn new() -> Self {
        Self {
            map: Mutex::new(BTreeMap::new()),
        }
    }

    fn get(&self, device: c_int) -> Stats {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&device).copied().unwrap_or_default()
    }

    fn set(&self, device: c_int, stats: Stats) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(device, stats);
    }
}

/// The name of PyTorch's `i`-th statistic in the order `streamalloc_torch_stats` writes
/// them (e.g. `"allocated_bytes.all.peak"`), or null past the last. The string is static.
#[no_mangle]
pub extern "C" fn streamalloc_torch_stat_name(i: usize) -> *const c_char {
    // Like every call, it clears the last error (null past the last is not a failure).
    error::call(std::ptr::null(), || {
        TORCH_STATS
            .get(i)
            .map_or(std::ptr::null(), |(name, _)| name.as_ptr())
    })
}

/// Writes `device`'s value of each statistic `streamalloc_torch_stat_name` lists, in that
/// order, up to `capacity` of them, and returns how many there are; -1 (device
/// unavailable) with the reason in `streamalloc_last_error`.
///
/// # Safety
/// `out` must be writable for `capacity` values (it may be null when `capacity` is 0).
#[no_mangle]
pub unsafe extern "C" fn streamalloc_torch_stats(
    device: c_int,
    out: *mut i64,
    capacity: usize,
) -> i64 {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { torch_stats(registry::global(), device, out, capacity) }
}

/// [`streamalloc_torch_stats`] on `registry`.
///
/// # Safety
/// As [`streamalloc_torch_stats`].
pub unsafe fn torch_stats<B: Backend>(
    registry: &Registry<B>,
    device: c_int,
    out: *mut i64,
    capacity: usize,
) -> i64 {
    if out.is_null() && capacity > 0 {
        return error::call(-1, || {
            super::fail(-1, "streamalloc_torch_stats: out is null")
        });
    }
    device_call(registry, device, -1, |allocator| {
        let since = registry.since.get(device);
        let source = TorchSource {
            now: &allocator.stats(),
            since: &since,
            max_split_size: allocator.config().max_split_size,
        };
        let values = torch_stat_values(&source);
        for (i, value) in values.iter().take(capacity).enumerate() {
            // SAFETY: `out` is writable for `capacity` values (see # Safety) and i < capacity.
            unsafe { out.add(i).write(*value) };
        }
        Ok(values.len() as i64)
    })
}

/// Starts PyTorch's accumulated statistics of `device` (every `allocated` and `freed`,
/// and the retry, OOM, synchronisation and device call counts) from zero again, as
/// `torch.cuda.reset_accumulated_memory_stats()` asks. The engine's own counters are
/// untouched. Returns 0, or -1 (device unavailable).
#[no_mangle]
pub extern "C" fn streamalloc_reset_accumulated_stats(device: c_int) -> c_int {
    reset_accumulated_stats(registry::global(), device)
}

/// [`streamalloc_reset_accumulated_stats`] on `registry`.
pub fn reset_accumulated_stats<B: Backend>(registry: &Registry<B>, device: c_int) -> c_int {
    device_call(registry, device, -1, |allocator| {
        registry.since.set(device, allocator.stats());
        Ok(0)
    })
}

/// For the live allocation at `ptr`: its device, its block's size (the request rounded)
/// and the device's allocated and reserved bytes now: what PyTorch's profiler is told of
/// each allocation and free (`c10::reportMemoryUsageToProfiler`). 0, or -1 (not a live
/// allocation of streamalloc).
///
/// # Safety
/// Each out pointer must be null or writable for one value of its type.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_allocation_usage(
    ptr: *mut c_void,
    device: *mut c_int,
    block_size: *mut u64,
    allocated: *mut u64,
    reserved: *mut u64,
) -> c_int {
    // SAFETY: forwarded from this function's # Safety.
    unsafe {
        allocation_usage(
            registry::global(),
            ptr,
            device,
            block_size,
            allocated,
            reserved,
        )
    }
}

/// [`streamalloc_allocation_usage`] on `registry`.
///
/// # Safety
/// As [`streamalloc_allocation_usage`].
pub unsafe fn allocation_usage<B: Backend>(
    registry: &Registry<B>,
    ptr: *mut c_void,
    device: *mut c_int,
    block_size: *mut u64,
    allocated: *mut u64,
    reserved: *mut u64,
) -> c_int {
    error::call(-1, || {
        let Some((owner, site)) = super::pools::allocation_owner(registry, ptr as usize as u64)
        else {
            return super::fail(
                -1,
                format_args!(
                    "streamalloc_allocation_usage: {ptr:p} is not a live allocation of streamalloc"
                ),
            );
        };
        let stats = match owner.run(|allocator| allocator.stats()) {
            Ok(stats) => stats,
            Err(err) => return super::fail(-1, super::unavailable_message(owner.ordinal(), &err)),
        };
        // SAFETY: each pointer is null or writable for one value (see # Safety).
        unsafe {
            for (out, value) in [
                (block_size, site.size),
                (allocated, stats.allocated_bytes.current),
                (reserved, stats.reserved_bytes.current),
            ] {
                if !out.is_null() {
                    out.write(value);
                }
            }
            if !device.is_null() {
                device.write(owner.ordinal());
            }
        }
        0
    })
}
