//! The simulator's race detector must catch the bug it exists for: a block reused by one
//! stream while another stream still reads it, because the allocator skipped the
//! device-side wait. A backend wrapper that silently drops `stream_wait_event` plants
//! exactly that bug; the detector must report it, naming both operations.

use streamalloc_allocator::backend::sim::{Access, RaceKind, SimBackend};
use streamalloc_allocator::backend::Events;
use streamalloc_allocator::backend::{Backend, BackendResult, Streams};
use streamalloc_allocator::{Allocator, Config, DevicePtr, EventHandle, StreamId};

/// Forwards everything to the simulator except device-side waits, which it drops.
struct DropWaits(SimBackend);

streamalloc_allocator::forward_backend! {
    impl[] for DropWaits as this => &this.0, SimBackend;
    Clock, Segments, Events, VirtualMemory, HostMemory
}

impl Streams for DropWaits {
    fn stream_wait_event(&self, _stream: StreamId, _event: EventHandle) -> BackendResult<()> {
        Ok(()) // the planted bug
    }
    fn synchronize_device(&self) -> BackendResult<()> {
        self.0.synchronize_device()
    }
    fn is_capturing(&self, stream: StreamId) -> BackendResult<bool> {
        self.0.is_capturing(stream)
    }
}

/// Compute allocates, comm reads (slowly), compute frees and reallocates and writes.
fn reuse_while_comm_reads<B: Backend>(device: &SimBackend, allocator: &Allocator<B>) -> DevicePtr {
    let (compute, comm) = (device.create_stream(), device.create_stream());
    let block = allocator.malloc(64 << 20, compute).unwrap();
    device.launch(
        compute,
        &[Access::write(block.ptr, 64 << 20)],
        1_000,
        "produce",
    );
    let produced = device.create_event().unwrap();
    device.record_event(produced, compute).unwrap();
    device.stream_wait_event(comm, produced).unwrap();
    device.launch(
        comm,
        &[Access::read(block.ptr, 64 << 20)],
        5_000_000,
        "isend",
    );
    allocator.record_use(block.ptr, comm).unwrap();
    allocator.free(block.ptr).unwrap();
    let again = allocator.malloc(64 << 20, compute).unwrap();
    assert_eq!(again.ptr, block.ptr, "the block is reused at once");
    device.launch(
        compute,
        &[Access::write(again.ptr, 64 << 20)],
        1_000,
        "overwrite",
    );
    block.ptr
}

#[test]
fn detector_reports_reuse_without_the_wait_naming_both_operations() {
    let device = SimBackend::new(1 << 30);
    let allocator = Allocator::new(DropWaits(device.clone()), Config::default()).unwrap();
    let reused = reuse_while_comm_reads(&device, &allocator);
    // One race per physical page of the block (expandable segments map a page per
    // allocation), each naming the two operations, and together the whole block.
    let races = device.races();
    assert!(!races.is_empty());
    for race in &races {
        assert_eq!(race.kind, RaceKind::Unordered);
        let message = race.to_string();
        assert!(
            message.contains("isend") && message.contains("overwrite"),
            "{message}"
        );
    }
    let mut ranges: Vec<_> = races.iter().map(|race| race.range).collect();
    ranges.sort_unstable();
    assert_eq!(ranges.first().map(|r| r.0), Some(reused.0));
    assert!(ranges.windows(2).all(|pair| pair[0].1 == pair[1].0));
    assert_eq!(ranges.last().map(|r| r.1), Some(reused.0 + (64 << 20)));
}

#[test]
fn the_same_program_is_race_free_with_the_wait() {
    let device = SimBackend::new(1 << 30);
    let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
    reuse_while_comm_reads(&device, &allocator);
    assert!(device.races().is_empty(), "{:?}", device.races());
    assert_eq!(allocator.stats().cross_stream_waits, 1);
}

#[test]
fn detector_reports_touching_freed_segments() {
    let device = SimBackend::new(1 << 30);
    let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
    let stream = device.create_stream();
    let block = allocator.malloc(4096, stream).unwrap();
    allocator.free(block.ptr).unwrap();
    allocator.empty_cache().unwrap();
    device.launch(
        stream,
        &[Access::read(block.ptr, 4096)],
        10,
        "use after free",
    );
    let races = device.races();
    assert_eq!(races.len(), 1);
    assert_eq!(races[0].kind, RaceKind::OutOfBounds);
    assert!(races[0].to_string().contains("use after free"));
}
