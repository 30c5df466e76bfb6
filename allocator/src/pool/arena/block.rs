//! The records the arena keeps: a block (one cache line) and a segment, read through
//! getters, and the table of a block's states. Their fields are the arena's alone to
//! write (see the contract in [`super`]).

#[cfg(doc)]
use super::Arena;
use super::{BlockKey, SegmentKey, StreamSlot};
use crate::types::{EventKey, PoolKind};
use thin_vec::ThinVec;

/// A contiguous range of a segment, allocated or free.
///
/// One cache line: the fast paths touch a few blocks per call (the one handed out or
/// freed, its neighbours, a split remainder), so links and the segment index are 32-bit,
/// the rarely used lists are thin (one pointer, no allocation while empty), and the
/// segment's pool and kind are copied here so that listing a block reads no segment.
///
/// Every field is private: the policy reads them through getters and changes a block only
/// through the [`Arena`]'s named operations, each of which checks (in debug builds) the
/// state transition it makes.
#[derive(Debug, Clone)]
#[repr(align(64))]
pub(crate) struct Block {
    /// First byte.
    pub(super) addr: u64,
    /// Bytes, a multiple of the minimum block size.
    pub(super) size: u64,
    /// Bytes the caller asked for (0 while free).
    pub(super) requested: u64,
    /// While allocated: other streams recorded as using it (`record_use`), deduplicated.
    pub(super) uses: ThinVec<StreamSlot>,
    /// While free: events, one per former use stream, that must complete (or be waited on)
    /// before any stream reuses these bytes. Empty for a block that is ready for its owner.
    pub(super) pending: ThinVec<EventKey>,
    /// The segment this block tiles.
    pub(super) segment: Link,
    /// The block just below in the segment, if any.
    pub(super) prev: Link,
    /// The block just above in the segment, if any.
    pub(super) next: Link,
    /// The owning stream: while allocated, the stream it was allocated on; while free, the
    /// stream whose free list holds it. The owner may reuse it with no event.
    pub(super) owner: StreamSlot,
    /// Its segment's pool.
    pub(super) pool: PoolKind,
    /// Its segment is expandable.
    pub(super) expandable: bool,
    /// Its segment is a stitched range (see [`super::stitch`]): the block is its segment's
    /// only one, and freeing it gives its pages back to the blocks they were lent by.
    pub(super) stitched: bool,
    /// Which of the allocator's structures may hold the block (see [`BlockUse`]).
    pub(super) state: BlockUse,
    /// While free: the owner's free epoch when its bytes were last used
    /// (`lifetime::fences`); 0 for memory never used. What another stream taking it waits
    /// for. (In the line's last four bytes, which were padding.)
    pub(super) freed_epoch: u32,
}

const _: () = assert!(std::mem::size_of::<Block>() == 64);

/// What a block is doing. One field instead of independent flags, so that no block can be
/// both handed out and parked, or unmapped and listed: each state names the one structure
/// that may hold the block.
///
/// The legal transitions, and the [`Arena`] operation that makes each:
///
/// | from        | to          | operation                                                  |
/// | ----------- | ----------- | ---------------------------------------------------------- |
/// | `Free`      | `Allocated` | [`Arena::hand_out`] (to a caller), [`Arena::withhold`] (to nobody) |
/// | `Hot`       | `Allocated` | [`Arena::hand_out`] (back to its owner)                     |
/// | `Allocated` | `Free`      | [`Arena::free`]                                             |
/// | `Free`      | `Hot`       | [`Arena::park_hot`]                                         |
/// | `Hot`       | `Free`      | [`Arena::unpark`]                                           |
/// | `Free`      | `Unmapped`  | [`Arena::mark_unmapped`]                                    |
/// | `Unmapped`  | `Free`      | [`Arena::mark_mapped`]                                      |
/// | `Free`      | `Lent`      | [`Arena::lend`]                                             |
/// | `Lent`      | `Free`      | [`Arena::take_back`]                                        |
///
/// Nothing else: an unmapped block is never handed out or parked, a hot block never
/// unmapped, a lent block never touched until its stitched range is freed. [`Arena::split`] gives the new block its parent's state (`Free` or
/// `Unmapped` only) and [`Arena::merge`] joins two blocks of one of those states.
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
    /// Whole pages of an expandable segment whose physical memory is also mapped into a
    /// stitched range that is allocated (see [`super::stitch`]): in use through the other
    /// address, so in no list, never merged, split, unmapped or handed out here.
    Lent,
}

