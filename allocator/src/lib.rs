//! # streamalloc-allocator
//!
//! The engine of streamalloc, a CUDA caching allocator whose central idea is
//! **stream-aware lifetime tracking through recorded events**.
//!
//! A caching allocator keeps freed device memory to hand out again without the driver's
//! ~66 µs `cuMemAlloc`/`cuMemFree`. The hard part is streams: a block freed by one stream
//! may still be read by another (a communication stream sending it, say). PyTorch keeps
//! such a block out of circulation until the host *observes* the other stream's event
//! complete; since the host runs ahead of the GPU, blocks pile up. streamalloc instead
//! returns the block to its free list at once, carrying the events, and makes whichever
//! stream reuses it *wait on the device* (`cuStreamWaitEvent`). Memory stays flat and the
//! host never polls.
//!
//! Unlike `cudaMallocAsync` pools, the engine is ordinary host code you can read, test and
//! trace: every decision is made here, over the [`Backend`] trait, and recorded in a
//! trace ring that snapshots and the bundled viewer show.
//!
//! ## Layout
//! - [`pool`]: segments, blocks, best-fit free lists; no policy.
//! - `lifetime`: per-stream free lists, pooled events, completion passes.
//! - [`Allocator`]: the allocation policy, stats, trace and snapshots (`allocator/`, a file
//!   per step of the policy), behind one lock released by a plain store (`lock`).
//! - [`backend`]: the [`Backend`] trait, the simulator with its race detector
//!   ([`backend::sim`]) and the CUDA driver backend (feature `cuda`).
//! - [`trace`], [`snapshot`]: the trace ring and snapshots; their record types come from
//!   `streamalloc-records`, shared with the snapshot formats, and are re-exported there.
//! - `testing` (feature `testing`): the operation-level harness of the property tests and
//!   the fuzz target, outside the engine's API.
//!
//! ## Example
//! ```
//! use streamalloc_allocator::{Allocator, Config, StreamId};
//! use streamalloc_allocator::backend::sim::SimBackend;
//!
//! let device = SimBackend::new(1 << 30);
//! let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
//! let (compute, comm) = (device.create_stream(), device.create_stream());
//! let block = allocator.malloc(64 << 20, compute).unwrap();
//! allocator.record_use(block.ptr, comm).unwrap(); // comm reads it, e.g. an isend
//! allocator.free(block.ptr).unwrap();              // back in compute's list at once
//! let again = allocator.malloc(64 << 20, compute).unwrap();
//! assert_eq!(again.ptr, block.ptr);                // reused, after a device-side wait
//! assert_eq!(allocator.stats().cross_stream_waits, 1);
//! ```
//!
//! ## Caveats
//! - Dropping an [`Allocator`] does not return its segments: calling the driver during
//!   process teardown is undefined, so (like RMM) memory is left to the process exit. Call
//!   [`Allocator::empty_cache`] first when that matters.
//! - A block freed while another stream uses it, without `record_use`, is the caller's
//!   race, exactly as with PyTorch's allocator.

#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod allocator;
pub mod backend;
pub mod config;
mod counters;
pub mod error;
pub mod implementation;
pub(crate) mod lifetime;
mod lock;
pub mod pool;
pub mod rng;
pub mod scenarios;
pub mod snapshot;
pub mod stats;
/// The operation-level harness of the property tests and the fuzz target (feature
/// `testing`): not part of the engine's API.
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod trace;
pub mod types;
mod util;

pub use allocator::{
    AllocationSite, Allocator, Backup, PoolBlock, SleepReport, TagInfo, WakeReport,
};
pub use backend::Backend;
pub use config::{Config, ReusePolicy, TraceClock};
pub use error::{AllocError, BackendError, ConfigError, OutOfMemory, SleepError};
pub use snapshot::Snapshot;
pub use stats::{Gauge, StatArray, Stats, TorchStats};
pub use types::{Allocation, DevicePtr, EventHandle, HostPtr, PoolId, PoolKind, StreamId};
