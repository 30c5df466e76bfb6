//! Reference workloads on the simulator, shared by tests, benchmarks and the CLI demo so
//! that each figure is produced by one piece of code.

use crate::backend::sim::{Access, SimBackend};
use crate::backend::{Events, Streams};
use crate::config::{Config, ReusePolicy};
use crate::error::AllocError;
use crate::Allocator;

/// What a scenario measured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScenarioReport {
    /// Peak bytes reserved from the device.
    pub peak_reserved: u64,
    /// Peak bytes allocated to the program.
    pub peak_allocated: u64,
    /// Device-side waits the allocator issued.
    pub cross_stream_waits: u64,
    /// Event queries the allocator made.
    pub event_queries: u64,
    /// Simulated device time at the end, nanoseconds.
    pub device_time_ns: u64,
    /// Races the simulator detected (each rendered as a message); empty when correct.
    pub races: Vec<String>,
}

/// The `record_stream` pipeline (docs/design.md, "The lifetime model: streams"): a compute
/// stream produces a `size`-byte activation `iterations` times; a slower communication
/// stream reads each one (an `isend`), recorded with `record_use`, and the compute side
/// frees it at once. The host runs ahead of both.
///
/// Under [`ReusePolicy::Pytorch`] every activation is held until the host sees its send
/// complete, so memory grows with `iterations`; under [`ReusePolicy::StreamWait`] the
/// compute stream waits on the device and memory stays near two activations.
pub fn record_stream_pipeline(
    policy: ReusePolicy,
    iterations: u32,
    size: u64,
) -> Result<ScenarioReport, AllocError> {
    let device = SimBackend::new(64 << 30);
    let config = Config {
        reuse_policy: policy,
        ..Config::default()
    };
    let allocator = Allocator::new(device.clone(), config)?;
    let compute = device.create_stream();
    let comm = device.create_stream();
    let produced = device.create_event()?;
    for i in 0..iterations {
        let activation = allocator.malloc(size, compute)?;
        device.launch(
            compute,
            &[Access::write(activation.ptr, size)],
            1_000_000,
            &format!("matmul {i}"),
        );
        // The program orders the send after the producer, as NCCL's stream does.
        device.record_event(produced, compute)?;
        device.stream_wait_event(comm, produced)?;
        device.launch(
            comm,
            &[Access::read(activation.ptr, size)],
            5_000_000,
            &format!("isend {i}"),
        );
        allocator.record_use(activation.ptr, comm)?;
        allocator.free(activation.ptr)?;
        device.advance_host(20_000);
    }
    device.synchronize_device()?;
    device.destroy_event(produced)?;
    let stats = allocator.stats();
    Ok(ScenarioReport {
        peak_reserved: stats.reserved_bytes.peak,
        peak_allocated: stats.allocated_bytes.peak,
        cross_stream_waits: stats.cross_stream_waits,
        event_queries: stats.event_queries,
        device_time_ns: device.device_time(),
        races: device.races().iter().map(ToString::to_string).collect(),
    })
}
