//! The engine's contract, case by case: the record_stream scenario, out-of-memory reports,
//! memory limits, failure injection, misuse, graph capture and threads.

use std::sync::Arc;
use streamalloc_allocator::backend::sim::{Access, SimBackend};
use streamalloc_allocator::scenarios::record_stream_pipeline;
use streamalloc_allocator::trace::TraceAction;
use streamalloc_allocator::{
    AllocError, Allocation, Allocator, Config, DevicePtr, PoolBlock, PoolId, ReusePolicy, StreamId,
};

const MIB: u64 = 1 << 20;

fn allocator(capacity: u64, config: Config) -> (SimBackend, Allocator<SimBackend>) {
    let device = SimBackend::new(capacity);
    let allocator = Allocator::new(device.clone(), config).unwrap();
    (device, allocator)
}

/// The `record_stream` pipeline (docs/design.md, "The lifetime model: streams"): 32 activations of 64 MiB, each read by a slower comm stream.
#[test]
fn record_stream_scenario_stays_within_three_activations() {
    let ours = record_stream_pipeline(ReusePolicy::StreamWait, 32, 64 * MIB).unwrap();
    let pytorch = record_stream_pipeline(ReusePolicy::Pytorch, 32, 64 * MIB).unwrap();
    assert!(
        ours.races.is_empty() && pytorch.races.is_empty(),
        "{ours:?} {pytorch:?}"
    );
    assert!(
        ours.peak_reserved <= 3 * 64 * MIB,
        "stream_wait reserved {}",
        ours.peak_reserved
    );
    assert!(
        pytorch.peak_reserved >= 30 * 64 * MIB,
        "the PyTorch policy should pile up ~32 activations, reserved {}",
        pytorch.peak_reserved
    );
    assert!(ours.cross_stream_waits > 0);
    // Queries are batched: far fewer than one per malloc.
    assert!(ours.event_queries < 32, "{} queries", ours.event_queries);
}

#[test]
fn same_stream_reuse_makes_no_backend_call() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let stream = device.create_stream();
    let first = allocator.malloc(MIB, stream).unwrap();
    allocator.free(first.ptr).unwrap();
    let before = [
        "alloc_segment",
        "record_event",
        "stream_wait_event",
        "query_event",
        "create_event",
    ]
    .map(|call| device.calls(call));
    for _ in 0..100 {
        let block = allocator.malloc(MIB, stream).unwrap();
        assert_eq!(block.ptr, first.ptr);
        allocator.free(block.ptr).unwrap();
    }
    let after = [
        "alloc_segment",
        "record_event",
        "stream_wait_event",
        "query_event",
        "create_event",
    ]
    .map(|call| device.calls(call));
    assert_eq!(before, after);
}

/// The statistics say how many requests left the fast path and what they cost the host:
/// one that maps pages counts once, with its driver time inside; reusing the stream's own
/// free block counts nothing.
#[test]
fn slow_paths_and_their_host_time_are_counted_and_reuse_adds_none() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    device.set_mapping_cost(40_000);
    let stream = device.create_stream();
    let first = allocator.malloc(8 * MIB, stream).unwrap();
    let grown = allocator.stats();
    assert_eq!(grown.slow_paths, 1);
    assert!(
        grown.vmm_ns >= 40_000 && grown.slow_path_ns >= grown.vmm_ns,
        "slow path {} ns, driver {} ns",
        grown.slow_path_ns,
        grown.vmm_ns
    );
    allocator.free(first.ptr).unwrap();
    for size in [8 * MIB, 4 * MIB, 8 * MIB] {
        let block = allocator.malloc(size, stream).unwrap();
        allocator.free(block.ptr).unwrap();
    }
    let reused = allocator.stats();
    assert_eq!(
        (reused.slow_paths, reused.slow_path_ns),
        (grown.slow_paths, grown.slow_path_ns)
    );
}

#[test]
fn out_of_memory_says_how_much_is_fragmentation_and_what_would_help() {
    // Six 8 MiB blocks fill three 20 MiB segments up to the limit; freeing every other one
    // leaves 36 MiB free in pieces of 12 MiB, none of which holds 16 MiB.
    let program = |expandable_segments| {
        let config = Config {
            memory_limit: Some(60 * MIB),
            expandable_segments,
            ..Config::default()
        };
        let (device, allocator) = allocator(1 << 30, config);
        let stream = device.create_stream();
        let blocks: Vec<_> = (0..6)
            .map(|_| allocator.malloc(8 * MIB, stream).unwrap())
            .collect();
        for block in blocks.iter().step_by(2) {
            allocator.free(block.ptr).unwrap();
        }
        allocator.malloc(16 * MIB, stream)
    };
    let Err(AllocError::OutOfMemory(report)) = program(false) else {
        panic!("whole segments cannot serve it")
    };
    assert_eq!(report.fragmented(), 36 * MIB);
    let message = report.to_string();
    assert!(
        message.contains("36.00 MiB of reserved memory is free but fragmented")
            && message.contains("expandable_segments:true"),
        "{message}"
    );
    // The advice holds: expandable segments serve the same program.
    assert!(program(true).is_ok());
}

