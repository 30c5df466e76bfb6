//! Counters across the C ABI: a flat `#[repr(C)]` struct for C callers and a JSON string
//! for Python (whose `memory_stats()` maps it to PyTorch's key names).

use super::layout::c_struct;
use super::{device_call, error, on_device};
use crate::registry::{self, Registry};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
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
