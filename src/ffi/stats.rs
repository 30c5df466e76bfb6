//! Counters across the C ABI: a flat `#[repr(C)]` struct for C callers and a JSON string
//! for Python (whose `memory_stats()` maps it to PyTorch's key names).

pub use super::layout::StreamallocStats;
use super::{device_call, error, on_device};
use crate::registry::{self, Registry};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::LazyLock;
use streamalloc_allocator::{Backend, Gauge, StatArray, Stats, TorchStats};

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
            vmm_ns: stats.vmm_ns,
            slow_paths: stats.slow_paths,
            slow_path_ns: stats.slow_path_ns,
            sleeping_bytes: stats.sleeping_bytes,
            host_backup_bytes: stats.host_backup_bytes,
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
// `allocated_bytes.all.peak`. Both doors answer it from the one table below, generated
// from the engine's `TorchStats` (PyTorch's `DeviceStats`, kept by the engine): the native
// door (C++) parses each name into the `DeviceStats` member it fills, the pluggable door
// (Python) zips the names with the values. Every key PyTorch 2.11 has is listed.

/// The counters a PyTorch statistic is computed from: the engine's now, and the
/// engine's at the last `reset_accumulated_memory_stats()` (PyTorch's `allocated` and
/// `freed` count from then; `current` and `peak` do not reset).
#[derive(Clone, Copy, Debug)]
pub struct TorchSource<'a> {
    /// The engine's counters now.
    pub now: &'a Stats,
    /// The engine's counters when the accumulated ones were last reset.
    pub since: &'a Stats,
}

/// Which value of a gauge a key reads.
#[derive(Clone, Copy, Debug)]
enum Field {
    Current,
    Peak,
    Allocated,
    Freed,
}

/// Reads a `StatArray` of the engine's `TorchStats`.
type ArrayOf = fn(&TorchStats) -> &StatArray;
/// Reads a single gauge of the engine's `TorchStats`.
type GaugeOf = fn(&TorchStats) -> &Gauge;
/// Reads a count of the engine's counters.
type CountOf = fn(&Stats) -> u64;

/// Where one of PyTorch's statistics comes from.
#[derive(Clone, Copy)]
enum Origin {
    /// A gauge of a `StatArray` (index 0: all, 1: small pool, 2: large pool).
    Array(ArrayOf, usize, Field),
    /// A single gauge.
    Gauge(GaugeOf, Field),
    /// A count accumulated since the last reset.
    Count(CountOf),
    /// `max_split_size`, as it is.
    MaxSplitSize,
}

/// PyTorch's `StatArray` members, in `DeviceStats`' order.
const ARRAYS: [(&str, ArrayOf); 9] = [
    ("allocation", |t| &t.allocation),
    ("segment", |t| &t.segment),
    ("active", |t| &t.active),
    ("inactive_split", |t| &t.inactive_split),
    ("allocated_bytes", |t| &t.allocated_bytes),
    ("reserved_bytes", |t| &t.reserved_bytes),
    ("active_bytes", |t| &t.active_bytes),
    ("inactive_split_bytes", |t| &t.inactive_split_bytes),
    ("requested_bytes", |t| &t.requested_bytes),
];

/// PyTorch's names of a `StatArray`'s entries.
const POOL_TYPES: [&str; 3] = ["all", "small_pool", "large_pool"];

/// PyTorch's names of a gauge's values.
const FIELDS: [(&str, Field); 4] = [
    ("current", Field::Current),
    ("peak", Field::Peak),
    ("allocated", Field::Allocated),
    ("freed", Field::Freed),
];

/// The table: each key of PyTorch's `memory_stats()` with where its value comes from, in
/// the order `streamalloc_torch_stat_name` lists them.
static TORCH_STATS: LazyLock<Vec<(CString, Origin)>> = LazyLock::new(|| {
    let mut table = Vec::new();
    let mut push = |name: String, origin| {
        table.push((CString::new(name).expect("names have no NUL"), origin));
    };
    for (array, get) in ARRAYS {
        for (index, pool) in POOL_TYPES.iter().enumerate() {
            for (field_name, field) in FIELDS {
                push(
                    format!("{array}.{pool}.{field_name}"),
                    Origin::Array(get, index, field),
                );
            }
        }
    }
    let gauges: [(&str, GaugeOf); 2] = [
        ("oversize_allocations", |t| &t.oversize_allocations),
        ("oversize_segments", |t| &t.oversize_segments),
    ];
    for (gauge, get) in gauges {
        for (field_name, field) in FIELDS {
            push(format!("{gauge}.{field_name}"), Origin::Gauge(get, field));
        }
    }
    let counts: [(&str, CountOf); 5] = [
        ("num_alloc_retries", |s| s.torch.alloc_retries),
        ("num_ooms", |s| s.ooms),
        ("num_sync_all_streams", |s| s.device_syncs),
        ("num_device_alloc", |s| s.torch.device_allocs),
        ("num_device_free", |s| s.torch.device_frees),
    ];
    for (count, get) in counts {
        push(count.to_string(), Origin::Count(get));
    }
    push("max_split_size".to_string(), Origin::MaxSplitSize);
    table
});

/// A gauge's `field`, with `allocated` and `freed` counted from `since`.
fn gauge_value(now: &Gauge, since: &Gauge, field: Field) -> u64 {
    match field {
        Field::Current => now.current,
        Field::Peak => now.peak,
        Field::Allocated => now.allocated.saturating_sub(since.allocated),
        Field::Freed => now.freed.saturating_sub(since.freed),
    }
}

impl Origin {
    fn value(&self, source: &TorchSource<'_>) -> u64 {
        let (now, since) = (&source.now.torch, &source.since.torch);
        match *self {
            Origin::Array(get, index, field) => {
                gauge_value(&get(now)[index], &get(since)[index], field)
            }
            Origin::Gauge(get, field) => gauge_value(get(now), get(since), field),
            Origin::Count(get) => get(source.now).saturating_sub(get(source.since)),
            // PyTorch's unset max_split_size is SIZE_MAX, which reads -1 as an int64.
            Origin::MaxSplitSize => now.max_split_size,
        }
    }
}

/// PyTorch's keys, in the order of [`torch_stat_values`].
pub fn torch_stat_names() -> impl Iterator<Item = &'static CStr> {
    TORCH_STATS.iter().map(|(name, _)| name.as_c_str())
}

/// The values of PyTorch's statistics for `source`, in the order of [`torch_stat_names`],
/// as PyTorch's `int64_t`s.
pub fn torch_stat_values(source: &TorchSource<'_>) -> Vec<i64> {
    TORCH_STATS
        .iter()
        .map(|(_, origin)| origin.value(source) as i64)
        .collect()
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
    error::call(-1, || {
        let (now, since) = match registry.on(device, |d| d.stats_since_reset()) {
            Ok(counters) => counters,
            Err(err) => return super::or_fail(-1, Err(err)),
        };
        let values = torch_stat_values(&TorchSource {
            now: &now,
            since: &since,
        });
        for (i, value) in values.iter().take(capacity).enumerate() {
            // SAFETY: `out` is writable for `capacity` values (see # Safety) and i < capacity.
            unsafe { out.add(i).write(*value) };
        }
        values.len() as i64
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
    error::call(-1, || {
        let reset = registry.on(device, |d| d.reset_accumulated_stats());
        super::or_fail(-1, reset.map(|()| 0))
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
        let Some((owner, site)) =
            super::introspect::allocation_owner(registry, ptr as usize as u64)
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
            Err(err) => {
                return super::fail(-1, super::error::unavailable_message(owner.ordinal(), &err))
            }
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