#[test]
fn out_of_memory_reports_size_cache_fragmentation_reserved_and_limit() {
    let config = Config {
        memory_limit: Some(64 * MIB),
        ..Config::default()
    };
    let (device, allocator) = allocator(1 << 30, config);
    let stream = device.create_stream();
    let held = allocator.malloc(40 * MIB, stream).unwrap();
    let err = allocator.malloc(40 * MIB, stream).unwrap_err();
    let AllocError::OutOfMemory(report) = &err else {
        panic!("expected out of memory, got {err}")
    };
    assert_eq!(report.requested, 40 * MIB);
    assert_eq!(report.reserved, 40 * MIB);
    assert_eq!(report.limit, Some(64 * MIB));
    let message = err.to_string();
    for needle in [
        "40.00 MiB",
        "free in cache",
        "largest free block",
        "reserved",
        "limit 64.00 MiB",
    ] {
        assert!(
            message.contains(needle),
            "`{needle}` missing from: {message}"
        );
    }
    let stats = allocator.stats();
    assert_eq!(stats.ooms, 1);
    assert!(
        stats.reserved_bytes.peak <= 64 * MIB,
        "the limit is never exceeded"
    );
    let trace = allocator.snapshot().trace;
    assert_eq!(trace.last().unwrap().action, TraceAction::Oom);
    allocator.free(held.ptr).unwrap();
}

#[test]
fn growth_retries_after_releasing_cached_segments() {
    // Whole-segment mechanics (expandable segments unmap instead of retrying).
    let classic = Config::parse("expandable_segments:false").unwrap();
    let (device, allocator) = allocator(100 * MIB, classic);
    let stream = device.create_stream();
    let small: Vec<_> = (0..20)
        .map(|_| allocator.malloc(MIB / 2, stream).unwrap())
        .collect();
    for block in &small {
        allocator.free(block.ptr).unwrap();
    }
    let reserved_by_small = allocator.stats().reserved_bytes.current;
    assert!(reserved_by_small > 0);
    // Only fits once the cached small segments are returned.
    let big = allocator.malloc(100 * MIB - 2 * MIB, stream).unwrap();
    let stats = allocator.stats();
    assert_eq!(stats.retries, 1);
    assert!(stats.segment_frees > 0);
    allocator.free(big.ptr).unwrap();
    allocator.check_invariants().unwrap();
}

#[test]
fn lowering_the_limit_releases_cache_but_never_live_memory() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let stream = device.create_stream();
    let live = allocator.malloc(30 * MIB, stream).unwrap();
    let cached = allocator.malloc(30 * MIB, stream).unwrap();
    allocator.free(cached.ptr).unwrap();
    allocator.set_memory_limit(Some(32 * MIB)).unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 30 * MIB);
    assert!(matches!(
        allocator.malloc(30 * MIB, stream),
        Err(AllocError::OutOfMemory(_))
    ));
    allocator.set_memory_limit(None).unwrap();
    allocator.malloc(30 * MIB, stream).unwrap();
    allocator.free(live.ptr).unwrap();
}

/// Allocates 30, 4 and 26 MiB in a row and frees the outer two: 56 MiB free in two pieces
/// around the live 4 MiB block, which is returned, at a live peak of 60 MiB.
fn free_around_a_live_block(allocator: &Allocator<SimBackend>, stream: StreamId) -> DevicePtr {
    let below = allocator.malloc(30 * MIB, stream).unwrap();
    let live = allocator.malloc(4 * MIB, stream).unwrap();
    let above = allocator.malloc(26 * MIB, stream).unwrap();
    allocator.free(below.ptr).unwrap();
    allocator.free(above.ptr).unwrap();
    live.ptr
}

/// `reclaim:false` stops the unmapping that keeps reserved memory near the live peak, not
/// the unmapping a limit needs: free memory split around a live block still makes room
/// for a request it cannot hold whole, within the limit, after one synchronisation.
#[test]
fn without_reclaims_a_limit_still_unmaps_free_memory_to_make_room() {
    let config = Config::parse("reclaim:false,stitch:false,memory_limit:64MiB").unwrap();
    let (device, allocator) = allocator(1 << 30, config);
    let stream = device.create_stream();
    let live = free_around_a_live_block(&allocator, stream);
    let syncs = allocator.stats().device_syncs;
    // 56 MiB free, in two pieces, and no room to map 40 more under the limit.
    let wide = allocator.malloc(40 * MIB, stream).unwrap();
    let stats = allocator.stats();
    assert!(stats.reserved_bytes.peak <= 64 * MIB, "{stats:?}");
    assert!(stats.page_unmap_bytes > 0, "{stats:?}");
    assert!(stats.device_syncs > syncs, "{stats:?}");
    // Made by the policy's step under pressure (one synchronisation, which PyTorch counts
    // as an allocation retry), unmapping only what the limit needs: not an out-of-memory.
    assert_eq!((stats.retries, stats.ooms), (1, 0), "{stats:?}");
    assert!(stats.page_unmap_bytes < 56 * MIB, "{stats:?}");
    allocator.free(wide.ptr).unwrap();
    allocator.free(live).unwrap();
    allocator.check_invariants().unwrap();
}

