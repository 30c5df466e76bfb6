//! A bounded ring of allocator events: the raw material of snapshots and the viewer.
//!
//! Every state change the engine makes (a block handed out or returned, a segment
//! obtained or released, a cross-stream wait, an out-of-memory) is pushed here with a
//! timestamp from [`crate::Backend::now_ns`]. The ring has a fixed capacity set by
//! `trace_capacity` in the configuration: when full, the oldest record is overwritten and
//! counted in [`TraceRing::dropped`], so tracing never grows memory and never fails.
//!
//! # Record format
//! One [`TraceEntry`] per event: `action`, `addr`, `size`, `stream`, `time_ns`. The action
//! names are PyTorch's (`alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`, `segment_map`, `segment_unmap`, `oom`) plus streamalloc's own
//! (`cross_stream_wait`, `staging_acquire`, `staging_release`, `empty_cache`), so `viz/`
//! can write both PyTorch-compatible pickles and our JSON from the same records.

use crate::types::{DevicePtr, StreamId};
use serde::{Deserialize, Serialize};

/// What happened. Serialised in snake_case, matching PyTorch's trace action names where
/// PyTorch has one.
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
    /// A stream was made to wait on the device for another stream's event, so that a block
    /// could be reused: `stream` is the waiting stream, `addr`/`size` the block.
    CrossStreamWait,
    /// A staging buffer was taken from the pool.
    StagingAcquire,
    /// A staging buffer was returned.
    StagingRelease,
    /// Cached memory was returned to the device (`addr`/`size` are 0 / bytes released).
    EmptyCache,
}

impl TraceAction {
    /// The action's name as written in traces (`"free_requested"`).
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
            TraceAction::CrossStreamWait => "cross_stream_wait",
            TraceAction::StagingAcquire => "staging_acquire",
            TraceAction::StagingRelease => "staging_release",
            TraceAction::EmptyCache => "empty_cache",
        }
    }
}

/// One recorded event.
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

/// The fixed-capacity ring. Capacity 0 turns tracing off at the cost of one branch.
#[derive(Debug)]
pub struct TraceRing {
    /// Grows on demand up to `capacity` (a large ring costs nothing until used), then is
    /// overwritten in place: `entries[next]` is the oldest entry once full.
    entries: Vec<TraceEntry>,
    /// Where the next entry goes once the ring is full.
    next: usize,
    /// Maximum number of entries kept.
    capacity: usize,
    /// Entries overwritten because the ring was full.
    dropped: u64,
}

impl TraceRing {
    /// A ring keeping at most `capacity` entries.
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Vec::new(),
            next: 0,
            capacity,
            dropped: 0,
        }
    }

    /// Appends an entry, overwriting the oldest one when full.
    #[inline]
    pub fn push(&mut self, entry: TraceEntry) {
        if self.entries.len() < self.capacity {
            self.entries.push(entry);
        } else if self.capacity != 0 {
            self.entries[self.next] = entry;
            self.next += 1;
            if self.next == self.capacity {
                self.next = 0;
            }
            self.dropped += 1;
        }
    }

    /// True if the ring records anything.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.capacity != 0
    }

    /// Time of the newest entry (0 if none).
    #[inline]
    pub fn last_time_ns(&self) -> u64 {
        let newest = if self.entries.len() < self.capacity || self.next == 0 {
            self.entries.last()
        } else {
            self.entries.get(self.next - 1)
        };
        newest.map_or(0, |entry| entry.time_ns)
    }

    /// The entries, oldest first.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = &TraceEntry> {
        let (newer, older) = self.entries.split_at(self.next);
        OrderedEntries {
            iter: older.iter().chain(newer.iter()),
            len: self.entries.len(),
        }
    }

    /// Entries lost to overwriting since creation.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Maximum number of entries kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// The ring's entries in age order (the chain of its two halves, with a known length).
struct OrderedEntries<I> {
    iter: I,
    len: usize,
}

impl<'a, I: Iterator<Item = &'a TraceEntry>> Iterator for OrderedEntries<I> {
    type Item = &'a TraceEntry;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.iter.next()?;
        self.len -= 1;
        Some(item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.len, Some(self.len))
    }
}

impl<'a, I: Iterator<Item = &'a TraceEntry>> ExactSizeIterator for OrderedEntries<I> {}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> TraceEntry {
        TraceEntry {
            action: TraceAction::Alloc,
            addr: DevicePtr(i),
            size: i,
            stream: StreamId(0),
            time_ns: i,
        }
    }

    #[test]
    fn ring_keeps_the_newest_entries_and_counts_the_dropped() {
        let mut ring = TraceRing::new(3);
        for i in 0..5 {
            ring.push(entry(i));
        }
        let kept: Vec<u64> = ring.entries().map(|e| e.size).collect();
        assert_eq!(kept, vec![2, 3, 4]);
        assert_eq!(ring.dropped(), 2);
        assert_eq!(ring.last_time_ns(), 4);
        assert_eq!(ring.entries().len(), 3);
        ring.push(entry(5));
        ring.push(entry(6));
        let kept: Vec<u64> = ring.entries().map(|e| e.size).collect();
        assert_eq!(kept, vec![4, 5, 6]);
        assert_eq!(ring.last_time_ns(), 6);
    }

    #[test]
    fn zero_capacity_records_nothing() {
        let mut ring = TraceRing::new(0);
        ring.push(entry(1));
        assert_eq!(ring.entries().len(), 0);
        assert!(!ring.enabled());
    }
}
