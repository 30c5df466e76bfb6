//! Expandable segments: one large address-space reservation per stream and pool, with
//! physical pages mapped where blocks need them and unmapped where none do.
//!
//! A classic segment is obtained whole and returned whole, so one live block keeps the
//! entire segment reserved, and a request that fits no free block costs a new segment even
//! when the free bytes exist, scattered. With virtual memory (CUDA's VMM API, modelled by
//! the simulator) the engine instead reserves addresses once and maps physical memory on
//! demand, in mappings of whole pages (2 MiB) of at most [`MAP_CHUNK`] bytes each: reserved
//! memory follows the mappings that live blocks touch, not the segments they happen to
//! sit in.
//!
//! # Representation
//! An expandable segment is an ordinary arena segment whose size is the whole reservation,
//! tiled by blocks as usual. Its unmapped stretches are blocks too, marked
//! [`BlockUse::Unmapped`](super::arena::BlockUse::Unmapped): always free, page-aligned, a
//! multiple of the page size, carrying no events, in no free list, never adjacent to one
//! another, and indexed here by address. Every other block of the segment lies on mapped
//! pages. So
//!
//! `mapped bytes of a segment == segment.size − Σ unmapped block sizes`,
//!
//! and the allocator's `reserved_bytes` counts mapped bytes for expandable segments
//! (address space costs no memory). A mapping is one physical allocation, shared by the
//! blocks that overlap it; like `cuMemUnmap`, the engine unmaps only whole mappings, and
//! only when one free block covers them.
//!
//! The policy (when to map, when to unmap and how to make unmapping safe across streams)
//! lives in the allocator; this module holds only the indexes and the arithmetic. The
//! arena does not know the page size, so the index checks (in debug builds) that what it
//! indexes as unmapped is whole pages.

use super::arena::{BlockKey, SegmentKey, StreamSlot};
use crate::types::PoolKind;
use std::collections::{BTreeMap, HashMap};

/// The most bytes one mapping (one physical allocation) covers. Each mapping costs about
/// as much as the next whatever its size (measured on an H200: creating, mapping, granting
/// access to, unmapping and releasing a 2 MiB page took ~80 µs, the same for a 512 MiB
/// allocation ~2 µs per 2 MiB), so mapping page by page made remapping dominate step time.
/// But only a whole mapping can be unmapped, so huge ones would keep memory that small
/// live blocks pin. On the replays (GPT-2, ResNet-50, BERT, `--steps 3`) 128 MiB gave the
/// lowest ratios with no remapping in the steady state (2 MiB: 1.049 / 1.061 / 1.017 with
/// ~700 maps a GPT-2 step; 128 MiB: 1.009 / 1.040 / 1.020 with none).
pub(crate) const MAP_CHUNK: u64 = 128 << 20;

/// Mappings are at most the live peak divided by this (see [`ExpandableTable::chunk`]).
/// Replayed with `--steps 3` (peak reserved / peak live), with the last page of each
/// mapping run on its own (see [`ExpandableTable::pieces`]): a 64th gave 1.049 on the
/// KV-cache generation trace, a 256th 1.036 (a 32nd without the separate last page: 1.102),
/// the training traces (GPT-2, ResNet-50, BERT with varying length) within 0.002 of one
/// another and mapping nothing in their last step either way. Below a 1 GiB peak a 256th is
/// one page: what generation needs, since its live blocks move every request; above it,
/// mappings stay 4–128 MiB and a GPT-2 step maps 1.5k times while warming up (~0.1 s on an
/// H200) and never after.
const MAP_PEAK_FRACTION: u64 = 256;

/// A run of pages mapped for one request is cut into at most about this many pieces (and
/// the last page), however small [`ExpandableTable::chunk`] is. On the replays (`--steps 3`)
/// a 16th kept every ratio of pieces sized by the peak alone and mapped 13–22% less (GPT-2
/// 1,451 mappings instead of 1,671); an 8th or a 4th raised the generation trace to 1.040 /
/// 1.043, and a 4th made the BERT trace remap in its last step.
const RUN_PIECES: u64 = 16;

/// The largest power of two not above `bytes` (1 for 0).
fn pow2_floor(bytes: u64) -> u64 {
    1u64 << (63 - bytes.max(1).leading_zeros())
}

