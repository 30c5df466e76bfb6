//! Expandable segments: one large address-space reservation per stream and pool, with
//! physical pages mapped where blocks need them and unmapped where none do.
//!
//! A classic segment is obtained whole and returned whole, so one live block keeps the
//! entire segment reserved, and a request that fits no free block costs a new segment even
//! when the free bytes exist, scattered. With virtual memory (CUDA's VMM API, modelled by
//! the simulator) the engine instead reserves addresses once and maps 2 MiB pages on
//! demand: reserved memory follows the pages that live blocks touch, not the segments they
//! happen to sit in.
//!
//! # Representation
//! An expandable segment is an ordinary arena segment whose size is the whole reservation,
//! tiled by blocks as usual. Its unmapped stretches are blocks too, marked
//! [`Block::unmapped`](super::arena::Block::unmapped): always free, page-aligned, a
//! multiple of the page size, carrying no events, in no free list, never adjacent to one
//! another, and indexed here by address. Every other block of the segment lies on mapped
//! pages. So
//!
//! `mapped bytes of a segment == segment.size − Σ unmapped block sizes`,
//!
//! and the allocator's `reserved_bytes` counts mapped bytes for expandable segments
//! (address space costs no memory). A page is shared by the blocks that overlap it; it can
//! be unmapped only when one free block covers it whole.
//!
//! The policy (when to map, when to unmap and how to make unmapping safe across streams)
//! lives in the allocator; this module holds only the index and the page arithmetic.

use super::arena::{BlockKey, SegmentKey, StreamSlot};
use crate::types::PoolKind;
use std::collections::{BTreeMap, HashMap};

/// The expandable segments of one allocator.
#[derive(Debug)]
pub(crate) struct ExpandableTable {
    /// Mapping granularity ([`crate::Backend::page_size`]), a power of two.
    pub(crate) page: u64,
    /// Size of each address reservation, a multiple of `page`.
    pub(crate) reservation: u64,
    /// The segment serving each (stream, pool).
    by_owner: HashMap<(StreamSlot, PoolKind), SegmentKey>,
    /// Per segment: unmapped blocks by address.
    unmapped: HashMap<SegmentKey, BTreeMap<u64, BlockKey>>,
    /// Bytes mapped over all expandable segments (part of `reserved_bytes`).
    pub(crate) mapped: u64,
    /// The most bytes live (allocated plus the request) at any growth: the live peak that
    /// reclaiming is measured against.
    pub(crate) live_peak_at_growth: u64,
}

impl ExpandableTable {
    /// A table for pages of `page` bytes and reservations of at least `reservation` bytes.
    pub(crate) fn new(page: u64, reservation: u64) -> Self {
        debug_assert!(page.is_power_of_two());
        Self {
            page,
            reservation: reservation.max(page).div_ceil(page) * page,
            by_owner: HashMap::new(),
            unmapped: HashMap::new(),
            mapped: 0,
            live_peak_at_growth: 0,
        }
    }

    /// The segment that serves `stream` in `pool`, if made.
    pub(crate) fn segment_of(&self, stream: StreamSlot, pool: PoolKind) -> Option<SegmentKey> {
        self.by_owner.get(&(stream, pool)).copied()
    }

    /// Registers a new segment for `(stream, pool)`, wholly unmapped as block `head`.
    pub(crate) fn add(
        &mut self,
        stream: StreamSlot,
        pool: PoolKind,
        segment: SegmentKey,
        addr: u64,
        head: BlockKey,
    ) {
        self.by_owner.insert((stream, pool), segment);
        self.unmapped.entry(segment).or_default().insert(addr, head);
    }

    /// Forgets a segment (its reservation was released).
    pub(crate) fn remove(&mut self, segment: SegmentKey) {
        self.by_owner.retain(|_, s| *s != segment);
        self.unmapped.remove(&segment);
    }

    /// Every expandable segment.
    pub(crate) fn segments(&self) -> impl Iterator<Item = SegmentKey> + '_ {
        self.unmapped.keys().copied()
    }

    /// True if `segment` is expandable.
    pub(crate) fn contains(&self, segment: SegmentKey) -> bool {
        self.unmapped.contains_key(&segment)
    }

    /// Unmapped blocks of `segment`, by address.
    pub(crate) fn unmapped(&self, segment: SegmentKey) -> &BTreeMap<u64, BlockKey> {
        &self.unmapped[&segment]
    }

    /// Mutable access to the unmapped blocks of `segment`.
    pub(crate) fn unmapped_mut(&mut self, segment: SegmentKey) -> &mut BTreeMap<u64, BlockKey> {
        self.unmapped.get_mut(&segment).expect("expandable segment")
    }

    /// The whole pages inside `[addr, addr + size)`, as `(first byte, bytes)`, if any.
    #[inline]
    pub(crate) fn whole_pages(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let start = addr.div_ceil(self.page) * self.page;
        let end = (addr + size) / self.page * self.page;
        (end > start).then_some((start, end - start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pages_rounds_inward() {
        let table = ExpandableTable::new(2 << 20, 5 << 20);
        assert_eq!(table.reservation, 6 << 20);
        let mib = 1 << 20;
        assert_eq!(table.whole_pages(mib, 4 * mib), Some((2 * mib, 2 * mib)));
        assert_eq!(table.whole_pages(mib, 2 * mib), None);
        assert_eq!(table.whole_pages(0, 4 * mib), Some((0, 4 * mib)));
        assert_eq!(table.whole_pages(512, 4 * mib), Some((2 * mib, 2 * mib)));
    }
}
