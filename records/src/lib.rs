//! # streamalloc-records
//!
//! The records that the engine writes and every snapshot format reads: what happened
//! ([`TraceAction`]), one trace event ([`TraceEntry`]), the state of a block
//! ([`BlockState`]), the two handles they name ([`DevicePtr`], [`StreamId`]), and a
//! picture of an allocator at one instant ([`Snapshot`], with its segments and blocks, the
//! pools they belong to: [`PoolId`], [`PoolKind`]).
//!
//! The engine (`streamalloc-allocator`), the viewer and its formats (`streamalloc-viz`:
//! our JSON, PyTorch's pickles, Perfetto) and the trace replayer all speak of the same
//! events and states. Defined once here, a new action is one variant that every format
//! then spells the same way, and the correspondence with PyTorch's names lives in one
//! place ([`TraceAction::from_pytorch_name`], [`TraceAction::PYTORCH`]). The crate depends
//! only on serde, so the formats need not pull in the engine to name its records.
//!
//! Names are written in snake_case, PyTorch's own where PyTorch has the action or state
//! (`alloc`, `free_requested`, `active_pending_free`, ...).

#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod snapshot;

pub use snapshot::{BlockInfo, PoolId, PoolKind, SegmentInfo, Snapshot};

use serde::{Deserialize, Serialize};
use std::fmt;

/// A stream as the caller names it (a `CUstream` cast to an integer; `0` is the legacy
/// default stream). Only compared and hashed; serialised as the bare integer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct StreamId(pub u64);

/// A device address handed out by a backend (`CUdeviceptr`); serialised as the bare
/// integer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct DevicePtr(pub u64);

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream:{:#x}", self.0)
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Displays the handles as their `Debug` form (`stream:0x7`, `0x1000`).
macro_rules! display_as_debug {
    ($($handle:ty),*) => {$(
        impl fmt::Display for $handle {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }
    )*};
}

display_as_debug!(StreamId, DevicePtr);

/// What a trace event records: PyTorch's actions (`TraceEntry::Action` in its allocator)
/// plus streamalloc's own. Serialised as [`TraceAction::name`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    /// A block was handed to a caller.
    Alloc,
    /// The caller freed a block; other streams may still be using it.
    FreeRequested,
    /// The block is reusable by any stream without waiting (its pending events are
    /// known complete, or it had none).
    FreeCompleted,
    /// A segment was obtained from the device.
    SegmentAlloc,
    /// A segment was returned to the device.
    SegmentFree,
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages were unmapped from an expandable segment.
    SegmentUnmap,
    /// A request failed for lack of memory.
    Oom,
    /// PyTorch: a snapshot was taken at this point.
    Snapshot,
    /// PyTorch: a marker inserted by the user.
    UserDefined,
    /// streamalloc: a stream was made to wait on the device for another stream's event so
    /// that a block could be reused: `stream` is the waiting stream, `addr`/`size` the
    /// block.
    CrossStreamWait,
    /// streamalloc: a staging buffer was taken from the pool.
    StagingAcquire,
    /// streamalloc: a staging buffer was returned.
    StagingRelease,
    /// streamalloc: cached memory was returned to the device (`addr`/`size` are 0 / bytes
    /// released).
    EmptyCache,
    /// streamalloc: free pages were mapped into one range for an allocation (`addr`/`size`
    /// are the stitched range), or a range kept from an earlier free was taken again. No
    /// memory is reserved by it: the pages are counted where they were first mapped.
    Stitch,
    /// streamalloc: a stitched range kept after its free was unmapped (its pages stay where
    /// they were first mapped).
    Unstitch,
    /// streamalloc: a memory pool went to sleep: the pages at `addr`/`size` went back to the
    /// device with their addresses kept, and the blocks on them stay allocated.
    Sleep,
    /// streamalloc: a sleeping memory pool woke: fresh pages were mapped at `addr`/`size`,
    /// the addresses an earlier `sleep` left.
    Wake,
}

impl TraceAction {
    /// Every action, in the order of the viewer's numeric codes ([`TraceAction::code`]).
    pub const ALL: [TraceAction; 18] = [
        TraceAction::Alloc,
        TraceAction::FreeRequested,
        TraceAction::FreeCompleted,
        TraceAction::SegmentAlloc,
        TraceAction::SegmentFree,
        TraceAction::SegmentMap,
        TraceAction::SegmentUnmap,
        TraceAction::Oom,
        TraceAction::Snapshot,
        TraceAction::UserDefined,
        TraceAction::CrossStreamWait,
        TraceAction::StagingAcquire,
        TraceAction::StagingRelease,
        TraceAction::EmptyCache,
        TraceAction::Stitch,
        TraceAction::Unstitch,
        TraceAction::Sleep,
        TraceAction::Wake,
    ];