/// Without a limit, `reclaim:false` never unmaps to follow the live peak: memory freed in
/// pieces stays mapped and the next large request maps more instead of synchronising,
/// where the default synchronises once, unmaps the piece below and stays at the peak.
#[test]
fn without_reclaims_memory_grows_instead_of_synchronising() {
    let run = |conf: &str| {
        let (device, allocator) = allocator(1 << 30, Config::parse(conf).unwrap());
        let stream = device.create_stream();
        let live = free_around_a_live_block(&allocator, stream);
        let wide = allocator.malloc(40 * MIB, stream).unwrap();
        let stats = allocator.stats();
        allocator.free(wide.ptr).unwrap();
        allocator.free(live).unwrap();
        allocator.check_invariants().unwrap();
        stats
    };
    let quiet = run("reclaim:false,stitch:false");
    assert_eq!(
        (quiet.device_syncs, quiet.page_unmap_bytes),
        (0, 0),
        "{quiet:?}"
    );
    // 14 MiB mapped over the 26 freed at the top, past the 60 MiB live peak.
    assert_eq!(quiet.reserved_bytes.peak, 74 * MIB, "{quiet:?}");
    // Without stitching, the default reclaims here: it synchronises and unmaps to stay
    // near the peak.
    let reclaiming = run("stitch:false");
    assert_eq!(reclaiming.device_syncs, 1, "{reclaiming:?}");
    assert_eq!(reclaiming.reserved_bytes.peak, 60 * MIB, "{reclaiming:?}");
    // With it (the default), the free pages on both sides of the live block are mapped
    // into one range: no synchronisation, nothing unmapped, nothing grown.
    let stitching = run("");
    assert_eq!(
        (
            stitching.device_syncs,
            stitching.page_unmap_bytes,
            stitching.stitches
        ),
        (0, 0, 1),
        "{stitching:?}"
    );
    assert_eq!(stitching.reserved_bytes.peak, 60 * MIB, "{stitching:?}");
}

/// A block of `size` bytes and the physical allocations the driver made for it.
fn mapped_for(
    device: &SimBackend,
    allocator: &Allocator<SimBackend>,
    size: u64,
    stream: StreamId,
) -> (Allocation, u64) {
    let before = device.driver_allocations();
    let block = allocator.malloc(size, stream).unwrap();
    (block, device.driver_allocations() - before)
}

/// While the device has room, a run is mapped in pieces (the driver's time goes by
/// physical allocations); once the device refused memory, page by page, so that from then
/// on any free page can go back alone, as under a limit.
#[test]
fn once_the_device_refuses_memory_pages_are_mapped_one_by_one() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let stream = device.create_stream();
    let mapped_for = |size: u64| mapped_for(&device, &allocator, size, stream);
    // 512 MiB in pieces of up to 32 MiB (a 16th of the run) and its last page alone.
    let (first, allocations) = mapped_for(512 * MIB);
    assert_eq!(allocations, 17);
    let refused = allocator.malloc(768 * MIB, stream).unwrap_err();
    assert!(matches!(refused, AllocError::OutOfMemory(_)), "{refused}");
    allocator.free(first.ptr).unwrap();
    allocator.empty_cache().unwrap();
    let (again, allocations) = mapped_for(512 * MIB);
    assert_eq!(allocations, 256, "one allocation per 2 MiB page");
    allocator.free(again.ptr).unwrap();
    allocator.check_invariants().unwrap();
}

/// Near the device's capacity (a mapping would leave it less than a sixteenth free), pages
/// are mapped one by one before the device ever refuses: a small block left in memory
/// freed there pins its page, not a piece, so the rest can go back.
#[test]
fn near_the_device_capacity_pages_are_mapped_one_by_one() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let stream = device.create_stream();
    let mapped_for = |size: u64| mapped_for(&device, &allocator, size, stream);
    // 512 MiB leaves half the device free: pieces of up to 32 MiB and the last page alone.
    let (_weights, allocations) = mapped_for(512 * MIB);
    assert_eq!(allocations, 17);
    // 460 MiB more would leave 52 MiB, under 64: one allocation per page.
    let (activations, allocations) = mapped_for(460 * MIB);
    assert_eq!(allocations, 230, "one allocation per 2 MiB page");
    allocator.free(activations.ptr).unwrap();
    let small = allocator.malloc(MIB, stream).unwrap();
    allocator.empty_cache().unwrap();
    // Only the small block's page stays of the 460 MiB: a 16 MiB piece would have stayed
    // whole around it.
    assert_eq!(allocator.stats().reserved_bytes.current, 514 * MIB);
    assert_eq!(device.reserved(), 514 * MIB);
    allocator.free(small.ptr).unwrap();
    allocator.check_invariants().unwrap();
}

