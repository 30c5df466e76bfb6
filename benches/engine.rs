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

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::config::format_bytes;
use streamalloc_allocator::scenarios::record_stream_pipeline;
use streamalloc_allocator::{Allocator, Config, ReusePolicy};

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

    let (device, allocator) = sim_allocator(Config::default());
    let (compute, comm) = (device.create_stream(), device.create_stream());
    group.bench_function("cross_stream", |b| {
        b.iter(|| {
            let block = allocator.malloc(black_box(64 << 20), compute).unwrap();
            allocator.record_use(block.ptr, comm).unwrap();
            allocator.free(block.ptr).unwrap();
        })
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