impl BlockUse {
    /// True if the table on [`BlockUse`] allows going from `self` to `to`.
    pub(super) const fn may_become(self, to: BlockUse) -> bool {
        use BlockUse::{Allocated, Free, Hot, Lent, Unmapped};
        matches!(
            (self, to),
            (Free | Hot, Allocated)
                | (Allocated | Hot | Unmapped | Lent, Free)
                | (Free, Hot | Unmapped | Lent)
        )
    }
}

/// A block or segment index in 32 bits, `u32::MAX` for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Link(pub(super) u32);

impl Link {
    pub(super) const NONE: Link = Link(u32::MAX);

    /// A link to `key`. Four billion blocks would take 256 GiB of host memory first.
    #[inline]
    pub(super) fn to(key: usize) -> Link {
        match u32::try_from(key) {
            Ok(link) if link != u32::MAX => Link(link),
            _ => panic!("more than 2^32 - 1 blocks or segments"),
        }
    }

    #[inline]
    pub(super) fn get(self) -> Option<usize> {
        (self != Link::NONE).then_some(self.0 as usize)
    }
}

impl Block {
    /// First byte.
    #[inline]
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes, a multiple of the minimum block size.
    #[inline]
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Bytes the caller asked for (0 while free or allocated to nobody).
    #[inline]
    pub(crate) fn requested(&self) -> u64 {
        self.requested
    }

    /// While allocated: the other streams recorded as using it.
    #[inline]
    pub(crate) fn uses(&self) -> &[StreamSlot] {
        &self.uses
    }

    /// While free: the events that must complete before another stream reuses it.
    #[inline]
    pub(crate) fn pending(&self) -> &[EventKey] {
        &self.pending
    }

    /// The owning stream (see the field).
    #[inline]
    pub(crate) fn owner(&self) -> StreamSlot {
        self.owner
    }

    /// Its segment's pool.
    #[inline]
    pub(crate) fn pool(&self) -> PoolKind {
        self.pool
    }

    /// While free: the owner's epoch of its last use (see the field).
    #[inline]
    pub(crate) fn freed_epoch(&self) -> u32 {
        self.freed_epoch
    }

    /// Its segment is expandable.
    #[inline]
    pub(crate) fn is_expandable(&self) -> bool {
        self.expandable
    }

    /// Its segment is a stitched range.
    #[inline]
    pub(crate) fn is_stitched(&self) -> bool {
        self.stitched
    }

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

    /// Pages lent to an allocated stitched range.
    #[inline]
    pub(crate) fn is_lent(&self) -> bool {
        self.state == BlockUse::Lent
    }

    /// Free and mapped: the only state in which a block may sit in a free list or merge.
    #[inline]
    pub(crate) fn is_free(&self) -> bool {
        self.state == BlockUse::Free
    }
}

/// One range obtained from the device. Fixed once registered: read through getters.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    /// First byte.
    pub(super) addr: u64,
    /// Bytes.
    pub(super) size: u64,
    /// Small or large pool: a segment serves one pool only.
    pub(super) pool: PoolKind,
    /// The stream whose request created it (reported in snapshots).
    pub(super) stream: StreamSlot,
    /// The lowest block; stable for the segment's life.
    pub(super) head: BlockKey,
    /// An address reservation with pages mapped on demand (see [`super::expandable`]);
    /// its size is the reservation's, not the memory behind it.
    pub(super) expandable: bool,
    /// A stitched range: pages of expandable segments mapped a second time, contiguously
    /// (see [`super::stitch`]). Its memory is counted where the pages are lent from.
    pub(super) stitched: bool,
}

impl Segment {
    /// First byte.
    #[inline]
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes (for an expandable segment, the whole reservation).
    #[inline]
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Small or large pool.
    #[inline]
    pub(crate) fn pool(&self) -> PoolKind {
        self.pool
    }

    /// The stream whose request created it.
    #[inline]
    pub(crate) fn stream(&self) -> StreamSlot {
        self.stream
    }

    /// The lowest block.
    #[inline]
    pub(crate) fn head(&self) -> BlockKey {
        self.head
    }

    /// An address reservation with pages mapped on demand.
    #[inline]
    pub(crate) fn is_expandable(&self) -> bool {
        self.expandable
    }

    /// A stitched range.
    #[inline]
    pub(crate) fn is_stitched(&self) -> bool {
        self.stitched
    }
}
