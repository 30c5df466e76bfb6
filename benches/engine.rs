//! Host cost of the engine on the simulated device (criterion), plus the record_stream
//! scenario's memory figures printed side by side.
//!
//! - `cached_same_stream`: one malloc+free pair served from the stream's own free list —
//!   the path that must make no driver call (target ≤ 60 ns per pair on a 2-core box).
//! - `cross_stream`: a pair whose block was used by another stream: one event recorded on
//!   free, one device-side wait on reuse.
//! - `two_threads_two_streams`: the cached pair from two threads at once, one stream each
//!   (reported per pair per thread).
//! - `mixed_sizes_64_live`: PyTorch's micro-benchmark pattern, per operation.
//! - `stream_per_request`: a request on a stream of its own (volatile, destroyed after),
//!   then one on a long-lived stream, after 20,000 such requests: what a server that makes
//!   a stream per request pays per request.
//! - `crowded_size_class`: pairs whose best fit is the lowest-addressed of 20,000 free
//!   blocks of one size (the free list's worst case for shifting).
//! - `c_abi_pair`: the cached pair through the C ABI's code (`streamalloc_malloc` /
//!   `streamalloc_free` over a registry of simulated devices): what the door adds to the
//!   engine (guards, device lookup, poisoning check).
//! - `host_cost_mixed`: `benches/gpu/host_cost.py`'s mixed workload exactly (the same
//!   `mt19937_64` sequences: 60% of sizes uniform in 1 B–1 MiB, 35% in 1–64 MiB, 5% in
//!   64–256 MiB; 64 live blocks, a random one freed after each malloc), per operation, so
//!   that local figures track the GPU host's. The random numbers are drawn before timing.
//! - `*_tsc_clock`: the same with the trace stamped by the time-stamp counter, as the CUDA
//!   backend does (x86-64 only): the simulator's virtual clock is one load, so only these
//!   show what the trace's clock reads cost.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::backend::Clock;
use streamalloc_allocator::config::format_bytes;
use streamalloc_allocator::scenarios::record_stream_pipeline;
use streamalloc_allocator::{Allocator, Backend, Config, ReusePolicy, StreamId};

fn sim_allocator(config: Config) -> (SimBackend, Allocator<SimBackend>) {
    let device = SimBackend::new(1 << 40);
    let allocator = Allocator::new(device.clone(), config).unwrap();
    (device, allocator)
}

