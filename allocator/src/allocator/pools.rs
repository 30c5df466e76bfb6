//! Memory pools, the policy side: the engine's pool calls (uses, rules, checkpoints),
//! what a pool's blocks are, checkpoints of a pool and putting a pool back to one, and
//! forgetting pools that hold nothing.
//!
//! The isolation itself needs no code here: a slot is a stream in one pool, blocks stay
//! with slots of their segment's pool, and releases skip pools with uses left
//! (`release::Release`). See `lifetime::pools` for why.

use super::*;

/// One live allocation of a pool, as a checkpoint keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolBlock {
    /// First byte.
    pub ptr: DevicePtr,
    /// Bytes reserved for it (rounded).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The stream it belongs to.
    pub stream: StreamId,
}

/// The engine's memory-pool calls (PyTorch's `MempoolId_t` API).
impl<B: Backend> Allocator<B> {
    /// Creates memory pool `pool` with one use, or adds a use to it (PyTorch's
    /// `createOrIncrefPool`; a graph capture into the pool adds one too). Returns the new
    /// use count.
    pub fn create_or_incref_pool(&self, pool: PoolId) -> Result<u32, AllocError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("created or referenced"));
        }
        Ok(self.state.lock().pools.incref(pool))
    }

    /// A graph capture into `pool`, or a `use_mem_pool` context, begins (PyTorch's
    /// `beginAllocateToPool`): creates the pool or adds a use, as PyTorch does. Until the
    /// matching [`Allocator::end_allocate_to_pool`], a capture may be under way on any
    /// stream, and in CUDA's global capture mode that forbids event queries, waits on a
    /// capturing stream's events and synchronisation everywhere: the engine makes none of
    /// them, reuses no block across streams, releases no cached memory, and defers the
    /// events of blocks freed with other-stream uses. Returns the pool's use count.
    pub fn begin_allocate_to_pool(&self, pool: PoolId) -> Result<u32, AllocError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("allocated to as a pool"));
        }
        Ok(self.state.lock().pools.begin(pool))
    }

    /// Ends the newest [`Allocator::begin_allocate_to_pool`] of `pool` (PyTorch's
    /// `endAllocateToPool`); the pool keeps its use until released. When no capture is
    /// under way any more, frees deferred during captures get their events.
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        self.operation(|state| {
            if !state.pools.end(pool) {
                return Err(AllocError::UnknownPool(pool));
            }
            if !state.pools.capture_underway() {
                state.complete_deferred_frees(&self.backend)?;
            }
            Ok(())
        })
    }

    /// Drops a use of `pool` (PyTorch's `releasePool`). At zero its memory stops being
    /// reserved for it: [`Allocator::empty_cache`] returns its wholly free segments, and
    /// blocks still allocated in it follow once freed. Returns the remaining use count.
    pub fn release_pool(&self, pool: PoolId) -> Result<u32, AllocError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("released"));
        }
        self.state
            .lock()
            .pools
            .release(pool)
            .ok_or(AllocError::UnknownPool(pool))
    }

    /// Makes `pool` grow by whole segments from [`Segments::alloc_segment`](crate::backend::Segments::alloc_segment) (given back with
    /// [`Segments::free_segment`](crate::backend::Segments::free_segment)) whatever `expandable_segments` says: what a pool whose
    /// segments come from another allocator needs (PyTorch's `MemPool(allocator=...)`,
    /// whose segments its allocator makes whole whatever the default pool does). Set
    /// before the pool allocates; the pool keeps the rule until it is forgotten.
    pub fn set_pool_whole_segments(&self, pool: PoolId) -> Result<(), AllocError> {
        self.set_pool_rule(
            pool,
            "growing by whole segments",
            PoolTable::set_whole_segments,
        )
    }

    /// Makes `pool` never split a block (PyTorch's `MemPool(no_split=True)`): each block is
    /// a whole segment, sized to its request rounded to 2 MiB, handed out whole. Set
    /// before the pool allocates.
    pub fn set_pool_no_split(&self, pool: PoolId) -> Result<(), AllocError> {
        self.set_pool_rule(pool, "no_split", PoolTable::set_no_split)
    }

    fn set_pool_rule(
        &self,
        pool: PoolId,
        rule: &'static str,
        set: fn(&mut PoolTable, PoolId),
    ) -> Result<(), AllocError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("given a rule of its own"));
        }
        let mut state = self.state.lock();
        if !state.pools.is_live(pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        if state.holds_memory(pool) {
            return Err(AllocError::PoolHoldsMemory { pool, rule });
        }
        set(&mut state.pools, pool);
        Ok(())
    }

    /// The use count of `pool`; 0 for a pool that does not exist or was released.
    pub fn pool_use_count(&self, pool: PoolId) -> u32 {
        self.state.lock().pools.uses(pool)
    }

    /// The addresses of `pool`'s live allocations, ascending.
    pub fn pool_live_allocations(&self, pool: PoolId) -> Vec<DevicePtr> {
        self.state.lock().pool_blocks(pool).map(|b| b.ptr).collect()
    }

    /// `pool`'s live allocations with their sizes and streams, ascending: what
    /// [`Allocator::restore_pool`] can put back.
    pub fn pool_checkpoint(&self, pool: PoolId) -> Vec<PoolBlock> {
        self.state.lock().pool_blocks(pool).collect()
    }

    /// Puts `pool` back to `checkpoint` (PyTorch's `setCheckpointPoolState`, used by CUDA
    /// graph trees): synchronises the device, frees every live allocation of the pool and
    /// allocates exactly the checkpoint's blocks again, at their addresses. Returns the
    /// addresses freed. Checked before anything changes: every checkpoint block must lie in
    /// the pool's memory, without overlapping another; a stitched range only whole (it is
    /// revived over the same pages), and no other block on the pages it maps.
    pub fn restore_pool(
        &self,
        pool: PoolId,
        checkpoint: &[PoolBlock],
    ) -> Result<Vec<DevicePtr>, AllocError> {
        let now = self.early_now();
        self.operation(|state| state.restore_pool(&self.backend, pool, checkpoint, now))
    }

    /// Synchronises the device and returns `pool`'s wholly free segments (and free
    /// mappings) to it, whatever its use count: a `torch.cuda.MemPool`'s own empty_cache.
    /// With the default pool, the same as [`Allocator::empty_cache`]. Returns the bytes
    /// released.
    pub fn empty_pool_cache(&self, pool: PoolId) -> Result<u64, AllocError> {
        let which = if pool.is_default() {
            Release::Unpinned
        } else {
            Release::Pool(pool)
        };
        Ok(self.operation(|state| state.release_cached_where(&self.backend, which))?)
    }
}

