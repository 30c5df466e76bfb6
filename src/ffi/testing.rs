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

use super::p2p;
use super::pools::{self, StreamallocBlockState, StreamallocPoolBlock, StreamallocSegmentInfo};
use super::{error, stats, StreamallocStats};
use crate::registry::Registry;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CStr};
use streamalloc_allocator::backend::sim::{SimBackend, INJECTED_PANIC};
use streamalloc_allocator::{Config, DevicePtr, Stats};

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

/// Reads the program's bytes; past the end, every read is 0.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }

    fn u8(&mut self) -> u8 {
        let byte = self.bytes.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        byte
    }

    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |word, _| (word << 8) | u64::from(self.u8()))
    }

    fn below(&mut self, n: usize) -> usize {
        usize::from(self.u8()) % n
    }
}

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

    fn device(&self, r: &mut Reader<'_>) -> c_int {
        DEVICES[r.below(DEVICES.len())]
    }

    fn size(&self, r: &mut Reader<'_>) -> usize {
        match r.below(8) {
            0 => 0,
            1 => 1 + r.u8() as usize * 16,
            2 | 3 => 1 + (r.u64() as usize % (4 << 20)),
            4 => (1 + r.below(64)) << 20,
            5 => (1 + r.below(4)) << 30,
            6 => usize::MAX - r.u8() as usize,
            _ => (1usize << 40) + r.u8() as usize,
        }
    }

    fn stream(&self, r: &mut Reader<'_>) -> *mut c_void {
        let id = match r.below(6) {
            0 => 0,
            1..=3 => r.below(4) as u64 + 1,
            4 => u64::MAX,
            _ => r.u64(),
        };
        id as usize as *mut c_void
    }

    fn pool(&self, r: &mut Reader<'_>) -> (u64, u64) {
        match r.below(6) {
            0 => (0, 0),
            1 | 2 => (1, 0),
            3 => (0, 2),
            4 => (u64::MAX, u64::MAX),
            _ => (u64::from(r.u8()), u64::from(r.u8())),
        }
    }

    fn pointer(&self, r: &mut Reader<'_>) -> u64 {
        let pick = r.below(8);
        let nth = r.u8() as usize;
        match pick {
            0..=3 if !self.live.is_empty() => *self.live.keys().nth(nth % self.live.len()).unwrap(),
            4 if !self.dead.is_empty() => self.dead[nth % self.dead.len()],
            6 if !self.live.is_empty() => {
                self.live.keys().nth(nth % self.live.len()).unwrap() + 1 + r.u8() as u64
            }
            7 => r.u64(),
            5 => 0,
            _ => 0x1000,
        }
    }

    /// Invalid frees counted on each created device, and in the registry.
    fn invalid_frees(&self) -> (BTreeMap<c_int, u64>, u64) {
        let per_device = self
            .registry
            .initialized()
            .map(|d| (d.ordinal(), d.allocator().stats().invalid_frees))
            .collect();
        (per_device, self.registry.invalid_frees())
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
                failed = Some(unsafe { pools::cache_info(registry, device, out) } != 0);
                format!("cache_info({device}, {out:p})")
            }
            22 => {
                let device = self.device(r);
                let limit = pools::memory_limit(registry, device);
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
                        pools::block_info(
                            registry,
                            ptr as usize as *mut c_void,
                            &mut device,
                            &mut base,
                            &mut size,
                            &mut expandable,
                        )
                    } else {
                        use std::ptr::null_mut;
                        pools::block_info(
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
                        pools::snapshot_segments(
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
                        pools::snapshot_segments(
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

    /// Notes a pointer `malloc` returned, if any; it must be new.
    fn allocated(&mut self, ptr: u64, device: c_int, size: usize) -> Result<(), String> {
        if ptr == 0 {
            return if size == 0 && !last_error().is_empty() {
                Err("malloc of 0 bytes set an error".to_string())
            } else {
                Ok(())
            };
        }
        if let Some(live) = self.live.insert(ptr, Live { device }) {
            return Err(format!(
                "{ptr:#x} handed out again while live (device {})",
                live.device
            ));
        }
        self.dead.retain(|&p| p != ptr);
        match self.registry.get(device) {
            Some(d) if d.allocator().owns(DevicePtr(ptr)) => Ok(()),
            _ => Err(format!("{ptr:#x} is not a live block of device {device}")),
        }
    }

    /// Updates the model after `free(ptr, device)` and says whether it went as it should.
    fn freed(
        &mut self,
        ptr: u64,
        device: c_int,
        (before, registry_before): (BTreeMap<c_int, u64>, u64),
    ) -> Result<(), String> {
        let live = self.live.remove(&ptr);
        if live.is_some() {
            self.dead.push(ptr);
        }
        if ptr == 0 || !self.exact() {
            return Ok(());
        }
        let (after, registry_after) = self.invalid_frees();
        let error = last_error();
        let mut expected = before.clone();
        let mut registry_expected = registry_before;
        if live.is_some() {
            if !error.is_empty() {
                return Err(format!("freeing a live pointer failed: {error}"));
            }
        } else {
            if !error.contains("unknown pointer") {
                return Err(format!("freeing a dead pointer: error {error:?}"));
            }
            if let Some(count) = expected.get_mut(&device) {
                *count += 1;
            }
            registry_expected += 1;
        }
        // A device created by this call (none is) would be missing from `before`.
        if after != expected || registry_after != registry_expected {
            return Err(format!(
                "invalid frees per device {before:?} -> {after:?} (expected {expected:?}), registry {registry_before} -> {registry_after} (expected {registry_expected})"
            ));
        }
        Ok(())
    }

    /// `pool_restore` with a checkpoint taken earlier, or junk.
    fn restore(&mut self, r: &mut Reader<'_>) -> Outcome {
        let (mut device, mut pool) = (self.device(r), self.pool(r));
        let mut blocks: Vec<StreamallocPoolBlock> = match r.below(4) {
            0 | 1 if !self.checkpoints.is_empty() => {
                let (d, p, blocks) = &self.checkpoints[r.u8() as usize % self.checkpoints.len()];
                if r.below(2) == 0 {
                    (device, pool) = (*d, *p);
                }
                blocks.clone()
            }
            2 => (0..r.below(3))
                .map(|_| StreamallocPoolBlock {
                    address: self.pointer(r),
                    size: self.size(r) as u64,
                    requested: r.u64() % 4096,
                    stream: r.u64() % 4,
                })
                .collect(),
            _ => Vec::new(),
        };
        if r.below(8) == 0 {
            if let Some(first) = blocks.first_mut() {
                first.size = first.size.wrapping_add(1 << 21);
            }
        }
        let null_blocks = r.below(8) == 0;
        let capacity = r.below(9);
        let mut freed = [0u64; 8];
        let live_before = self.pool_live(device, pool);
        // SAFETY: `blocks` readable for its length (or null, which is refused when the
        // count is not 0); `freed` has room for `capacity` <= 8 addresses.
        let n = unsafe {
            pools::pool_restore(
                &self.registry,
                device,
                pool.0,
                pool.1,
                if null_blocks {
                    std::ptr::null()
                } else {
                    blocks.as_ptr()
                },
                blocks.len(),
                freed.as_mut_ptr(),
                capacity,
            )
        };
        let call = format!(
            "pool_restore({device}, {pool:?}, {} blocks, room {capacity}) = {n}",
            blocks.len()
        );
        let mut expect = Ok(());
        if n >= 0 {
            for address in &freed[..(n as usize).min(capacity)] {
                if self.live.remove(address).is_some() {
                    self.dead.push(*address);
                } else if self.exact() {
                    expect = Err(format!("restore freed {address:#x}, which was not live"));
                }
            }
            for block in &blocks {
                if let Err(err) = self.allocated(block.address, device, block.size as usize) {
                    expect = expect.and(Err(format!("after restore: {err}")));
                }
            }
        } else if self.exact() && self.pool_live(device, pool) != live_before {
            expect = Err("a failed restore changed the pool's live allocations".to_string());
        }
        Outcome {
            call,
            failed: Some(n < 0),
            expect,
        }
    }

    /// A pool's live allocations, read without going through the C ABI (none on a device
    /// not created yet).
    fn pool_live(&self, device: c_int, pool: (u64, u64)) -> Vec<DevicePtr> {
        self.registry.get(device).map_or_else(Vec::new, |d| {
            d.allocator()
                .pool_live_allocations(streamalloc_allocator::PoolId(pool.0, pool.1))
        })
    }

    /// The p2p planner on junk descriptions, then its readers on what came back, each
    /// checked as a call of its own.
    fn p2p(&mut self, r: &mut Reader<'_>) -> Outcome {
        let world = r.below(4) as u32;
        let descriptions: Vec<Vec<u8>> = (0..world)
            .map(|_| (0..r.below(48)).map(|_| r.u8()).collect())
            .collect();
        let pointers: Vec<*const u8> = descriptions.iter().map(|d| d.as_ptr()).collect();
        let lengths: Vec<usize> = descriptions.iter().map(Vec::len).collect();
        let (budget, buffers, zero_copy_min) = (r.u64(), u32::from(r.u8()), r.u64());
        let rank = u32::from(r.u8() % 4);
        let mut expect = Ok(());
        let mut step = |name: &str, failed: bool| {
            let error = last_error();
            if error == SENTINEL || failed == error.is_empty() {
                expect = expect.clone().and(Err(format!(
                    "{name}: failed {failed} with last error {error:?}"
                )));
            }
            error::set(SENTINEL);
        };
        // SAFETY: `world` entries, each readable for its length.
        let plan = unsafe {
            p2p::streamalloc_p2p_plan_new(
                world,
                pointers.as_ptr(),
                lengths.as_ptr(),
                budget,
                buffers,
                zero_copy_min,
            )
        };
        step("streamalloc_p2p_plan_new", plan.is_null());
        let mut rows = [0i64; 4 * p2p::ROW_COLUMNS];
        let mut summary = [0u64; 8];
        // SAFETY: a live plan or null; buffers sized as documented.
        unsafe {
            let n = p2p::streamalloc_p2p_plan_rows(plan, rank, rows.as_mut_ptr(), 4);
            step("streamalloc_p2p_plan_rows", n < 0);
            let n = p2p::streamalloc_p2p_plan_summary(plan, rank, summary.as_mut_ptr());
            step("streamalloc_p2p_plan_summary", n < 0);
            let digest = p2p::streamalloc_p2p_plan_digest(plan);
            step("streamalloc_p2p_plan_digest", plan.is_null() && digest == 0);
            p2p::streamalloc_p2p_plan_free(plan);
        }
        Outcome {
            call: format!("p2p plan of {world} junk descriptions for rank {rank}, then free"),
            failed: Some(false),
            expect,
        }
    }

    /// The checks after every call (see the module docs).
    fn check(&mut self, outcome: &Outcome) -> Result<(), String> {
        let call = &outcome.call;
        let error = last_error();
        if error == SENTINEL {
            return Err(format!("{call}: the last error is stale"));
        }
        outcome
            .expect
            .clone()
            .map_err(|why| format!("{call}: {why}"))?;
        if let Some(failed) = outcome.failed {
            if failed == error.is_empty() {
                return Err(format!(
                    "{call}: {} with last error {error:?}",
                    if failed { "failed" } else { "succeeded" }
                ));
            }
        }
        if error.contains("internal error (panic)") {
            return Err(format!("{call}: a panic was caught: {error}"));
        }
        for device in self.registry.initialized() {
            let ordinal = device.ordinal();
            let backend = device.allocator().backend();
            match device.poisoned() {
                Some(poisoned) => {
                    let message = poisoned.to_string();
                    if !self.planted.contains(&ordinal) || !message.contains(INJECTED_PANIC) {
                        return Err(format!("{call}: device {ordinal} poisoned by a panic nobody planted: {message}"));
                    }
                    let now = (device.allocator().stats(), driver_calls(backend));
                    match self.poisoned.get(&ordinal) {
                        None => {
                            self.poisoned.insert(ordinal, now);
                        }
                        Some(then) if *then != now => {
                            return Err(format!(
                                "{call}: the engine of poisoned device {ordinal} was used"
                            ));
                        }
                        Some(_) => {}
                    }
                }
                None => {
                    device
                        .allocator()
                        .check_invariants()
                        .map_err(|why| format!("{call}: device {ordinal}: {why}"))?;
                    if let Some(race) = backend.races().first() {
                        return Err(format!("{call}: device {ordinal}: {race}"));
                    }
                }
            }
        }
        if error.contains("unusable after an internal panic") && self.poisoned.is_empty() {
            return Err(format!("{call}: {error}, yet no device is poisoned"));
        }
        Ok(())
    }

    /// Frees everything and checks that the devices end empty.
    fn finish(mut self) -> Result<(), String> {
        let live: Vec<(u64, Live)> = self.live.iter().map(|(p, l)| (*p, *l)).collect();
        for (ptr, Live { device }) in live {
            error::set(SENTINEL);
            let before = self.invalid_frees();
            super::free(
                &self.registry,
                ptr as usize as *mut c_void,
                0,
                device,
                std::ptr::null_mut(),
            );
            let outcome = Outcome {
                call: format!("final free({ptr:#x}, {device})"),
                failed: None,
                expect: self.freed(ptr, device, before),
            };
            self.check(&outcome)?;
        }
        for device in self.registry.initialized() {
            let allocated = device.allocator().stats().allocated_bytes.current;
            if self.exact() && allocated != 0 {
                return Err(format!(
                    "device {}: {allocated} bytes still allocated after every live pointer was freed",
                    device.ordinal()
                ));
            }
        }
        Ok(())
    }
}
