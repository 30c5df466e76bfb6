//! The C ABI driven by arbitrary bytes, on simulated devices: a hostile C caller.
//!
//! The `c_abi` cargo-fuzz target (`fuzz/fuzz_targets/c_abi.rs`) and the stable replay of
//! its corpus (`tests/fuzz_corpus.rs`) share [`run_bytes`], so both check the same
//! things. The bytes become a configuration and a sequence of calls of the generic
//! functions behind the exports (the very code `streamalloc_*` runs, on a
//! `Registry<SimBackend>`), with hostile arguments: null, foreign, interior and double
//! frees, sizes of 0 and beyond any device, bad device numbers, bogus streams, pool calls
//! out of order, restores of junk checkpoints, snapshots, stats, the p2p planner on junk,
//! and panics planted in the simulated driver.
//!
//! After every call it checks:
//! - **the last error**: set to a sentinel before the call, it must not read the sentinel
//!   after it (each call clears or sets it), and a call's failure value comes with a
//!   message while its success comes with "";
//! - **no hidden panic**: no panic was caught anywhere but where one was planted, and a
//!   device is unusable only after a planted panic, from then on refusing every call
//!   with the poisoned message and never touching its engine again;
//! - **the engine**: every usable device passes `Allocator::check_invariants` and the
//!   simulator found no race;
//! - **a model of the caller's pointers**: a new allocation is not already live; freeing a
//!   live pointer succeeds, on whichever device was named, and counts no invalid free;
//!   freeing anything else fails and counts exactly one, on the named device (if it
//!   exists) and in the registry; `record_stream` and `block_info` know exactly the live
//!   pointers.

mod args;
mod calls;
mod model;

use self::args::Reader;
use super::pools::{self, StreamallocBlockState, StreamallocPoolBlock, StreamallocSegmentInfo};
use super::{error, introspect, stats, StreamallocStats};
use crate::registry::Registry;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CStr};
use streamalloc_allocator::backend::sim::{SimBackend, INJECTED_PANIC};
use streamalloc_allocator::{Config, Stats};

/// What the last error holds before each call; no call may leave it there.
const SENTINEL: &str = "(sentinel: the call neither cleared nor set the last error)";

/// Calls in one program at most.
const MAX_CALLS: usize = 512;

/// The device numbers a program names: created ones, one never created, and bad ones.
const DEVICES: [c_int; 8] = [0, 0, 1, 1, 2, -1, 64, c_int::MIN];

/// Backend calls a planted panic may hit.
const PANIC_SITES: [&str; 8] = [
    "alloc_segment",
    "free_segment",
    "map_pages",
    "unmap_pages",
    "reserve_address_space",
    "create_event",
    "record_event",
    "synchronize_device",
];

/// Installs a panic hook that passes the panics [`run_bytes`] plants and hands every other
/// one to the hook installed before it. libFuzzer's hook aborts at any panic, caught or not,
/// so the fuzz target needs planted panics to unwind to the registry, which catches them;
/// the corpus test keeps their reports off its output.
pub fn pass_planted_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planted = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|message| message.starts_with(INJECTED_PANIC));
        if !planted {
            previous(info);
        }
    }));
}

/// Runs the program encoded by `bytes`; `Err` describes the first broken rule. The first
/// byte chooses the configuration and whether panics may be planted (the model's exact
/// expectations stop at the first one); each call then takes an opcode and its arguments
/// (reads past the end are 0).
pub fn run_bytes(bytes: &[u8]) -> Result<(), String> {
    let mut reader = Reader { bytes, at: 0 };
    let flags = reader.u8();
    let config = Config {
        expandable_segments: flags & 1 != 0,
        graph_pools: flags & 2 == 0,
        memory_limit: (flags & 4 != 0).then_some(256 << 20),
        trace_capacity: if flags & 8 != 0 { 64 } else { 0 },
        ..Config::default()
    };
    let mut harness = Harness::new(config, flags & 16 != 0);
    let mut calls = 0;
    while !reader.done() && calls < MAX_CALLS {
        let what = harness.call(&mut reader);
        harness.check(&what)?;
        calls += 1;
    }
    harness.finish()
}

/// A live allocation the caller holds.
#[derive(Clone, Copy, Debug)]
struct Live {
    device: c_int,
}

