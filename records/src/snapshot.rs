//! A picture of an allocator at one instant: segments with their blocks, the trace ring,
//! counters and configuration. The engine builds it (`streamalloc_allocator::Snapshot`,
//! with its own configuration and counters); the formats read it (`streamalloc-viz`)
//! without depending on the engine.

use crate::{BlockState, DevicePtr, StreamId, TraceEntry};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A memory pool: a set of segments whose blocks serve only allocations made for the same
/// pool (PyTorch's `MempoolId_t`: CUDA graphs' private pools and `torch.cuda.MemPool`).
/// [`PoolId::DEFAULT`] is the pool every ordinary allocation uses.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct PoolId(pub u64, pub u64);

impl PoolId {
    /// The pool of ordinary allocations: `(0, 0)`, as in PyTorch.
    pub const DEFAULT: PoolId = PoolId(0, 0);

    /// True for [`PoolId::DEFAULT`].
    pub fn is_default(&self) -> bool {
        *self == Self::DEFAULT
    }
}

impl fmt::Debug for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pool({}, {})", self.0, self.1)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Which pool a block lives in. Small requests are packed into small segments so that
/// they never fragment the large ones (PyTorch makes the same split, at the same 1 MiB).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// Requests of at most 1 MiB (the engine's `pool::SMALL_REQUEST_LIMIT`).
    Small = 0,
    /// Everything larger.
    Large = 1,
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// First byte.
    pub addr: DevicePtr,
    /// Bytes reserved.
    pub size: u64,
    /// Bytes the caller asked for (0 for free blocks).
    pub requested: u64,
    /// Allocated, pending or free.
    pub state: BlockState,
    /// Owning stream.
    pub stream: StreamId,
    /// Events still pending on it (free blocks only).
    pub pending_events: u32,
    /// For pages lent to a stitched range: the range's address, where the allocation the
    /// program sees lies (the trace records it there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lent_to: Option<DevicePtr>,
}

/// One segment obtained from the device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentInfo {
    /// First byte.
    pub addr: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// Small or large pool.
    pub pool: PoolKind,
    /// The memory pool it belongs to (absent in snapshots of the default pool's segments
    /// and in those written before pools existed).
    #[serde(default, skip_serializing_if = "PoolId::is_default")]
    pub mempool: PoolId,
    /// An expandable segment: an address reservation of which only `blocks` are mapped
    /// (`size` counts those bytes).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expandable: bool,
    /// The stream whose request created it.
    pub stream: StreamId,
    /// The tag of its memory pool (`Allocator::tag_pool`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Its memory pool is asleep: `size` bytes went back to the device, their addresses
    /// and blocks kept, and `reserved_bytes` leaves them out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub asleep: bool,
    /// Its blocks in address order; their sizes add up to `size`.
    pub blocks: Vec<BlockInfo>,
}

/// Everything a viewer needs. `Config` and `Stats` are the engine's configuration and
/// counters (the engine's `Snapshot` names them); a reader that does not know the engine
/// reads them as it likes, e.g. as JSON values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot<Config, Stats> {
    /// The configuration in force.
    pub config: Config,
    /// Counters at the instant of the snapshot.
    pub stats: Stats,
    /// Segments in address order.
    pub segments: Vec<SegmentInfo>,
    /// The trace ring, oldest first.
    pub trace: Vec<TraceEntry>,
    /// Trace entries lost because the ring was full.
    pub trace_dropped: u64,
    /// Backend clock when the snapshot was taken.
    pub time_ns: u64,
}