impl State {
    /// The live allocations of `pool` (quarantined blocks, allocated to nobody, excluded),
    /// ascending by address.
    pub(super) fn pool_blocks(&self, pool: PoolId) -> impl Iterator<Item = PoolBlock> + '_ {
        let mut blocks: Vec<PoolBlock> = self
            .allocated
            .iter()
            .map(|(_, &key)| self.arena.block(key))
            .filter(|block| block.is_allocated() && self.streams.pool(block.owner()) == pool)
            .map(|block| PoolBlock {
                ptr: DevicePtr(block.addr()),
                size: block.size(),
                requested: block.requested(),
                stream: self.streams.id(block.owner()),
            })
            .collect();
        blocks.sort_unstable_by_key(|b| b.ptr);
        blocks.into_iter()
    }

    /// The largest free block, ready or pending, of `pool`.
    pub(super) fn largest_free_block(&self, pool: PoolId) -> u64 {
        self.streams
            .states
            .iter()
            .filter(|state| state.pool == pool)
            .flat_map(|state| state.ready.iter().chain(state.pending.iter()))
            .map(|list| list.largest())
            .max()
            .unwrap_or(0)
    }

    /// True if some segment belongs to `pool`.
    pub(super) fn holds_memory(&self, pool: PoolId) -> bool {
        self.arena
            .segments()
            .any(|(_, seg)| self.streams.pool(seg.stream()) == pool)
    }

    /// Pools' rules hold: a pool that grows by whole segments has no expandable segment,
    /// and a pool that never splits has one block per segment.
    pub(super) fn check_pool_rules(&self) -> Result<(), String> {
        for (segment, seg) in self.arena.segments() {
            let pool = self.streams.pool(seg.stream());
            if self.pools.grows_whole(pool) && (seg.is_expandable() || seg.is_stitched()) {
                return Err(format!(
                    "{pool} grows by whole segments but holds expandable segment {segment}"
                ));
            }
            if self.pools.never_splits(pool) && self.arena.block(seg.head()).next().is_some() {
                return Err(format!(
                    "{pool} never splits but segment {segment} holds several blocks"
                ));
            }
        }
        Ok(())
    }

    /// Forgets released pools that no segment belongs to any more.
    pub(super) fn forget_empty_pools(&mut self) {
        if self.pools.len() == 0 {
            return;
        }
        let holding: std::collections::HashSet<PoolId> = self
            .arena
            .segments()
            .map(|(_, seg)| self.streams.pool(seg.stream()))
            .collect();
        self.pools.forget_empty(|pool| holding.contains(&pool));
    }

    /// See [`Allocator::restore_pool`].
    pub(super) fn restore_pool<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolId,
        checkpoint: &[PoolBlock],
        now: u64,
    ) -> Result<Vec<DevicePtr>, AllocError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("restored to a checkpoint"));
        }
        if !self.pools.is_live(pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        if let Some(tag) = self.tags.asleep(pool) {
            return Err(AllocError::Checkpoint {
                pool,
                reason: format!("it is asleep (tag {:?}): wake it first", tag.name),
            });
        }
        self.check_checkpoint(pool, checkpoint)?;
        let freed: Vec<DevicePtr> = self.pool_blocks(pool).map(|b| b.ptr).collect();
        for &ptr in &freed {
            self.free(backend, ptr, now)?;
        }
        // After a device-wide synchronisation every free byte of the pool is safe for any
        // of its streams, so its free blocks merge into maximal runs, each of which holds
        // whole checkpoint blocks.
        self.synchronize(backend)?;
        self.coalesce_across_streams();
        for block in checkpoint {
            let slot = self.streams.slot_in(block.stream, pool);
            if let Some(index) = self.dormant_stitch_at(pool, block.ptr.0, block.size) {
                // A stitched range, handed out whole: freed above, it went dormant with its
                // pages, which it alone held, free again; revived, it maps nothing.
                let need = Need {
                    slot,
                    pool: PoolKind::Large,
                    size: block.size,
                    max_size: block.size,
                };
                let key = self.revive(backend, index, need)?;
                self.hand_out_whole(key, slot, block.requested, now);
                continue;
            }
            let key = self
                .free_block_covering(pool, block.ptr.0, block.size)
                .expect("checked: the pool's memory covers every checkpoint block");
            self.unlist(key);
            let key = self.carve(key, block.ptr.0, block.size);
            self.arena.hand_out(key, slot, block.requested);
            self.allocated.insert(block.ptr.0, key);
            self.account_alloc(key, slot, block.requested, now);
        }
        Ok(freed)
    }

    /// Checks, changing nothing, that `checkpoint`'s blocks do not overlap and each lies
    /// in mapped memory of one of `pool`'s segments at block granularity.
    fn check_checkpoint(&self, pool: PoolId, checkpoint: &[PoolBlock]) -> Result<(), AllocError> {
        let refuse = |reason: String| AllocError::Checkpoint { pool, reason };
        // A checkpoint comes from outside (PyTorch's graph trees, through the C ABI): sizes
        // and alignment first, so that no sum below can overflow.
        for block in checkpoint {
            let (addr, size) = (block.ptr.0, block.size);
            if size == 0
                || !size.is_multiple_of(MIN_BLOCK_SIZE)
                || !addr.is_multiple_of(MIN_BLOCK_SIZE)
            {
                return Err(refuse(format!("block at {} has size {size}", block.ptr)));
            }
            if addr.checked_add(size).is_none() {
                return Err(refuse(format!(
                    "the block at {} of {size} bytes runs past the end of the address space",
                    block.ptr
                )));
            }
        }
        let mut sorted: Vec<&PoolBlock> = checkpoint.iter().collect();
        sorted.sort_unstable_by_key(|b| b.ptr);
        for pair in sorted.windows(2) {
            if pair[0].ptr.0 + pair[0].size > pair[1].ptr.0 {
                return Err(refuse(format!(
                    "blocks at {} and {} overlap",
                    pair[0].ptr, pair[1].ptr
                )));
            }
        }
        // Every byte the checkpoint claims: ordinary blocks where they lie, stitched ranges
        // by the pages they map; (first byte, bytes, the checkpoint block).
        let mut pages: Vec<(u64, u64, DevicePtr)> = Vec::with_capacity(checkpoint.len());
        for block in checkpoint {
            let (addr, size) = (block.ptr.0, block.size);
            let holder = self.arena.segments().find(|(_, seg)| {
                self.streams.pool(seg.stream()) == pool
                    && seg.addr() <= addr
                    && addr + size <= seg.addr() + seg.size()
            });
            let refuse_block =
                |what: &str| refuse(format!("block at {} ({size} bytes) {what}", block.ptr));
            // What holds the block decides whether it can come back, and the pages it claims:
            // an ordinary block its own bytes, a stitched range (allocated, or freed since
            // and dormant: then no segment holds it) the pages it maps.
            let stitch = match holder {
                Some((segment, seg)) if seg.is_stitched() => {
                    if seg.addr() != addr || seg.size() != size {
                        return Err(refuse_block(
                            "is part of a stitched range, which is handed out only whole",
                        ));
                    }
                    self.stitches.active(segment)
                }
                Some((segment, _)) => {
                    let mapped = self.arena.segment_blocks(segment).all(|(_, b)| {
                        !b.is_unmapped() || b.addr() + b.size() <= addr || addr + size <= b.addr()
                    });
                    if !mapped {
                        return Err(refuse_block("no longer lies in the pool's memory"));
                    }
                    None
                }
                None => match self.dormant_stitch_at(pool, addr, size) {
                    Some(index) => self.stitches.dormant().get(index),
                    None => return Err(refuse_block("no longer lies in the pool's memory")),
                },
            };
            match stitch {
                Some(_) if self.pools.capture_underway() => {
                    return Err(refuse(format!(
                        "block at {} is a stitched range, which is not revived while a capture is under way",
                        block.ptr
                    )));
                }
                Some(stitch) => {
                    pages.extend(stitch.sources.iter().map(|s| (s.addr, s.len, block.ptr)));
                }
                None => pages.push((addr, size, block.ptr)),
            }
        }
        // A stitched range maps its pages a second time: no other block may claim them.
        // Blocks do not overlap one another, nor do the pages of different stitched ranges,
        // so in address order any overlap is between neighbours.
        pages.sort_unstable_by_key(|&(addr, _, _)| addr);
        for pair in pages.windows(2) {
            let ((addr, len, first), (next, _, second)) = (pair[0], pair[1]);
            if addr + len > next {
                return Err(refuse(format!(
                    "blocks at {first} and {second} would share pages (one is a stitched range)"
                )));
            }
        }
        Ok(())
    }

    /// The dormant stitch of `pool` whose range is exactly `[addr, addr + size)`: after the
    /// restore frees the pool's blocks, the pages it maps are free (a dormant range keeps
    /// no page that was unmapped since), so it can be revived.
    fn dormant_stitch_at(&self, pool: PoolId, addr: u64, size: u64) -> Option<usize> {
        self.stitches.dormant().iter().position(|stitch| {
            stitch.memory_pool == pool && stitch.addr == addr && stitch.size == size
        })
    }

    /// The listed free block of `pool` containing `[addr, addr + size)`, if any.
    fn free_block_covering(&self, pool: PoolId, addr: u64, size: u64) -> Option<BlockKey> {
        let (segment, _) = self.arena.segments().find(|(_, seg)| {
            self.streams.pool(seg.stream()) == pool
                && seg.addr() <= addr
                && addr + size <= seg.addr() + seg.size()
        })?;
        self.arena
            .segment_blocks(segment)
            .find(|(_, b)| b.addr() <= addr && addr + size <= b.addr() + b.size())
            .filter(|(_, b)| b.is_free())
            .map(|(key, _)| key)
    }

    /// Cuts `[addr, addr + size)` out of the unlisted free block `key` (which contains it),
    /// listing what lies on either side; returns the block of exactly that range, unlisted.
    fn carve(&mut self, key: BlockKey, addr: u64, size: u64) -> BlockKey {
        let mut middle = key;
        let start = self.arena.block(key).addr();
        if addr > start {
            middle = self.arena.split(key, addr - start);
            self.list(key);
        }
        if self.arena.block(middle).size() > size {
            let tail = self.arena.split(middle, size);
            self.list(tail);
        }
        middle
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SimBackend;

    const MIB: u64 = 1 << 20;

    fn sim(expandable: bool) -> (SimBackend, Allocator<SimBackend>) {
        let device = SimBackend::new(1 << 30);
        let config = Config {
            expandable_segments: expandable,
            ..Config::default()
        };
        (device.clone(), Allocator::new(device, config).unwrap())
    }

    #[test]
    fn a_pools_blocks_never_serve_another_pool_and_its_memory_outlives_empty_cache() {
        for expandable in [false, true] {
            let (device, allocator) = sim(expandable);
            let stream = device.create_stream();
            let graph = PoolId(1, 7);
            assert_eq!(
                allocator.malloc_in(MIB, stream, graph),
                Err(AllocError::UnknownPool(graph))
            );
            assert_eq!(allocator.create_or_incref_pool(graph), Ok(1));
            let captured = allocator.malloc_in(4 * MIB, stream, graph).unwrap();
            assert_eq!(allocator.pool_live_allocations(graph), [captured.ptr]);
            allocator.free(captured.ptr).unwrap();
            assert!(allocator.pool_live_allocations(graph).is_empty());
            // Same stream, same size, but the default pool: never the graph's block.
            let eager = allocator.malloc(4 * MIB, stream).unwrap();
            let graph_range = captured.ptr.0..captured.ptr.0 + captured.size;
            assert!(
                !graph_range.contains(&eager.ptr.0),
                "expandable: {expandable}"
            );
            allocator.free(eager.ptr).unwrap();
            // The pool keeps its memory while it has a use; the default pool's goes.
            allocator.empty_cache().unwrap();
            assert_eq!(allocator.snapshot().segments.len(), 1);
            assert_eq!(allocator.snapshot().segments[0].mempool, graph);
            // Back in the pool, the graph's next capture reuses it.
            let again = allocator.malloc_in(4 * MIB, stream, graph).unwrap();
            assert_eq!(again.ptr, captured.ptr);
            allocator.free(again.ptr).unwrap();
            assert_eq!(allocator.release_pool(graph), Ok(0));
            assert_eq!(
                allocator.release_pool(graph),
                Err(AllocError::UnknownPool(graph))
            );
            allocator.empty_cache().unwrap();
            assert_eq!(allocator.stats().reserved_bytes.current, 0);
            assert_eq!(device.reserved(), 0);
            allocator.check_invariants().unwrap();
        }
    }

    #[test]
    fn a_block_allocated_in_a_released_pool_returns_to_it_and_then_to_the_device() {
        let (device, allocator) = sim(false);
        let stream = device.create_stream();
        let pool = PoolId(2, 0);
        allocator.create_or_incref_pool(pool).unwrap();
        let output = allocator.malloc_in(3 * MIB, stream, pool).unwrap();
        allocator.release_pool(pool).unwrap();
        assert_eq!(
            allocator.malloc_in(MIB, stream, pool),
            Err(AllocError::UnknownPool(pool)),
            "a released pool takes no new allocations"
        );
        allocator.empty_cache().unwrap();
        assert!(device.reserved() > 0, "its block is still live");
        allocator.free(output.ptr).unwrap();
        allocator.empty_cache().unwrap();
        assert_eq!(device.reserved(), 0);
        allocator.check_invariants().unwrap();
    }

    #[test]
    fn a_pool_goes_back_to_its_checkpoint() {
        let (device, allocator) = sim(false);
        let (first, second) = (device.create_stream(), device.create_stream());
        let pool = PoolId(5, 0);
        allocator.create_or_incref_pool(pool).unwrap();
        let a = allocator.malloc_in(2 * MIB, first, pool).unwrap();
        let b = allocator.malloc_in(6 * MIB, second, pool).unwrap();
        let checkpoint = allocator.pool_checkpoint(pool);
        assert_eq!(checkpoint.len(), 2);
        allocator.free(a.ptr).unwrap();
        let c = allocator.malloc_in(MIB, first, pool).unwrap();
        let freed = allocator.restore_pool(pool, &checkpoint).unwrap();
        let mut expected = vec![b.ptr, c.ptr];
        expected.sort();
        assert_eq!(freed, expected);
        assert_eq!(allocator.pool_checkpoint(pool), checkpoint);
        allocator.check_invariants().unwrap();
        // A checkpoint outside the pool's memory is refused, and nothing changes.
        let mut stray = checkpoint.clone();
        stray[0].ptr = DevicePtr(stray[0].ptr.0 + (1 << 40));
        assert!(matches!(
            allocator.restore_pool(pool, &stray),
            Err(AllocError::Checkpoint { .. })
        ));
        assert_eq!(allocator.pool_checkpoint(pool), checkpoint);
        for block in checkpoint {
            allocator.free(block.ptr).unwrap();
        }
        allocator.release_pool(pool).unwrap();
        allocator.empty_cache().unwrap();
        assert_eq!(device.reserved(), 0);
        assert!(device.races().is_empty(), "{:?}", device.races());
    }

    #[test]
    fn frees_with_other_stream_uses_wait_for_the_capture_to_end() {
        let (device, allocator) = sim(false);
        let (capture, comm) = (device.create_stream(), device.create_stream());
        let graph = PoolId(8, 0);
        let sent = allocator.malloc(4 * MIB, comm).unwrap();
        allocator.record_use(sent.ptr, capture).unwrap();
        assert_eq!(allocator.begin_allocate_to_pool(graph), Ok(1));
        device.begin_capture(capture);
        allocator.free(sent.ptr).unwrap();
        // No event may be recorded on the capturing stream: the block waits, counted as
        // pending, and no allocation can take it.
        assert_eq!(device.calls("record_event"), 0);
        assert_eq!(allocator.stats().pending_free_bytes.current, sent.size);
        allocator.check_invariants().unwrap();
        let other = allocator.malloc(4 * MIB, comm).unwrap();
        assert_ne!(other.ptr, sent.ptr);
        device.end_capture(capture);
        allocator.end_allocate_to_pool(graph).unwrap();
        assert_eq!(
            device.calls("record_event"),
            1,
            "recorded once the capture ended"
        );
        allocator.check_invariants().unwrap();
        allocator.free(other.ptr).unwrap();
        assert_eq!(
            allocator.end_allocate_to_pool(graph),
            Err(AllocError::UnknownPool(graph)),
            "no begin left to end"
        );
        allocator.release_pool(graph).unwrap();
        allocator.empty_cache().unwrap();
        assert_eq!(device.reserved(), 0);
        assert!(device.races().is_empty(), "{:?}", device.races());
    }

    #[test]
    fn a_live_user_pool_is_emptied_only_when_named() {
        let (device, allocator) = sim(true);
        let stream = device.create_stream();
        let pool = PoolId(0, 9);
        allocator.create_or_incref_pool(pool).unwrap();
        let block = allocator.malloc_in(8 * MIB, stream, pool).unwrap();
        allocator.free(block.ptr).unwrap();
        allocator.empty_cache().unwrap();
        assert!(device.mapped() > 0, "a live pool keeps its pages mapped");
        allocator.empty_pool_cache(pool).unwrap();
        assert_eq!(device.mapped(), 0);
        allocator.check_invariants().unwrap();
    }
}
