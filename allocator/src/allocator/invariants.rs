//! The allocator's invariants, checked structure by structure: the property tests, the fuzz
//! targets and the simulator run [`State::check_invariants`] after every operation, so a
//! broken rule is caught at the operation that broke it, with a sentence naming it.
//!
//! One pass over the blocks ([`State::check_blocks`]) checks each block against the
//! structure its state says holds it and adds up what the others are checked against: the
//! free and hot lists, the address map, the events, the expandable segments' indexes and
//! the statistics.

use super::*;

/// What the blocks add up to, for the structures that count them.
#[derive(Default)]
struct Tally {
    /// Bytes of handed-out blocks.
    allocated: u64,
    /// Bytes callers asked for, over handed-out blocks.
    requested: u64,
    /// Bytes of free blocks awaiting events (and of frees deferred by a capture).
    pending: u64,
    /// Free blocks that must be in a free list.
    listed: usize,
    /// Blocks parked in hot lists.
    hot: usize,
    /// Per event, the free blocks and streams that hold it.
    event_refs: HashMap<EventKey, u32>,
    /// Bytes and count of unmapped stretches.
    unmapped_bytes: u64,
    unmapped_blocks: usize,
    /// Lent blocks (pages of an allocated stitched range).
    lent: std::collections::HashSet<BlockKey>,
}