#[test]
fn memory_fraction_resolves_against_device_memory() {
    let config = Config::parse("memory_fraction:0.25").unwrap();
    let (_, allocator) = allocator(400 * MIB, config);
    assert_eq!(allocator.memory_limit(), Some(100 * MIB));
}

#[test]
fn driver_failures_are_typed_errors_not_panics() {
    // Whole segments: the failing call is cuMemAlloc.
    let classic = Config::parse("expandable_segments:false").unwrap();
    let (device, allocator) = allocator(1 << 30, classic);
    let stream = device.create_stream();
    device.fail_next_segment_allocs(1);
    let err = allocator.malloc(MIB, stream).unwrap_err();
    assert!(matches!(err, AllocError::Backend(_)), "{err}");
    assert!(err.to_string().contains("cuMemAlloc"));
    // The next attempt works and nothing was left half-done.
    allocator.malloc(MIB, stream).unwrap();
    allocator.check_invariants().unwrap();
}

#[test]
fn misuse_is_reported_and_counted() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let stream = device.create_stream();
    assert!(matches!(
        allocator.malloc(0, stream),
        Err(AllocError::InvalidSize(0))
    ));
    let block = allocator.malloc(1000, stream).unwrap();
    allocator.free(block.ptr).unwrap();
    assert_eq!(
        allocator.free(block.ptr),
        Err(AllocError::UnknownPointer(block.ptr))
    );
    assert_eq!(
        allocator.free(DevicePtr(0xdead)),
        Err(AllocError::UnknownPointer(DevicePtr(0xdead)))
    );
    assert!(allocator.record_use(DevicePtr(0xdead), stream).is_err());
    assert_eq!(allocator.stats().invalid_frees, 2);
    allocator.check_invariants().unwrap();
}

#[test]
fn capturing_stream_never_queries_waits_or_synchronises() {
    let (device, allocator) = allocator(
        1 << 30,
        Config {
            event_batch: 1,
            ..Config::default()
        },
    );
    let (capture, other) = (device.create_stream(), device.create_stream());
    // A pending block of the capturing stream and a ready block of another stream.
    let used = allocator.malloc(4 * MIB, capture).unwrap();
    allocator.record_use(used.ptr, other).unwrap();
    allocator.free(used.ptr).unwrap();
    let foreign = allocator.malloc(4 * MIB, other).unwrap();
    allocator.free(foreign.ptr).unwrap();
    device.set_capturing(capture, true);
    let during = allocator.malloc(4 * MIB, capture).unwrap();
    device.set_capturing(capture, false);
    assert_ne!(during.ptr, used.ptr, "a pending block would need a wait");
    assert!(device.races().is_empty(), "{:?}", device.races());
}

#[test]
fn pytorch_policy_never_moves_blocks_between_streams() {
    let config = Config {
        reuse_policy: ReusePolicy::Pytorch,
        ..Config::default()
    };
    let (device, allocator) = allocator(1 << 30, config);
    let (a, b) = (device.create_stream(), device.create_stream());
    let block = allocator.malloc(8 * MIB, a).unwrap();
    allocator.free(block.ptr).unwrap();
    let other = allocator.malloc(8 * MIB, b).unwrap();
    assert_ne!(other.ptr, block.ptr);
    assert_eq!(allocator.stats().cross_stream_waits, 0);
}

#[test]
fn pending_blocks_become_ready_once_their_events_complete() {
    let (device, allocator) = allocator(
        1 << 30,
        Config {
            event_batch: 1,
            ..Config::default()
        },
    );
    let (compute, comm) = (device.create_stream(), device.create_stream());
    let block = allocator.malloc(8 * MIB, compute).unwrap();
    device.launch(comm, &[], 1_000, "comm work");
    allocator.record_use(block.ptr, comm).unwrap();
    allocator.free(block.ptr).unwrap();
    assert_eq!(allocator.stats().pending_free_bytes.current, 8 * MIB);
    device.advance_host(10_000);
    // A miss on another size triggers the batched pass, which finds the event complete.
    let other = allocator.malloc(MIB, compute).unwrap();
    let stats = allocator.stats();
    assert_eq!(stats.pending_free_bytes.current, 0);
    assert_eq!(stats.events_outstanding, 0);
    let again = allocator.malloc(8 * MIB, compute).unwrap();
    assert_eq!(
        allocator.stats().cross_stream_waits,
        0,
        "completed events need no wait"
    );
    allocator.free(again.ptr).unwrap();
    allocator.free(other.ptr).unwrap();
}