/// How one call went, for the checks.
#[derive(Debug)]
struct Outcome {
    /// The call, for messages.
    call: String,
    /// `Some(failed)` when the return value tells failure from success.
    failed: Option<bool>,
    /// The model's verdict, checked before the generic checks.
    expect: Result<(), String>,
}

struct Harness {
    registry: Registry<SimBackend>,
    live: BTreeMap<u64, Live>,
    /// Pointers once live and freed since.
    dead: Vec<u64>,
    /// Checkpoints taken, to restore later.
    checkpoints: Vec<(c_int, (u64, u64), Vec<StreamallocPoolBlock>)>,
    /// The program may plant panics.
    panics: bool,
    /// A panic was planted on these devices (it may not have fired yet).
    planted: Vec<c_int>,
    /// Each device made unusable, with its counters and simulated driver calls then.
    poisoned: BTreeMap<c_int, (Stats, u64)>,
}

fn last_error() -> String {
    // SAFETY: the slot holds a NUL-terminated string, valid until the next call.
    unsafe { CStr::from_ptr(error::last()) }
        .to_string_lossy()
        .into_owned()
}

fn driver_calls(device: &SimBackend) -> u64 {
    [
        "alloc_segment",
        "free_segment",
        "create_event",
        "destroy_event",
        "record_event",
        "query_event",
        "synchronize_event",
        "stream_wait_event",
        "synchronize_device",
        "reserve_address_space",
        "release_address_space",
        "map_pages",
        "unmap_pages",
    ]
    .iter()
    .map(|name| device.calls(name))
    .sum()
}

impl Harness {
    fn new(config: Config, panics: bool) -> Self {
        Self {
            registry: Registry::simulated(config),
            panics,
            live: BTreeMap::new(),
            dead: Vec::new(),
            checkpoints: Vec::new(),
            planted: Vec::new(),
            poisoned: BTreeMap::new(),
        }
    }

    /// Whether the model can say what a call on `device` (or resolving a pointer) does:
    /// not once a panic was planted anywhere.
    fn exact(&self) -> bool {
        self.planted.is_empty()
    }

