//! Properties of replay and of expandable segments on random inputs:
//! - replaying any trace (several streams, frees out of order, frees only requested, frees
//!   of blocks never seen) never reports less reserved than live, the engine's invariants
//!   hold afterwards, and `empty_cache` after freeing everything returns every page;
//! - random multi-stream programs (the engine's operation harness, with the race detector)
//!   stay race-free with expandable segments, under both reuse policies: no page is
//!   unmapped while a stream may still use it;
//! - the simulator itself reports unmapping in-use pages and touching unmapped ones.

use common::{allocation_op, block_op};
use proptest::prelude::*;
use streamalloc::replay::replay_on;
use streamalloc_allocator::backend::sim::{Access, RaceKind, SimBackend};
use streamalloc_allocator::backend::{Streams, VirtualMemory};
use streamalloc_allocator::testing::{proptest_cases, Harness, Op};

mod common;
#[path = "common/trace_steps.rs"]
mod trace_steps;
use streamalloc_allocator::{Allocation, Allocator, Config, DevicePtr, ReusePolicy};
use trace_steps::{trace_of, Step};

const MIB: u64 = 1 << 20;

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..=8192,
        3 => 8193u64..=MIB,
        3 => (MIB + 1)..=(12 * MIB),
        1 => (12 * MIB + 1)..=(64 * MIB),
    ]
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    trace_steps::steps(size(), 300)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: proptest_cases(96), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn replay_never_reports_less_reserved_than_live(
        steps in steps(),
        expandable in any::<bool>(),
        pytorch in any::<bool>(),
    ) {
        let config = Config {
            expandable_segments: expandable,
            reuse_policy: if pytorch { ReusePolicy::Pytorch } else { ReusePolicy::StreamWait },
            ..Config::default()
        };
        let device = SimBackend::new(1 << 40);
        let allocator = Allocator::new(device.clone(), config).unwrap();
        let events = trace_of(&steps);
        let report = replay_on(&allocator, &events, &mut |_| {}).unwrap();
        prop_assert!(report.peak_reserved_bytes >= report.peak_live_bytes, "{report:?}");
        allocator.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(allocator.stats().reserved_bytes.current, device.reserved());
        prop_assert!(device.races().is_empty());
        let unknown = steps.iter().filter(|s| matches!(s, Step::UnknownFree)).count() as u64;
        prop_assert_eq!(report.unknown_frees, unknown);
        allocator.empty_cache().unwrap();
        let held = allocator.stats().allocated_bytes.current;
        prop_assert_eq!(held == 0, report.live_at_end == 0);
        if held == 0 {
            prop_assert_eq!(device.reserved(), 0);
        }
        allocator.check_invariants().map_err(TestCaseError::fail)?;
    }

    #[test]
    fn expandable_programs_stay_race_free(
        ops in prop::collection::vec(op(), 1..150),
        pytorch in any::<bool>(),
        small_device in any::<bool>(),
        reclaim in any::<bool>(),
    ) {
        let mut config = Config::parse("expandable_segments:true,event_batch:4").unwrap();
        if pytorch {
            config.reuse_policy = ReusePolicy::Pytorch;
        }
        config.reclaim = reclaim;
        let capacity = if small_device { 96 * MIB } else { 1 << 30 };
        let mut harness = Harness::new(config, capacity).unwrap();
        for op in &ops {
            harness.apply(op).map_err(TestCaseError::fail)?;
        }
        harness.finish().map_err(TestCaseError::fail)?;
    }
}

/// Any harness operation; one on a live block is skipped while the program holds none.
fn op() -> impl Strategy<Value = Op> {
    prop_oneof![10 => allocation_op(size()), 9 => block_op()]
}

#[test]
fn the_simulator_reports_unmapping_pages_in_use_and_touching_unmapped_ones() {
    let device = SimBackend::new(1 << 30);
    let stream = device.create_stream();
    let base = device.reserve_address_space(64 * MIB).unwrap();
    // Two mappings (two physical allocations) side by side.
    device.map_pages(base, 2 * MIB).unwrap();
    device
        .map_pages(DevicePtr(base.0 + 2 * MIB), 2 * MIB)
        .unwrap();
    assert_eq!(device.reserved(), 4 * MIB);
    device.launch(stream, &[Access::write(base, 4 * MIB)], 1_000_000, "kernel");
    // The host has not seen the kernel finish: unmapping now is a race.
    device
        .unmap_pages(DevicePtr(base.0 + 2 * MIB), 2 * MIB)
        .unwrap();
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].kind, RaceKind::Unordered);
    // After a synchronisation it is fine.
    device.synchronize_device().unwrap();
    device.unmap_pages(base, 2 * MIB).unwrap();
    assert_eq!(device.races().len(), 1);
    // Touching an unmapped page is out of bounds.
    device.launch(stream, &[Access::read(base, 512)], 1, "late read");
    assert_eq!(device.races().last().unwrap().kind, RaceKind::OutOfBounds);
    // Misuse is a typed error: unaligned, already unmapped, or part of a mapping
    // (`cuMemUnmap` takes whole mappings only).
    assert!(device.map_pages(DevicePtr(base.0 + 512), 2 * MIB).is_err());
    assert!(device.unmap_pages(base, 2 * MIB).is_err());
    device.map_pages(base, 4 * MIB).unwrap();
    let partial = device.unmap_pages(base, 2 * MIB).unwrap_err();
    assert!(partial.to_string().contains("whole mappings"), "{partial}");
    device.unmap_pages(base, 4 * MIB).unwrap();
    device.release_address_space(base, 64 * MIB).unwrap();
    assert_eq!(device.reserved(), 0);
}

