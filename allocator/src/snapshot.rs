//! A picture of the allocator at one instant: segments with their blocks, the trace ring,
//! counters and configuration. `viz/` turns it into files (our JSON, PyTorch pickles,
//! Perfetto traces); the engine only builds it. The records are shared with the formats
//! (`streamalloc-records`), which read them without the engine, and re-exported here.

use crate::config::Config;
use crate::stats::Stats;
pub use streamalloc_records::{BlockInfo, BlockState, SegmentInfo};

/// The engine's snapshot: the records' snapshot with its configuration and counters.
pub type Snapshot = streamalloc_records::Snapshot<Config, Stats>;
