//! Reporting: the out-of-memory report, trace records, snapshots, and the invariant check
//! that the property tests run after every operation.

use super::*;

impl State {
    #[cold]
    pub(super) fn out_of_memory<B: Backend>(
        &mut self,
        backend: &B,
        requested: u64,
        slot: StreamSlot,
    ) -> OutOfMemory {
        let (mut free_cached, mut largest) = (0, 0);
        for state in &self.streams.states {
            for list in state.ready.iter().chain(state.pending.iter()) {
                free_cached += list.bytes();
                largest = largest.max(list.largest());
            }
        }
        self.stats.ooms += 1;
        self.note(backend, TraceAction::Oom, 0, requested, slot);
        let report = OutOfMemory {
            requested,
            stream: self.streams.id(slot),
            free_cached,
            largest_free_block: largest,
            reserved: self.stats.reserved_bytes.current,
            allocated: self.stats.allocated_bytes.current,
            limit: self.limit,
            expandable: self.vmm.is_some(),
        };
        tracing::warn!(%report, "allocation failed");
        report
    }

    /// The clock for a trace record taken under the lock (0 when not tracing).
    #[inline]
    pub(super) fn clock<B: Backend>(&self, backend: &B) -> u64 {
        if self.trace.enabled() {
            backend.now_ns()
        } else {
            0
        }
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
            self.trace.push(action, addr, size, slot, backend.now_ns());
        }
    }

    pub(super) fn snapshot<B: Backend>(&mut self, backend: &B, config: &Config) -> Snapshot {
        let mut segments: Vec<SegmentInfo> = self
            .arena
            .segments
            .iter()
            .map(|(segment, seg)| SegmentInfo {
                addr: DevicePtr(seg.addr),
                // An expandable segment reports the memory mapped into it, and only the
                // blocks on mapped pages.
                size: self
                    .arena
                    .segment_blocks(segment)
                    .filter(|(_, block)| !block.is_unmapped())
                    .map(|(_, block)| block.size)
                    .sum(),
                pool: seg.pool,
                mempool: self.streams.pool(seg.stream),
                expandable: seg.expandable,
                stream: self.streams.id(seg.stream),
                blocks: self
                    .arena
                    .segment_blocks(segment)
                    .filter(|(_, block)| !block.is_unmapped())
                    .map(|(_, block)| BlockInfo {
                        addr: DevicePtr(block.addr),
                        size: block.size,
                        requested: block.requested,
                        state: if block.is_allocated() {
                            BlockState::ActiveAllocated
                        } else if block.pending.is_empty() {
                            BlockState::Inactive
                        } else {
                            BlockState::ActivePendingFree
                        },
                        stream: self.streams.id(block.stream),
                        pending_events: block.pending.len() as u32,
                    })
                    .collect(),
            })
            .collect();
        segments.sort_by_key(|s| s.addr);
        Snapshot {
            config: config.clone(),
            stats: self.stats,
            segments,
            trace: self.trace.entries(|slot| self.streams.id(slot)),
            trace_dropped: self.trace.dropped(),
            time_ns: backend.now_ns(),
        }
    }

    pub(super) fn check_invariants(&self) -> Result<(), String> {
        self.arena.validate()?;
        let (mut allocated, mut requested, mut pending_bytes, mut listed) =
            (0u64, 0u64, 0u64, 0usize);
        let mut hot_blocks = 0usize;
        let mut event_refs: HashMap<EventKey, u32> = HashMap::new();
        let (mut unmapped_bytes, mut unmapped_blocks) = (0u64, 0usize);
        let deferred: std::collections::HashSet<BlockKey> =
            self.deferred_frees.iter().map(|&(key, _, _)| key).collect();
        if !deferred.is_empty() && !self.pools.capture_underway() {
            return Err(format!(
                "{} frees deferred with no capture under way",
                deferred.len()
            ));
        }
        for (key, block) in &self.arena.blocks {
            let pool = block.pool;
            // Blocks never leave their segment's memory pool: a pool's memory serves only
            // that pool's allocations.
            let segment_pool = self
                .streams
                .pool(self.arena.segments[block.segment()].stream);
            if self.streams.pool(block.stream) != segment_pool {
                return Err(format!(
                    "block {key} is owned by a slot of {:?} in a segment of {segment_pool:?}",
                    self.streams.pool(block.stream)
                ));
            }
            if block.is_unmapped() {
                self.check_unmapped(key)?;
                unmapped_bytes += block.size;
                unmapped_blocks += 1;
                continue;
            }
            if deferred.contains(&key) {
                // Freed during a capture; counted as pending until its events are recorded.
                if !block.is_allocated() || self.allocated.get(&block.addr) == Some(&key) {
                    return Err(format!("deferred block {key} is listed or handed out"));
                }
                pending_bytes += block.size;
                continue;
            }
            if block.is_allocated() {
                if self.allocated.get(&block.addr) == Some(&key) {
                    requested += block.requested;
                }
                allocated += block.size;
                if !block.pending.is_empty() {
                    return Err(format!("allocated block {key} carries pending events"));
                }
                continue;
            }
            if !block.uses.is_empty() {
                return Err(format!("free block {key} has uses"));
            }
            if block.is_hot() {
                let hot = &self.streams.get(block.stream).hot;
                if !block.pending.is_empty() || hot.keys().filter(|k| *k == key).count() != 1 {
                    return Err(format!(
                        "hot block {key} is not once in its owner's hot list, or is pending"
                    ));
                }
                hot_blocks += 1;
                continue;
            }
            let pending = !block.pending.is_empty();
            let state = self.streams.get(block.stream);
            let list = if pending {
                &state.pending[pool as usize]
            } else {
                &state.ready[pool as usize]
            };
            if !list.contains(block.size, block.addr, key) {
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
            listed += 1;
            if pending {
                pending_bytes += block.size;
            }
            for event in &block.pending {
                *event_refs.entry(*event).or_default() += 1;
            }
        }
        let total_listed: usize = self
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
        let total_hot: usize = self.streams.states.iter().map(|s| s.hot.len()).sum();
        if total_hot != hot_blocks {
            return Err(format!(
                "{total_hot} blocks in hot lists, {hot_blocks} hot blocks exist"
            ));
        }
        // The allocated map holds exactly the handed-out (unquarantined) and hot blocks, each
        // at its own address.
        for (&addr, &key) in &self.allocated {
            match self.arena.blocks.get(key) {
                Some(block) if block.addr == addr && (block.is_allocated() || block.is_hot()) => {}
                _ => return Err(format!("allocated map sends {addr:#x} to block {key}")),
            }
            if self.arena.blocks[key].is_hot() && self.arena.blocks[key].is_allocated() {
                return Err(format!("hot block {key} is allocated"));
            }
        }
        let hot_unmapped = self
            .arena
            .blocks
            .iter()
            .filter(|(key, block)| block.is_hot() && self.allocated.get(&block.addr) != Some(key))
            .count();
        if hot_unmapped != 0 {
            return Err(format!(
                "{hot_unmapped} hot blocks missing from the allocated map"
            ));
        }
        if total_listed != listed {
            return Err(format!(
                "{total_listed} blocks listed, {listed} free blocks exist"
            ));
        }
        for state in &self.streams.states {
            for event in &state.in_flight {
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
        let indexed: usize = self.vmm.as_ref().map_or(0, |vmm| {
            vmm.segments()
                .map(|segment| vmm.unmapped(segment).len())
                .sum()
        });
        if indexed != unmapped_blocks {
            return Err(format!(
                "{indexed} unmapped blocks indexed, {unmapped_blocks} exist"
            ));
        }
        let expandable_size: u64 = self
            .arena
            .segments
            .iter()
            .filter(|(_, s)| s.expandable)
            .map(|(_, s)| s.size)
            .sum();
        let mapped = self.vmm.as_ref().map_or(0, |vmm| vmm.mapped);
        if mapped != expandable_size - unmapped_bytes {
            return Err(format!(
                "{mapped} bytes counted mapped, the segments map {}",
                expandable_size - unmapped_bytes
            ));
        }
        let stats = &self.stats;
        let reserved: u64 =
            self.arena.segments.iter().map(|(_, s)| s.size).sum::<u64>() - unmapped_bytes;
        let checks = [
            ("allocated_bytes", stats.allocated_bytes.current, allocated),
            ("requested_bytes", stats.requested_bytes.current, requested),
            ("reserved_bytes", stats.reserved_bytes.current, reserved),
            (
                "pending_free_bytes",
                stats.pending_free_bytes.current,
                pending_bytes,
            ),
            (
                "active_bytes",
                stats.active_bytes.current,
                allocated + pending_bytes,
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

    /// Checks one unmapped block: free, page-aligned, in an expandable segment, indexed,
    /// not listed, and not adjacent to another unmapped block.
    pub(super) fn check_unmapped(&self, key: BlockKey) -> Result<(), String> {
        let block = &self.arena.blocks[key];
        let Some(vmm) = self.vmm.as_ref() else {
            return Err(format!("unmapped block {key} without expandable segments"));
        };
        if !vmm.contains(block.segment()) || !block.expandable {
            return Err(format!(
                "unmapped block {key} outside an expandable segment"
            ));
        }
        if block.is_allocated() || !block.pending.is_empty() || !block.uses.is_empty() {
            return Err(format!("unmapped block {key} is in use"));
        }
        if !block.addr.is_multiple_of(vmm.page) || !block.size.is_multiple_of(vmm.page) {
            return Err(format!("unmapped block {key} is not page-aligned"));
        }
        if vmm.unmapped(block.segment()).get(&block.addr) != Some(&key) {
            return Err(format!("unmapped block {key} is not indexed"));
        }
        let pool = block.pool as usize;
        let state = self.streams.get(block.stream);
        if state.ready[pool].contains(block.size, block.addr, key)
            || state.pending[pool].contains(block.size, block.addr, key)
        {
            return Err(format!("unmapped block {key} is in a free list"));
        }
        let neighbours = [block.prev(), block.next()];
        if neighbours
            .iter()
            .flatten()
            .any(|&n| self.arena.blocks[n].is_unmapped())
        {
            return Err(format!("unmapped block {key} borders another"));
        }
        Ok(())
    }
}