    /// Makes one call chosen by the reader, and says what it expects of it.
    fn call(&mut self, r: &mut Reader<'_>) -> Outcome {
        let op = r.u8() % 28;
        error::set(SENTINEL);
        let registry = &self.registry;
        let mut failed = None;
        let mut expect = Ok(());
        let call = match op {
            0..=3 => {
                let (size, device, stream) = (self.size(r), self.device(r), self.stream(r));
                let ptr = super::malloc(registry, size, device, stream);
                failed = Some(ptr.is_null() && size != 0);
                expect = self.allocated(ptr as u64, device, size);
                format!("malloc({size}, {device}, {stream:p}) = {ptr:p}")
            }
            4..=6 => {
                let (ptr, device) = (self.pointer(r), self.device(r));
                let before = self.invalid_frees();
                super::free(
                    registry,
                    ptr as usize as *mut c_void,
                    0,
                    device,
                    self.stream(r),
                );
                expect = self.freed(ptr, device, before);
                format!("free({ptr:#x}, {device})")
            }
            7 => {
                let (ptr, stream) = (self.pointer(r), self.stream(r));
                let before = registry.unknown_record_streams();
                super::record_stream(registry, ptr as usize as *mut c_void, stream);
                let known = ptr == 0 || self.live.contains_key(&ptr);
                if self.exact() {
                    let counted = registry.unknown_record_streams() - before;
                    let error = last_error();
                    if known != (error.is_empty() && counted == 0) {
                        expect = Err(format!(
                            "record_stream of a {} pointer: error {error:?}, counted {counted}",
                            if known { "live" } else { "dead" }
                        ));
                    }
                }
                format!("record_stream({ptr:#x}, {stream:p})")
            }
            8 => {
                super::empty_cache(registry);
                "empty_cache()".to_string()
            }
            9 => {
                let fraction = match r.below(8) {
                    0 => 0.5,
                    1 => 1.0,
                    2 => 0.0,
                    3 => -1.0,
                    4 => f64::NAN,
                    5 => f64::INFINITY,
                    6 => 1e-9,
                    _ => f64::from_bits(r.u64()),
                };
                let device = self.device(r);
                super::set_memory_fraction(registry, fraction, device);
                format!("set_memory_fraction({fraction}, {device})")
            }
            10 => {
                let device = self.device(r);
                failed = Some(super::reset_peak_stats(registry, device) != 0);
                format!("reset_peak_stats({device})")
            }
            11 => {
                let device = self.device(r);
                let mut out = StreamallocStats::default();
                let out_ptr = if r.below(4) == 0 {
                    std::ptr::null_mut()
                } else {
                    &mut out as *mut StreamallocStats
                };
                // SAFETY: null or a valid out pointer.
                failed = Some(unsafe { stats::get_stats(registry, device, out_ptr) } != 0);
                format!("get_stats({device}, {out_ptr:p})")
            }
            12 => {
                let device = self.device(r);
                failed = Some(stats::stats_json(registry, device).is_null());
                format!("stats_json({device})")
            }
            13 => {
                let device = self.device(r);
                let path = [
                    None,
                    Some(c"/nonexistent/dir/snapshot.json"),
                    Some(c"/dev/null"),
                ][r.below(3)];
                let path_ptr = path.map_or(std::ptr::null(), CStr::as_ptr);
                // SAFETY: null or a NUL-terminated string.
                failed = Some(unsafe { super::dump_snapshot(registry, path_ptr, device) } != 0);
                format!("dump_snapshot({path:?}, {device})")
            }
            14 | 15 => {
                let (size, device, stream) = (self.size(r), self.device(r), self.stream(r));
                let (id0, id1) = self.pool(r);
                let ptr = pools::malloc_in_pool(registry, size, device, stream, id0, id1);
                failed = Some(ptr.is_null() && size != 0);
                expect = self.allocated(ptr as u64, device, size);
                format!("malloc_in_pool({size}, {device}, {stream:p}, ({id0}, {id1})) = {ptr:p}")
            }
            16 => {
                let (device, pool) = (self.device(r), self.pool(r));
                let (name, result) = match r.below(5) {
                    0 => (
                        "pool_begin_allocate",
                        pools::pool_begin_allocate(registry, device, pool.0, pool.1),
                    ),
                    1 => (
                        "pool_end_allocate",
                        pools::pool_end_allocate(registry, device, pool.0, pool.1),
                    ),
                    2 => (
                        "pool_incref",
                        pools::pool_incref(registry, device, pool.0, pool.1),
                    ),
                    3 => (
                        "pool_release",
                        pools::pool_release(registry, device, pool.0, pool.1),
                    ),
                    _ => (
                        "pool_use_count",
                        pools::pool_use_count(registry, device, pool.0, pool.1),
                    ),
                };
                // A use count of 0 means "no such pool", which is also the answer for a
                // device that is unavailable: it never says failure.
                if name == "pool_use_count" {
                    if result < 0 {
                        expect = Err(format!("a use count of {result}"));
                    }
                } else {
                    failed = Some(result < 0);
                }
                format!("{name}({device}, {pool:?}) = {result}")
            }
            17 => {
                let (device, pool) = (self.device(r), self.pool(r));
                let capacity = r.below(4);
                let mut out = [0u64; 4];
                let out_ptr = if r.below(3) == 0 {
                    std::ptr::null_mut()
                } else {
                    out.as_mut_ptr()
                };
                // SAFETY: null or room for `capacity` <= 4 values.
                let n = unsafe {
                    pools::pool_live_allocations(
                        registry, device, pool.0, pool.1, out_ptr, capacity,
                    )
                };
                failed = Some(n < 0);
                format!("pool_live_allocations({device}, {pool:?}, {capacity}) = {n}")
            }
            18 => {
                let (device, pool) = (self.device(r), self.pool(r));
                let mut out = vec![StreamallocPoolBlock::default(); 64];
                // SAFETY: room for 64 blocks.
                let n = unsafe {
                    pools::pool_checkpoint(
                        registry,
                        device,
                        pool.0,
                        pool.1,
                        out.as_mut_ptr(),
                        out.len(),
                    )
                };
                failed = Some(n < 0);
                if n >= 0 {
                    out.truncate(n.min(64) as usize);
                    self.checkpoints.push((device, pool, out));
                }
                format!("pool_checkpoint({device}, {pool:?}) = {n}")
            }
            19 => {
                let call = self.restore(r);
                failed = call.failed;
                expect = call.expect;
                call.call
            }
            20 => {
                let (device, pool) = (self.device(r), self.pool(r));
                failed = Some(pools::empty_cache_pool(registry, device, pool.0, pool.1) != 0);
                format!("empty_cache_pool({device}, {pool:?})")
            }
            21 => {
                let device = self.device(r);
                let mut largest = 0u64;
                let out = if r.below(4) == 0 {
                    std::ptr::null_mut()
                } else {
                    &mut largest as *mut u64
                };
                // SAFETY: null or a valid out pointer.
                failed = Some(unsafe { introspect::cache_info(registry, device, out) } != 0);
                format!("cache_info({device}, {out:p})")
            }
            22 => {
                let device = self.device(r);
                let limit = introspect::memory_limit(registry, device);
                if limit != 0 && !last_error().is_empty() {
                    expect = Err(format!("memory_limit failed yet returned {limit}"));
                }
                format!("memory_limit({device}) = {limit}")
            }
            23 => {
                let ptr = self.pointer(r);
                let (mut device, mut base, mut size, mut expandable) = (-7, 0u64, 0u64, 0);
                let with_outs = r.below(3) != 0;
                // SAFETY: each out pointer is null or valid.
                let result = unsafe {
                    if with_outs {
                        introspect::block_info(
                            registry,
                            ptr as usize as *mut c_void,
                            &mut device,
                            &mut base,
                            &mut size,
                            &mut expandable,
                        )
                    } else {
                        use std::ptr::null_mut;
                        introspect::block_info(
                            registry,
                            ptr as usize as *mut c_void,
                            null_mut(),
                            null_mut(),
                            null_mut(),
                            null_mut(),
                        )
                    }
                };
                failed = Some(result != 0);
                if self.exact() {
                    match self.live.get(&ptr) {
                        Some(live)
                            if result != 0
                                || (with_outs
                                    && (device != live.device
                                        || ptr < base
                                        || ptr >= base + size)) =>
                        {
                            expect = Err(format!("block_info of a live pointer of device {}: {result}, device {device}, [{base:#x}, +{size})", live.device));
                        }
                        None if result == 0 => {
                            expect = Err("block_info found a pointer that is not live".to_string())
                        }
                        _ => {}
                    }
                }
                format!("block_info({ptr:#x})")
            }
            24 => {
                let device = self.device(r);
                let (segment_capacity, block_capacity) = (r.below(5), r.below(9));
                let mut segments = [StreamallocSegmentInfo::default(); 4];
                let mut blocks = [StreamallocBlockState::default(); 8];
                let (mut segment_count, mut block_count) = (0usize, 0usize);
                let nulls = r.below(4) == 0;
                // SAFETY: null or room for the capacities.
                let result = unsafe {
                    if nulls {
                        introspect::snapshot_segments(
                            registry,
                            device,
                            std::ptr::null_mut(),
                            0,
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            0,
                            std::ptr::null_mut(),
                        )
                    } else {
                        introspect::snapshot_segments(
                            registry,
                            device,
                            segments.as_mut_ptr(),
                            segment_capacity,
                            &mut segment_count,
                            blocks.as_mut_ptr(),
                            block_capacity,
                            &mut block_count,
                        )
                    }
                };
                failed = Some(result < 0);
                format!(
                    "snapshot_segments({device}, {segment_capacity}, {block_capacity}) = {result}"
                )
            }
            25 => {
                let (device, pool) = (self.device(r), self.pool(r));
                let name = match r.below(3) {
                    0 => {
                        pools::begin_allocate_to_pool(
                            registry,
                            device,
                            pool.0,
                            pool.1,
                            std::ptr::null_mut(),
                        );
                        "begin_allocate_to_pool"
                    }
                    1 => {
                        pools::end_allocate_to_pool(registry, device, pool.0, pool.1);
                        "end_allocate_to_pool"
                    }
                    _ => {
                        pools::release_pool(registry, device, pool.0, pool.1);
                        "release_pool"
                    }
                };
                format!("{name}({device}, {pool:?})")
            }
            26 if self.panics => {
                let device = DEVICES[r.below(4)];
                let site = PANIC_SITES[r.below(PANIC_SITES.len())];
                if let Some(d) = registry.get(device) {
                    if d.poisoned().is_none() {
                        d.allocator().backend().panic_on_next(site);
                        self.planted.push(device);
                    }
                }
                // Not a C call: leave the last error as the checks expect.
                error::clear();
                format!("(a panic planted in {site} of device {device})")
            }
            26 => {
                super::empty_cache(registry);
                "empty_cache()".to_string()
            }
            _ => {
                let call = self.p2p(r);
                failed = call.failed;
                expect = call.expect;
                call.call
            }
        };
        Outcome {
            call,
            failed,
            expect,
        }
    }
}
