//! `cargo bench --bench replay`: the side-by-side table of trace replays, a large generated
//! trace's replay time, and the engine's cached fast path, printed (no criterion: each
//! figure is one deterministic run, and the point is the table).
//!
//! - For every trace in `tests/data/traces`: peak live, then peak
//!   reserved over peak live for the recording allocator (native), for us with expandable
//!   segments, with whole segments (the default) and with expandable segments under the
//!   PyTorch reuse policy (`reuse_policy:pytorch`).
//! - A generated 400k-event training-like trace, replayed with expandable segments (target:
//!   under 2 s) and with whole segments.
//! - Host ns per malloc+free on the cached path, expandable and whole segments.

use std::path::{Path, PathBuf};
use std::time::Instant;
use streamalloc::replay::{load_traces, shared_traces_dir};
use streamalloc::replay::{replay, training_trace};
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::{Allocator, Config, StreamId};

fn traces_dir() -> PathBuf {
    shared_traces_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
}

fn expandable() -> Config {
    Config::parse("expandable_segments:true").expect("config")
}

fn configs() -> Vec<(&'static str, Config)> {
    vec![
        ("expandable", expandable()),
        ("whole segs", Config::default()),
        (
            "pytorch pol",
            Config::parse("expandable_segments:true,reuse_policy:pytorch").expect("config"),
        ),
    ]
}

fn table() {
    let dir = traces_dir();
    let mut paths: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(err) => {
            println!("no trace table: {}: {err}", dir.display());
            return;
        }
    };
    paths.sort();
    println!(
        "{:<26} {:>8} {:>12} {:>8} {:>10} {:>11} {:>12} {:>8}",
        "trace", "allocs", "live MiB", "native", "expandable", "whole segs", "pytorch pol", "ns/op"
    );
    for path in paths {
        let traces = match load_traces(&path) {
            Ok(traces) => traces,
            Err(err) => {
                println!("{err}");
                continue;
            }
        };
        for trace in traces {
            let mut ratios = Vec::new();
            let mut first = None;
            for (_, config) in configs() {
                match replay(&trace.entries, &config, &mut |_| {}) {
                    Ok(report) => {
                        ratios.push(format!("{:.3}", report.ratio()));
                        first.get_or_insert(report);
                    }
                    Err(err) => ratios.push(format!("error: {err}")),
                }
            }
            let Some(report) = first else { continue };
            println!(
                "{:<26} {:>8} {:>12.1} {:>8.3} {:>10} {:>11} {:>12} {:>8.0}",
                trace.name,
                report.allocs,
                report.peak_live_bytes as f64 / (1u64 << 20) as f64,
                report.native_ratio(),
                ratios[0],
                ratios[1],
                ratios[2],
                report.ns_per_op
            );
        }
    }
}

fn large_trace() {
    let trace = training_trace(400_000);
    let started = Instant::now();
    let report = replay(&trace, &expandable(), &mut |_| {}).expect("replay");
    let elapsed = started.elapsed();
    println!(
        "generated trace: {} events, {} allocs, replayed in {:.3} s ({:.0} ns/op), ratio {:.3}, \
         {} device syncs (target < 2 s)",
        trace.len(),
        report.allocs,
        elapsed.as_secs_f64(),
        report.ns_per_op,
        report.ratio(),
        report.device_syncs
    );
    let classic = replay(&trace, &Config::default(), &mut |_| {}).expect("replay");
    println!(
        "generated trace, whole segments: ratio {:.3}, {:.0} ns/op",
        classic.ratio(),
        classic.ns_per_op
    );
}

/// Host ns per malloc+free pair of one size on one stream (the cached fast path), and per
/// operation with 64 live blocks of mixed sizes.
fn fast_path() {
    for (name, config) in [
        ("expandable", expandable()),
        ("whole segments", Config::default()),
    ] {
        let device = SimBackend::new(1 << 40);
        let allocator = Allocator::new(device, config).expect("allocator");
        let stream = StreamId(7);
        let mut pair = Vec::new();
        for size in [4096u64, 1 << 20, 64 << 20] {
            let block = allocator.malloc(size, stream).expect("malloc");
            allocator.free(block.ptr).expect("free");
            let n = 1_000_000u32;
            let started = Instant::now();
            for _ in 0..n {
                let block = allocator.malloc(size, stream).expect("malloc");
                allocator.free(block.ptr).expect("free");
            }
            pair.push(started.elapsed().as_nanos() as f64 / f64::from(n));
        }
        let mut live = std::collections::VecDeque::new();
        let mut x = 12345u64;
        let n = 1_000_000u32;
        let started = Instant::now();
        for _ in 0..n {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let size = 512 * (1 + (x >> 33) % 4096);
            live.push_back(allocator.malloc(size, stream).expect("malloc").ptr);
            if live.len() > 64 {
                allocator
                    .free(live.pop_front().expect("live"))
                    .expect("free");
            }
        }
        let mixed = started.elapsed().as_nanos() as f64 / f64::from(2 * n);
        println!(
            "cached path, {name}: malloc+free pair 4 KiB / 1 MiB / 64 MiB = {:.0} / {:.0} / {:.0} ns; \
             mixed sizes, 64 live: {mixed:.0} ns per op",
            pair[0], pair[1], pair[2]
        );
    }
}

fn main() {
    // `cargo test --benches` runs bench binaries with no arguments too: keep that quick.
    if std::env::args().any(|a| a == "--bench") {
        table();
        large_trace();
        fast_path();
    } else {
        println!("run with `cargo bench --bench replay`");
    }
}
