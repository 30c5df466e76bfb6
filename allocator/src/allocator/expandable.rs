//! Expandable segments, the policy: when to map pages into a stream's reservation, where,
//! and when to synchronise and unmap free mappings. The indexes and the arithmetic are in
//! `pool::expandable`; why each rule is as it is (with the figures measured on an H200) is
//! in the comments below.

use super::*;
use crate::pool::arena::SegmentKey;

/// Expandable segments first map up to this much (in 1/10,000) beyond the live peak
/// before reclaiming free pages; each reclaim widens the slack by a quarter, up to
/// [`MAX_RECLAIM_SLACK_BP`].
pub(super) const RECLAIM_SLACK_BP: u64 = 100;

/// The widest reclaim slack, in 1/10,000 of the live peak: peak reserved stays within
/// about this much of peak live plus the mappings that live blocks pin. 1.5% keeps every
/// replayed trace (GPT-2, BERT with varying lengths, ResNet-50, KV-cache generation)
/// within 1.02, the training traces with no remapping in the steady state; 25% let
/// ResNet-50 reach 1.026 once mappings are sized to the peak. Generation remaps at its
/// prefill peaks (81 mappings in the third pass of `--steps 3`) whatever the slack: 1.9%
/// and 3% still mapped 58–131 times a pass over eight passes, at 1.024–1.030 and
/// 1.036–1.039.
const MAX_RECLAIM_SLACK_BP: u64 = 150;

/// Remapping memory already reserved (reclaims: the driver's unmapping and mapping again,
/// not the wait for the device; stitches evicted without ever having been revived: mapping
/// free pages a second time for one request, and unmapping them again) may take at most
/// this fraction (1/n) of the host time since the first reservation, plus
/// [`REMAP_TIME_ALLOWANCE_NS`]; past it, a reclaim or a new stitch that growing within a
/// wider slack can replace is skipped and the slack doubles (up to
/// [`MAX_THROTTLED_SLACK_BP`]). A stitch that is revived has paid for itself and is not
/// charged: a training loop's kept ranges never count. Measured on an H200: a C loop of
/// random sizes up to 256 MiB with 64 live (`benches/gpu/host_abi.cpp`) reclaimed ~115
/// times and remapped ~15 GB per 100,000 mallocs, 980 ns per operation against 147 with
/// whole segments; with stitching, the same loop inside PyTorch (`benches/gpu/host_cost.py`)
/// made 38 new stitches and evicted 38 per 100,000 operations, 3 ms each way (about 100
/// pages mapped, then unmapped, one call per page), 1,213 ns per operation with a median
/// of 194. Training and generation spend well under 1% of their time remapping. Memory
/// then follows the churn less closely, only where following it costs more time than it
/// is worth.
const REMAP_TIME_SHARE: u64 = 50;

/// Remapping time allowed before [`REMAP_TIME_SHARE`] applies: a few reclaims and
/// stitches while a program warms up are worth their cost whatever the time elapsed so
/// far.
const REMAP_TIME_ALLOWANCE_NS: u64 = 20_000_000;

/// The widest slack that skipped remapping widens to, in 1/10,000 of the live peak.
const MAX_THROTTLED_SLACK_BP: u64 = 5_000;

/// Without a limit, a mapping that would leave the device less than this fraction (1/n) of
/// its memory free switches to one physical allocation per page before the device ever
/// refuses: the device's free memory is then the limit that binds, and a piece of up to
/// 128 MiB that one live block pins is memory no reclaim can give back. On an H200 under a
/// cap the allocator is not told of (another allocation holding the rest), FSDP2 GPT-2 on
/// one GPU ran out at 0.955 of its live peak with 175 MiB free but pinned in partly used
/// pieces, where PyTorch's expandable segments had 87 MiB reserved and unallocated.
/// Mapping the last sixteenth page by page costs 55-65 µs a page once (about 0.25 s for
/// the 8.8 GB of an H200); a program far from the device's capacity never pays it.
const NEAR_FULL_FRACTION: u64 = 16;

