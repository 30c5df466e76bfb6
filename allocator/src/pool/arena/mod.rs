//! Segments and the blocks that tile them.
//!
//! A segment is one range obtained from the device. It is always tiled exactly by its
//! blocks, linked in address order through `prev`/`next`:
//! `Σ block.size over a segment == segment.size`, and `block.next.addr == block.addr +
//! block.size`. Splitting keeps the left block's key; merging keeps the left block's key
//! and removes the right one, so a segment's `head` never changes.
//!
//! The arena knows nothing of streams or events beyond the fields it stores for the
//! lifetime layer; it never decides where a free block goes.
//!
//! # The contract with the policy
//! Blocks and segments are private to this module. The policy reads them through getters
//! and changes a block only through a few named operations, each of which states the
//! transition of [`BlockUse`] it makes; debug builds check every transition against the
//! one table on [`BlockUse`], and the local tiling after every split and merge (in the
//! manner of mimalloc's debug walks), so a policy bug stops at the operation that commits
//! it. Release builds check nothing: the operations are the field writes they replace.

mod block;

pub(crate) use self::block::{Block, BlockUse, Segment};

use self::block::Link;
use crate::types::{EventKey, PoolKind};
use slab::Slab;
use thin_vec::ThinVec;

/// Index of a block in the arena.
pub(crate) type BlockKey = usize;
/// Index of a segment in the arena.
pub(crate) type SegmentKey = usize;
/// Index of a stream in the allocator's stream table.
pub(crate) type StreamSlot = u32;

/// All segments and blocks, changed only through the operations below.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    blocks: Slab<Block>,
    segments: Slab<Segment>,
}

impl Arena {
    /// The block `key`.
    #[inline]
    pub(crate) fn block(&self, key: BlockKey) -> &Block {
        &self.blocks[key]
    }

    /// The block `key`, if it exists.
    pub(crate) fn get_block(&self, key: BlockKey) -> Option<&Block> {
        self.blocks.get(key)
    }