/// The expandable segments of one allocator.
#[derive(Debug)]
pub(crate) struct ExpandableTable {
    /// Mapping granularity ([`crate::Backend::page_size`]), a power of two.
    pub(crate) page: u64,
    /// Size of each address reservation, a multiple of `page`.
    pub(crate) reservation: u64,
    /// The segments serving each (stream, pool), the first reserved first. A stream has one
    /// until, under a memory limit, no unmapped stretch of its reservations holds a request
    /// that the limit has room for: a second reservation then gives the contiguous room
    /// (address space costs no memory).
    by_owner: HashMap<(StreamSlot, PoolKind), Vec<SegmentKey>>,
    /// Per segment: unmapped blocks by address.
    unmapped: HashMap<SegmentKey, BTreeMap<u64, BlockKey>>,
    /// Bytes mapped over all expandable segments (part of `reserved_bytes`).
    pub(crate) mapped: u64,
    /// The most bytes live (allocated plus the request) at any growth: the live peak that
    /// reclaiming is measured against.
    pub(crate) live_peak_at_growth: u64,
    /// How far (in 1/10,000) mapping may go past the live peak before a reclaim.
    pub(crate) slack_bp: u64,
    /// Host time (the backend's precise clock, ns) when the first reservation was made:
    /// remapping is measured against the time since.
    pub(crate) clock_start_ns: Option<u64>,
    /// Host time spent remapping memory that is already reserved: reclaims (unmapping,
    /// and mapping right after) and stitches evicted without ever having been revived
    /// (mapping free pages a second time, and unmapping them again).
    pub(crate) remap_ns: u64,
    /// Every mapping (one physical allocation each): address → bytes. Unmapping must take
    /// whole mappings (`cuMemUnmap`'s rule).
    mappings: BTreeMap<u64, u64>,
    /// Every page is its own physical allocation (`VirtualMemory::set_page_allocations`), so any
    /// whole free page can be unmapped (or stitched) alone: on while a memory limit is in
    /// force, or once the device refused memory. Off, runs are mapped in pieces of up to
    /// [`ExpandableTable::chunk`], and stitches take whole pieces.
    pub(crate) page_granular: bool,
    /// The pieces each growth would be mapped in without [`ExpandableTable::page_granular`]
    /// (the same as `mappings` while it is off): address → bytes. While memory is
    /// plentiful, stitching takes these whole whatever the mode, so that a limit far from
    /// binding changes no choice (pages alone, it took holes that best fit fills again in
    /// the next step). A piece loses its entry once any of its pages is unmapped.
    growth_pieces: BTreeMap<u64, u64>,
}

impl ExpandableTable {
    /// A table for pages of `page` bytes and reservations of at least `reservation` bytes,
    /// reclaiming first at `slack_bp` (1/10,000) past the live peak.
    pub(crate) fn new(page: u64, reservation: u64, slack_bp: u64) -> Self {
        debug_assert!(page.is_power_of_two());
        Self {
            page,
            reservation: reservation.max(page).div_ceil(page) * page,
            by_owner: HashMap::new(),
            unmapped: HashMap::new(),
            mapped: 0,
            live_peak_at_growth: 0,
            slack_bp,
            clock_start_ns: None,
            remap_ns: 0,
            mappings: BTreeMap::new(),
            page_granular: false,
            growth_pieces: BTreeMap::new(),
        }
    }

    /// The first segment that serves `stream` in `pool`, if made.
    pub(crate) fn segment_of(&self, stream: StreamSlot, pool: PoolKind) -> Option<SegmentKey> {
        self.segments_of(stream, pool).first().copied()
    }

    /// Every segment that serves `stream` in `pool`, the first reserved first.
    pub(crate) fn segments_of(&self, stream: StreamSlot, pool: PoolKind) -> &[SegmentKey] {
        self.by_owner
            .get(&(stream, pool))
            .map_or(&[], |segments| segments.as_slice())
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
        debug_assert!(
            addr.is_multiple_of(self.page),
            "reservation at {addr:#x} is not page-aligned"
        );
        self.by_owner
            .entry((stream, pool))
            .or_default()
            .push(segment);
        self.unmapped.entry(segment).or_default().insert(addr, head);
    }

