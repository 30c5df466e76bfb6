//! A bounded ring of allocator events: the raw material of snapshots and the viewer.
//!
//! Every state change the engine makes (a block handed out or returned, a segment
//! obtained or released, a cross-stream wait, an out-of-memory) is pushed here with a
//! timestamp from [`crate::backend::Clock::now_ticks`], converted to nanoseconds by
//! [`crate::backend::Clock::ticks_to_ns`] when the ring is read. The ring has a fixed capacity set by
//! `trace_capacity` in the configuration: when full, the oldest record is overwritten and
//! counted in [`TraceRing::dropped`], so tracing never grows memory and never fails.
//!
//! # Record format
//! One [`TraceEntry`] per event: `action`, `addr`, `size`, `stream`, `time_ns`. The action
//! names are PyTorch's (`alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`, `segment_map`, `segment_unmap`, `oom`) plus streamalloc's own
//! (`cross_stream_wait`, `staging_acquire`, `staging_release`, `empty_cache`), so `viz/`
//! can write both PyTorch-compatible pickles and our JSON from the same records. Both
//! types are defined in `streamalloc-records`, which the formats share, and re-exported
//! here.
//!
//! # The engine's ring
//! The allocator keeps a `CompactRing` rather than a [`TraceRing`]: its records hold the
//! stream's slot in the allocator's stream table instead of the 64-bit handle, and a free
//! that completes at once (no other stream used the block) is one record standing for both
//! `free_requested` and `free_completed` at the same instant. A same-stream malloc+free pair
//! thus costs two 32-byte records and two clock reads instead of three 40-byte entries.
//! Records keep the clock's raw ticks (on the CUDA backend the time-stamp counter as read):
//! the conversion to nanoseconds, a 128-bit multiply per entry, is paid when the ring is
//! read rather than on every operation.
//! Records are expanded back into [`TraceEntry`]s when read, and capacity and `dropped`
//! still count entries, so snapshots see exactly what a [`TraceRing`] of the same capacity
//! fed the expanded entries would hold (the property test below checks this).
//!
//! Pushes land first in a small staging array (`STAGED` records, 2 KiB, reused every 64
//! events and so kept in cache) and move into the ring 64 at a time, or when the ring is
//! read. Why: the ring (2 MiB at the default capacity) writes each of its lines once a lap,
//! so every line it writes is cold, and a miss taken under the engine's lock stalls the
//! caller; moved 64 at a time, the misses overlap. Measured on the GPU host, builds side
//! by side: PyTorch's Python alloc/free loop 1397 → 1349 ns per operation, a tight C loop
//! 139 → 145, both within that shared host's noise (`benches/gpu/results.md`).
//!
//! The ring keeps the newest `capacity` records, which stand for at least `capacity`
//! entries once it has wrapped, and a read keeps the newest `capacity` of their entries.
//! So a move is a plain copy that never reads the records it overwrites (reading them, to
//! count the entries lost, cost a cold line every two records).
//!
//! Fast-path records carry a time read before the engine's lock was taken (the read then
//! overlaps the lock's atomic instruction), so a thread that read the clock first may push
//! last: pushes clamp each time to the newest one, and the ring reads back in time order
//! (ticks are monotonic, and so is their conversion).

use crate::types::{DevicePtr, StreamId};
pub use streamalloc_records::{TraceAction, TraceEntry};

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

// ---- The engine's compact ring ---------------------------------------------------------

/// The slot recorded for an event that concerns no registered stream; read back as
/// `StreamId(0)`.
pub(crate) const NO_STREAM: u32 = u32::MAX;

/// One record of a [`CompactRing`]: one entry, or two for a free completed at once.
/// Aligned to its size, so that writing one touches a single cache line.
#[derive(Clone, Copy, Debug)]
#[repr(align(32))]
struct Record {
    addr: u64,
    size: u64,
    /// The backend clock's raw reading ([`crate::backend::Clock::now_ticks`]).
    ticks: u64,
    /// The stream's slot in the allocator's stream table, or [`NO_STREAM`].
    slot: u32,
    /// What happened; `FreeRequested` for a completed free.
    action: TraceAction,
    /// A `free_requested` followed by its `free_completed` at the same instant: two entries.
    completed: bool,
}