/// Stream a writes 8 MiB for a long time, then frees it: ready for a, but a's kernel is
/// still running when stream b asks for 10 MiB, too large for the freed block; b then
/// writes its block. Returns the device, the allocator and b's block.
fn long_write_freed_then_larger_request(
    config: Config,
) -> (SimBackend, Allocator<SimBackend>, Allocation) {
    let device = SimBackend::new(1 << 30);
    let allocator = Allocator::new(device.clone(), config).unwrap();
    let (a, b) = (device.create_stream(), device.create_stream());
    let first = allocator.malloc(8 * MIB, a).unwrap();
    device.launch(
        a,
        &[Access::write(first.ptr, 8 * MIB)],
        50_000_000,
        "long write",
    );
    allocator.free(first.ptr).unwrap();
    let second = allocator.malloc(10 * MIB, b).unwrap();
    device.launch(b, &[Access::write(second.ptr, 10 * MIB)], 1_000, "b writes");
    (device, allocator, second)
}

#[test]
/// Without stitching: growing unmaps the free pages first, after a synchronisation.
fn growth_unmaps_free_pages_only_after_their_streams_finish() {
    let (device, allocator, second) =
        long_write_freed_then_larger_request(Config::parse("stitch:false").unwrap());
    assert!(device.races().is_empty(), "{:?}", device.races());
    // The freed pages went back before b's were mapped: never more than 10 MiB reserved.
    assert_eq!(allocator.stats().reserved_bytes.peak, 10 * MIB);
    assert!(device.calls("synchronize_device") >= 1);
    allocator.check_invariants().unwrap();
    allocator.free(second.ptr).unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(device.reserved(), 0);
    allocator.check_invariants().unwrap();
}

/// Stream-aware pages: the same pages, freed on stream a while a's kernel still writes
/// them, are stitched into b's range with a device-side wait, never a host
/// synchronisation, and without growing past what b needs.
#[test]
fn stitched_pages_of_another_stream_wait_on_the_device_not_the_host() {
    let (device, allocator, second) = long_write_freed_then_larger_request(Config::default());
    let b = second.stream;
    assert!(device.races().is_empty(), "{:?}", device.races());
    let stats = allocator.stats();
    assert_eq!(stats.stitches, 1, "{stats:?}");
    assert_eq!(stats.reserved_bytes.peak, 10 * MIB, "{stats:?}");
    assert_eq!(device.calls("synchronize_device"), 0);
    assert!(stats.cross_stream_waits >= 1, "{stats:?}");
    allocator.check_invariants().unwrap();
    // Freed, the range is kept: the same request takes it again, mapping nothing.
    allocator.free(second.ptr).unwrap();
    let maps = device.calls("alias_pages") + device.calls("map_pages");
    let again = allocator.malloc(10 * MIB, b).unwrap();
    assert_eq!(again.ptr, second.ptr);
    assert_eq!(
        device.calls("alias_pages") + device.calls("map_pages"),
        maps
    );
    assert_eq!(allocator.stats().stitch_revivals, 1);
    device.launch(b, &[Access::write(again.ptr, 10 * MIB)], 1_000, "b again");
    assert!(device.races().is_empty(), "{:?}", device.races());
    allocator.free(again.ptr).unwrap();
    allocator.check_invariants().unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(device.reserved(), 0);
    allocator.check_invariants().unwrap();
}

#[test]
fn without_virtual_memory_the_allocator_falls_back_to_whole_segments() {
    /// The simulator without virtual memory, said explicitly.
    #[derive(Debug)]
    struct NoVmm(SimBackend);
    streamalloc_allocator::forward_backend! {
        impl[] for NoVmm as this => &this.0, SimBackend;
        Clock, Segments, Events, Streams, HostMemory;
        unsupported VirtualMemory
    }
    let sim = SimBackend::new(1 << 30);
    let backend = NoVmm(sim.clone());
    assert!(backend
        .map_pages(DevicePtr(0), 2 * MIB)
        .unwrap_err()
        .to_string()
        .contains("not supported"));
    let allocator =
        Allocator::new(backend, Config::parse("expandable_segments:true").unwrap()).unwrap();
    let block = allocator.malloc(3 * MIB, sim.create_stream()).unwrap();
    assert_eq!(sim.calls("alloc_segment"), 1);
    assert_eq!(sim.calls("map_pages"), 0);
    allocator.free(block.ptr).unwrap();
    allocator.check_invariants().unwrap();
}