impl State {
    /// The expandable segments' table. Everything in this file runs only after an entry
    /// point found expandable segments (`grow_expandable`, the reclaims and releases each
    /// return early without them), so a missing table here is a bug in the engine.
    pub(super) fn table(&self) -> &ExpandableTable {
        self.growth
            .expandable()
            .expect("expandable-segment policy reached with whole segments")
    }

    /// See [`State::table`].
    pub(super) fn table_mut(&mut self) -> &mut ExpandableTable {
        table_in(&mut self.growth)
    }

    /// Room for a rounded `size` in one of `slot`'s expandable segments of `pool`, unlisted
    /// and owned by `slot`; `None` if the budget, the limit, the device or the address
    /// space refuses. How far it goes first depends on `effort`:
    /// - [`Effort::Light`]: only within the growth budget (the live peak plus the slack) and
    ///   the limit; nothing is unmapped;
    /// - [`Effort::Waiting`]: within the limit. If mapping would take reserved memory past
    ///   the budget (`reclaim` on, reclaims affordable) and a ready free block covers a
    ///   whole mapping, synchronise the device (unmapping does not synchronise, and the
    ///   memory's last users may be any stream), settle every event, retry the caller's
    ///   free list, then unmap free mappings until the excess is gone;
    /// - [`Effort::Synchronised`] (the device was just synchronised): unmap free whole
    ///   pages until the request fits the limit (or, where the device refused, as much as
    ///   it takes), then map.
    ///
    /// While a capture is under way, growth only maps, within the limit.
    /// The fewest pages that give room are mapped, right after a free block of the caller
    /// when one borders an unmapped stretch, so the request packs against it; if no
    /// unmapped stretch of the stream's reservations can hold the request, another
    /// reservation is made (address space costs no memory).
    pub(super) fn grow_expandable<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        capturing: bool,
        effort: Effort,
    ) -> Result<Option<BlockKey>, AllocError> {
        let Need {
            slot, pool, size, ..
        } = need;
        if self.growth.expandable().is_none() {
            return Ok(None);
        }
        let bytes = self.page_rounded(size);
        let reclaimed = match effort {
            _ if capturing => false,
            Effort::Light => {
                if !self.within_budget(bytes) {
                    return Ok(None);
                }
                false
            }
            Effort::Waiting => match self.reclaim_before_mapping(backend, need)? {
                Reclaim::Served(key) => return Ok(Some(key)),
                Reclaim::Unmapped => true,
                Reclaim::NotNeeded => false,
            },
            Effort::Synchronised => {
                let target = self.limit.unwrap_or(self.stats.reserved_bytes.current);
                let excess = (self.stats.reserved_bytes.current + bytes).saturating_sub(target);
                if excess > 0 {
                    self.unmap_free_pages_upto(backend, excess, Release::Unpinned, &[])?;
                }
                false
            }
        };
        // Only mapping that follows a reclaim is charged to it: the clock is read for that.
        let map_started = reclaimed.then(|| backend.precise_ns());
        let mapped = match self.place(backend, pool, slot, size)? {
            Some((segment, placement)) => {
                self.map_placement(backend, segment, placement, size, slot)
            }
            None => Ok(None),
        };
        if let Some(started_ns) = map_started {
            self.charge_remap(backend, started_ns);
        }
        mapped
    }

    /// `bytes` rounded up to whole pages (at least one).
    pub(super) fn page_rounded(&self, bytes: u64) -> u64 {
        let page = self.table().page;
        bytes.div_ceil(page).max(1) * page
    }

    /// True if `bytes` more reserved stay within the limit, if any.
    pub(super) fn fits_limit(&self, bytes: u64) -> bool {
        self.limit
            .is_none_or(|limit| self.stats.reserved_bytes.current + bytes <= limit)
    }

    /// Reserved memory that growth may reach without a reclaim: the live peak (with the
    /// request) plus the slack, and a page more, so that a program's first requests grow.
    fn growth_budget(&self, bytes: u64) -> u64 {
        let vmm = self.table();
        let live_peak = vmm
            .live_peak_at_growth
            .max(self.stats.allocated_bytes.current + bytes);
        live_peak + live_peak / 10_000 * vmm.slack_bp
    }

    /// True if mapping `bytes` more stays within the growth budget and the limit.
    pub(super) fn within_budget(&self, bytes: u64) -> bool {
        self.within_budget_serving(bytes, bytes)
    }

    /// True if mapping `bytes` more to serve a request of `serving` bytes (a stitch maps
    /// only what free pages lack) stays within the growth budget and the limit: the budget
    /// counts the whole request as live, as it will be. Counted with the mapping alone, a
    /// GPT-2 trace made a new stitch in its sixth replayed step (1.004 of its live peak
    /// became 1.006).
    pub(super) fn within_budget_serving(&self, bytes: u64, serving: u64) -> bool {
        let after = self.stats.reserved_bytes.current + bytes;
        let budget = self.growth_budget(serving.max(bytes));
        after <= budget + self.table().page && self.fits_limit(bytes)
    }

    /// Where to map room for `size` bytes of `slot` in `pool`: the placement with the fewest
    /// pages over every segment of the stream's, reserving another segment if none has an
    /// unmapped stretch that can hold it.
    fn place<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolKind,
        slot: StreamSlot,
        size: u64,
    ) -> Result<Option<(SegmentKey, Placement)>, AllocError> {
        let mut best: Option<(SegmentKey, Placement)> = None;
        let segments = self.table().segments_of(slot, pool).to_vec();
        for segment in segments {
            if let Some(placement) = self.placement(segment, size, slot) {
                if best.as_ref().is_none_or(|(_, b)| placement.map < b.map) {
                    best = Some((segment, placement));
                }
            }
        }
        if best.is_some() {
            return Ok(best);
        }
        let segment = self.add_expandable_segment(backend, pool, slot, size)?;
        Ok(self
            .placement(segment, size, slot)
            .map(|placement| (segment, placement)))
    }

    /// Before mapping `map` bytes in pieces: if that would leave the device less than
    /// [`NEAR_FULL_FRACTION`] of its memory free, every page is mapped on its own from now
    /// on. The device is asked only while pieces are mapped, once per growth; a device that
    /// cannot say changes nothing.
    fn heed_device_headroom<B: Backend>(&mut self, backend: &B, map: u64) {
        if self.limit.is_some() || self.growth.expandable().is_none_or(|vmm| vmm.page_granular) {
            return;
        }
        let (Ok(free), Ok(total)) = (backend.free_memory(), backend.total_memory()) else {
            return;
        };
        if free.saturating_sub(map) < total / NEAR_FULL_FRACTION && self.map_page_by_page(backend) {
            tracing::info!(
                free,
                total,
                "the device is nearly full: pages are mapped one by one from now on"
            );
        }
    }

    /// From now on every page is mapped as its own physical allocation, so that any free
    /// page can go back alone (pages mapped before keep their pieces). True if this
    /// changed the mode; false without expandable segments or if pages already were.
    pub(super) fn map_page_by_page<B: Backend>(&mut self, backend: &B) -> bool {
        match self.growth.expandable_mut() {
            Some(vmm) if !vmm.page_granular => {
                vmm.page_granular = true;
                backend.set_page_allocations(true);
                true
            }
            _ => false,
        }
    }

    /// Adds the host time since `started_ns` (the backend's precise clock) to the time
    /// spent in the driver's virtual-memory calls ([`crate::stats::Stats::vmm_ns`]), and
    /// returns it.
    pub(super) fn count_vmm<B: Backend>(&mut self, backend: &B, started_ns: u64) -> u64 {
        let spent = backend.precise_ns().saturating_sub(started_ns);
        self.stats.vmm_ns += spent;
        spent
    }

    /// Adds the host time since `started_ns` (the backend's precise clock) to the time
    /// spent remapping: the driver's work of unmapping and of mapping again, not the wait
    /// for the device, whose work had to finish anyway.
    pub(super) fn charge_remap<B: Backend>(&mut self, backend: &B, started_ns: u64) {
        let spent = backend.precise_ns().saturating_sub(started_ns);
        self.table_mut().remap_ns += spent;
    }

    /// True if remapping so far took no more than its share of the host time since the
    /// first reservation ([`REMAP_TIME_SHARE`], [`REMAP_TIME_ALLOWANCE_NS`]).
    pub(super) fn remap_affordable<B: Backend>(&self, backend: &B) -> bool {
        let now_ns = backend.precise_ns();
        let vmm = self.table();
        let elapsed = now_ns.saturating_sub(vmm.clock_start_ns.unwrap_or(now_ns));
        vmm.remap_ns <= elapsed / REMAP_TIME_SHARE + REMAP_TIME_ALLOWANCE_NS
    }

    /// Remapping costs more than its share of time: memory should follow the churn less
    /// closely. Doubles the slack (at least to [`MAX_RECLAIM_SLACK_BP`], at most to
    /// [`MAX_THROTTLED_SLACK_BP`]).
    pub(super) fn widen_throttled_slack(&mut self, skipped: &'static str) {
        let vmm = self.table_mut();
        vmm.slack_bp = (vmm.slack_bp * 2).clamp(MAX_RECLAIM_SLACK_BP, MAX_THROTTLED_SLACK_BP);
        tracing::debug!(
            slack_bp = vmm.slack_bp,
            skipped,
            "remapping over its share of time"
        );
    }

    /// With `reclaim` on: if mapping `size` more bytes would take reserved memory past the
    /// live peak plus the slack, and a ready free block covers a whole mapping, synchronise
    /// the device, settle every event, and take a ready block of `slot` if one now fits;
    /// else unmap free mappings until the excess is gone. Never while a capture is under
    /// way, and only while reclaims are affordable. (At the limit, the policy's last step
    /// unmaps what the limit needs.)
    fn reclaim_before_mapping<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
    ) -> Result<Reclaim, AllocError> {
        // Reclaim (synchronise, unmap free mappings, map where there is room) only when
        // mapping would take reserved memory past the live peak plus a slack. Measured on an
        // H200 (GPT-2 small), what a reclaim costs decides the policy:
        // - reclaiming at every new high-water mark made steps 1.42x slower: the peak creeps
        //   up a little every step; against the live peak, stable in a steady state, it
        //   stops;
        // - unmapping every free page then remapped 4.7 GB a step (1.34x): unmap only the
        //   excess;
        // - a workload whose free memory is scattered differently at every peak (GPT-2's
        //   1.5 GB logits find no hole big enough) still remapped 1.4 GB a step: each reclaim
        //   widens the slack by a quarter, so reclaims die out where they would recur.
        // Mapping in large pieces (`ExpandableTable::pieces`) makes what remains cheap.
        let after = self.stats.reserved_bytes.current + self.page_rounded(need.size);
        let budget = self.growth_budget(need.size);
        if !self.reclaim || after <= budget || !self.has_unmappable_pages(Release::Unpinned) {
            return Ok(Reclaim::NotNeeded);
        }
        if !self.remap_affordable(backend) {
            // Free memory moves faster than reclaims can follow at a sensible cost: map, and
            // widen the slack so that reclaims become rarer.
            self.widen_throttled_slack("reclaim");
            return Ok(Reclaim::NotNeeded);
        }
        self.synchronize(backend)?;
        if let Some(key) = self.take_ready(need) {
            return Ok(Reclaim::Served(key));
        }
        let unmap_started = backend.precise_ns();
        self.unmap_free_pages_upto(backend, after - budget, Release::Unpinned, &[])?;
        self.charge_remap(backend, unmap_started);
        let vmm = table_in(&mut self.growth);
        if vmm.slack_bp < MAX_RECLAIM_SLACK_BP {
            vmm.slack_bp = (vmm.slack_bp * 5 / 4 + 1).min(MAX_RECLAIM_SLACK_BP);
        }
        Ok(Reclaim::Unmapped)
    }

    /// Where to map room for `size` bytes of `slot` in `segment`: over every unmapped
    /// stretch, the placement that maps the fewest pages (lowest address among equals): at
    /// the bottom of the stretch, continuing the caller's free block below it; at the top,
    /// continuing the free block above; or the whole stretch, joining both.
    pub(super) fn placement(
        &self,
        segment: SegmentKey,
        size: u64,
        slot: StreamSlot,
    ) -> Option<Placement> {
        let vmm = self.table();
        let page = vmm.page;
        let arena = &self.arena;
        let reusable = |neighbour: Option<BlockKey>| {
            neighbour.filter(|&n| {
                let b = arena.block(n);
                b.is_free() && b.pending().is_empty() && b.owner() == slot
            })
        };
        let pages_for = |bytes: u64| (bytes.div_ceil(page) * page).max(page);
        let mut best: Option<Placement> = None;
        for (&addr, &hole) in vmm.unmapped(segment) {
            let hole_block = arena.block(hole);
            let room = hole_block.size();
            let below = reusable(hole_block.prev());
            let above = reusable(hole_block.next());
            let lo = below.map_or(0, |k| arena.block(k).size());
            let hi = above.map_or(0, |k| arena.block(k).size());
            let options = [
                (lo + room >= size).then(|| Placement {
                    addr,
                    hole,
                    map: pages_for(size.saturating_sub(lo)).min(room),
                    top: false,
                }),
                (hi + room >= size).then(|| {
                    let map = pages_for(size.saturating_sub(hi)).min(room);
                    Placement {
                        addr: addr + room - map,
                        hole,
                        map,
                        top: true,
                    }
                }),
                (lo + room + hi >= size).then_some(Placement {
                    addr,
                    hole,
                    map: room,
                    top: false,
                }),
            ];
            for option in options.into_iter().flatten() {
                if best.as_ref().is_none_or(|b| option.map < b.map) {
                    best = Some(option);
                }
            }
            if best.as_ref().is_some_and(|b| b.map == page) {
                break;
            }
        }
        best
    }

    /// [`State::placement`] for `bytes` of `slot`, widened so that it maps at least `bytes`
    /// (as much of its stretch as that takes) even where a free neighbour would give room:
    /// for memory that must be new, not merely contiguous.
    pub(super) fn placement_mapping(
        &self,
        segment: SegmentKey,
        bytes: u64,
        slot: StreamSlot,
    ) -> Option<Placement> {
        let mut placement = self.placement(segment, bytes, slot)?;
        let page = self.table().page;
        let hole = self.arena.block(placement.hole);
        let (hole_addr, room) = (hole.addr(), hole.size());
        let map = (bytes.div_ceil(page) * page).max(placement.map).min(room);
        if placement.top {
            placement.addr = hole_addr + room - map;
        }
        placement.map = map;
        Some(placement)
    }

    /// Maps `placement` in `segment` for `size` bytes of `slot` and returns the block that
    /// holds the new room, merged with the caller's free neighbours; `None` if the limit or
    /// the device refuses.
    pub(super) fn map_placement<B: Backend>(
        &mut self,
        backend: &B,
        segment: SegmentKey,
        placement: Placement,
        size: u64,
        slot: StreamSlot,
    ) -> Result<Option<BlockKey>, AllocError> {
        let Placement {
            addr,
            hole,
            map,
            top,
        } = placement;
        if let Some(limit) = self.limit {
            if self.stats.reserved_bytes.current + map > limit {
                return Ok(None);
            }
        }
        // One physical allocation per piece; on failure, undo the pieces already mapped
        // (untouched, so unmapping them needs no synchronisation). A tagged pool's memory
        // is mapped whole (`allocator::sleep`).
        let whole = self.maps_whole(self.streams.pool(slot));
        if !whole {
            self.heed_device_headroom(backend, map);
        }
        let pieces: Vec<_> = if whole {
            self.table().pieces_as(addr, map, false).collect()
        } else {
            self.table().pieces(addr, map).collect()
        };
        let vmm_started = backend.precise_ns();
        for (index, &(at, len)) in pieces.iter().enumerate() {
            let result = if whole {
                backend.map_pages_whole(DevicePtr(at), len)
            } else {
                backend.map_pages(DevicePtr(at), len)
            };
            if let Err(err) = result {
                for &(done, done_len) in &pieces[..index] {
                    backend.unmap_pages(DevicePtr(done), done_len)?;
                }
                self.count_vmm(backend, vmm_started);
                if !err.out_of_memory {
                    return Err(err.into());
                }
                // The device is short of memory: be as frugal as under a limit.
                if self.map_page_by_page(backend) {
                    tracing::info!(
                        "the device refused memory: pages are mapped one by one from now on"
                    );
                }
                return Ok(None);
            }
        }
        self.count_vmm(backend, vmm_started);
        let vmm = table_in(&mut self.growth);
        for &(at, len) in &pieces {
            if whole {
                vmm.add_mapping_as(at, len, false);
            } else {
                vmm.add_mapping(at, len);
            }
        }
        // Cut the mapped part out of the stretch; what stays unmapped stays indexed.
        let vmm = table_in(&mut self.growth);
        let room = self.arena.block(hole).size();
        let mapped = if map == room {
            vmm.unindex_unmapped(segment, addr);
            hole
        } else if top {
            self.arena.split(hole, room - map)
        } else {
            vmm.unindex_unmapped(segment, addr);
            let rest = self.arena.split(hole, map);
            vmm.index_unmapped(segment, addr + map, room - map, rest);
            hole
        };
        vmm.mapped += map;
        self.stats.page_map_bytes += map;
        vmm.live_peak_at_growth = vmm
            .live_peak_at_growth
            .max(self.stats.allocated_bytes.current + size);
        self.arena.mark_mapped(mapped, slot);
        self.count_mapped(addr, map, size);
        self.note(backend, TraceAction::SegmentMap, addr, map, slot);
        // Join the caller's free blocks on both sides, not only the one the placement packed
        // against: a mapping that fills its stretch borders both, and `hand_out` lists the
        // remainder of what it splits without merge attempts.
        Ok(Some(self.merge_neighbours(mapped)))
    }

    /// `slot`'s expandable segment of `pool`, reserved now if it has none yet.
    pub(super) fn expandable_segment_for<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolKind,
        slot: StreamSlot,
    ) -> Result<SegmentKey, AllocError> {
        match self
            .growth
            .expandable()
            .and_then(|vmm| vmm.segment_of(slot, pool))
        {
            Some(segment) => Ok(segment),
            None => self.add_expandable_segment(backend, pool, slot, 0),
        }
    }

    /// Reserves the address space of another expandable segment of `slot` in `pool`, large
    /// enough for `at_least` bytes.
    pub(super) fn add_expandable_segment<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolKind,
        slot: StreamSlot,
        at_least: u64,
    ) -> Result<usize, AllocError> {
        let vmm = table_in(&mut self.growth);
        let size = vmm.reservation.max(at_least.div_ceil(vmm.page) * vmm.page);
        let ptr = backend.reserve_address_space(size)?;
        vmm.clock_start_ns
            .get_or_insert_with(|| backend.precise_ns());
        let head = self.arena.add_segment(ptr.0, size, pool, slot, true);
        let segment = self.arena.block(head).segment();
        self.arena.mark_unmapped(head);
        vmm.add(slot, pool, segment, ptr.0, head);
        tracing::debug!(?ptr, size, "address space reserved");
        Ok(segment)
    }
}

/// What [`State::reclaim_before_mapping`] did.
enum Reclaim {
    /// Nothing: mapping stays within the slack and the limit, nothing can be unmapped, or
    /// reclaims have had their share of time.
    NotNeeded,
    /// After synchronising, a ready block of the caller fits: the request takes it.
    Served(BlockKey),
    /// Free mappings were unmapped; mapping follows.
    Unmapped,
}

/// Where [`State::grow_expandable`] maps pages: `map` bytes at `addr`, inside the unmapped
/// block `hole` (at its top or bottom).
#[derive(Debug)]
pub(super) struct Placement {
    addr: u64,
    hole: BlockKey,
    map: u64,
    top: bool,
}

/// [`State::table_mut`] over the one field, for code that holds other fields of the state
/// at the same time.
pub(super) fn table_in(growth: &mut Growth) -> &mut ExpandableTable {
    growth
        .expandable_mut()
        .expect("expandable-segment policy reached with whole segments")
}
