//! The host fast path's workloads as plain loops, for counting instructions per operation
//! under callgrind (`benches/callgrind.sh`), which repeats where timings on a shared
//! machine do not. Each workload runs [`OPS`] operations to warm up, then as many inside
//! [`measured`], the one function callgrind collects in (`--toggle-collect`).
//!
//! ```sh
//! cargo bench --bench host_path                  # ns per operation of every workload
//! target/release/deps/host_path-HASH WORKLOAD    # one workload (what callgrind.sh runs)
//! ```
//!
//! Workloads, all on simulated devices with the default configuration unless named
//! `_ring_off` (`trace_capacity:0`):
//! - `abi_pair`: `streamalloc_malloc` + `streamalloc_free` of 1 MiB on device 0, as
//!   `benches/gpu/host_abi.cpp` calls them (the C ABI's code over a registry of
//!   simulated devices);
//! - `abi_mixed`: `host_abi.cpp`'s mixed sizes through the same calls;
//! - `door_pair` / `door_loop`: the calls the native PyTorch door makes for
//!   `torch.empty` and the tensor's deleter (`streamalloc_malloc_in_pool` on the default
//!   pool, `streamalloc_free` naming no device), a same-size pair and the Python
//!   alloc/free loop's sizes (`benches/gpu/micro_loop.py`: 64 live, a random one freed);
//! - `engine_pair`: `Allocator::malloc` + `free` of the same device's allocator, the
//!   engine alone.
//!
//! Besides the time, each workload prints how often it called the device for memory
//! (segments obtained or returned, pages mapped or unmapped) and synchronised it: on a GPU
//! each such call costs microseconds, which the simulator's counts do not show.

use std::ffi::c_void;
use std::hint::black_box;
use std::time::Instant;
use streamalloc::registry::Registry;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::{Config, Stats, StreamId};

/// Operations each workload runs inside [`measured`].
const OPS: usize = 200_000;

/// The workloads' names, in the order `cargo bench` prints them.
const WORKLOADS: [&str; 10] = [
    "abi_pair",
    "abi_pair_ring_off",
    "abi_mixed",
    "abi_mixed_ring_off",
    "door_pair",
    "door_pair_ring_off",
    "door_loop",
    "door_loop_ring_off",
    "engine_pair",
    "engine_pair_ring_off",
];

fn config(ring: bool) -> Config {
    Config {
        trace_capacity: if ring {
            Config::default().trace_capacity
        } else {
            0
        },
        ..Config::default()
    }
}

/// A simulated device of 1 TiB: the mixed workloads keep up to 64 blocks of up to
/// 256 MiB live, more than [`Registry::simulated`]'s devices hold.
fn large_device(ordinal: i32) -> Result<SimBackend, String> {
    let ordinal = u64::try_from(ordinal).map_err(|_| format!("no device {ordinal}"))?;
    Ok(SimBackend::with_base_address(
        1 << 40,
        0x7f00_0000_0000 + (ordinal << 44),
    ))
}

/// A small xorshift generator: the workloads' sizes and victims, drawn before measuring.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

/// Sizes and victims of a mixed workload: each malloc, then (once more than 64 are live)
/// the index of the live block freed after it.
struct Mixed {
    steps: Vec<(usize, Option<usize>)>,
}

impl Mixed {
    /// `host_abi.cpp`'s sizes: 60% in 1 B–1 MiB, 35% in 1–64 MiB, 5% in 64–256 MiB.
    fn host_abi(mallocs: usize) -> Self {
        Self::drawn(mallocs, |draw| match draw.below(1000) {
            0..600 => draw.below(1 << 20) + 1,
            600..950 => draw.below(63 << 20) + (1 << 20),
            _ => draw.below(192 << 20) + (64 << 20),
        })
    }

    /// `micro_loop.py`'s sizes (60% up to 256 KiB, 35% up to 16 MiB, 5% up to 64 MiB),
    /// as the float32 tensors it makes of them.
    fn python_loop(mallocs: usize) -> Self {
        Self::drawn(mallocs, |draw| {
            let bytes = match draw.below(1000) {
                0..600 => draw.below(1 << 18) + 1,
                600..950 => draw.below((1 << 24) - (1 << 18)) + (1 << 18),
                _ => draw.below((1 << 26) - (1 << 24)) + (1 << 24),
            };
            (bytes / 4 + 1) * 4
        })
    }

    fn drawn(mallocs: usize, mut size: impl FnMut(&mut Draw) -> u64) -> Self {
        let mut draw = Draw(0x9e37_79b9_7f4a_7c15);
        let mut live = 0usize;
        let steps = (0..mallocs)
            .map(|_| {
                let bytes = size(&mut draw) as usize;
                live += 1;
                let victim = (live > 64).then(|| {
                    let k = draw.below(live as u64) as usize;
                    live -= 1;
                    k
                });
                (bytes, victim)
            })
            .collect();
        Self { steps }
    }

