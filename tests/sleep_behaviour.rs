//! Sleep and wake, case by case (docs/design.md, "Sleep and wake"): a tagged memory pool
//! gives its pages back and keeps its addresses and blocks; with a backup, waking restores
//! every live byte; a sleeping pool refuses allocations; touching it is out of bounds;
//! misuse is refused with a one-line error and changes nothing.

use streamalloc_allocator::backend::sim::{Access, RaceKind, SimBackend};
use streamalloc_allocator::backend::{Events, Streams};
use streamalloc_allocator::trace::TraceAction;
use streamalloc_allocator::{
    AllocError, Allocation, Allocator, Backup, Config, PoolId, SleepError, StreamId,
};

const MIB: u64 = 1 << 20;
const KV: PoolId = PoolId(0, 1);
const WEIGHTS: PoolId = PoolId(0, 2);

fn setup(config: Config) -> (SimBackend, Allocator<SimBackend>, StreamId) {
    let device = SimBackend::new(1 << 30);
    let allocator = Allocator::new(device.clone(), config).unwrap();
    let stream = device.create_stream();
    for (pool, tag) in [(KV, "kv_cache"), (WEIGHTS, "weights")] {
        allocator.create_or_incref_pool(pool).unwrap();
        allocator.tag_pool(pool, tag).unwrap();
    }
    (device, allocator, stream)
}

/// Allocates `size` bytes in `pool` and writes them on `stream`.
fn written(
    device: &SimBackend,
    allocator: &Allocator<SimBackend>,
    stream: StreamId,
    pool: PoolId,
    size: u64,
) -> Allocation {
    let block = allocator.malloc_in(size, stream, pool).unwrap();
    device.launch(stream, &[Access::write(block.ptr, size)], 5_000, "init");
    block
}

fn contents(device: &SimBackend, blocks: &[Allocation]) -> Vec<Vec<(u64, u64, u64)>> {
    blocks
        .iter()
        .map(|b| device.contents(b.ptr, b.requested).expect("mapped"))
        .collect()
}

#[test]
fn a_sleeping_pool_gives_its_pages_back_and_wakes_with_its_contents_at_the_same_addresses() {
    let (device, allocator, stream) = setup(Config::default());
    let kv = [
        written(&device, &allocator, stream, KV, 3 * MIB),
        written(&device, &allocator, stream, KV, 40 * MIB + 512),
    ];
    let eager = written(&device, &allocator, stream, PoolId::DEFAULT, 8 * MIB);
    let before = contents(&device, &kv);
    let reserved = allocator.stats().reserved_bytes.current;
    let mapped = device.mapped();

    let report = allocator.sleep(&["kv_cache"], Backup::Host).unwrap();
    let stats = allocator.stats();
    assert!(report.released >= 43 * MIB, "{report:?}");
    assert_eq!(
        report.backed_up,
        3 * MIB + 40 * MIB + 512,
        "live bytes only"
    );
    assert_eq!(stats.reserved_bytes.current, reserved - report.released);
    assert_eq!(stats.sleeping_bytes, report.released);
    assert_eq!(
        device.mapped(),
        mapped - report.released,
        "back to the device"
    );
    assert_eq!(device.host_bytes(), stats.host_backup_bytes);
    for block in &kv {
        assert!(allocator.owns(block.ptr), "live blocks stay allocated");
        assert!(device.contents(block.ptr, 1).is_none(), "and unmapped");
    }
    // The rest of the device carries on.
    device.launch(
        stream,
        &[Access::read(eager.ptr, eager.size)],
        1_000,
        "eager",
    );
    allocator.check_invariants().unwrap();

    let woken = allocator.wake(&["kv_cache"]).unwrap();
    assert_eq!(woken.mapped, report.released);
    assert_eq!(woken.restored, report.backed_up);
    assert_eq!(contents(&device, &kv), before, "every live byte restored");
    assert_eq!(allocator.stats().reserved_bytes.current, reserved);
    assert_eq!(allocator.stats().sleeping_bytes, 0);
    device.launch(
        stream,
        &[Access::write(kv[1].ptr, kv[1].size)],
        1_000,
        "decode",
    );
    assert!(device.races().is_empty(), "{:?}", device.races());
    allocator.check_invariants().unwrap();
    let actions: Vec<_> = allocator
        .snapshot()
        .trace
        .iter()
        .map(|e| e.action)
        .collect();
    assert!(actions.contains(&TraceAction::Sleep) && actions.contains(&TraceAction::Wake));
}

