//! Expandable segments giving memory back: which ready free blocks cover whole mappings,
//! unmapping them (up to a target, or a block's whole pages), and releasing reservations
//! with nothing mapped. When to do it is decided where memory is needed (`expandable`,
//! `release`).

use super::expandable::table_in;
use super::*;

impl State {
    /// True if some ready free block of an expandable segment that `which` may release
    /// covers a whole mapping. Blocks awaiting other streams' events do not count:
    /// synchronising for them would be the host wait the lifetime model avoids.
    pub(super) fn has_unmappable_pages(&self, which: Release) -> bool {
        let Some(vmm) = self.growth.expandable() else {
            return false;
        };
        self.streams.states.iter().enumerate().any(|(slot, state)| {
            self.releasable(which, slot as StreamSlot)
                && state.ready.iter().any(|list| {
                    list.keys_at_least(vmm.page).any(|key| {
                        let block = self.arena.block(key);
                        block.is_expandable() && vmm.has_whole_mapping(block.addr(), block.size())
                    })
                })
        })
    }

    /// Per ready free block of an expandable segment that `which` may release, the
    /// mappings lying wholly inside it, lowest first (contiguous: the block lies on mapped
    /// memory).
    pub(super) fn unmappable(&self, which: Release) -> Vec<(BlockKey, Vec<(u64, u64)>)> {
        let Some(vmm) = self.growth.expandable() else {
            return Vec::new();
        };
        let mut victims = Vec::new();
        for (slot, state) in self.streams.states.iter().enumerate() {
            if !self.releasable(which, slot as StreamSlot) {
                continue;
            }
            for list in &state.ready {
                for key in list.keys_at_least(vmm.page) {
                    let block = self.arena.block(key);
                    if !block.is_expandable() {
                        continue;
                    }
                    let mappings = vmm.whole_mappings(block.addr(), block.size());
                    if !mappings.is_empty() {
                        victims.push((key, mappings));
                    }
                }
            }
        }
        victims
    }

    /// Unmaps at least `bytes` of the whole mappings inside ready free blocks of expandable
    /// segments that `which` may release, but for the blocks in `keep`, or all of them if
    /// there are fewer: highest addresses first, so what stays mapped stays low and
    /// compact, where placement looks first. Only valid right after a device-wide
    /// synchronisation.
    pub(super) fn unmap_free_pages_upto<B: Backend>(
        &mut self,
        backend: &B,
        bytes: u64,
        which: Release,
        keep: &[BlockKey],
    ) -> Result<(), BackendError> {
        let mut victims = self.unmappable(which);
        victims.retain(|(key, _)| !keep.contains(key));
        victims.sort_unstable_by_key(|(_, mappings)| std::cmp::Reverse(mappings[0].0));
        let mut left = bytes;
        for (key, mappings) in victims {
            if left == 0 {
                break;
            }
            // Whole mappings from the top of the block down, until enough.
            let end = mappings.last().map_or(0, |&(at, len)| at + len);
            let mut start = end;
            for &(at, len) in mappings.iter().rev() {
                if left == 0 {
                    break;
                }
                start = at;
                left = left.saturating_sub(len);
            }
            self.unmap_block_pages(backend, key, start, end - start)?;
        }
        Ok(())
    }

    /// Unmaps `[start, start + len)`, whole pages inside the listed, ready free block `key`;
    /// what is left of the block on either side stays listed.
    pub(super) fn unmap_block_pages<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        start: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        // A dormant stitch would keep the pages alive through its second mapping.
        self.evict_stitches_over(backend, start, len)?;
        let started_ns = backend.precise_ns();
        backend.unmap_pages(DevicePtr(start), len)?;
        self.count_vmm(backend, started_ns);
        self.table_mut().remove_mappings(start, len);
        self.unlist(key);
        let (addr, size, segment, owner) = {
            let block = self.arena.block(key);
            (block.addr(), block.size(), block.segment(), block.owner())
        };
        let mut middle = key;
        if start > addr {
            middle = self.arena.split(key, start - addr);
            self.list(key);
        }
        if start + len < addr + size {
            let tail = self.arena.split(middle, len);
            self.list(tail);
        }
        self.arena.mark_unmapped(middle);
        self.count_unmapped(start, len);
        self.stats.page_unmap_bytes += len;
        self.note(backend, TraceAction::SegmentUnmap, start, len, owner);
        let vmm = table_in(&mut self.growth);
        vmm.mapped -= len;
        let (mut merged, mut merged_addr) = (middle, start);
        if let Some(prev) = self.arena.block(middle).prev() {
            if self.arena.block(prev).is_unmapped() {
                self.arena.merge(prev, middle);
                merged = prev;
                merged_addr = self.arena.block(prev).addr();
            }
        }
        if let Some(next) = self.arena.block(merged).next() {
            if self.arena.block(next).is_unmapped() {
                vmm.unindex_unmapped(segment, self.arena.block(next).addr());
                self.arena.merge(merged, next);
            }
        }
        vmm.index_unmapped(
            segment,
            merged_addr,
            self.arena.block(merged).size(),
            merged,
        );
        Ok(())
    }

    /// Returns the address space of expandable segments with nothing mapped that `which`
    /// may release.
    pub(super) fn release_unmapped_segments<B: Backend>(
        &mut self,
        backend: &B,
        which: Release,
    ) -> Result<(), BackendError> {
        let empty: Vec<usize> = match self.growth.expandable() {
            None => return Ok(()),
            Some(vmm) => vmm
                .segments()
                .filter(|&segment| {
                    let seg = self.arena.segment(segment);
                    let head = self.arena.block(seg.head());
                    head.is_unmapped()
                        && head.next().is_none()
                        && self.releasable(which, seg.stream())
                })
                .collect(),
        };
        let vmm = table_in(&mut self.growth);
        for segment in empty {
            let seg = self.arena.segment(segment);
            let (addr, size) = (seg.addr(), seg.size());
            backend.release_address_space(DevicePtr(addr), size)?;
            vmm.remove(segment);
            self.arena.remove_segment(segment);
        }
        Ok(())
    }
}