#[test]
fn many_threads_on_many_streams_keep_every_invariant() {
    let device = SimBackend::new(4 << 30);
    let allocator = Arc::new(Allocator::new(device.clone(), Config::default()).unwrap());
    let streams: Vec<_> = (0..4).map(|_| device.create_stream()).collect();
    let threads: Vec<_> = streams
        .iter()
        .enumerate()
        .map(|(t, &stream)| {
            let (allocator, device) = (Arc::clone(&allocator), device.clone());
            std::thread::spawn(move || {
                let mut live = Vec::new();
                for i in 0..2_000u64 {
                    let size = 512 + (i * 7919 + t as u64 * 104_729) % (3 * MIB);
                    let block = allocator.malloc(size, stream).unwrap();
                    device.launch(
                        stream,
                        &[Access::write(block.ptr, size)],
                        100,
                        "thread work",
                    );
                    live.push(block);
                    if live.len() > 16 {
                        allocator
                            .free(live.swap_remove((i as usize * 31) % live.len()).ptr)
                            .unwrap();
                    }
                }
                for block in live {
                    allocator.free(block.ptr).unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert!(device.races().is_empty(), "{:?}", device.races().first());
    allocator.check_invariants().unwrap();
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    allocator.empty_cache().unwrap();
    assert_eq!(device.reserved(), 0);
}

/// Mapping pages into a hole between two free blocks of the caller packs the request
/// against one of them; the remainder of the block handed out then borders the other, and
/// must be merged with it (found by the random programs of `replay_properties` in CI).
#[test]
fn pages_mapped_between_two_free_blocks_join_both() {
    let (device, allocator) =
        allocator(1 << 30, Config::parse("expandable_segments:true").unwrap());
    let stream = device.create_stream();
    // One 2 MiB page each: [low | low_free] [middle] [high_free | high].
    let low = allocator.malloc(MIB, stream).unwrap();
    let low_free = allocator.malloc(MIB, stream).unwrap();
    let middle = allocator.malloc(2 * MIB, stream).unwrap();
    let high_free = allocator.malloc(MIB, stream).unwrap();
    let high = allocator.malloc(MIB, stream).unwrap();
    assert_eq!(low_free.ptr.0, low.ptr.0 + MIB);
    assert_eq!(middle.ptr.0, low.ptr.0 + 2 * MIB);
    assert_eq!(high_free.ptr.0, middle.ptr.0 + 2 * MIB);
    allocator.free(middle.ptr).unwrap();
    allocator.empty_cache().unwrap(); // the middle page is unmapped: a hole
    allocator.free(low_free.ptr).unwrap();
    allocator.free(high_free.ptr).unwrap();
    // 2.5 MiB: mapping the hole and joining the free MiB below it is enough.
    let reserved_before = allocator.stats().reserved_bytes.current;
    let joined = allocator.malloc(5 * MIB / 2, stream).unwrap();
    assert_eq!(joined.ptr, low_free.ptr);
    assert_eq!(
        allocator.stats().reserved_bytes.current,
        reserved_before + 2 * MIB
    );
    allocator.check_invariants().unwrap();
    // What the request left (0.5 MiB) and the free MiB above are one block now.
    let rest = allocator.malloc(3 * MIB / 2, stream).unwrap();
    assert_eq!(rest.ptr.0, joined.ptr.0 + 5 * MIB / 2);
    for block in [low, high, joined, rest] {
        allocator.free(block.ptr).unwrap();
    }
    allocator.check_invariants().unwrap();
}

/// In an expandable segment a request packs against a live block above when nothing live
/// lies below: the remainder is left facing the free side, where its whole pages can be
/// unmapped, not between two live blocks. (Whole segments keep PyTorch's placement, which
/// `replay_traces::whole_segments_reproduce_the_native_allocator` holds to.)
#[test]
fn requests_pack_against_the_live_block_above_when_nothing_live_lies_below() {
    let (device, allocator) =
        allocator(1 << 30, Config::parse("expandable_segments:true").unwrap());
    let stream = device.create_stream();
    // [first: 4 MiB][second: 4 MiB], then the first freed: a free block at the start of the
    // segment (nothing below) under a live one.
    let first = allocator.malloc(4 * MIB, stream).unwrap();
    let second = allocator.malloc(4 * MIB, stream).unwrap();
    assert_eq!(second.ptr.0, first.ptr.0 + 4 * MIB);
    allocator.free(first.ptr).unwrap();
    let small = allocator.malloc(MIB, stream).unwrap();
    assert_eq!(
        small.ptr.0,
        first.ptr.0 + 3 * MIB,
        "packed against the second"
    );
    allocator.check_invariants().unwrap();
    // The 3 MiB left below hold a whole free page, which releasing the cache returns: one
    // page stays under the small block, two under the second.
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.stats().reserved_bytes.current, 6 * MIB);
    for block in [small, second] {
        allocator.free(block.ptr).unwrap();
    }
    allocator.check_invariants().unwrap();
}

/// A driver that cannot map pages a second time does not fail the program's requests:
/// stitching switches itself off and memory grows as without it.
#[test]
fn a_driver_refusing_second_mappings_turns_stitching_off_not_requests() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    device.refuse_second_mappings();
    let stream = device.create_stream();
    let live = free_around_a_live_block(&allocator, stream);
    let wide = allocator.malloc(40 * MIB, stream).unwrap();
    let stats = allocator.stats();
    assert_eq!(stats.stitches, 0, "{stats:?}");
    assert_eq!(
        device.calls("alias_pages"),
        1,
        "tried once, then never again"
    );
    let again = allocator.malloc(40 * MIB, stream).unwrap();
    assert_eq!(device.calls("alias_pages"), 1);
    for ptr in [wide.ptr, again.ptr, live] {
        allocator.free(ptr).unwrap();
    }
    allocator.check_invariants().unwrap();
    assert!(device.races().is_empty(), "{:?}", device.races());
}

/// The out-of-memory report names the live bytes that stitching made of scattered pages
/// and the free bytes left in partly used pages, which no stitch can take.
#[test]
fn out_of_memory_names_stitched_and_stranded_bytes() {
    let config = Config::parse("memory_limit:64MiB").unwrap();
    let (device, allocator) = allocator(1 << 30, config);
    let stream = device.create_stream();
    let live = free_around_a_live_block(&allocator, stream);
    let wide = allocator.malloc(40 * MIB, stream).unwrap();
    let small = allocator.malloc(MIB, stream).unwrap();
    let err = allocator.malloc(30 * MIB, stream).unwrap_err();
    let AllocError::OutOfMemory(report) = &err else {
        panic!("expected out of memory, got {err}")
    };
    assert_eq!(report.stitched, 40 * MIB, "{report:?}");
    // The 1 MiB block shares its page with free bytes that no stitch can take.
    assert!(
        report.stranded > 0 && report.stranded < 2 * MIB,
        "{report:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("40.00 MiB of it stitched from scattered pages")
            && message.contains("stranded in partly used mappings"),
        "{message}"
    );
    for ptr in [wide.ptr, small.ptr, live] {
        allocator.free(ptr).unwrap();
    }
    allocator.check_invariants().unwrap();
}

/// A block another stream freed is taken after a wait for its owner's work up to the free
/// (the fence recorded then), not for what the owner queued since: stream A uses a block
/// for 1 ms, frees it, then queues 10 ms of unrelated work; stream B's take of the block
/// lets B's next kernel start after the first millisecond.
#[test]
fn a_take_from_another_stream_waits_only_for_the_owners_work_up_to_the_free() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let (a, b) = (device.create_stream(), device.create_stream());
    let block = allocator.malloc(4 * MIB, a).unwrap();
    device.launch(
        a,
        &[Access::write(block.ptr, 4 * MIB)],
        1_000_000,
        "a uses it",
    );
    allocator.free(block.ptr).unwrap();
    device.launch(a, &[], 10_000_000, "a's unrelated work");
    let taken = allocator.malloc(4 * MIB, b).unwrap();
    assert_eq!(taken.ptr, block.ptr, "b takes a's free block");
    device.launch(b, &[Access::write(taken.ptr, 4 * MIB)], 1_000, "b uses it");
    device.synchronize_stream(b);
    assert!(device.races().is_empty(), "{:?}", device.races());
    assert!(
        device.host_time() < 2_000_000,
        "b waited until {} ns: for a's later work too",
        device.host_time()
    );
    allocator.free(taken.ptr).unwrap();
    allocator.check_invariants().unwrap();
}

/// On a full device without a limit, free whole pages that a live block pins inside a piece
/// are named in the report with the setting that would have freed them, and with that
/// setting the same request fits.
#[test]
fn a_full_device_names_the_pages_pinned_in_pieces_and_the_setting_that_frees_them() {
    let run = |config: Config| {
        let (device, allocator) = allocator(1 << 30, config);
        let stream = device.create_stream();
        let first = allocator.malloc(512 * MIB, stream).unwrap();
        let _second = allocator.malloc(256 * MIB, stream).unwrap();
        allocator.free(first.ptr).unwrap();
        // The small block lands right after the 100 MiB one, inside the first run's piece
        // of 96-128 MiB: in pieces, that whole piece stays mapped once the rest is free.
        let before = allocator.malloc(100 * MIB, stream).unwrap();
        let _small = allocator.malloc(MIB, stream).unwrap();
        allocator.free(before.ptr).unwrap();
        allocator.malloc(750 * MIB, stream).map(|_| ())
    };
    let err = run(Config::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("30.00 MiB of free pages lie in pieces"),
        "{text}"
    );
    assert!(text.contains("page_allocations:true"), "{text}");
    let pages = Config::parse("page_allocations:true").unwrap();
    run(pages).unwrap();
}

/// A request smaller than a page that the limit cannot hold a page for is told that the
/// limit is reached, not that the device is full: growth maps whole pages.
#[test]
fn an_out_of_memory_under_a_limit_names_the_limit_even_for_less_than_a_page() {
    let config = Config {
        memory_limit: Some(25 * MIB),
        ..Config::default()
    };
    let (device, allocator) = allocator(1 << 30, config);
    let stream = device.create_stream();
    let live = allocator.malloc(24 * MIB, stream).unwrap();
    let err = allocator.malloc(512 << 10, stream).unwrap_err();
    assert!(
        err.to_string().contains("the memory limit is reached"),
        "{err}"
    );
    allocator.free(live.ptr).unwrap();
}

/// A pool's checkpoint may hold a stitched range (handed out whole, its pages mapped a
/// second time): restoring the pool revives the range at its address over the same pages,
/// whether it is still allocated or was freed (and kept dormant) since.
/// A checkpoint that would give those pages to another block as well, or that names part
/// of the range, is refused before anything changes (a C caller's junk, found by fuzzing:
/// it used to stop the device with an internal panic).
#[test]
fn a_checkpoint_with_a_stitched_range_restores_it_whole_and_never_shares_its_pages() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let stream = device.create_stream();
    let pool = PoolId(3, 0);
    allocator.create_or_incref_pool(pool).unwrap();
    let below = allocator.malloc_in(30 * MIB, stream, pool).unwrap();
    let live = allocator.malloc_in(4 * MIB, stream, pool).unwrap();
    let above = allocator.malloc_in(26 * MIB, stream, pool).unwrap();
    allocator.free(below.ptr).unwrap();
    allocator.free(above.ptr).unwrap();
    let wide = allocator.malloc_in(40 * MIB, stream, pool).unwrap();
    let pages = allocator
        .stitched_pages(wide.ptr)
        .expect("40 MiB in two free stretches of the pool is stitched");
    let checkpoint = allocator.pool_checkpoint(pool);
    assert_eq!(checkpoint.len(), 2);

    let freed = allocator.restore_pool(pool, &checkpoint).unwrap();
    assert_eq!(freed.len(), 2);
    assert_eq!(allocator.pool_checkpoint(pool), checkpoint);
    assert_eq!(allocator.stitched_pages(wide.ptr), Some(pages.clone()));
    allocator.check_invariants().unwrap();

    let refused = |junk: &[PoolBlock], why: &str| {
        let err = allocator.restore_pool(pool, junk).unwrap_err();
        assert!(
            matches!(&err, AllocError::Checkpoint { reason, .. } if reason.contains(why)),
            "{err}"
        );
        assert_eq!(
            allocator.pool_checkpoint(pool),
            checkpoint,
            "nothing changed"
        );
    };
    // The live block's entry moved onto the stitched range's first run of pages.
    let mut shared = checkpoint.clone();
    let other = shared.iter_mut().find(|b| b.ptr == live.ptr).unwrap();
    (other.ptr, other.size) = pages[0];
    refused(&shared, "would share pages");
    // The stitched range less its last page.
    let mut part = checkpoint.clone();
    let range = part.iter_mut().find(|b| b.ptr == wide.ptr).unwrap();
    range.size -= 2 * MIB;
    refused(&part, "part of a stitched range");

    // Freed since the checkpoint, the range is dormant: restored all the same, over its
    // pages, though a block of the pool took some of them in between.
    allocator.free(wide.ptr).unwrap();
    let between = allocator.malloc_in(20 * MIB, stream, pool).unwrap();
    assert!(
        pages
            .iter()
            .any(|&(page, len)| page.0 < between.ptr.0 + 20 * MIB && between.ptr.0 < page.0 + len),
        "the block in between lies on the range's pages"
    );
    let freed = allocator.restore_pool(pool, &checkpoint).unwrap();
    assert!(freed.contains(&between.ptr), "{freed:?}");
    assert_eq!(allocator.pool_checkpoint(pool), checkpoint);
    assert_eq!(allocator.stitched_pages(wide.ptr), Some(pages.clone()));
    allocator.check_invariants().unwrap();

    for block in &checkpoint {
        allocator.free(block.ptr).unwrap();
    }
    allocator.check_invariants().unwrap();
    assert!(device.races().is_empty(), "{:?}", device.races());
}

/// Under a limit, the step after a synchronisation stitches as many runs as covering the
/// request takes. Under PyTorch's policy, 40 pages freed while another stream still used
/// them are one page apart and become free only at a synchronisation; a request of 40
/// pages at the limit is then served by one stitch of all 40, unmapping nothing.
#[test]
fn after_a_synchronisation_a_stitch_under_a_limit_takes_as_many_runs_as_it_needs() {
    let config = Config {
        reuse_policy: ReusePolicy::Pytorch,
        memory_limit: Some(160 * MIB),
        ..Config::default()
    };
    let (device, allocator) = allocator(1 << 30, config);
    let (stream, reader) = (device.create_stream(), device.create_stream());
    let page = 2 * MIB;
    let blocks: Vec<_> = (0..80)
        .map(|_| allocator.malloc(page, stream).unwrap())
        .collect();
    assert_eq!(allocator.stats().reserved_bytes.current, 160 * MIB);
    for block in blocks.iter().step_by(2) {
        device.launch(
            reader,
            &[Access::read(block.ptr, page)],
            1_000_000,
            "reads it",
        );
        allocator.record_use(block.ptr, reader).unwrap();
        allocator.free(block.ptr).unwrap();
    }
    let before = allocator.stats();
    let wide = allocator.malloc(40 * page, stream).unwrap();
    let after = allocator.stats();
    assert_eq!(after.device_syncs, before.device_syncs + 1, "{after:?}");
    assert_eq!(after.stitches, before.stitches + 1, "{after:?}");
    assert_eq!(after.page_unmap_bytes, before.page_unmap_bytes, "{after:?}");
    assert_eq!(
        allocator.stitched_pages(wide.ptr).map(|runs| runs.len()),
        Some(40)
    );
    allocator.free(wide.ptr).unwrap();
    for block in blocks.iter().skip(1).step_by(2) {
        allocator.free(block.ptr).unwrap();
    }
    allocator.check_invariants().unwrap();
    assert!(device.races().is_empty(), "{:?}", device.races());
}

/// Frees `block` after `reader` read it (a long read, recorded as a use): its events stay
/// pending, so a stream that takes it waits on the device.
fn free_after_read_on(
    device: &SimBackend,
    allocator: &Allocator<SimBackend>,
    block: &Allocation,
    reader: StreamId,
) {
    device.launch(
        reader,
        &[Access::read(block.ptr, block.size)],
        1_000_000,
        "reads it",
    );
    allocator.record_use(block.ptr, reader).unwrap();
    allocator.free(block.ptr).unwrap();
}

/// Allocates `size` on `stream`, which must be served by a new stitch of `runs` runs with
/// no memory grown, then writes it: the device-side waits leave no race.
fn stitched_without_growth(
    device: &SimBackend,
    allocator: &Allocator<SimBackend>,
    size: u64,
    stream: StreamId,
    runs: usize,
) -> Allocation {
    let before = allocator.stats();
    let stitched = allocator.malloc(size, stream).unwrap();
    let after = allocator.stats();
    assert_eq!(after.stitches, before.stitches + 1, "{after:?}");
    assert_eq!(
        after.reserved_bytes.current, before.reserved_bytes.current,
        "{after:?}"
    );
    assert_eq!(
        allocator
            .stitched_pages(stitched.ptr)
            .map(|runs| runs.len()),
        Some(runs)
    );
    device.launch(
        stream,
        &[Access::write(stitched.ptr, size)],
        1_000,
        "writes it",
    );
    assert!(device.races().is_empty(), "{:?}", device.races());
    stitched
}

/// Free blocks side by side that do not merge (here a ready one and one still read by
/// another stream) are one run of pages for a stitch: a request that only both together
/// can hold is stitched from one run, after a device-side wait for the reader, with no
/// growth and no race.
#[test]
fn free_blocks_side_by_side_are_one_run_for_a_stitch() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let (stream, reader) = (device.create_stream(), device.create_stream());
    let first = allocator.malloc(20 * MIB, stream).unwrap();
    let second = allocator.malloc(20 * MIB, stream).unwrap();
    let pin = allocator.malloc(2 * MIB, stream).unwrap();
    assert_eq!(second.ptr.0, first.ptr.0 + 20 * MIB);
    allocator.free(first.ptr).unwrap();
    free_after_read_on(&device, &allocator, &second, reader);
    let wide = stitched_without_growth(&device, &allocator, 40 * MIB, stream, 1);
    allocator.free(wide.ptr).unwrap();
    allocator.free(pin.ptr).unwrap();
    allocator.check_invariants().unwrap();
}

