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

use crate::types::{EventKey, PoolKind};
use slab::Slab;
use thin_vec::ThinVec;

/// Index of a block in the arena.
pub(crate) type BlockKey = usize;
/// Index of a segment in the arena.
pub(crate) type SegmentKey = usize;
/// Index of a stream in the allocator's stream table.
pub(crate) type StreamSlot = u32;

/// A contiguous range of a segment, allocated or free.
///
/// One cache line: the fast paths touch a few blocks per call (the one handed out or
/// freed, its neighbours, a split remainder), so links and the segment index are 32-bit,
/// the rarely used lists are thin (one pointer, no allocation while empty), and the
/// segment's pool and kind are copied here so that listing a block reads no segment.
#[derive(Debug, Clone)]
#[repr(align(64))]
pub(crate) struct Block {
    /// First byte.
    pub(crate) addr: u64,
    /// Bytes, a multiple of the minimum block size.
    pub(crate) size: u64,
    /// Bytes the caller asked for (0 while free).
    pub(crate) requested: u64,
    /// While allocated: other streams recorded as using it (`record_use`), deduplicated.
    pub(crate) uses: ThinVec<StreamSlot>,
    /// While free: events, one per former use stream, that must complete (or be waited on)
    /// before any stream reuses these bytes. Empty for a block that is ready for its owner.
    pub(crate) pending: ThinVec<EventKey>,
    /// The segment this block tiles.
    segment: Link,
    /// The block just below in the segment, if any.
    prev: Link,
    /// The block just above in the segment, if any.
    next: Link,
    /// The owning stream: while allocated, the stream it was allocated on; while free, the
    /// stream whose free list holds it. The owner may reuse it with no event.
    pub(crate) stream: StreamSlot,
    /// Its segment's pool.
    pub(crate) pool: PoolKind,
    /// Its segment is expandable.
    pub(crate) expandable: bool,
    /// Which of the allocator's structures may hold the block (see [`BlockUse`]).
    pub(crate) state: BlockUse,
}

const _: () = assert!(std::mem::size_of::<Block>() == 64);

/// What a block is doing. One field instead of independent flags, so that no block can be
/// both handed out and parked, or unmapped and listed: each state names the one structure
/// that may hold the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockUse {
    /// Handed to a caller and not yet freed: in the allocator's address map only.
    Allocated,
    /// Free, ready for its owner and unmerged, parked in the owner's hot list (see
    /// `lifetime::streams::StreamState::hot`) and still in the address map; never merged
    /// while there.
    Hot,
    /// Free and mapped: in its owner's free lists (ready, or pending on events), or being
    /// moved between them.
    Free,
    /// A stretch of an expandable segment with no pages mapped (see [`super::expandable`]):
    /// page-aligned and in no free list.
    Unmapped,
}

/// A block or segment index in 32 bits, `u32::MAX` for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Link(u32);

impl Link {
    const NONE: Link = Link(u32::MAX);

    /// A link to `key`. Four billion blocks would take 256 GiB of host memory first.
    #[inline]
    fn to(key: usize) -> Link {
        match u32::try_from(key) {
            Ok(link) if link != u32::MAX => Link(link),
            _ => panic!("more than 2^32 - 1 blocks or segments"),
        }
    }

    #[inline]
    fn get(self) -> Option<usize> {
        (self != Link::NONE).then_some(self.0 as usize)
    }
}

impl Block {
    /// The block just below in the segment, if any.
    #[inline]
    pub(crate) fn prev(&self) -> Option<BlockKey> {
        self.prev.get()
    }

    /// The block just above in the segment, if any.
    #[inline]
    pub(crate) fn next(&self) -> Option<BlockKey> {
        self.next.get()
    }

    /// The segment this block tiles.
    #[inline]
    pub(crate) fn segment(&self) -> SegmentKey {
        self.segment.0 as usize
    }