    /// Forgets a segment (its reservation was released).
    pub(crate) fn remove(&mut self, segment: SegmentKey) {
        self.by_owner.retain(|_, segments| {
            segments.retain(|&s| s != segment);
            !segments.is_empty()
        });
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

    /// Indexes the unmapped block `key` of `size` bytes at `addr` in `segment`, or updates
    /// the entry of the block there (one that grew by a merge). Unmapped stretches are
    /// whole pages: checked here, where the page size is known.
    pub(crate) fn index_unmapped(
        &mut self,
        segment: SegmentKey,
        addr: u64,
        size: u64,
        key: BlockKey,
    ) {
        debug_assert!(
            addr.is_multiple_of(self.page) && size.is_multiple_of(self.page) && size > 0,
            "unmapped block {key} at {addr:#x} of {size:#x} bytes is not whole pages"
        );
        let holes = self.unmapped.get_mut(&segment).expect("expandable segment");
        let before = holes.insert(addr, key);
        debug_assert!(
            before.is_none_or(|before| before == key),
            "unmapped block {key} indexed over block {before:?} at {addr:#x}"
        );
    }

    /// Forgets the unmapped block at `addr` in `segment` (mapped, or merged into the one
    /// below).
    pub(crate) fn unindex_unmapped(&mut self, segment: SegmentKey, addr: u64) {
        let holes = self.unmapped.get_mut(&segment).expect("expandable segment");
        let removed = holes.remove(&addr);
        debug_assert!(removed.is_some(), "no unmapped block indexed at {addr:#x}");
    }

    /// The most bytes one mapping may cover now: a 256th of the live peak (a power of two
    /// of pages), between one page and [`MAP_CHUNK`]. A mapping is unmapped only whole,
    /// so a live block can pin up to a mapping of free memory around it: sized to the peak,
    /// that stays a small fraction of it on small workloads, while large ones keep large
    /// mappings and few driver calls.
    pub(crate) fn chunk(&self) -> u64 {
        pow2_floor(self.live_peak_at_growth / MAP_PEAK_FRACTION)
            .clamp(self.page, MAP_CHUNK.max(self.page))
    }

    /// The pieces in which to map the whole pages `[addr, addr + size)`: one physical
    /// allocation each, of at most [`ExpandableTable::chunk`] bytes, and the last page on
    /// its own. The block that causes a mapping covers all of it but the end of its last
    /// page, where the remainder of the block's free neighbour begins: the next small
    /// request lands there. Mapped on its own, that page is all such a request pins, so the
    /// rest can be unmapped once the large block is freed.
    /// With [`ExpandableTable::page_granular`] the run is one call: the backend backs each
    /// page with its own allocation and grants access to the run at once.
    pub(crate) fn pieces(&self, addr: u64, size: u64) -> impl Iterator<Item = (u64, u64)> {
        self.pieces_as(addr, size, self.page_granular)
    }

    /// [`ExpandableTable::pieces`] with `page_granular` given (off for memory mapped whole
    /// whatever the table's mode: a tagged pool's, see `allocator::sleep`).
    pub(crate) fn pieces_as(
        &self,
        addr: u64,
        size: u64,
        page_granular: bool,
    ) -> impl Iterator<Item = (u64, u64)> {
        debug_assert!(addr.is_multiple_of(self.page) && size.is_multiple_of(self.page));
        if page_granular {
            return Pieces::Whole(Some((addr, size)));
        }
        // A long run needs no more than RUN_PIECES mappings whatever the peak: the block
        // that causes it covers it all, so finer pieces would only add driver calls.
        let chunk = self
            .chunk()
            .max(pow2_floor(size / RUN_PIECES))
            .clamp(self.page, MAP_CHUNK.max(self.page));
        let bulk = if size > self.page {
            size - self.page
        } else {
            size
        };
        let last_page = (bulk < size).then_some((addr + bulk, self.page));
        Pieces::Chunked(
            (addr..addr + bulk)
                .step_by(chunk as usize)
                .map(move |start| (start, chunk.min(addr + bulk - start)))
                .chain(last_page),
        )
    }

    /// Records a mapping made by one `map_pages` call: one per page when every page is its
    /// own allocation.
    pub(crate) fn add_mapping(&mut self, addr: u64, size: u64) {
        self.add_mapping_as(addr, size, self.page_granular);
    }

    /// [`ExpandableTable::add_mapping`] of a call that made one allocation per page or not,
    /// whatever the table's mode.
    pub(crate) fn add_mapping_as(&mut self, addr: u64, size: u64, per_page: bool) {
        if per_page {
            for page in (addr..addr + size).step_by(self.page as usize) {
                self.mappings.insert(page, self.page);
            }
            let pieces: Vec<_> = self.pieces_as(addr, size, false).collect();
            self.growth_pieces.extend(pieces);
        } else {
            self.mappings.insert(addr, size);
            self.growth_pieces.insert(addr, size);
        }
    }

    /// The mappings lying wholly inside `[addr, addr + size)`, lowest first. Inside one
    /// free block they are contiguous: a block lies on mapped memory.
    pub(crate) fn whole_mappings(&self, addr: u64, size: u64) -> Vec<(u64, u64)> {
        let end = addr + size;
        self.mappings
            .range(addr..end)
            .map(|(&start, &len)| (start, len))
            .take_while(|&(start, len)| start + len <= end)
            .collect()
    }

    /// The stretch of whole mappings inside the mapped range `[addr, addr + size)` (a free
    /// block's, which lies on contiguous mappings), as (first byte, bytes); `None` if no
    /// mapping lies wholly inside. What a stitch can map a second time: the driver maps
    /// only whole allocations again.
    pub(crate) fn whole_mapping_span(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let end = addr + size;
        let (&start, _) = self.mappings.range(addr..end).next()?;
        let (&last, &len) = self.mappings.range(start..end).next_back()?;
        // The last mapping starting inside may run past the range: the one before it ends
        // where it begins (the range is contiguously mapped).
        let stop = if last + len <= end { last + len } else { last };
        (stop > start).then(|| (start, stop - start))
    }

    /// The first byte past the mapping that holds byte `addr`, if one does.
    pub(crate) fn mapping_end(&self, addr: u64) -> Option<u64> {
        end_of_range_holding(&self.mappings, addr)
    }

    /// True if some mapping lies wholly inside `[addr, addr + size)`.
    pub(crate) fn has_whole_mapping(&self, addr: u64, size: u64) -> bool {
        self.mappings
            .range(addr..addr + size)
            .next()
            .is_some_and(|(&start, &len)| start + len <= addr + size)
    }

    /// Forgets the mappings inside `[addr, addr + size)` (just unmapped).
    pub(crate) fn remove_mappings(&mut self, addr: u64, size: u64) {
        let gone: Vec<u64> = self
            .mappings
            .range(addr..addr + size)
            .map(|(&a, _)| a)
            .collect();
        for start in gone {
            self.mappings.remove(&start);
        }
        // Pieces are disjoint: those overlapping the range are the last ones starting
        // before its end.
        let cut: Vec<u64> = self
            .growth_pieces
            .range(..addr + size)
            .rev()
            .take_while(|(&start, &len)| start + len > addr)
            .map(|(&start, _)| start)
            .collect();
        for start in cut {
            self.growth_pieces.remove(&start);
        }
    }

    /// [`ExpandableTable::whole_mapping_span`] in growth pieces: the first stretch of
    /// contiguous whole pieces inside the mapped range `[addr, addr + size)`.
    pub(crate) fn whole_piece_span(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let end = addr + size;
        let mut span: Option<(u64, u64)> = None;
        for (&start, &len) in self.growth_pieces.range(addr..end) {
            if start + len > end {
                break;
            }
            match &mut span {
                None => span = Some((start, start + len)),
                Some((_, stop)) if *stop == start => *stop = start + len,
                Some(_) => break,
            }
        }
        span.map(|(start, stop)| (start, stop - start))
    }

    /// The first byte past the growth piece that holds byte `addr`, if one does.
    pub(crate) fn piece_end(&self, addr: u64) -> Option<u64> {
        end_of_range_holding(&self.growth_pieces, addr)
    }
}

/// In `ranges` (disjoint, start → bytes), the first byte past the range that holds byte
/// `addr`, if one does.
fn end_of_range_holding(ranges: &BTreeMap<u64, u64>, addr: u64) -> Option<u64> {
    ranges
        .range(..=addr)
        .next_back()
        .map(|(&start, &len)| start + len)
        .filter(|&end| end > addr)
}

/// What [`ExpandableTable::pieces`] yields: the run whole, or cut in chunks.
enum Pieces<C> {
    Whole(Option<(u64, u64)>),
    Chunked(C),
}

impl<C: Iterator<Item = (u64, u64)>> Iterator for Pieces<C> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        match self {
            Pieces::Whole(run) => run.take(),
            Pieces::Chunked(chunks) => chunks.next(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_are_cut_in_chunks_with_the_last_page_alone_and_found_whole() {
        let mib = 1 << 20;
        let mut table = ExpandableTable::new(2 * mib, 5 * mib, 100);
        assert_eq!(table.reservation, 6 * mib);
        table.live_peak_at_growth = 64 << 30;
        let pieces: Vec<_> = table.pieces(0, MAP_CHUNK + 4 * mib).collect();
        assert_eq!(
            pieces,
            vec![
                (0, MAP_CHUNK),
                (MAP_CHUNK, 2 * mib),
                (MAP_CHUNK + 2 * mib, 2 * mib)
            ]
        );
        assert_eq!(
            table.pieces(8 * mib, 2 * mib).collect::<Vec<_>>(),
            [(8 * mib, 2 * mib)],
            "a single page is mapped once"
        );
        for (addr, size) in pieces {
            table.add_mapping(addr, size);
        }
        // A block covering the second mapping and part of the first sees only the second.
        assert_eq!(
            table.whole_mappings(2 * mib, MAP_CHUNK),
            vec![(MAP_CHUNK, 2 * mib)]
        );
        assert!(table.has_whole_mapping(2 * mib, MAP_CHUNK));
        assert!(!table.has_whole_mapping(2 * mib, MAP_CHUNK - 2 * mib));
        assert_eq!(table.whole_mappings(0, MAP_CHUNK + 4 * mib).len(), 3);
        table.remove_mappings(MAP_CHUNK, 4 * mib);
        assert!(table.whole_mappings(MAP_CHUNK, 4 * mib).is_empty());
    }

    /// Page by page, a growth is still known by the pieces it would have been mapped in:
    /// stitching takes those whole while memory is plentiful. A piece any of whose pages
    /// was unmapped is no longer one.
    #[test]
    fn pages_mapped_one_by_one_keep_their_growth_pieces() {
        let mib = 1 << 20;
        let mut table = ExpandableTable::new(2 * mib, 5 * mib, 100);
        table.live_peak_at_growth = 2 << 30;
        assert_eq!(table.chunk(), 8 * mib);
        table.page_granular = true;
        table.add_mapping(0, 32 * mib);
        assert_eq!(table.whole_mappings(0, 32 * mib).len(), 16, "one per page");
        assert_eq!(table.whole_piece_span(0, 32 * mib), Some((0, 32 * mib)));
        // A free block over part of the run sees the pieces wholly inside it.
        assert_eq!(
            table.whole_piece_span(2 * mib, 20 * mib),
            Some((8 * mib, 8 * mib))
        );
        assert_eq!(table.piece_end(9 * mib), Some(16 * mib));
        // Unmapping one page takes its piece out; the span stops at the gap.
        table.remove_mappings(10 * mib, 2 * mib);
        assert_eq!(table.piece_end(9 * mib), None);
        assert_eq!(table.whole_piece_span(0, 32 * mib), Some((0, 8 * mib)));
        assert_eq!(
            table.whole_piece_span(8 * mib, 24 * mib),
            Some((16 * mib, 16 * mib))
        );
        assert_eq!(table.whole_mappings(8 * mib, 8 * mib).len(), 3);
    }

    #[test]
    fn mappings_are_sized_to_the_live_peak_in_powers_of_two_of_pages() {
        let mib = 1 << 20;
        let mut table = ExpandableTable::new(2 * mib, 64 * mib, 100);
        let chunk_at = |table: &mut ExpandableTable, peak: u64| {
            table.live_peak_at_growth = peak;
            table.chunk()
        };
        assert_eq!(chunk_at(&mut table, 0), 2 * mib, "one page at least");
        assert_eq!(chunk_at(&mut table, 1000 * mib), 2 * mib);
        assert_eq!(chunk_at(&mut table, 4096 * mib), 16 * mib);
        assert_eq!(chunk_at(&mut table, 6000 * mib), 16 * mib, "rounded down");
        assert_eq!(
            chunk_at(&mut table, 64 << 30),
            MAP_CHUNK,
            "at most MAP_CHUNK"
        );
        // Under a small peak, a long run still takes few pieces: a 16th of it (4 MiB)
        // each, then the last page.
        table.live_peak_at_growth = 0;
        let run: Vec<_> = table.pieces(0, 64 * mib).collect();
        assert_eq!(run.len(), 17);
        assert!(run[..16].iter().all(|&(_, len)| len <= 4 * mib));
        assert_eq!(run[16], (62 * mib, 2 * mib));
        table.live_peak_at_growth = 64 << 30;
        let pieces: Vec<_> = table.pieces(0, 3 * MAP_CHUNK / 2).collect();
        assert_eq!(
            pieces,
            [
                (0, MAP_CHUNK),
                (MAP_CHUNK, MAP_CHUNK / 2 - 2 * mib),
                (3 * MAP_CHUNK / 2 - 2 * mib, 2 * mib)
            ]
        );
    }
}