#[test]
fn without_a_backup_waking_maps_fresh_pages_and_copies_nothing() {
    let (device, allocator, stream) = setup(Config::default());
    let block = written(&device, &allocator, stream, KV, 10 * MIB);
    let report = allocator.sleep(&["kv_cache"], Backup::None).unwrap();
    assert_eq!((report.backed_up, report.copies), (0, 0));
    assert_eq!(device.host_bytes(), 0);
    let woken = allocator.wake(&["kv_cache"]).unwrap();
    assert_eq!(woken.restored, 0);
    assert_eq!(
        device.contents(block.ptr, block.size).unwrap(),
        [(0, block.size, 0)],
        "fresh pages: never written"
    );
    allocator.check_invariants().unwrap();
}

#[test]
fn sleep_waits_for_the_streams_that_use_the_pool_and_not_for_the_rest() {
    let (device, allocator, stream) = setup(Config::default());
    let (reader, other) = (device.create_stream(), device.create_stream());
    let block = written(&device, &allocator, stream, KV, 4 * MIB);
    // Another stream reads it, ordered after the write and recorded (record_stream).
    let event = device.create_event().unwrap();
    device.record_event(event, stream).unwrap();
    device.stream_wait_event(reader, event).unwrap();
    device.launch(
        reader,
        &[Access::read(block.ptr, 4 * MIB)],
        1_000_000,
        "send",
    );
    allocator.record_use(block.ptr, reader).unwrap();
    // Long work elsewhere that the sleep has no reason to wait for.
    let eager = written(&device, &allocator, other, PoolId::DEFAULT, MIB);
    device.launch(other, &[Access::write(eager.ptr, MIB)], 50_000_000, "train");
    let syncs = allocator.stats().device_syncs;
    allocator.sleep(&["kv_cache"], Backup::Host).unwrap();
    assert_eq!(allocator.stats().device_syncs, syncs, "no device-wide sync");
    assert!(
        device.host_time() < 50_000_000,
        "the host did not wait for the other stream ({} ns)",
        device.host_time()
    );
    assert!(device.races().is_empty(), "{:?}", device.races());
    allocator.wake(&["kv_cache"]).unwrap();
    allocator.check_invariants().unwrap();
}

#[test]
fn a_sleeping_pool_refuses_allocations_and_touching_it_is_out_of_bounds() {
    let (device, allocator, stream) = setup(Config::default());
    let block = written(&device, &allocator, stream, KV, 4 * MIB);
    allocator.sleep(&["kv_cache"], Backup::None).unwrap();
    let err = allocator.malloc_in(MIB, stream, KV).unwrap_err();
    assert_eq!(
        err,
        AllocError::PoolAsleep {
            tag: "kv_cache".into(),
            size: MIB
        }
    );
    let text = err.to_string();
    assert!(
        text.contains("\"kv_cache\"") && text.contains("asleep"),
        "{text}"
    );
    assert!(!text.contains("out of memory"), "not an OOM: {text}");
    // Other pools still allocate.
    allocator.malloc_in(MIB, stream, WEIGHTS).unwrap();
    // A kernel that touches sleeping memory is the program's bug, and the detector's
    // (compute-sanitizer's on a GPU) to find.
    device.launch(
        stream,
        &[Access::read(block.ptr, 64)],
        1_000,
        "stale kernel",
    );
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].kind, RaceKind::OutOfBounds);
    assert!(races[0].later.contains("stale kernel"));
}

#[test]
fn misuse_is_refused_with_a_clear_error_and_changes_nothing() {
    let (device, allocator, stream) = setup(Config::default());
    written(&device, &allocator, stream, KV, 4 * MIB);
    let unknown = allocator.sleep(&["kv"], Backup::None).unwrap_err();
    assert_eq!(
        unknown.to_string(),
        r#"no memory pool is tagged "kv" (tags: "kv_cache", "weights")"#
    );
    assert_eq!(
        allocator.wake(&["kv_cache"]).unwrap_err(),
        SleepError::NotAsleep("kv_cache".into()).into()
    );
    allocator.sleep(&["kv_cache"], Backup::None).unwrap();
    let stats = allocator.stats();
    let again = allocator.sleep(&["weights", "kv_cache"], Backup::None);
    assert_eq!(
        again.unwrap_err(),
        SleepError::AlreadyAsleep("kv_cache".into()).into()
    );
    assert_eq!(
        allocator.stats(),
        stats,
        "weights stayed awake: nothing changed"
    );
    assert_eq!(
        allocator.sleep(&[], Backup::None).unwrap_err().to_string(),
        "no tags given"
    );
    // Tags: one name per pool, one pool per name, valid names, live pools only.
    let text = |err: AllocError| err.to_string();
    assert_eq!(
        text(allocator.tag_pool(WEIGHTS, "kv_cache").unwrap_err()),
        "tag \"kv_cache\" already names pool(0, 1)"
    );
    assert_eq!(
        text(allocator.tag_pool(KV, "other").unwrap_err()),
        "pool(0, 1) is already tagged \"kv_cache\""
    );
    assert!(text(allocator.tag_pool(PoolId(0, 3), "x").unwrap_err()).contains("does not exist"));
    assert!(text(allocator.tag_pool(PoolId::DEFAULT, "x").unwrap_err()).contains("default pool"));
    allocator.create_or_incref_pool(PoolId(0, 3)).unwrap();
    assert!(text(allocator.tag_pool(PoolId(0, 3), "a\nb").unwrap_err()).contains("invalid tag"));
    assert_eq!(
        allocator.tag_pool(KV, "kv_cache"),
        Ok(()),
        "its own tag again"
    );
    // A checkpoint cannot be restored into a sleeping pool.
    let restore = allocator.restore_pool(KV, &[]).unwrap_err();
    assert!(text(restore).contains("asleep"));
    allocator.check_invariants().unwrap();
}