    /// Operations in one run: every malloc and every free.
    fn ops(&self) -> usize {
        2 * self.steps.len()
    }

    /// One run through `malloc` / `free`, the remaining live blocks freed at the end.
    fn run(&self, malloc: impl Fn(usize) -> *mut c_void, free: impl Fn(*mut c_void)) {
        let mut live = Vec::with_capacity(65);
        for &(size, victim) in &self.steps {
            let ptr = malloc(size);
            assert!(!ptr.is_null(), "allocation of {size} bytes failed");
            live.push(ptr);
            if let Some(k) = victim {
                free(live.swap_remove(k));
            }
        }
        for ptr in live {
            free(ptr);
        }
    }
}

/// The loop callgrind measures: `body` run `times` times. Never inlined, so that
/// `--toggle-collect` finds it.
#[inline(never)]
fn measured(times: usize, body: &mut dyn FnMut()) {
    for _ in 0..times {
        body();
    }
}

/// What one workload did while measured.
struct Measured {
    ops: usize,
    seconds: f64,
    /// Calls that obtained or returned device memory (segments, mappings).
    device_calls: u64,
    /// Device-wide synchronisations.
    syncs: u64,
}

/// Runs `workload` warm, then measured.
fn run(workload: &str) -> Measured {
    let ring = !workload.ends_with("_ring_off");
    let name = workload.trim_end_matches("_ring_off");
    let registry = Registry::with_config(large_device, config(ring));
    let stream: *mut c_void = std::ptr::null_mut();
    // What the native door calls for `torch.empty` and the tensor's deleter.
    let door_malloc =
        |size: usize| streamalloc::ffi::pools::malloc_in_pool(&registry, size, 0, stream, 0, 0);
    let door_free = |ptr: *mut c_void| streamalloc::ffi::free(&registry, ptr, 0, -1, stream);
    // What `host_abi.cpp` calls.
    let abi_malloc = |size: usize| streamalloc::ffi::malloc(&registry, size, 0, stream);
    let abi_free = |ptr: *mut c_void| streamalloc::ffi::free(&registry, ptr, 0, 0, stream);
    // (operations per run of the body, the body)
    let (per_run, mut body): (usize, Box<dyn FnMut() + '_>) = match name {
        "abi_pair" => (2, Box::new(|| abi_free(abi_malloc(black_box(1 << 20))))),
        "door_pair" => (2, Box::new(|| door_free(door_malloc(black_box(1 << 20))))),
        "abi_mixed" => {
            let mixed = Mixed::host_abi(20_000);
            (
                mixed.ops(),
                Box::new(move || mixed.run(abi_malloc, abi_free)),
            )
        }
        "door_loop" => {
            let mixed = Mixed::python_loop(20_000);
            (
                mixed.ops(),
                Box::new(move || mixed.run(door_malloc, door_free)),
            )
        }
        "engine_pair" => {
            // The same device's allocator, called directly.
            let allocator = registry.device(0).expect("a simulated device").allocator();
            let pair = move || {
                let block = allocator.malloc(black_box(1 << 20), StreamId(0)).unwrap();
                allocator.free(block.ptr).unwrap();
            };
            (2, Box::new(pair))
        }
        other => {
            eprintln!("unknown workload {other}; one of {}", WORKLOADS.join(", "));
            std::process::exit(2);
        }
    };
    let times = (OPS / per_run).max(1);
    // Warm, outside the measured function: the segments and the stream's slot made, the
    // trace ring grown to its capacity (it grows on demand, a copy at each doubling).
    for _ in 0..times {
        body();
    }
    let stats = || {
        registry
            .get(0)
            .expect("device 0 in use")
            .allocator()
            .stats()
    };
    let before = stats();
    let start = Instant::now();
    measured(times, &mut body);
    let seconds = start.elapsed().as_secs_f64();
    let after = stats();
    let device_calls = |s: &Stats| s.torch.device_allocs + s.torch.device_frees;
    Measured {
        ops: times * per_run,
        seconds,
        device_calls: device_calls(&after) - device_calls(&before),
        syncs: after.device_syncs - before.device_syncs,
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a workload name runs that one alone.
    let chosen: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with("--"))
        .collect();
    let workloads: Vec<&str> = if chosen.is_empty() {
        WORKLOADS.to_vec()
    } else {
        chosen.iter().map(String::as_str).collect()
    };
    println!(
        "{:<22} {:>10} {:>12} {:>26} {:>18}",
        "workload", "ops", "ns per op", "device calls per 1000 ops", "syncs per 1000 ops"
    );
    for workload in workloads {
        let m = run(workload);
        let per_thousand = |n: u64| n as f64 * 1000.0 / m.ops as f64;
        println!(
            "{workload:<22} {:>10} {:>12.1} {:>26.2} {:>18.2}",
            m.ops,
            m.seconds * 1e9 / m.ops as f64,
            per_thousand(m.device_calls),
            per_thousand(m.syncs)
        );
    }
}