/// Past the growth budget, a stitch that free runs of at least an eighth of its request
/// cannot cover takes narrower runs rather than growing what the wide ones lack: here a
/// 40 MiB run and six 4 MiB runs between live blocks, all still read by another stream,
/// hold a 64 MiB request exactly, and it is stitched from all seven with nothing mapped
/// (grown instead, memory would pass the live peak by 24 MiB). No race after the waits.
#[test]
fn past_the_growth_budget_a_stitch_takes_narrow_runs_before_growing() {
    let (device, allocator) = allocator(1 << 30, Config::default());
    let (stream, reader) = (device.create_stream(), device.create_stream());
    let mut runs = vec![allocator.malloc(40 * MIB, stream).unwrap()];
    let mut pins = vec![allocator.malloc(2 * MIB, stream).unwrap()];
    for _ in 0..6 {
        runs.push(allocator.malloc(4 * MIB, stream).unwrap());
        pins.push(allocator.malloc(2 * MIB, stream).unwrap());
    }
    for run in &runs {
        free_after_read_on(&device, &allocator, run, reader);
    }
    let request = stitched_without_growth(&device, &allocator, 64 * MIB, stream, 7);
    allocator.free(request.ptr).unwrap();
    for pin in pins {
        allocator.free(pin.ptr).unwrap();
    }
    allocator.check_invariants().unwrap();
}