    /// Every block, in key order.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = (BlockKey, &Block)> {
        self.blocks.iter()
    }

    /// The segment `key`.
    #[inline]
    pub(crate) fn segment(&self, key: SegmentKey) -> &Segment {
        &self.segments[key]
    }

    /// Every segment, in key order.
    pub(crate) fn segments(&self) -> impl Iterator<Item = (SegmentKey, &Segment)> {
        self.segments.iter()
    }

    // ---- State transitions (the table on `BlockUse`) -----------------------------------

    /// Moves `key` from one of `from` to `to`, checking in debug builds that it is in one
    /// of them and that the table on [`BlockUse`] allows the move; returns the block for
    /// the operation's other changes.
    #[inline]
    fn transition(
        &mut self,
        key: BlockKey,
        operation: &str,
        from: &[BlockUse],
        to: BlockUse,
    ) -> &mut Block {
        let block = &mut self.blocks[key];
        debug_assert!(
            from.contains(&block.state) && block.state.may_become(to),
            "{operation}: block {key} is {:?}; the operation takes it from {from:?} to {to:?}",
            block.state
        );
        block.state = to;
        block
    }

    /// Hands the free or hot block `key` to `owner` for a request of `requested` bytes
    /// (Free | Hot → Allocated) and returns it, for the caller's accounting. It must carry
    /// no pending events (an allocated block never does: the caller takes and settles them
    /// first) and no uses.
    #[inline]
    pub(crate) fn hand_out(&mut self, key: BlockKey, owner: StreamSlot, requested: u64) -> &Block {
        use BlockUse::{Allocated, Free, Hot};
        let block = self.transition(key, "hand_out", &[Free, Hot], Allocated);
        debug_assert!(
            block.pending.is_empty() && block.uses.is_empty(),
            "hand_out: block {key} carries pending events or uses"
        );
        block.owner = owner;
        block.requested = requested;
        block
    }

    /// Keeps the free block `key` out of circulation, allocated to nobody (Free →
    /// Allocated): a free deferred by a graph capture, or a block whose reuse could not be
    /// ordered. Its owner stays; it asks for no bytes.
    pub(crate) fn withhold(&mut self, key: BlockKey) {
        use BlockUse::{Allocated, Free};
        let block = self.transition(key, "withhold", &[Free], Allocated);
        debug_assert!(block.pending.is_empty(), "withhold: block {key} is pending");
        block.requested = 0;
    }

    /// Takes back the allocated block `key` (Allocated → Free), freed in its owner's epoch
    /// `epoch`, and returns the other streams recorded as using it.
    #[inline]
    pub(crate) fn free(&mut self, key: BlockKey, epoch: u32) -> ThinVec<StreamSlot> {
        use BlockUse::{Allocated, Free};
        let block = self.transition(key, "free", &[Allocated], Free);
        block.requested = 0;
        block.freed_epoch = epoch;
        std::mem::take(&mut block.uses)
    }

    /// Parks the free, ready block `key` in its owner's hot list (Free → Hot) and returns
    /// it, for the caller's accounting.
    #[inline]
    pub(crate) fn park_hot(&mut self, key: BlockKey) -> &Block {
        use BlockUse::{Free, Hot};
        let block = self.transition(key, "park_hot", &[Free], Hot);
        debug_assert!(block.pending.is_empty(), "park_hot: block {key} is pending");
        block
    }

    /// Takes the block `key` out of its hot list, free again (Hot → Free).
    #[inline]
    pub(crate) fn unpark(&mut self, key: BlockKey) {
        use BlockUse::{Free, Hot};
        self.transition(key, "unpark", &[Hot], Free);
    }

    /// Records that the free block `key`'s pages were unmapped (Free → Unmapped). An
    /// unmapped block carries nothing: no events, no uses, no request.
    pub(crate) fn mark_unmapped(&mut self, key: BlockKey) {
        use BlockUse::{Free, Unmapped};
        let block = self.transition(key, "mark_unmapped", &[Free], Unmapped);
        debug_assert!(
            block.expandable && block.pending.is_empty() && block.uses.is_empty(),
            "mark_unmapped: block {key} is outside an expandable segment or in use"
        );
    }

    /// Records that the unmapped block `key`'s pages were mapped for `owner`, whose free
    /// block it now is (Unmapped → Free).
    pub(crate) fn mark_mapped(&mut self, key: BlockKey, owner: StreamSlot) {
        use BlockUse::{Free, Unmapped};
        let block = self.transition(key, "mark_mapped", &[Unmapped], Free);
        block.owner = owner;
        block.freed_epoch = 0;
    }

    /// Lends the free, unlisted block `key` of whole pages to a stitched range (Free →
    /// Lent). It carries nothing while lent: the caller settled its events (the stitched
    /// range's stream waited for them).
    pub(crate) fn lend(&mut self, key: BlockKey) {
        use BlockUse::{Free, Lent};
        let block = self.transition(key, "lend", &[Free], Lent);
        debug_assert!(
            block.expandable && block.pending.is_empty() && block.uses.is_empty(),
            "lend: block {key} is outside an expandable segment or carries events"
        );
    }

    /// Takes back the lent block `key` from a stitched range that was freed, as a free
    /// block of `owner`, the stream that freed the range, in its epoch `epoch` (Lent → Free).
    pub(crate) fn take_back(&mut self, key: BlockKey, owner: StreamSlot, epoch: u32) {
        use BlockUse::{Free, Lent};
        let block = self.transition(key, "take_back", &[Lent], Free);
        block.owner = owner;
        block.freed_epoch = epoch;
    }

    /// Gives the free, unlisted block `key`, whose events were settled (its new owner's
    /// stream waited for them and for its former owner's work), to `owner`, as freed in
    /// `owner`'s epoch `epoch` (Free → Free).
    pub(crate) fn adopt(&mut self, key: BlockKey, owner: StreamSlot, epoch: u32) {
        let block = &mut self.blocks[key];
        debug_assert!(
            block.is_free() && block.pending.is_empty(),
            "adopt: block {key} is {:?} or carries events",
            block.state
        );
        block.owner = owner;
        block.freed_epoch = epoch;
    }

    /// Marks the free block `key` as idle for every stream (after a device-wide
    /// synchronisation, whoever owned it).
    pub(crate) fn mark_idle(&mut self, key: BlockKey) {
        debug_assert!(
            self.blocks[key].is_free(),
            "mark_idle: block {key} is not free"
        );
        self.blocks[key].freed_epoch = 0;
    }

    // ---- Fields that change within a state ---------------------------------------------

    /// Adds `event` to what the free block `key` waits for (each event once).
    #[inline]
    pub(crate) fn add_pending(&mut self, key: BlockKey, event: EventKey) {
        let block = &mut self.blocks[key];
        debug_assert!(
            block.is_free() && !block.pending.contains(&event),
            "add_pending: block {key} is {:?} or already waits for the event",
            block.state
        );
        block.pending.push(event);
    }

    /// Gives the split remainder `right` the events that the free block `left`, cut from
    /// the same block, waits for: the remainder needs what the whole block needed.
    pub(crate) fn copy_pending(&mut self, left: BlockKey, right: BlockKey) {
        debug_assert!(
            self.blocks[left].is_free()
                && self.blocks[right].is_free()
                && self.blocks[right].pending.is_empty()
                && self.blocks[left].next() == Some(right),
            "copy_pending: block {right} is not the fresh remainder of free block {left}"
        );
        self.blocks[right].pending = self.blocks[left].pending.clone();
    }

    /// Takes the events the free block `key` waits for, leaving it ready for any stream
    /// (the caller settles or releases them).
    #[inline]
    pub(crate) fn take_pending(&mut self, key: BlockKey) -> ThinVec<EventKey> {
        let block = &mut self.blocks[key];
        debug_assert!(
            block.is_free(),
            "take_pending: block {key} is {:?}",
            block.state
        );
        std::mem::take(&mut block.pending)
    }

    /// Records that stream `slot` uses the allocated block `key`; its owner and streams
    /// already recorded are not recorded again.
    pub(crate) fn add_use(&mut self, key: BlockKey, slot: StreamSlot) {
        let block = &mut self.blocks[key];
        debug_assert!(
            block.is_allocated(),
            "add_use: block {key} is {:?}",
            block.state
        );
        if slot != block.owner && !block.uses.contains(&slot) {
            block.uses.push(slot);
        }
    }

    // ---- Segments, split and merge -------------------------------------------------------

    /// Registers a new segment, tiled by one free block owned by `stream`.
    pub(crate) fn add_segment(
        &mut self,
        addr: u64,
        size: u64,
        pool: PoolKind,
        stream: StreamSlot,
        expandable: bool,
    ) -> BlockKey {
        let segment = self.segments.vacant_key();
        let head = self.blocks.insert(Block {
            addr,
            size,
            requested: 0,
            uses: ThinVec::new(),
            pending: ThinVec::new(),
            segment: Link::to(segment),
            prev: Link::NONE,
            next: Link::NONE,
            owner: stream,
            pool,
            expandable,
            stitched: false,
            state: BlockUse::Free,
            freed_epoch: 0,
        });
        self.segments.insert(Segment {
            addr,
            size,
            pool,
            stream,
            head,
            expandable,
            stitched: false,
        });
        head
    }

    /// Registers a stitched range as a segment of one free block owned by `stream`, to be
    /// handed out whole.
    pub(crate) fn add_stitched_segment(
        &mut self,
        addr: u64,
        size: u64,
        pool: PoolKind,
        stream: StreamSlot,
    ) -> BlockKey {
        let head = self.add_segment(addr, size, pool, stream, false);
        let segment = self.blocks[head].segment();
        self.blocks[head].stitched = true;
        self.segments[segment].stitched = true;
        head
    }

    /// Forgets a segment tiled by a single free or unmapped block; returns its address and
    /// size.
    pub(crate) fn remove_segment(&mut self, segment: SegmentKey) -> (u64, u64) {
        let seg = self.segments.remove(segment);
        let head = self.blocks.remove(seg.head);
        debug_assert!(
            head.next().is_none()
                && (head.is_free() || head.is_unmapped())
                && head.pending.is_empty()
                && head.size == seg.size,
            "remove_segment: segment {segment} is not one idle block"
        );
        (seg.addr, seg.size)
    }

    /// Cuts the free or unmapped block `key` at `size` bytes; the new right-hand block
    /// (returned) is free, or unmapped like `key`, owned by the same stream, and carries no pending
    /// events (the caller copies them if needed).
    pub(crate) fn split(&mut self, key: BlockKey, size: u64) -> BlockKey {
        let block = &self.blocks[key];
        debug_assert!(
            size < block.size && size.is_multiple_of(super::MIN_BLOCK_SIZE),
            "split: block {key} of {} bytes cut at {size}",
            block.size
        );
        debug_assert!(
            block.is_free() || block.is_unmapped(),
            "split: block {key} is {:?}",
            block.state
        );
        let right = Block {
            addr: block.addr + size,
            size: block.size - size,
            requested: 0,
            uses: ThinVec::new(),
            pending: ThinVec::new(),
            segment: block.segment,
            prev: Link::to(key),
            next: block.next,
            owner: block.owner,
            pool: block.pool,
            expandable: block.expandable,
            stitched: block.stitched,
            state: if block.is_unmapped() {
                BlockUse::Unmapped
            } else {
                BlockUse::Free
            },
            freed_epoch: block.freed_epoch,
        };
        let next = right.next.get();
        let right = self.blocks.insert(right);
        if let Some(next) = next {
            self.blocks[next].prev = Link::to(right);
        }
        let block = &mut self.blocks[key];
        block.size = size;
        block.next = Link::to(right);
        self.debug_check_tiling(key);
        self.debug_check_tiling(right);
        right
    }

    /// Absorbs `right` (the block just above `left`) into `left` and returns `right`'s
    /// pending events for the caller to merge or release. Both must be free, or both
    /// unmapped: an allocated or hot block never merges.
    pub(crate) fn merge(&mut self, left: BlockKey, right: BlockKey) -> ThinVec<EventKey> {
        if cfg!(debug_assertions) {
            let (below, above) = (&self.blocks[left], &self.blocks[right]);
            debug_assert!(
                below.state == above.state && (below.is_free() || below.is_unmapped()),
                "merge: blocks {left} and {right} are {:?} and {:?}",
                below.state,
                above.state
            );
            debug_assert!(
                below.next() == Some(right) && below.segment == above.segment,
                "merge: block {right} is not just above block {left} in its segment"
            );
            debug_assert!(above.uses.is_empty(), "merge: block {right} has uses");
        }
        let removed = self.blocks.remove(right);
        if let Some(next) = removed.next() {
            self.blocks[next].prev = Link::to(left);
        }
        let block = &mut self.blocks[left];
        block.size += removed.size;
        block.next = removed.next;
        block.freed_epoch =
            crate::lifetime::fences::later_epoch(block.freed_epoch, removed.freed_epoch);
        self.debug_check_tiling(left);
        removed.pending
    }

    /// Debug builds: the blocks on either side of `key` link back to it, lie in its
    /// segment and touch it with no gap or overlap. The local half of [`Arena::validate`],
    /// cheap enough to run after every split and merge.
    #[inline]
    fn debug_check_tiling(&self, key: BlockKey) {
        if !cfg!(debug_assertions) {
            return;
        }
        let block = &self.blocks[key];
        if let Some(prev) = block.prev() {
            let below = &self.blocks[prev];
            debug_assert!(
                below.next() == Some(key)
                    && below.segment == block.segment
                    && below.addr + below.size == block.addr,
                "block {prev} below block {key} does not tile with it"
            );
        }
        if let Some(next) = block.next() {
            let above = &self.blocks[next];
            debug_assert!(
                above.prev() == Some(key)
                    && above.segment == block.segment
                    && block.addr + block.size == above.addr,
                "block {next} above block {key} does not tile with it"
            );
        }
    }

    /// True if the segment is one free block.
    pub(crate) fn segment_is_free(&self, segment: SegmentKey) -> bool {
        let seg = &self.segments[segment];
        let head = &self.blocks[seg.head];
        !head.is_allocated() && head.next().is_none()
    }

    /// Blocks of a segment in address order.
    pub(crate) fn segment_blocks(
        &self,
        segment: SegmentKey,
    ) -> impl Iterator<Item = (BlockKey, &Block)> {
        let mut cursor = Some(self.segments[segment].head);
        std::iter::from_fn(move || {
            let key = cursor?;
            let block = &self.blocks[key];
            cursor = block.next();
            Some((key, block))
        })
    }

    /// Checks that every segment is tiled exactly by its blocks. Used by tests.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let mut seen = 0usize;
        for (segment, seg) in &self.segments {
            let mut expected_addr = seg.addr;
            let mut prev = None;
            for (key, block) in self.segment_blocks(segment) {
                seen += 1;
                if block.addr != expected_addr {
                    return Err(format!(
                        "block {key} at {:#x}, expected {expected_addr:#x}",
                        block.addr
                    ));
                }
                if block.prev() != prev || block.segment() != segment {
                    return Err(format!("block {key} has broken links"));
                }
                if block.size == 0 || block.size % super::MIN_BLOCK_SIZE != 0 {
                    return Err(format!("block {key} has size {}", block.size));
                }
                expected_addr += block.size;
                prev = Some(key);
            }
            if expected_addr != seg.addr + seg.size {
                return Err(format!(
                    "segment {segment} tiled to {expected_addr:#x} of {:#x}",
                    seg.addr + seg.size
                ));
            }
        }
        if seen != self.blocks.len() {
            return Err(format!(
                "{} blocks exist but {seen} tile segments",
                self.blocks.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_merge_keep_the_segment_tiled() {
        let mut arena = Arena::default();
        let head = arena.add_segment(0x10000, 4096, PoolKind::Small, 0, false);
        let right = arena.split(head, 1024);
        let middle = arena.split(right, 1024);
        arena.validate().unwrap();
        assert_eq!(arena.blocks[middle].addr, 0x10000 + 2048);
        assert!(arena.merge(right, middle).is_empty());
        assert!(arena.merge(head, right).is_empty());
        arena.validate().unwrap();
        assert!(arena.segment_is_free(0));
        assert_eq!(arena.remove_segment(0), (0x10000, 4096));
        assert!(arena.blocks.is_empty());
    }

    #[test]
    fn the_operations_follow_the_table_of_states() {
        let mut arena = Arena::default();
        let head = arena.add_segment(0x200000, 0x400000, PoolKind::Large, 0, true);
        arena.hand_out(head, 1, 1000);
        arena.add_use(head, 2);
        arena.add_use(head, 2);
        arena.add_use(head, 1);
        assert_eq!(
            arena.block(head).uses(),
            [2],
            "the owner and repeats are not uses"
        );
        assert_eq!(&arena.free(head, 1)[..], [2]);
        assert_eq!(arena.block(head).requested(), 0);
        arena.park_hot(head);
        arena.hand_out(head, 1, 512);
        arena.free(head, 1);
        arena.park_hot(head);
        arena.unpark(head);
        arena.mark_unmapped(head);
        let right = arena.split(head, 0x200000);
        assert!(arena.block(right).is_unmapped());
        assert!(arena.merge(head, right).is_empty());
        arena.mark_mapped(head, 3);
        assert!(arena.block(head).is_free() && arena.block(head).owner() == 3);
        arena.validate().unwrap();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "hand_out: block 0 is Unmapped")]
    fn an_unmapped_block_cannot_be_handed_out() {
        let mut arena = Arena::default();
        let head = arena.add_segment(0x200000, 0x200000, PoolKind::Large, 0, true);
        arena.mark_unmapped(head);
        arena.hand_out(head, 0, 512);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "merge: blocks 0 and 1 are Allocated and Free")]
    fn an_allocated_block_never_merges() {
        let mut arena = Arena::default();
        let head = arena.add_segment(0x10000, 4096, PoolKind::Small, 0, false);
        let right = arena.split(head, 1024);
        arena.hand_out(head, 0, 1000);
        arena.merge(head, right);
    }
}
