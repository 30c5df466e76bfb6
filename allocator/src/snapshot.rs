//! A picture of the allocator at one instant: segments with their blocks, the trace ring,
//! counters and configuration. `viz/` turns it into files (our JSON, PyTorch pickles,
//! Perfetto traces); the engine only builds it. [`BlockState`] is shared with the formats
//! (`streamalloc-records`) and re-exported here.

use crate::config::Config;
use crate::stats::Stats;
use crate::trace::TraceEntry;
use crate::types::{DevicePtr, PoolId, PoolKind, StreamId};
use serde::{Deserialize, Serialize};
pub use streamalloc_records::BlockState;

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

/// Everything a viewer needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
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