    /// The actions PyTorch has, in the order of its enum.
    pub const PYTORCH: [TraceAction; 10] = [
        TraceAction::Alloc,
        TraceAction::FreeRequested,
        TraceAction::FreeCompleted,
        TraceAction::SegmentAlloc,
        TraceAction::SegmentFree,
        TraceAction::SegmentMap,
        TraceAction::SegmentUnmap,
        TraceAction::Snapshot,
        TraceAction::Oom,
        TraceAction::UserDefined,
    ];

    /// The action's name as every format writes it (`"free_requested"`).
    pub fn name(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
            TraceAction::Snapshot => "snapshot",
            TraceAction::UserDefined => "user_defined",
            TraceAction::CrossStreamWait => "cross_stream_wait",
            TraceAction::StagingAcquire => "staging_acquire",
            TraceAction::StagingRelease => "staging_release",
            TraceAction::EmptyCache => "empty_cache",
            TraceAction::Stitch => "stitch",
            TraceAction::Unstitch => "unstitch",
            TraceAction::Sleep => "sleep",
            TraceAction::Wake => "wake",
        }
    }

    /// True for the actions PyTorch has (those of [`TraceAction::PYTORCH`]); PyTorch's
    /// files and viewer know no others.
    pub fn is_pytorch(self) -> bool {
        Self::PYTORCH.contains(&self)
    }

    /// The PyTorch action PyTorch spells `name`, if there is one (streamalloc's own names
    /// give `None`: they never appear in PyTorch's files).
    pub fn from_pytorch_name(name: &str) -> Option<Self> {
        Self::PYTORCH.into_iter().find(|a| a.name() == name)
    }

    /// True for PyTorch's markers (`snapshot`, `user_defined`): points in the trace at
    /// which no memory changed hands.
    pub fn is_marker(self) -> bool {
        matches!(self, TraceAction::Snapshot | TraceAction::UserDefined)
    }

    /// The viewer's numeric code: its index in [`TraceAction::ALL`].
    pub fn code(self) -> u8 {
        Self::ALL.iter().position(|a| *a == self).unwrap_or(0) as u8
    }
}

/// One recorded event, as the engine's trace ring holds it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// The block or segment address (0 where none applies).
    pub addr: DevicePtr,
    /// Bytes concerned.
    pub size: u64,
    /// The stream concerned.
    pub stream: StreamId,
    /// Backend clock at the event, nanoseconds.
    pub time_ns: u64,
}

/// State of a block, in PyTorch's vocabulary. Serialised as [`BlockState::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Handed to a caller.
    ActiveAllocated,
    /// Freed, but other streams' events are pending on it.
    ActivePendingFree,
    /// Free and ready for its stream.
    Inactive,
}

impl BlockState {
    /// Every state.
    pub const ALL: [BlockState; 3] = [
        BlockState::ActiveAllocated,
        BlockState::ActivePendingFree,
        BlockState::Inactive,
    ];

    /// The name every format writes, PyTorch's (`"active_pending_free"`).
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }

    /// The state named `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names the formats write are serde's, so JSON and pickles spell them alike.
    #[test]
    fn names_match_serde() {
        for action in TraceAction::ALL {
            let json = serde_json::to_string(&action).unwrap();
            assert_eq!(json, format!("\"{}\"", action.name()));
            assert_eq!(TraceAction::ALL[usize::from(action.code())], action);
        }
        for state in BlockState::ALL {
            let json = serde_json::to_string(&state).unwrap();
            assert_eq!(json, format!("\"{}\"", state.name()));
            assert_eq!(BlockState::from_name(state.name()), Some(state));
        }
    }

    #[test]
    fn pytorch_names_are_pytorchs_only() {
        for action in TraceAction::ALL {
            let back = TraceAction::from_pytorch_name(action.name());
            assert_eq!(back.is_some(), action.is_pytorch(), "{action:?}");
        }
        assert_eq!(TraceAction::from_pytorch_name("cross_stream_wait"), None);
        assert_eq!(
            TraceAction::from_pytorch_name("free_requested"),
            Some(TraceAction::FreeRequested)
        );
    }

    #[test]
    fn handles_serialise_as_integers() {
        let entry = TraceEntry {
            action: TraceAction::Alloc,
            addr: DevicePtr(4096),
            size: 512,
            stream: StreamId(7),
            time_ns: 9,
        };
        let json = serde_json::to_string(&entry).unwrap();
        assert_eq!(
            json,
            r#"{"action":"alloc","addr":4096,"size":512,"stream":7,"time_ns":9}"#
        );
    }
}
