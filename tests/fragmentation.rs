//! Peak reserved against peak live on workloads whose allocation pattern defeats whole
//! segments, on the simulated device with the default configuration: generation with KV
//! caches grown token by token, over requests of varying batch and prompt length. The
//! figures the GPU machine measures on real models are in `benches/gpu/fragmentation/`;
//! this keeps the policy from regressing where CI can see it.

use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::testing::SplitMix64;
use streamalloc_allocator::{Allocator, Config, DevicePtr, StreamId};

const HIDDEN: u64 = 768;
const LAYERS: usize = 12;
const VOCAB: u64 = 50_257;
/// Bytes per element (fp16).
const ELEM: u64 = 2;

struct Run {
    device: SimBackend,
    allocator: Allocator<SimBackend>,
    stream: StreamId,
    peak_live: u64,
}

impl Run {
    fn new(config: Config) -> Self {
        let device = SimBackend::new(80 << 30);
        let allocator = Allocator::new(device.clone(), config).unwrap();
        let stream = device.create_stream();
        Self {
            device,
            allocator,
            stream,
            peak_live: 0,
        }
    }

    fn alloc(&mut self, bytes: u64) -> DevicePtr {
        let block = self.allocator.malloc(bytes, self.stream).unwrap();
        let live = self.allocator.stats().allocated_bytes.current;
        self.peak_live = self.peak_live.max(live);
        block.ptr
    }

    fn free(&mut self, ptr: DevicePtr) {
        self.allocator.free(ptr).unwrap();
    }

    fn ratio(&self) -> f64 {
        self.allocator.stats().reserved_bytes.peak as f64 / self.peak_live as f64
    }
}

/// A decoder generating for `requests` seeded requests: weights once, then per request a
/// prefill (activations, logits over the prompt, a KV cache per layer) and one step per new
/// token that grows every layer's cache by allocating the longer one and freeing the old
/// (`torch.cat`), with the step's small activations and logits.
fn generate(run: &mut Run, seed: u64, requests: usize) {
    let mut rng = SplitMix64(seed);
    let mut weights: Vec<_> = (0..LAYERS)
        .map(|_| run.alloc(12 * HIDDEN * HIDDEN * ELEM))
        .collect();
    weights.push(run.alloc(VOCAB * HIDDEN * ELEM));
    for _ in 0..requests {
        let batch = 1 + rng.next_u64() % 16;
        let prompt = 16 + rng.next_u64() % 497;
        let new_tokens = 32 + rng.next_u64() % 97;
        let row = batch * HIDDEN * ELEM;
        let hidden = run.alloc(prompt * row);
        let mut cache: Vec<[DevicePtr; 2]> = Vec::new();
        for _ in 0..LAYERS {
            let scratch = run.alloc(4 * prompt * row);
            cache.push([run.alloc(prompt * row), run.alloc(prompt * row)]);
            run.free(scratch);
        }
        let logits = run.alloc(batch * prompt * VOCAB * ELEM);
        run.free(logits);
        run.free(hidden);
        for token in 1..=new_tokens {
            let hidden = run.alloc(row);
            for layer in cache.iter_mut() {
                for half in layer.iter_mut() {
                    let grown = run.alloc((prompt + token) * row);
                    run.free(*half);
                    *half = grown;
                }
                let scratch = run.alloc(4 * row);
                run.free(scratch);
            }
            let logits = run.alloc(batch * VOCAB * ELEM);
            run.free(logits);
            run.free(hidden);
        }
        for layer in cache {
            for half in layer {
                run.free(half);
            }
        }
    }
    for weight in weights {
        run.free(weight);
    }
}

#[test]
fn generation_with_growing_kv_caches_reserves_within_2_percent_of_peak_live() {
    for seed in [1, 2, 3] {
        let mut run = Run::new(Config::default());
        generate(&mut run, seed, 12);
        let ratio = run.ratio();
        eprintln!(
            "seed {seed}: peak live {:.0} MiB, peak reserved {:.0} MiB, ratio {ratio:.4}, whole segments would be {:.4}",
            run.peak_live as f64 / (1 << 20) as f64,
            run.allocator.stats().reserved_bytes.peak as f64 / (1 << 20) as f64,
            {
                let mut whole = Run::new(Config {
                    expandable_segments: false,
                    ..Config::default()
                });
                generate(&mut whole, seed, 12);
                whole.ratio()
            }
        );
        assert!(ratio <= 1.02, "seed {seed}: {ratio:.4}");
        assert!(run.device.races().is_empty());
    }
}

/// Random churn that no mapping policy can follow cheaply (`benches/gpu/host_abi.cpp`'s
/// mixed loop: 60% of sizes up to 1 MiB, 35% up to 64 MiB, 5% up to 256 MiB, 64 live, a
/// random one freed after each malloc), with each mapping made or undone costing 80 µs of
/// host time as on an H200 and each operation 200 ns of the program's own work. Reclaiming
/// would remap gigabytes per 100,000 mallocs, and stitching free pages for the large
/// requests maps them a second time (and unmaps the ranges as they age out) about as
/// often; instead, once remapping takes more than its share of time, the slack widens
/// until growth serves those requests: after a warm-up round, mapping takes a small share
/// of the time, and reserved memory stays bounded by the live peak. (Seeds 2 and 3 are
/// sequences where stitching alone, uncharged, kept remapping round after round.)
#[test]
fn churn_that_remapping_cannot_follow_stops_paying_for_it() {
    const OPERATION_NS: u64 = 200;
    const MALLOCS: u64 = 100_000;
    for seed in [2, 3, 7] {
        let device = SimBackend::new(80 << 30);
        device.set_mapping_cost(80_000);
        let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
        let stream = device.create_stream();
        let mut peak_live = 0;
        let mut last_round_ns = 0;
        for round in 0..4 {
            let started = device.host_time();
            let mut sizes = SplitMix64(seed);
            let mut victims = SplitMix64(11);
            let mut live = Vec::new();
            for _ in 0..MALLOCS {
                let share = sizes.below(1000);
                let size = if share < 600 {
                    sizes.range(1, 1 << 20)
                } else if share < 950 {
                    sizes.range(1 << 20, 64 << 20)
                } else {
                    sizes.range(64 << 20, 256 << 20)
                };
                live.push(allocator.malloc(size, stream).unwrap().ptr);
                if live.len() > 64 {
                    let victim = victims.below(live.len() as u64) as usize;
                    allocator.free(live.swap_remove(victim)).unwrap();
                }
                peak_live = peak_live.max(allocator.stats().allocated_bytes.current);
                device.advance_host(OPERATION_NS);
            }
            for ptr in live {
                allocator.free(ptr).unwrap();
            }
            last_round_ns = device.host_time() - started;
            let stats = allocator.stats();
            println!(
                "seed {seed} round {round}: {last_round_ns} ns, {} stitches, {} evicted, {} synchronisations so far",
                stats.stitches, stats.stitch_evictions, stats.device_syncs
            );
        }
        // The host time of the last round that is not the program's own work is the
        // driver's: mapping, stitching, unmapping.
        let own_ns = MALLOCS * OPERATION_NS;
        let remapping_ns = last_round_ns - own_ns;
        assert!(
            remapping_ns * 20 <= last_round_ns,
            "seed {seed}: the last round spent {remapping_ns} of {last_round_ns} ns remapping"
        );
        let stats = allocator.stats();
        assert!(
            stats.reserved_bytes.peak <= peak_live * 2,
            "seed {seed}: reserved {} for a live peak of {peak_live}",
            stats.reserved_bytes.peak
        );
    }
}