#[test]
fn whole_segments_and_switched_off_pools_cannot_sleep() {
    let device = SimBackend::new(1 << 30);
    let whole = Allocator::new(
        device.clone(),
        Config {
            expandable_segments: false,
            ..Config::default()
        },
    )
    .unwrap();
    whole.create_or_incref_pool(KV).unwrap();
    let err = whole.tag_pool(KV, "kv_cache").unwrap_err().to_string();
    assert!(err.contains("expandable_segments:true"), "{err}");
    assert_eq!(err.lines().count(), 1);
    let no_pools = Allocator::new(
        device,
        Config {
            graph_pools: false,
            ..Config::default()
        },
    )
    .unwrap();
    no_pools.create_or_incref_pool(KV).unwrap();
    let err = no_pools.tag_pool(KV, "kv_cache").unwrap_err().to_string();
    assert!(err.contains("graph_pools:true"), "{err}");
}

#[test]
fn sleeping_is_refused_while_a_pool_is_being_allocated_to() {
    let (_device, allocator, _stream) = setup(Config::default());
    allocator.begin_allocate_to_pool(WEIGHTS).unwrap();
    let err = allocator.sleep(&["kv_cache"], Backup::None).unwrap_err();
    assert_eq!(err, SleepError::CaptureUnderway.into());
    allocator.end_allocate_to_pool(WEIGHTS).unwrap();
    allocator.sleep(&["kv_cache"], Backup::None).unwrap();
}

#[test]
fn a_tagged_pool_is_mapped_whole_and_a_second_sleep_reuses_its_host_buffer() {
    // Stitching on (the default): other pools map page by page, a tagged pool whole.
    let (device, allocator, stream) = setup(Config::default());
    let block = written(&device, &allocator, stream, KV, 100 * MIB);
    assert_eq!(device.calls("map_pages"), 0);
    assert!(
        device.calls("map_pages_whole") >= 2,
        "pieces and the last page"
    );
    allocator.sleep(&["kv_cache"], Backup::Host).unwrap();
    let unmaps = device.calls("unmap_pages");
    assert!(unmaps <= 2, "contiguous mappings go in one call: {unmaps}");
    allocator.wake(&["kv_cache"]).unwrap();
    assert_eq!(device.calls("alloc_host"), 1);
    allocator.sleep(&["kv_cache"], Backup::Host).unwrap();
    assert_eq!(
        device.calls("alloc_host"),
        1,
        "the buffer is kept between sleeps"
    );
    allocator.wake(&["kv_cache"]).unwrap();
    let host = allocator.stats().host_backup_bytes;
    assert!(host >= block.requested);
    assert_eq!(allocator.release_host_backup(&["kv_cache"]), Ok(host));
    assert_eq!(
        (device.host_bytes(), allocator.stats().host_backup_bytes),
        (0, 0)
    );
    allocator.check_invariants().unwrap();
}

#[test]
fn waking_beyond_the_limit_is_refused_and_the_pool_stays_asleep() {
    let (device, allocator, stream) = setup(Config::default());
    let block = written(&device, &allocator, stream, KV, 60 * MIB);
    allocator.sleep(&["kv_cache"], Backup::Host).unwrap();
    let other = written(&device, &allocator, stream, PoolId::DEFAULT, 60 * MIB);
    allocator
        .set_memory_limit(Some(allocator.stats().reserved_bytes.current + 8 * MIB))
        .unwrap();
    let err = allocator.wake(&["kv_cache"]).unwrap_err().to_string();
    assert!(err.starts_with("cannot wake \"kv_cache\""), "{err}");
    assert!(err.contains("memory limit"), "{err}");
    assert!(allocator.tags()[0].asleep);
    allocator.check_invariants().unwrap();
    allocator.free(other.ptr).unwrap();
    allocator.set_memory_limit(None).unwrap();
    allocator.empty_cache().unwrap();
    allocator.wake(&["kv_cache"]).unwrap();
    assert!(device.contents(block.ptr, block.size).is_some());
    assert!(device.races().is_empty(), "{:?}", device.races());
}

