//! A small engine run on the simulated device, for tests that need a real engine snapshot.

use streamalloc_allocator::backend::sim::{Access, SimBackend};
use streamalloc_allocator::{Allocator, Config, Snapshot};

/// Two streams, cross-stream use with record_use, frees, some blocks left allocated, and
/// an empty_cache: every kind of event the engine records except staging and OOM.
#[allow(dead_code)]
pub fn engine_snapshot() -> Snapshot {
    engine_snapshot_with(Config::default())
}

/// [`engine_snapshot`] under `config`.
#[allow(dead_code)]
pub fn engine_snapshot_with(config: Config) -> Snapshot {
    let device = SimBackend::new(8 << 30);
    let allocator = Allocator::new(device.clone(), config).unwrap();
    let (compute, comm) = (device.create_stream(), device.create_stream());
    let mut keep = Vec::new();
    for i in 0..40u64 {
        let size = ((i % 7) + 1) << 20;
        let a = allocator.malloc(size, compute).unwrap();
        device.launch(compute, &[Access::write(a.ptr, size)], 1_000, "produce");
        if i % 3 == 0 {
            allocator.record_use(a.ptr, comm).unwrap();
            device.launch(comm, &[Access::read(a.ptr, size)], 5_000, "send");
        }
        if i % 5 == 0 {
            keep.push(a.ptr);
        } else {
            allocator.free(a.ptr).unwrap();
        }
        let small = allocator.malloc(4096 * (i + 1), comm).unwrap();
        allocator.free(small.ptr).unwrap();
        device.advance_host(500);
    }
    allocator.free(keep.pop().unwrap()).unwrap();
    device.synchronize_stream(comm);
    allocator.empty_cache().unwrap();
    allocator.snapshot()
}