    /// Handed to a caller and not yet freed.
    #[inline]
    pub(crate) fn is_allocated(&self) -> bool {
        self.state == BlockUse::Allocated
    }

    /// Parked in its owner's hot list.
    #[inline]
    pub(crate) fn is_hot(&self) -> bool {
        self.state == BlockUse::Hot
    }

    /// An unmapped stretch of an expandable segment.
    #[inline]
    pub(crate) fn is_unmapped(&self) -> bool {
        self.state == BlockUse::Unmapped
    }

    /// Free and mapped: the only state in which a block may sit in a free list or merge.
    #[inline]
    pub(crate) fn is_free(&self) -> bool {
        self.state == BlockUse::Free
    }
}

/// One range obtained from the device.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    /// First byte.
    pub(crate) addr: u64,
    /// Bytes.
    pub(crate) size: u64,
    /// Small or large pool: a segment serves one pool only.
    pub(crate) pool: PoolKind,
    /// The stream whose request created it (reported in snapshots).
    pub(crate) stream: StreamSlot,
    /// The lowest block; stable for the segment's life.
    pub(crate) head: BlockKey,
    /// An address reservation with pages mapped on demand (see [`super::expandable`]);
    /// its size is the reservation's, not the memory behind it.
    pub(crate) expandable: bool,
}

/// All segments and blocks.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    pub(crate) blocks: Slab<Block>,
    pub(crate) segments: Slab<Segment>,
}

impl Arena {
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
            stream,
            pool,
            expandable,
            state: BlockUse::Free,
        });
        self.segments.insert(Segment {
            addr,
            size,
            pool,
            stream,
            head,
            expandable,
        });
        head
    }

    /// Forgets a segment tiled by a single free block; returns its address and size.
    pub(crate) fn remove_segment(&mut self, segment: SegmentKey) -> (u64, u64) {
        let seg = self.segments.remove(segment);
        let head = self.blocks.remove(seg.head);
        debug_assert!(head.next().is_none() && !head.is_allocated() && head.size == seg.size);
        (seg.addr, seg.size)
    }

    /// Cuts `key` at `size` bytes; the new right-hand block (returned) is free, owned by
    /// the same stream, mapped or not like `key`, and carries no pending events (the caller
    /// copies them if needed).
    pub(crate) fn split(&mut self, key: BlockKey, size: u64) -> BlockKey {
        let block = &self.blocks[key];
        debug_assert!(size < block.size && size.is_multiple_of(super::MIN_BLOCK_SIZE));
        let right = Block {
            addr: block.addr + size,
            size: block.size - size,
            requested: 0,
            uses: ThinVec::new(),
            pending: ThinVec::new(),
            segment: block.segment,
            prev: Link::to(key),
            next: block.next,
            stream: block.stream,
            pool: block.pool,
            expandable: block.expandable,
            state: if block.is_unmapped() {
                BlockUse::Unmapped
            } else {
                BlockUse::Free
            },
        };
        let next = right.next.get();
        let right = self.blocks.insert(right);
        if let Some(next) = next {
            self.blocks[next].prev = Link::to(right);
        }
        let block = &mut self.blocks[key];
        block.size = size;
        block.next = Link::to(right);
        right
    }

    /// Absorbs `right` (the block just above `left`) into `left` and returns `right`'s
    /// pending events for the caller to merge or release.
    pub(crate) fn merge(&mut self, left: BlockKey, right: BlockKey) -> ThinVec<EventKey> {
        let removed = self.blocks.remove(right);
        debug_assert_eq!(removed.prev(), Some(left));
        debug_assert!(!removed.is_allocated());
        if let Some(next) = removed.next() {
            self.blocks[next].prev = Link::to(left);
        }
        let block = &mut self.blocks[left];
        debug_assert_eq!(block.addr + block.size, removed.addr);
        block.size += removed.size;
        block.next = removed.next;
        removed.pending
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
}