#[test]
fn freeing_a_sleeping_block_is_bookkeeping_and_snapshots_show_sleeping_segments() {
    let (device, allocator, stream) = setup(Config::default());
    let block = written(&device, &allocator, stream, KV, 6 * MIB);
    allocator.sleep(&["kv_cache"], Backup::Host).unwrap();
    let snapshot = allocator.snapshot();
    let asleep: Vec<_> = snapshot.segments.iter().filter(|s| s.asleep).collect();
    assert_eq!(asleep.len(), 1);
    assert_eq!(asleep[0].tag.as_deref(), Some("kv_cache"));
    assert!(asleep[0].blocks.iter().any(|b| b.addr == block.ptr));
    allocator.free(block.ptr).unwrap();
    allocator.check_invariants().unwrap();
    allocator.wake(&["kv_cache"]).unwrap();
    let info = allocator.tags();
    assert_eq!((info[0].name.as_str(), info[0].allocated), ("kv_cache", 0));
    allocator.empty_pool_cache(KV).unwrap();
    assert!(device.races().is_empty(), "{:?}", device.races());
    allocator.check_invariants().unwrap();
}

#[test]
fn our_json_and_the_viewer_show_sleeping_ranges_and_pytorchs_format_leaves_them_out() {
    use streamalloc_viz::model::from_engine;
    use streamalloc_viz::timeline::{Counter, Timeline};
    let (device, allocator, stream) = setup(Config::default());
    let block = written(&device, &allocator, stream, KV, 6 * MIB);
    let report = allocator.sleep(&["kv_cache"], Backup::None).unwrap();
    let ours = from_engine(&allocator.snapshot());
    let json = serde_json::to_value(&ours).unwrap();
    let segment = &json["devices"][0]["segments"][0];
    assert_eq!(
        (&segment["asleep"], &segment["tag"]),
        (&true.into(), &"kv_cache".into())
    );
    let timeline = Timeline::build(&ours.devices[0]);
    let last = ours.devices[0].trace.len() as u32;
    let sleeping = timeline.sleeping_at(last);
    assert_eq!(
        sleeping.iter().map(|&(_, size)| size).sum::<u64>(),
        report.released
    );
    assert!(sleeping
        .iter()
        .any(|&(at, size)| at <= block.ptr.0 && block.ptr.0 < at + size));
    assert_eq!(
        timeline.counters[Counter::Reserved as usize]
            .last()
            .copied(),
        Some(allocator.stats().reserved_bytes.current),
        "the viewer's reserved line falls with the sleep"
    );
    let encoded = streamalloc_viz::wire::encode_device(&ours, &ours.devices[0]);
    let header_len = u32::from_le_bytes(encoded[..4].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&encoded[4..4 + header_len]).unwrap();
    assert_eq!(header["sleeping"], sleeping.len());
    assert!(header["columns"]["sl_start"].is_object());
    let pytorch = streamalloc_viz::pytorch::to_torch(&ours);
    assert!(
        pytorch.segments.is_empty(),
        "PyTorch's segments are reserved memory only"
    );
}

#[test]
fn a_pool_released_while_asleep_keeps_its_addresses_until_woken_and_then_goes_back() {
    let (device, allocator, stream) = setup(Config::default());
    let block = written(&device, &allocator, stream, KV, 12 * MIB);
    allocator.sleep(&["kv_cache"], Backup::Host).unwrap();
    // The program drops its MemPool: the pool has no use left, its block is still live.
    assert_eq!(allocator.release_pool(KV), Ok(0));
    allocator.empty_cache().unwrap();
    assert!(allocator.owns(block.ptr));
    allocator.check_invariants().unwrap();
    allocator.wake(&["kv_cache"]).unwrap();
    assert!(device.contents(block.ptr, block.size).is_some());
    allocator.free(block.ptr).unwrap();
    allocator.release_host_backup(&["kv_cache"]).unwrap();
    allocator.empty_cache().unwrap();
    assert_eq!(
        device.mapped(),
        0,
        "released, freed and emptied: nothing left"
    );
    assert!(device.races().is_empty(), "{:?}", device.races());
    allocator.check_invariants().unwrap();
}
