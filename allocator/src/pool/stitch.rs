//! Stitched ranges: free pages scattered over a pool's expandable segments, mapped a second
//! time into one contiguous range of fresh addresses (GMLake's "virtual memory
//! stitching", ASPLOS 2024), so a request that no free block fits is served from memory
//! already mapped instead of from new memory.
//!
//! # Representation
//! A stitch is its own address reservation, mapped with `VirtualMemory::alias_pages` from
//! *sources*: runs of whole mappings (physical allocations) of expandable segments, in the
//! order they appear in the stitched range. The physical pages stay where they are; only a
//! second address reaches them. So a stitch costs no memory, and memory is counted once,
//! where the pages are mapped first (`reserved_bytes` is unchanged by stitching).
//!
//! A stitch is **active** while its range is allocated: it is an arena segment of one
//! allocated block, and each source is a block of its expandable segment in the state
//! [`BlockUse::Lent`](super::arena::BlockUse::Lent), held by no list, so the pages are in
//! use through exactly one address. Freeing the range gives the sources back as free
//! blocks (with the events the range's other streams recorded) and makes the stitch
//! **dormant**: its range stays mapped, and a later request of a fitting size whose
//! sources are all free again takes it whole, lending them again and mapping nothing. A
//! training loop whose step repeats its sizes reaches a steady state that maps nothing.
//!
//! A dormant stitch's range keeps a second mapping of pages that may meanwhile be in use
//! through their first address: nothing touches it until it is revived, and it is unmapped
//! (evicted) before its pages could go back to the device, only once the events recorded
//! at its last free are complete (or after a device-wide synchronisation).
//!
//! This module holds the records and the arithmetic; when to stitch, revive and evict is
//! the allocator's (`allocator::stitch`).

use super::arena::{BlockKey, SegmentKey};
use crate::lifetime::EventKey;
use crate::types::PoolId;
use std::collections::HashMap;
use thin_vec::ThinVec;

/// One run of whole mappings (physical allocations) of an expandable segment that a stitch
/// maps a second time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    /// First byte, page-aligned.
    pub(crate) addr: u64,
    /// Bytes, whole pages.
    pub(crate) len: u64,
    /// The expandable segment the pages belong to.
    pub(crate) segment: SegmentKey,
}

/// A stitched range.
#[derive(Debug)]
pub(crate) struct Stitch {
    /// First byte of the stitched range (its own reservation).
    pub(crate) addr: u64,
    /// Bytes: the sources' sum.
    pub(crate) size: u64,
    /// The memory pool whose pages it maps: a stitch never spans pools.
    pub(crate) memory_pool: PoolId,
    /// Its pages, in the order they appear in the range.
    pub(crate) sources: Vec<Source>,
    /// While active: the lent block of each source, in the same order.
    pub(crate) lent: Vec<BlockKey>,
    /// While dormant: the events recorded at its last free on every stream that used the
    /// range; the range may be unmapped once they are complete.
    pub(crate) last_use: ThinVec<EventKey>,
    /// While dormant: when it was last freed (the table's own clock), to evict the least
    /// recently used first.
    pub(crate) idle_since: u64,
    /// Host time its mapping took (the backend's precise clock, ns): remapping that was
    /// wasted if the range is evicted without ever having been revived.
    pub(crate) map_ns: u64,
    /// It has been revived at least once: its mapping served more than one request.
    pub(crate) revived: bool,
}

/// Active and dormant stitches of one allocator.
#[derive(Debug, Default)]
pub(crate) struct StitchTable {
    /// Active stitches by the arena segment that stands for the allocated range.
    active: HashMap<SegmentKey, Stitch>,
    /// Dormant stitches, oldest first.
    dormant: Vec<Stitch>,
    /// Counts frees, for `idle_since`.
    clock: u64,
}

impl StitchTable {
    /// Registers `stitch` as active, its range allocated as arena segment `segment`.
    pub(crate) fn activate(&mut self, segment: SegmentKey, stitch: Stitch) {
        debug_assert_eq!(stitch.lent.len(), stitch.sources.len());
        self.active.insert(segment, stitch);
    }