fn cached_same_stream(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(1));
    for (name, trace_capacity) in [
        ("cached_same_stream", 65_536),
        ("cached_same_stream_no_trace", 0),
    ] {
        let (device, allocator) = sim_allocator(Config {
            trace_capacity,
            ..Config::default()
        });
        let stream = device.create_stream();
        let warm = allocator.malloc(1 << 20, stream).unwrap();
        allocator.free(warm.ptr).unwrap();
        group.bench_function(name, |b| {
            b.iter(|| {
                let block = allocator.malloc(black_box(1 << 20), stream).unwrap();
                allocator.free(block.ptr).unwrap();
            })
        });
    }

    let registry = streamalloc::registry::Registry::simulated(Config::default());
    let stream = std::ptr::null_mut();
    let warm = streamalloc::ffi::malloc(&registry, 1 << 20, 0, stream);
    streamalloc::ffi::free(&registry, warm, 1 << 20, 0, stream);
    group.bench_function("c_abi_pair", |b| {
        b.iter(|| {
            let ptr = streamalloc::ffi::malloc(&registry, black_box(1 << 20), 0, stream);
            assert!(!ptr.is_null());
            streamalloc::ffi::free(&registry, ptr, 1 << 20, 0, stream);
        })
    });

    let (device, allocator) = sim_allocator(Config::default());
    let (compute, comm) = (device.create_stream(), device.create_stream());
    group.bench_function("cross_stream", |b| {
        b.iter(|| {
            let block = allocator.malloc(black_box(64 << 20), compute).unwrap();
            allocator.record_use(block.ptr, comm).unwrap();
            allocator.free(block.ptr).unwrap();
        })
    });

    // A program that makes a stream per request (its own streams, volatile), 20,000 of them
    // before timing: a malloc on a new stream is a slow path, which must not walk every
    // stream ever seen.
    let (device, allocator) = sim_allocator(Config::default());
    let main = device.create_stream();
    let request = |device: &SimBackend, allocator: &Allocator<SimBackend>| {
        let stream = device.create_stream();
        allocator.mark_stream_volatile(stream);
        let block = allocator.malloc(black_box(4 << 20), stream).unwrap();
        allocator.free(block.ptr).unwrap();
        device.destroy_stream(stream);
        let block = allocator.malloc(black_box(4 << 20), main).unwrap();
        allocator.free(block.ptr).unwrap();
    };
    for _ in 0..20_000 {
        request(&device, &allocator);
    }
    group.bench_function("stream_per_request", |b| {
        b.iter(|| request(&device, &allocator))
    });

    let (device, allocator) = sim_allocator(Config::default());
    let stream = device.create_stream();
    group.bench_function("mixed_sizes_64_live", |b| {
        b.iter_batched(
            || {
                (0u64..2048)
                    .map(|i| 1 + (i * 2_654_435_761) % (32 << 20))
                    .collect::<Vec<_>>()
            },
            |sizes| {
                let mut live = Vec::with_capacity(65);
                for (i, size) in sizes.into_iter().enumerate() {
                    live.push(allocator.malloc(size, stream).unwrap().ptr);
                    if live.len() > 64 {
                        allocator
                            .free(live.swap_remove(i * 7 % live.len()))
                            .unwrap();
                    }
                }
                for ptr in live {
                    allocator.free(ptr).unwrap();
                }
            },
            BatchSize::SmallInput,
        )
    });
    // Worst case for a free list kept in sorted vectors: 20,000 free blocks of one size,
    // each request (15 sizes in turn, so the hot list never serves it) splitting the
    // lowest-addressed one, and each free merging one back there.
    let (device, allocator) = sim_allocator(Config::default());
    let stream = device.create_stream();
    let blocks: Vec<_> = (0..40_000)
        .map(|_| allocator.malloc(8192, stream).unwrap().ptr)
        .collect();
    for ptr in blocks.iter().step_by(2) {
        allocator.free(*ptr).unwrap();
    }
    let mut turn = 0u64;
    group.throughput(Throughput::Elements(1));
    group.bench_function("crowded_size_class", |b| {
        b.iter(|| {
            turn = turn % 15 + 1;
            let block = allocator.malloc(black_box(512 * turn), stream).unwrap();
            allocator.free(block.ptr).unwrap();
        })
    });

    #[cfg(target_arch = "x86_64")]
    {
        let device = SimBackend::new(1 << 40);
        let allocator = Allocator::new(TscClocked::new(device.clone()), Config::default()).unwrap();
        let stream = device.create_stream();
        let warm = allocator.malloc(1 << 20, stream).unwrap();
        allocator.free(warm.ptr).unwrap();
        // The default configuration, as on the GPU: pages mapped into expandable segments.
        assert!(
            allocator.stats().page_map_bytes > 0,
            "the clocked device must run expandable segments as the default configuration does"
        );
        group.bench_function("cached_same_stream_tsc_clock", |b| {
            b.iter(|| {
                let block = allocator.malloc(black_box(1 << 20), stream).unwrap();
                allocator.free(block.ptr).unwrap();
            })
        });
        let workload = HostCostMixed::new(HOST_COST_MALLOCS);
        workload.run(&allocator, stream);
        group.throughput(Throughput::Elements(workload.ops()));
        group.bench_function("host_cost_mixed_tsc_clock", |b| {
            b.iter(|| workload.run(&allocator, stream))
        });
        group.throughput(Throughput::Elements(1));
    }

    for (name, trace_capacity) in [("host_cost_mixed", 65_536), ("host_cost_mixed_no_trace", 0)] {
        let (device, allocator) = sim_allocator(Config {
            trace_capacity,
            ..Config::default()
        });
        let stream = device.create_stream();
        let workload = HostCostMixed::new(HOST_COST_MALLOCS);
        // host_cost.py warms up with one run before timing.
        workload.run(&allocator, stream);
        let before = allocator.stats();
        workload.run(&allocator, stream);
        let after = allocator.stats();
        // Each segment alloc/free is a driver call (cuMemAlloc ~66 µs) on a GPU.
        println!(
            "{name}: per warm run of {} ops, {} segment allocs, {} frees",
            workload.ops(),
            after.segment_allocs - before.segment_allocs,
            after.segment_frees - before.segment_frees
        );
        group.throughput(Throughput::Elements(workload.ops()));
        group.bench_function(name, |b| b.iter(|| workload.run(&allocator, stream)));
    }
    group.finish();

    c.bench_function("engine/two_threads_two_streams", |b| {
        b.iter_custom(|iters| {
            let device = SimBackend::new(1 << 40);
            let allocator = Arc::new(Allocator::new(device.clone(), Config::default()).unwrap());
            let barrier = Arc::new(Barrier::new(2));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let (allocator, barrier, stream) =
                        (allocator.clone(), barrier.clone(), device.create_stream());
                    std::thread::spawn(move || {
                        barrier.wait();
                        let start = Instant::now();
                        for _ in 0..iters {
                            let block = allocator.malloc(black_box(1 << 20), stream).unwrap();
                            allocator.free(block.ptr).unwrap();
                        }
                        start.elapsed()
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .max()
                .unwrap_or(Duration::ZERO)
        })
    });
}

/// Mallocs per run of [`HostCostMixed`] (host_cost.py times 100,000 per run; fewer keep a
/// criterion sample short, and the per-operation cost is the same once warm).
const HOST_COST_MALLOCS: usize = 20_000;

/// The mixed workload of `benches/gpu/host_cost.py` (`Sizes` and `sa_mixed`), drawn from the
/// same generators with the same seeds.
struct HostCostMixed {
    /// Request sizes, in order.
    sizes: Vec<u64>,
    /// For the malloc at each index, the live-window index freed after it, if any.
    victims: Vec<Option<usize>>,
}

impl HostCostMixed {
    fn new(mallocs: usize) -> Self {
        check_mt19937_64();
        let mut size_gen = Mt19937_64::new(7);
        let mut victim_gen = Mt19937_64::new(11);
        let mut live = 0usize;
        let mut sizes = Vec::with_capacity(mallocs);
        let mut victims = Vec::with_capacity(mallocs);
        for _ in 0..mallocs {
            // `double r = (g() % 1000) / 1000.0;` then the three ranges, as in host_cost.py.
            let r = (size_gen.next() % 1000) as f64 / 1000.0;
            let size = if r < 0.6 {
                size_gen.next() % (1 << 20) + 1
            } else if r < 0.95 {
                size_gen.next() % (63 << 20) + (1 << 20)
            } else {
                size_gen.next() % (192 << 20) + (64 << 20)
            };
            sizes.push(size);
            live += 1;
            victims.push((live > 64).then(|| {
                let k = (victim_gen.next() % live as u64) as usize;
                live -= 1;
                k
            }));
        }
        Self { sizes, victims }
    }

    /// Mallocs plus frees in one run.
    fn ops(&self) -> u64 {
        2 * self.sizes.len() as u64
    }

    /// One run: every malloc, the frees after them, then the remaining live blocks freed.
    fn run<B: Backend>(&self, allocator: &Allocator<B>, stream: StreamId) {
        let mut live = Vec::with_capacity(65);
        for (&size, &victim) in self.sizes.iter().zip(&self.victims) {
            live.push(allocator.malloc(black_box(size), stream).unwrap().ptr);
            if let Some(k) = victim {
                allocator.free(live.swap_remove(k)).unwrap();
            }
        }
        for ptr in live {
            allocator.free(ptr).unwrap();
        }
    }
}

/// The simulated device with the CUDA backend's trace clock: the time-stamp counter, scaled
/// to nanoseconds by a rate measured at creation.
#[cfg(target_arch = "x86_64")]
struct TscClocked {
    device: SimBackend,
    start: u64,
    /// Nanoseconds per tick, in 32.32 fixed point.
    ns_per_tick_q32: u64,
}

#[cfg(target_arch = "x86_64")]
impl TscClocked {
    fn new(device: SimBackend) -> Self {
        let (begin, start) = (Instant::now(), rdtsc());
        while begin.elapsed() < Duration::from_millis(2) {
            std::hint::spin_loop();
        }
        let (ticks, ns) = (rdtsc() - start, begin.elapsed().as_nanos());
        Self {
            device,
            start,
            ns_per_tick_q32: ((ns << 32) / u128::from(ticks.max(1))) as u64,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn rdtsc() -> u64 {
    // SAFETY: RDTSC is available on every x86-64 CPU and has no memory effects.
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_rdtsc()
    }
}

#[cfg(target_arch = "x86_64")]
streamalloc_allocator::forward_backend! {
    impl[] for TscClocked as this => &this.device, SimBackend;
    Segments, Events, Streams, VirtualMemory, HostMemory
}

#[cfg(target_arch = "x86_64")]
impl Clock for TscClocked {
    fn now_ns(&self) -> u64 {
        self.ticks_to_ns(self.now_ticks())
    }
    #[inline]
    fn now_ticks(&self) -> u64 {
        rdtsc()
    }
    fn ticks_to_ns(&self, ticks: u64) -> u64 {
        let ticks = ticks.saturating_sub(self.start);
        ((u128::from(ticks) * u128::from(self.ns_per_tick_q32)) >> 32) as u64
    }
    fn precise_ns(&self) -> u64 {
        self.now_ns()
    }
    /// Always the time-stamp counter: this device exists to measure it.
    fn set_trace_clock(&self, _clock: streamalloc_allocator::TraceClock) {}
}

/// The 64-bit Mersenne Twister (`std::mt19937_64`), so the workload matches the C++ one
/// number for number.
struct Mt19937_64 {
    state: [u64; 312],
    index: usize,
}

impl Mt19937_64 {
    fn new(seed: u64) -> Self {
        let mut state = [0u64; 312];
        state[0] = seed;
        for i in 1..312 {
            let prev = state[i - 1];
            state[i] = 6_364_136_223_846_793_005u64
                .wrapping_mul(prev ^ (prev >> 62))
                .wrapping_add(i as u64);
        }
        Self { state, index: 312 }
    }

    fn next(&mut self) -> u64 {
        const UPPER: u64 = 0xFFFF_FFFF_8000_0000;
        const LOWER: u64 = 0x7FFF_FFFF;
        if self.index == 312 {
            for i in 0..312 {
                let x = (self.state[i] & UPPER) | (self.state[(i + 1) % 312] & LOWER);
                let mut xa = x >> 1;
                if x & 1 != 0 {
                    xa ^= 0xB502_6F5A_A966_19E9;
                }
                self.state[i] = self.state[(i + 156) % 312] ^ xa;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= (y >> 29) & 0x5555_5555_5555_5555;
        y ^= (y << 17) & 0x71D6_7FFF_EDA6_0000;
        y ^= (y << 37) & 0xFFF7_EEE0_0000_0000;
        y ^ (y >> 43)
    }
}

/// Checks the generator against the C++ standard, which requires the 10000th draw of a
/// default-seeded (5489) `mt19937_64` to be 9981545732273789042. Run before the workload
/// is drawn, so a wrong generator cannot silently change what is measured.
fn check_mt19937_64() {
    let mut g = Mt19937_64::new(5489);
    let last = (0..10_000).map(|_| g.next()).last();
    assert_eq!(last, Some(9_981_545_732_273_789_042), "mt19937_64 is wrong");
}

/// Not a timing: the memory the record_stream scenario needs under each policy.
fn record_stream_memory(_c: &mut Criterion) {
    println!("\nrecord_stream scenario (32 x 64 MiB activations, slower comm stream, simulated):");
    println!(
        "{:<12} {:>14} {:>10} {:>8}",
        "policy", "peak reserved", "dev waits", "queries"
    );
    for (name, policy) in [
        ("pytorch", ReusePolicy::Pytorch),
        ("stream_wait", ReusePolicy::StreamWait),
    ] {
        let report = record_stream_pipeline(policy, 32, 64 << 20).unwrap();
        println!(
            "{:<12} {:>14} {:>10} {:>8}",
            name,
            format_bytes(report.peak_reserved),
            report.cross_stream_waits,
            report.event_queries
        );
    }
    println!();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = record_stream_memory, cached_same_stream
}
criterion_main!(benches);
