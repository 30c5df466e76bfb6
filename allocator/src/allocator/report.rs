//! Reporting: the out-of-memory report, trace records and snapshots.

use super::*;
use crate::pool::stitch::whole_pages;

impl State {
    #[cold]
    pub(super) fn out_of_memory<B: Backend>(
        &mut self,
        backend: &B,
        requested: u64,
        slot: StreamSlot,
    ) -> Box<OutOfMemory> {
        let (mut free_cached, mut largest) = (0, 0);
        // A sleeping pool's free blocks hold no memory.
        for state in self
            .streams
            .states
            .iter()
            .filter(|state| self.tags.asleep(state.pool).is_none())
        {
            for list in state.ready.iter().chain(state.pending.iter()) {
                free_cached += list.bytes();
                largest = largest.max(list.largest());
            }
        }
        // Free bytes outside whole mappings: what neither stitching nor unmapping can reach
        // (a mapping is a page under a limit, a piece of up to 128 MiB otherwise); of them,
        // the whole pages, which only a piece that a live block shares keeps out of reach.
        let (stranded, pinned_in_pieces) = match self.growth.expandable() {
            Some(vmm) => self
                .arena
                .blocks()
                .filter(|(_, block)| {
                    block.is_free()
                        && block.is_expandable()
                        && self.tags.asleep(self.streams.pool(block.owner())).is_none()
                })
                .map(|(_, block)| {
                    let whole = vmm
                        .whole_mapping_span(block.addr(), block.size())
                        .map_or(0, |(_, len)| len);
                    let (_, pages) = whole_pages(block.addr(), block.size(), vmm.page);
                    (block.size() - whole, pages.saturating_sub(whole))
                })
                .fold((0, 0), |(a, b), (c, d)| (a + c, b + d)),
            None => (0, 0),
        };
        let stitched = self.stitches.actives().map(|(_, stitch)| stitch.size).sum();
        self.stats.ooms += 1;
        self.note(backend, TraceAction::Oom, 0, requested, slot);
        let growth = match self.growth.expandable() {
            Some(vmm) => requested.div_ceil(vmm.page).max(1) * vmm.page,
            None => segment_size_for(round_size(requested)),
        };
        let report = OutOfMemory {
            requested,
            stream: self.streams.id(slot),
            free_cached,
            largest_free_block: largest,
            reserved: self.stats.reserved_bytes.current,
            allocated: self.stats.allocated_bytes.current,
            limit: self.limit,
            expandable: self.growth.expandable().is_some(),
            stitched,
            stranded,
            pinned_in_pieces,
            growth,
        };
        tracing::warn!(%report, "allocation failed");
        Box::new(report)
    }

    /// Records an event now. The ring keeps `slot`, turned into the stream's handle only when
    /// read; a slot no stream has (`empty_cache` before any allocation) reads as stream 0.
    #[inline]
    pub(super) fn note<B: Backend>(
        &mut self,
        backend: &B,
        action: TraceAction,
        addr: u64,
        size: u64,
        slot: StreamSlot,
    ) {
        if self.trace.enabled() {
            let slot = if (slot as usize) < self.streams.len() {
                slot
            } else {
                NO_STREAM
            };
            self.trace
                .push(action, addr, size, slot, backend.now_ticks());
        }
    }

    pub(super) fn snapshot<B: Backend>(&mut self, backend: &B, config: &Config) -> Snapshot {
        // A stitched range reserves no memory of its own: it is shown where its pages are,
        // each lent run as a block allocated to the range's stream, carrying its share of
        // the bytes asked for, so that segments add up to reserved memory and blocks to
        // allocated memory in every viewer.
        let mut lent: HashMap<BlockKey, (StreamSlot, u64, u64)> = HashMap::new();
        for (segment, stitch) in self.stitches.actives() {
            let range = self.arena.block(self.arena.segment(segment).head());
            let mut requested = range.requested();
            for &key in &stitch.lent {
                let share = requested.min(self.arena.block(key).size());
                requested -= share;
                lent.insert(key, (range.owner(), share, range.addr()));
            }
        }
        let mut segments: Vec<SegmentInfo> = self
            .arena
            .segments()
            .filter(|(_, seg)| !seg.is_stitched())
            .map(|(segment, seg)| SegmentInfo {
                addr: DevicePtr(seg.addr()),
                // An expandable segment reports the memory mapped into it, and only the
                // blocks on mapped pages.
                size: self
                    .arena
                    .segment_blocks(segment)
                    .filter(|(_, block)| !block.is_unmapped())
                    .map(|(_, block)| block.size())
                    .sum(),
                pool: seg.pool(),
                mempool: self.streams.pool(seg.stream()),
                expandable: seg.is_expandable(),
                stream: self.streams.id(seg.stream()),
                tag: self
                    .tags
                    .get(self.streams.pool(seg.stream()))
                    .map(|tag| tag.name.clone()),
                asleep: self.tags.asleep(self.streams.pool(seg.stream())).is_some(),
                blocks: self
                    .arena
                    .segment_blocks(segment)
                    .filter(|(_, block)| !block.is_unmapped())
                    .map(|(key, block)| {
                        let (owner, requested, lent_to) = match lent.get(&key) {
                            Some(&(owner, share, range)) => (owner, share, Some(DevicePtr(range))),
                            None => (block.owner(), block.requested(), None),
                        };
                        BlockInfo {
                            addr: DevicePtr(block.addr()),
                            size: block.size(),
                            requested,
                            state: if block.is_allocated() || block.is_lent() {
                                BlockState::ActiveAllocated
                            } else if block.pending().is_empty() {
                                BlockState::Inactive
                            } else {
                                BlockState::ActivePendingFree
                            },
                            stream: self.streams.id(owner),
                            pending_events: block.pending().len() as u32,
                            lent_to,
                        }
                    })
                    .collect(),
            })
            .collect();
        segments.sort_by_key(|s| s.addr);
        Snapshot {
            config: config.clone(),
            stats: self.stats.read(),
            segments,
            trace: self.trace.entries(
                |slot| self.streams.id(slot),
                |ticks| backend.ticks_to_ns(ticks),
            ),
            trace_dropped: self.trace.dropped(),
            time_ns: backend.now_ns(),
        }
    }
}