    /// The active stitch of arena segment `segment`.
    pub(crate) fn active(&self, segment: SegmentKey) -> Option<&Stitch> {
        self.active.get(&segment)
    }

    /// Every active stitch, by arena segment.
    pub(crate) fn actives(&self) -> impl Iterator<Item = (SegmentKey, &Stitch)> {
        self.active
            .iter()
            .map(|(segment, stitch)| (*segment, stitch))
    }

    /// Takes the active stitch of `segment` out of the table (its range was freed).
    pub(crate) fn deactivate(&mut self, segment: SegmentKey) -> Option<Stitch> {
        self.active.remove(&segment)
    }

    /// Keeps `stitch` (freed, its sources given back) for a later request.
    pub(crate) fn park(&mut self, mut stitch: Stitch) {
        self.clock += 1;
        stitch.idle_since = self.clock;
        stitch.lent.clear();
        self.dormant.push(stitch);
    }

    /// Dormant stitches, oldest first.
    pub(crate) fn dormant(&self) -> &[Stitch] {
        &self.dormant
    }

    /// Takes dormant stitch `index` out of the table (to revive or evict it).
    pub(crate) fn take_dormant(&mut self, index: usize) -> Stitch {
        self.dormant.remove(index)
    }

    /// Indexes of dormant stitches with a source overlapping `[addr, addr + len)`.
    pub(crate) fn dormant_over(&self, addr: u64, len: u64) -> Vec<usize> {
        let end = addr.saturating_add(len);
        self.dormant
            .iter()
            .enumerate()
            .filter(|(_, stitch)| {
                stitch
                    .sources
                    .iter()
                    .any(|s| s.addr < end && addr < s.addr + s.len)
            })
            .map(|(index, _)| index)
            .collect()
    }
}

/// The whole pages of `[addr, addr + size)`: the first page boundary at or above `addr` and
/// the bytes up to the last boundary at or below its end (0 if no whole page fits). The
/// engine reasons in whole mappings (`ExpandableTable::whole_mapping_span`); pages matter
/// where mappings are larger: the out-of-memory report's pages pinned in pieces, and the
/// test harness's pressure floor, which holds under a limit (a page per mapping).
pub(crate) fn whole_pages(addr: u64, size: u64, page: u64) -> (u64, u64) {
    let start = addr.next_multiple_of(page);
    let end = (addr + size) / page * page;
    (start, end.saturating_sub(start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pages_lie_inside_the_range() {
        let page = 2 << 20;
        assert_eq!(whole_pages(0, 4 * page, page), (0, 4 * page));
        assert_eq!(whole_pages(512, 4 * page, page), (page, 3 * page));
        assert_eq!(whole_pages(512, page, page), (page, 0));
        assert_eq!(whole_pages(page - 512, page + 1024, page), (page, page));
    }

    #[test]
    fn dormant_stitches_are_found_by_the_pages_they_map() {
        let mut table = StitchTable::default();
        let stitch = |addr| Stitch {
            addr,
            size: 4 << 20,
            memory_pool: PoolId::DEFAULT,
            sources: vec![
                Source {
                    addr: 0x1000_0000,
                    len: 2 << 20,
                    segment: 0,
                },
                Source {
                    addr,
                    len: 2 << 20,
                    segment: 0,
                },
            ],
            lent: Vec::new(),
            last_use: ThinVec::new(),
            idle_since: 0,
            map_ns: 0,
            revived: false,
        };
        table.park(stitch(0x2000_0000));
        table.park(stitch(0x3000_0000));
        assert_eq!(table.dormant_over(0x1000_0000, 1), [0, 1]);
        assert_eq!(table.dormant_over(0x3000_0000 + (1 << 20), 4096), [1]);
        assert!(table.dormant_over(0x3000_0000 + (2 << 20), 4096).is_empty());
        assert_eq!(table.dormant()[1].idle_since, 2);
        assert_eq!(table.take_dormant(0).addr, 0x2000_0000);
        assert_eq!(table.dormant().len(), 1);
    }
}
