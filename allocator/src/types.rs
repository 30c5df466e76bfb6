//! The vocabulary shared by every module: opaque handles for streams, device pointers, host
//! buffers and events, the two block pools and memory pool ids.
//!
//! Handles are plain integers so the engine stays free of FFI types: a `CUstream` or
//! `CUevent` is carried as its address, a simulated one as a counter. Only a backend ever
//! interprets them. [`StreamId`] and [`DevicePtr`] appear in trace records, [`PoolId`] and
//! [`PoolKind`] in snapshots, so they are defined with them in `streamalloc-records` and
//! re-exported here.

use serde::{Deserialize, Serialize};
use std::fmt;

pub use streamalloc_records::{DevicePtr, PoolId, PoolKind, StreamId};

/// An event object owned by a backend (`CUevent`). Created, recorded, queried, waited on
/// and destroyed only through [`crate::Backend`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EventHandle(pub u64);

impl fmt::Debug for EventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "event:{:#x}", self.0)
    }
}

/// Page-locked host memory owned by a backend ([`crate::backend::HostMemory::alloc_host`]): the
/// address, carried as an integer like every handle (the simulator's is a counter).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostPtr(pub u64);

impl fmt::Debug for HostPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host:{:#x}", self.0)
    }
}

/// One allocation handed to a caller.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Allocation {
    /// First byte of the allocation.
    pub ptr: DevicePtr,
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Bytes reserved for it (the request rounded up to the pool's granularity).
    pub size: u64,
    /// The stream the allocation belongs to: it may use it with no synchronisation.
    pub stream: StreamId,
}

/// Index of a recorded event.
pub(crate) type EventKey = usize;
