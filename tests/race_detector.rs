//! The simulator's race detector must catch the bug it exists for: a block reused by one
//! stream while another stream still reads it, because the allocator skipped the
//! device-side wait. A backend wrapper that silently drops `stream_wait_event` plants
//! exactly that bug; the detector must report it, naming both operations.

use streamalloc_allocator::backend::sim::{Access, RaceKind, SimBackend};
use streamalloc_allocator::backend::{Backend, BackendResult};
use streamalloc_allocator::{Allocator, Config, DevicePtr, EventHandle, StreamId};

/// Forwards everything to the simulator except device-side waits, which it drops.
struct DropWaits(SimBackend);

impl Backend for DropWaits {
    fn total_memory(&self) -> BackendResult<u64> {
        self.0.total_memory()
    }
    fn alloc_segment(&self, size: u64) -> BackendResult<DevicePtr> {
        self.0.alloc_segment(size)
    }
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> BackendResult<()> {
        self.0.free_segment(ptr, size)
    }
    fn create_event(&self) -> BackendResult<EventHandle> {
        self.0.create_event()
    }
    fn destroy_event(&self, event: EventHandle) -> BackendResult<()> {
        self.0.destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> BackendResult<()> {
        self.0.record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> BackendResult<bool> {
        self.0.query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> BackendResult<()> {
        self.0.synchronize_event(event)
    }
    fn stream_wait_event(&self, _stream: StreamId, _event: EventHandle) -> BackendResult<()> {
        Ok(()) // the planted bug
    }
    fn synchronize_device(&self) -> BackendResult<()> {
        self.0.synchronize_device()
    }
    fn now_ns(&self) -> u64 {
        self.0.now_ns()
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
    reuse_while_comm_reads(&device, &allocator);
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].kind, RaceKind::Unordered);
    let message = races[0].to_string();
    assert!(
        message.contains("isend") && message.contains("overwrite"),
        "{message}"
    );
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