const _: () = assert!(std::mem::size_of::<Record>() == 32);

impl Record {
    /// Filler for unused staging slots.
    const EMPTY: Record = Record {
        addr: 0,
        size: 0,
        ticks: 0,
        slot: NO_STREAM,
        action: TraceAction::Alloc,
        completed: false,
    };

    /// Entries this record stands for.
    #[inline]
    fn weight(&self) -> u64 {
        1 + u64::from(self.completed)
    }
}

/// Records a [`CompactRing`] stages before moving them into its ring (see the module docs):
/// 2 KiB, a few cache lines that stay warm.
const STAGED: usize = 64;

/// The allocator's trace ring: [`TraceRing`]'s semantics (capacity and `dropped` count
/// entries; the oldest entries go first) over compact records, trimmed to `capacity`
/// entries when read. See the module docs.
#[derive(Debug)]
pub(crate) struct CompactRing {
    /// A circular buffer of records. Grows on demand up to `capacity` slots (a large ring
    /// costs nothing until used); once full, `records[next]` is the oldest.
    records: Vec<Record>,
    /// Where the next record goes once the buffer is full (0 until then).
    next: usize,
    /// The newest records, not yet in `records`: `staged[..staged_len]`, oldest first.
    staged: Box<[Record; STAGED]>,
    staged_len: usize,
    /// Ticks of the newest record pushed.
    newest_ticks: u64,
    /// Entries pushed since creation, staged ones included.
    pushed: u64,
    /// Maximum number of entries kept.
    capacity: usize,
}