impl State {
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        self.arena.validate()?;
        let mut tally = self.check_blocks()?;
        self.check_lists(&tally)?;
        self.check_address_map()?;
        self.check_events(std::mem::take(&mut tally.event_refs))?;
        self.check_expandable(&tally)?;
        self.check_stitches(&tally)?;
        self.check_sleep()?;
        self.check_stats(&tally)?;
        self.check_torch_stats()?;
        self.check_pool_rules()
    }

    /// Each block against its state: in its segment's memory pool; unmapped stretches
    /// indexed and unlisted; deferred frees neither listed nor handed out; handed-out blocks
    /// without pending events; hot blocks once in their owner's hot list; free blocks in
    /// their owner's list and merged with every neighbour they may merge with.
    fn check_blocks(&self) -> Result<Tally, String> {
        let mut tally = Tally::default();
        let deferred: std::collections::HashSet<BlockKey> =
            self.deferred_frees.iter().map(|&(key, _, _)| key).collect();
        if !deferred.is_empty() && !self.pools.capture_underway() {
            return Err(format!(
                "{} frees deferred with no capture under way",
                deferred.len()
            ));
        }
        for (key, block) in self.arena.blocks() {
            // Blocks never leave their segment's memory pool: a pool's memory serves only
            // that pool's allocations.
            let segment_pool = self
                .streams
                .pool(self.arena.segment(block.segment()).stream());
            if self.streams.pool(block.owner()) != segment_pool {
                return Err(format!(
                    "block {key} is owned by a slot of {:?} in a segment of {segment_pool:?}",
                    self.streams.pool(block.owner())
                ));
            }
            if block.is_lent() {
                if !block.pending().is_empty() || !block.uses().is_empty() {
                    return Err(format!("lent block {key} carries events or uses"));
                }
                tally.lent.insert(key);
                continue;
            }
            if block.is_unmapped() {
                self.check_unmapped(key)?;
                tally.unmapped_bytes += block.size();
                tally.unmapped_blocks += 1;
                continue;
            }
            if deferred.contains(&key) {
                // Freed during a capture; counted as pending until its events are recorded.
                if !block.is_allocated() || self.allocated.get(&block.addr()) == Some(&key) {
                    return Err(format!("deferred block {key} is listed or handed out"));
                }
                tally.pending += block.size();
                continue;
            }
            if block.is_allocated() {
                if self.allocated.get(&block.addr()) == Some(&key) {
                    tally.requested += block.requested();
                }
                tally.allocated += block.size();
                if !block.pending().is_empty() {
                    return Err(format!("allocated block {key} carries pending events"));
                }
                continue;
            }
            if !block.uses().is_empty() {
                return Err(format!("free block {key} has uses"));
            }
            if block.is_hot() {
                let hot = &self.streams.get(block.owner()).hot;
                if !block.pending().is_empty() || hot.keys().filter(|k| *k == key).count() != 1 {
                    return Err(format!(
                        "hot block {key} is not once in its owner's hot list, or is pending"
                    ));
                }
                tally.hot += 1;
                continue;
            }
            let pending = !block.pending().is_empty();
            let state = self.streams.get(block.owner());
            let list = if pending {
                &state.pending[block.pool() as usize]
            } else {
                &state.ready[block.pool() as usize]
            };
            if !list.contains(block.size(), block.addr(), key) {
                return Err(format!("free block {key} is not in its list"));
            }
            // Listed free blocks are merged with every neighbour they may merge with, so a
            // split remainder can be listed as it is (`State::hand_out`).
            if let Some(next) = block.next() {
                if self.mergeable(key, next) {
                    return Err(format!(
                        "free blocks {key} and {next} are adjacent and unmerged"
                    ));
                }
            }
            tally.listed += 1;
            if pending {
                tally.pending += block.size();
            }
            for event in block.pending() {
                *tally.event_refs.entry(*event).or_default() += 1;
            }
        }
        Ok(tally)
    }

    /// The free and hot lists hold exactly the free and hot blocks.
    fn check_lists(&self, tally: &Tally) -> Result<(), String> {
        let listed: usize = self
            .streams
            .states
            .iter()
            .map(|s| {
                s.ready
                    .iter()
                    .chain(s.pending.iter())
                    .map(|l| l.len())
                    .sum::<usize>()
            })
            .sum();
        if listed != tally.listed {
            return Err(format!(
                "{listed} blocks listed, {} free blocks exist",
                tally.listed
            ));
        }
        let hot: usize = self.streams.states.iter().map(|s| s.hot.len()).sum();
        if hot != tally.hot {
            return Err(format!(
                "{hot} blocks in hot lists, {} hot blocks exist",
                tally.hot
            ));
        }
        Ok(())
    }

    /// The address map holds exactly the handed-out (unquarantined) and hot blocks, each at
    /// its own address.
    fn check_address_map(&self) -> Result<(), String> {
        for (&addr, &key) in &self.allocated {
            match self.arena.get_block(key) {
                Some(block) if block.addr() == addr && (block.is_allocated() || block.is_hot()) => {
                }
                _ => return Err(format!("allocated map sends {addr:#x} to block {key}")),
            }
        }
        let hot_missing = self
            .arena
            .blocks()
            .filter(|(key, block)| block.is_hot() && self.allocated.get(&block.addr()) != Some(key))
            .count();
        if hot_missing != 0 {
            return Err(format!(
                "{hot_missing} hot blocks missing from the allocated map"
            ));
        }
        Ok(())
    }

    /// Every outstanding event is held by a free block or a stream's in-flight list, and
    /// nothing holds an event that is not outstanding.
    fn check_events(&self, mut event_refs: HashMap<EventKey, u32>) -> Result<(), String> {
        for (slot, state) in self.streams.states.iter().enumerate() {
            if state.has_events() && !state.in_event_slots() {
                return Err(format!(
                    "stream slot {slot} has events, fences or unfenced frees but is not among \
                     the event slots: completion passes would never visit it"
                ));
            }
            for event in state.in_flight.iter().copied().chain(state.fences.events()) {
                *event_refs.entry(event).or_default() += 1;
            }
        }
        for stitch in self.stitches.dormant() {
            for event in &stitch.last_use {
                *event_refs.entry(*event).or_default() += 1;
            }
        }
        if event_refs.len() != self.events.outstanding() {
            return Err(format!(
                "{} events referenced, {} outstanding",
                event_refs.len(),
                self.events.outstanding()
            ));
        }
        Ok(())
    }

    /// The expandable segments' index holds every unmapped stretch, and the mapped count is
    /// what the segments map.
    fn check_expandable(&self, tally: &Tally) -> Result<(), String> {
        let indexed: usize = self.growth.expandable().map_or(0, |vmm| {
            vmm.segments()
                .map(|segment| vmm.unmapped(segment).len())
                .sum()
        });
        if indexed != tally.unmapped_blocks {
            return Err(format!(
                "{indexed} unmapped blocks indexed, {} exist",
                tally.unmapped_blocks
            ));
        }
        let expandable_size: u64 = self
            .arena
            .segments()
            .filter(|(_, s)| s.is_expandable())
            .map(|(_, s)| s.size())
            .sum();
        let mapped = self.growth.expandable().map_or(0, |vmm| vmm.mapped);
        // Sleeping pools' pages are not mapped, and their blocks stay (`sleep`).
        let segments_map = expandable_size - tally.unmapped_bytes - self.sleeping_bytes();
        if mapped != segments_map {
            return Err(format!(
                "{mapped} bytes counted mapped, the segments map {segments_map}"
            ));
        }
        Ok(())
    }

    /// The statistics' current values are what the blocks and events add up to.
    fn check_stats(&self, tally: &Tally) -> Result<(), String> {
        let stats = &self.stats;
        // A stitched range reserves nothing: its pages are counted where they were mapped
        // first.
        let reserved: u64 = self
            .arena
            .segments()
            .filter(|(_, s)| !s.is_stitched())
            .map(|(_, s)| s.size())
            .sum::<u64>()
            - tally.unmapped_bytes
            - self.sleeping_bytes();
        let checks = [
            (
                "allocated_bytes",
                stats.allocated_bytes.current,
                tally.allocated,
            ),
            (
                "requested_bytes",
                stats.requested_bytes.current,
                tally.requested,
            ),
            ("reserved_bytes", stats.reserved_bytes.current, reserved),
            (
                "pending_free_bytes",
                stats.pending_free_bytes.current,
                tally.pending,
            ),
            (
                "active_bytes",
                stats.active_bytes.current,
                tally.allocated + tally.pending,
            ),
            (
                "events_outstanding",
                stats.events_outstanding,
                self.events.outstanding() as u64,
            ),
            (
                "event objects",
                stats.events_created - stats.events_destroyed,
                (self.events.outstanding() + self.events.idle()) as u64,
            ),
        ];
        for (name, counted, summed) in checks {
            if counted != summed {
                return Err(format!(
                    "{name} is {counted} but the blocks add up to {summed}"
                ));
            }
        }
        Ok(())
    }

    /// Stitched ranges: every stitched segment is an active stitch, one block of its size,
    /// in its pool; the pages of an active stitch are exactly its lent blocks, whole pages
    /// of expandable segments of the same pool, and no block is lent twice or to nobody;
    /// a dormant stitch's pages are all still mapped.
    fn check_stitches(&self, tally: &Tally) -> Result<(), String> {
        let mut lent_seen = std::collections::HashSet::new();
        let page = self.growth.expandable().map_or(1, |vmm| vmm.page);
        for (segment, seg) in self.arena.segments() {
            if !seg.is_stitched() {
                continue;
            }
            let Some(stitch) = self.stitches.active(segment) else {
                return Err(format!("stitched segment {segment} has no active stitch"));
            };
            let head = self.arena.block(seg.head());
            if head.next().is_some() || stitch.addr != seg.addr() || stitch.size != seg.size() {
                return Err(format!(
                    "stitched segment {segment} is not one block of its stitch"
                ));
            }
            if self.streams.pool(seg.stream()) != stitch.memory_pool {
                return Err(format!(
                    "stitched segment {segment} serves another pool than its pages"
                ));
            }
            for (source, &key) in stitch.sources.iter().zip(&stitch.lent) {
                let Some(block) = self.arena.get_block(key) else {
                    return Err(format!(
                        "stitch at {:#x} lends a missing block",
                        stitch.addr
                    ));
                };
                let owner_pool = self
                    .streams
                    .pool(self.arena.segment(block.segment()).stream());
                if !block.is_lent()
                    || block.addr() != source.addr
                    || block.size() != source.len
                    || block.segment() != source.segment
                    || !block.is_expandable()
                    || !source.addr.is_multiple_of(page)
                    || !source.len.is_multiple_of(page)
                    || owner_pool != stitch.memory_pool
                    || !lent_seen.insert(key)
                {
                    return Err(format!(
                        "stitch at {:#x}: block {key} is not its lent pages at {:#x} (+{:#x}) in its pool, or is lent twice",
                        stitch.addr, source.addr, source.len
                    ));
                }
            }
        }
        if self.stitches.actives().count()
            != self
                .arena
                .segments()
                .filter(|(_, seg)| seg.is_stitched())
                .count()
        {
            return Err("an active stitch has no stitched segment".into());
        }
        if lent_seen != tally.lent {
            return Err(format!(
                "{} blocks are lent, active stitches account for {}",
                tally.lent.len(),
                lent_seen.len()
            ));
        }
        for stitch in self.stitches.dormant() {
            for source in &stitch.sources {
                let unmapped = self.arena.segment_blocks(source.segment).any(|(_, b)| {
                    b.is_unmapped()
                        && b.addr() < source.addr + source.len
                        && source.addr < b.addr() + b.size()
                });
                if unmapped {
                    return Err(format!(
                        "dormant stitch at {:#x} maps pages at {:#x} that were unmapped",
                        stitch.addr, source.addr
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks one unmapped block: free, page-aligned, in an expandable segment, indexed,
    /// not listed, and not adjacent to another unmapped block.
    fn check_unmapped(&self, key: BlockKey) -> Result<(), String> {
        let block = self.arena.block(key);
        let Some(vmm) = self.growth.expandable() else {
            return Err(format!("unmapped block {key} without expandable segments"));
        };
        if !vmm.contains(block.segment()) || !block.is_expandable() {
            return Err(format!(
                "unmapped block {key} outside an expandable segment"
            ));
        }
        if block.is_allocated() || !block.pending().is_empty() || !block.uses().is_empty() {
            return Err(format!("unmapped block {key} is in use"));
        }
        if !block.addr().is_multiple_of(vmm.page) || !block.size().is_multiple_of(vmm.page) {
            return Err(format!("unmapped block {key} is not page-aligned"));
        }
        if vmm.unmapped(block.segment()).get(&block.addr()) != Some(&key) {
            return Err(format!("unmapped block {key} is not indexed"));
        }
        let pool = block.pool() as usize;
        let state = self.streams.get(block.owner());
        if state.ready[pool].contains(block.size(), block.addr(), key)
            || state.pending[pool].contains(block.size(), block.addr(), key)
        {
            return Err(format!("unmapped block {key} is in a free list"));
        }
        let neighbours = [block.prev(), block.next()];
        if neighbours
            .iter()
            .flatten()
            .any(|&n| self.arena.block(n).is_unmapped())
        {
            return Err(format!("unmapped block {key} borders another"));
        }
        Ok(())
    }
}
