//! Streams their owner destroys while blocks freed on them are still cached: a library's
//! own stream that PyTorch wraps as an `ExternalStream`, a CUDA program's
//! `cudaStreamCreate` under the interposer. Once such a stream is marked volatile, no call
//! names it after the free that ended its last block (on a GPU a dangling handle crashes
//! the driver), and the memory it freed still serves other streams without a race.

use streamalloc_allocator::backend::sim::{Access, Race, RaceKind, SimBackend};
use streamalloc_allocator::{Allocator, Config, DevicePtr, StreamId};

const MIB: u64 = 1 << 20;

/// What one run of rounds left behind: the simulator's reports and the requests refused.
struct Outcome {
    races: Vec<Race>,
    refused: usize,
    /// Device-wide synchronisations the engine made.
    syncs: u64,
}

/// Rounds of: a new stream allocates and writes blocks, frees them, and is destroyed with
/// its writes still queued; then another stream allocates under a limit that leaves it
/// the dead stream's memory to take (waits, stitching, synchronisations) and writes.
fn rounds(mark_volatile: bool, rounds: usize) -> Outcome {
    let device = SimBackend::new(1 << 30);
    let config = Config {
        memory_limit: Some(96 * MIB),
        ..Config::default()
    };
    let allocator = Allocator::new(device.clone(), config).unwrap();
    let main = device.create_stream();
    let mut refused = 0;
    let write_all = |stream: StreamId, blocks: &[(DevicePtr, u64)], label: &str| {
        for &(ptr, size) in blocks {
            device.launch(stream, &[Access::write(ptr, size)], 50_000, label);
        }
    };
    for round in 0..rounds {
        let foreign = device.create_stream();
        if mark_volatile {
            allocator.mark_stream_volatile(foreign);
        }
        let sizes = (0..6).map(|k| ((round * 7 + k * 3) % 11 + 1) as u64 * MIB);
        let theirs: Vec<(DevicePtr, u64)> = sizes
            .filter_map(|size| allocator.malloc(size, foreign).ok())
            .map(|a| (a.ptr, a.size))
            .collect();
        write_all(foreign, &theirs, "the foreign stream writes");
        for &(ptr, _) in &theirs {
            allocator.free(ptr).unwrap();
        }
        device.destroy_stream(foreign);
        let mut ours = Vec::new();
        for k in 0..8 {
            match allocator.malloc(((round * 5 + k * 7) % 13 + 1) as u64 * MIB, main) {
                Ok(a) => ours.push((a.ptr, a.size)),
                Err(_) => refused += 1,
            }
        }
        write_all(main, &ours, "the main stream writes");
        for &(ptr, _) in &ours {
            allocator.free(ptr).unwrap();
        }
    }
    Outcome {
        races: device.races(),
        refused,
        syncs: allocator.stats().device_syncs,
    }
}

#[test]
fn a_volatile_stream_is_never_named_after_it_is_destroyed() {
    let outcome = rounds(true, 40);
    assert!(
        outcome.races.is_empty(),
        "{} reports, first: {}",
        outcome.races.len(),
        outcome.races[0]
    );
    assert_eq!(
        outcome.refused, 0,
        "its memory still serves the other stream"
    );
    // Each free fenced itself while the stream lived: taking the blocks it freed waits on
    // those fences, with no synchronisation (one a round without them).
    assert_eq!(outcome.syncs, 0);
}

#[test]
fn an_unmarked_stream_is_named_after_it_is_destroyed() {
    // What the mark prevents: fences recorded lazily, on the stream the owner destroyed.
    // The calls fail (on the simulator; a GPU may crash), and each failed take leaves its
    // block listed as it was: the engine stays consistent (its debug checks run here).
    let outcome = rounds(false, 40);
    assert!(
        outcome
            .races
            .iter()
            .any(|race| race.kind == RaceKind::DeadStream),
        "expected calls on destroyed streams: {:?}",
        outcome.races.first()
    );
}