impl CompactRing {
    /// A ring keeping at most `capacity` entries; 0 records nothing.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            records: Vec::new(),
            next: 0,
            staged: Box::new([Record::EMPTY; STAGED]),
            staged_len: 0,
            newest_ticks: 0,
            pushed: 0,
            capacity,
        }
    }

    /// True if the ring records anything.
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.capacity != 0
    }

    /// Appends one entry for the stream in `slot` (or [`NO_STREAM`]), at the clock reading
    /// `ticks`.
    #[inline]
    pub(crate) fn push(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        slot: u32,
        ticks: u64,
    ) {
        self.push_record(Record {
            addr,
            size,
            ticks,
            slot,
            action,
            completed: false,
        });
    }

    /// Appends `free_requested` then `free_completed` for the same block at the same
    /// instant, as one record.
    #[inline]
    pub(crate) fn push_free_completed(&mut self, addr: u64, size: u64, slot: u32, ticks: u64) {
        self.push_record(Record {
            addr,
            size,
            ticks,
            slot,
            action: TraceAction::FreeRequested,
            completed: true,
        });
    }

    #[inline(always)]
    fn push_record(&mut self, mut record: Record) {
        if self.capacity == 0 {
            return;
        }
        // Fast-path times are read before the lock: keep the ring's times in its order.
        record.ticks = record.ticks.max(self.newest_ticks);
        self.newest_ticks = record.ticks;
        self.pushed += record.weight();
        // One comparison for both the full staging array and the index's bounds.
        if let Some(slot) = self.staged.get_mut(self.staged_len) {
            *slot = record;
            self.staged_len += 1;
        } else {
            self.flush();
            self.staged[0] = record;
            self.staged_len = 1;
        }
    }

    /// Copies the staged records into the ring, oldest first, over its oldest records.
    #[inline(never)]
    fn flush(&mut self) {
        let staged = std::mem::take(&mut self.staged_len);
        let mut batch = &self.staged[..staged];
        // Only the newest `capacity` records can hold kept entries.
        if batch.len() > self.capacity {
            batch = &batch[batch.len() - self.capacity..];
        }
        while !batch.is_empty() {
            let room = self.capacity - self.records.len();
            let (now, later) = if room > 0 {
                // Still growing: append.
                let (now, later) = batch.split_at(room.min(batch.len()));
                self.records.extend_from_slice(now);
                (now, later)
            } else {
                let (now, later) = batch.split_at((self.capacity - self.next).min(batch.len()));
                self.records[self.next..self.next + now.len()].copy_from_slice(now);
                self.next += now.len();
                (now, later)
            };
            debug_assert!(!now.is_empty());
            if self.next == self.capacity {
                self.next = 0;
            }
            batch = later;
        }
    }

    /// The records, oldest first.
    fn ordered(&self) -> impl Iterator<Item = &Record> {
        let (newer, older) = self.records.split_at(self.next);
        older.iter().chain(newer.iter())
    }

    /// Entries the records in the ring stand for.
    fn held(&self) -> u64 {
        self.records.iter().map(Record::weight).sum()
    }

    /// Ticks of the newest entry (0 if none).
    #[cfg(test)]
    fn last_ticks(&mut self) -> u64 {
        self.flush();
        self.ordered().last().map_or(0, |record| record.ticks)
    }

    /// The newest `capacity` entries, oldest first, with each slot turned into its stream
    /// by `stream` ([`NO_STREAM`] becomes `StreamId(0)`) and each reading into nanoseconds
    /// by `ticks_to_ns`.
    pub(crate) fn entries(
        &mut self,
        stream: impl Fn(u32) -> StreamId,
        ticks_to_ns: impl Fn(u64) -> u64,
    ) -> Vec<TraceEntry> {
        self.flush();
        let held = self.held();
        // Entries of the oldest records beyond `capacity` were overwritten in a ring of
        // entries; a completed free may lose its `free_requested` half alone.
        let mut skip = held.saturating_sub(self.capacity as u64);
        let mut out = Vec::with_capacity((held - skip) as usize);
        for record in self.ordered() {
            let entry = TraceEntry {
                action: record.action,
                addr: DevicePtr(record.addr),
                size: record.size,
                stream: if record.slot == NO_STREAM {
                    StreamId(0)
                } else {
                    stream(record.slot)
                },
                time_ns: ticks_to_ns(record.ticks),
            };
            if skip > 0 {
                skip -= 1;
            } else {
                out.push(entry);
            }
            if record.completed {
                if skip > 0 {
                    skip -= 1;
                } else {
                    out.push(TraceEntry {
                        action: TraceAction::FreeCompleted,
                        ..entry
                    });
                }
            }
        }
        debug_assert_eq!(out.len() as u64, held.min(self.capacity as u64));
        out
    }

    /// Entries lost to overwriting since creation.
    pub(crate) fn dropped(&mut self) -> u64 {
        self.flush();
        self.pushed - self.held().min(self.capacity as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A clock whose tick is a nanosecond, as the simulator's.
    fn same(ticks: u64) -> u64 {
        ticks
    }

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

    #[test]
    fn compact_ring_expands_completed_frees_and_drops_half_records() {
        let stream = |slot: u32| StreamId(100 + u64::from(slot));
        let mut ring = CompactRing::new(3);
        ring.push(TraceAction::Alloc, 0x10, 512, 0, 1);
        ring.push_free_completed(0x10, 512, 0, 2);
        let actions: Vec<_> = ring
            .entries(stream, same)
            .iter()
            .map(|e| e.action)
            .collect();
        assert_eq!(
            actions,
            [
                TraceAction::Alloc,
                TraceAction::FreeRequested,
                TraceAction::FreeCompleted
            ]
        );
        assert_eq!(ring.entries(stream, same)[2].stream, StreamId(100));
        assert_eq!(ring.entries(stream, same)[2].time_ns, 2);
        // One more entry pushes out the alloc; two more, the free_requested half too.
        ring.push(TraceAction::Oom, 0, 7, NO_STREAM, 3);
        ring.push(TraceAction::Alloc, 0x20, 512, 1, 4);
        let entries = ring.entries(stream, same);
        let actions: Vec<_> = entries.iter().map(|e| e.action).collect();
        assert_eq!(
            actions,
            [
                TraceAction::FreeCompleted,
                TraceAction::Oom,
                TraceAction::Alloc
            ]
        );
        assert_eq!(entries[1].stream, StreamId(0));
        assert_eq!(entries[2].stream, StreamId(101));
        assert_eq!(ring.dropped(), 2);
        assert_eq!(ring.last_ticks(), 4);
    }

    /// Fast-path times are read before the engine's lock, so a thread that read the clock
    /// first may push last: the ring still reads back in non-decreasing time.
    #[test]
    fn compact_ring_times_never_go_backwards() {
        let mut ring = CompactRing::new(16);
        for (i, time) in [5u64, 3, 9, 7, 7, 12, 1].into_iter().enumerate() {
            if i % 2 == 0 {
                ring.push(TraceAction::Alloc, i as u64, 512, 0, time);
            } else {
                ring.push_free_completed(i as u64, 512, 0, time);
            }
        }
        let times: Vec<u64> = ring
            .entries(|_| StreamId(1), same)
            .iter()
            .map(|e| e.time_ns)
            .collect();
        assert_eq!(times, [5, 5, 5, 9, 9, 9, 9, 12, 12, 12]);
    }

    /// Records keep the clock's raw reading; the conversion applies when the ring is read,
    /// to every entry, the completion half of a free included.
    #[test]
    fn compact_ring_converts_ticks_to_ns_when_read() {
        let mut ring = CompactRing::new(8);
        ring.push(TraceAction::Alloc, 0x10, 512, 0, 1_000);
        ring.push_free_completed(0x10, 512, 0, 1_250);
        assert_eq!(ring.last_ticks(), 1_250);
        let ticks_to_ns = |ticks: u64| (ticks - 1_000) * 3;
        let times: Vec<u64> = ring
            .entries(|_| StreamId(1), ticks_to_ns)
            .iter()
            .map(|e| e.time_ns)
            .collect();
        assert_eq!(times, [0, 750, 750]);
    }

    #[test]
    fn compact_ring_of_one_keeps_the_completion() {
        let mut ring = CompactRing::new(1);
        ring.push_free_completed(0x10, 512, 0, 9);
        let entries = ring.entries(|_| StreamId(5), same);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].action, TraceAction::FreeCompleted);
        assert_eq!(ring.dropped(), 1);
        assert!(!CompactRing::new(0).enabled());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Whatever is pushed, the compact ring reads back exactly what a [`TraceRing`] of
        /// the same capacity holds when fed the expanded entries: same entries, same
        /// `dropped`, same newest time. Reads come at random points (one push in 40 or so),
        /// so staged records move into the ring in batches of every size, wrapping included.
        #[test]
        fn compact_ring_matches_the_entry_ring(
            capacity in prop_oneof![0usize..8, 8usize..64, 64usize..300],
            pushes in proptest::collection::vec(
                (any::<bool>(), 0u32..4, 0u64..1000, proptest::bool::weighted(0.025)),
                0..700,
            ),
        ) {
            let stream = |slot: u32| StreamId(7 + u64::from(slot));
            let mut compact = CompactRing::new(capacity);
            let mut model = TraceRing::new(capacity);
            for (i, (completed, slot, size, read)) in pushes.into_iter().enumerate() {
                let (addr, time_ns) = (0x1000 + i as u64 * 512, i as u64);
                let slot = if slot == 3 { NO_STREAM } else { slot };
                let id = if slot == NO_STREAM { StreamId(0) } else { stream(slot) };
                let entry = |action| TraceEntry {
                    action,
                    addr: DevicePtr(addr),
                    size,
                    stream: id,
                    time_ns,
                };
                if completed {
                    compact.push_free_completed(addr, size, slot, time_ns);
                    model.push(entry(TraceAction::FreeRequested));
                    model.push(entry(TraceAction::FreeCompleted));
                } else {
                    compact.push(TraceAction::SegmentAlloc, addr, size, slot, time_ns);
                    model.push(entry(TraceAction::SegmentAlloc));
                }
                if read {
                    prop_assert_eq!(compact.dropped(), model.dropped());
                    prop_assert_eq!(compact.last_ticks(), model.last_time_ns());
                }
            }
            let expected: Vec<TraceEntry> = model.entries().copied().collect();
            prop_assert_eq!(compact.entries(stream, same), expected);
            prop_assert_eq!(compact.dropped(), model.dropped());
        }
    }
}
