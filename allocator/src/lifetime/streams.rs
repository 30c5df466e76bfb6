//! The per-stream side of the pool: free lists by stream and readiness, and each stream's
//! queue of in-flight events.
//!
//! Invariant on the lists (the heart of the lifetime model): a block in `ready[pool]` of
//! stream `s` may be handed to `s` with no synchronisation at all; a block in
//! `pending[pool]` carries events that must complete, or be waited on by the new owner's
//! stream on the device, before its bytes are reused. Handing any free block of `s` to
//! another stream `t` additionally needs `t` to wait for `s`'s own queued work.

use super::EventKey;
use crate::pool::arena::{BlockKey, StreamSlot};
use crate::pool::free_list::FreeList;
use crate::types::{PoolKind, StreamId};
use crate::util::BuildAddrHasher;
use std::collections::{HashMap, VecDeque};

/// Blocks kept in a stream's hot list.
pub(crate) const HOT_SLOTS: usize = 8;

/// Free lists and in-flight events of one stream.
#[derive(Debug)]
pub(crate) struct StreamState {
    /// The caller's handle for this stream.
    pub(crate) id: StreamId,
    /// Blocks the stream may reuse at once, by pool.
    pub(crate) ready: [FreeList; 2],
    /// Blocks awaiting other streams' events, by pool.
    pub(crate) pending: [FreeList; 2],
    /// The stream's most recently freed ready blocks, newest last, at most
    /// [`HOT_SLOTS`]: kept unmerged so that the common pattern — free a block and allocate
    /// the same size again on the same stream — costs a short scan instead of a merge and a
    /// split. Flushed into the free lists (with merging) on any slow path, so they never
    /// cause growth or fragmentation.
    pub(crate) hot: Vec<BlockKey>,
    /// Events recorded on this stream and not yet seen complete, oldest first. Events on
    /// one stream complete in order, so a completion pass stops at the first incomplete
    /// one: each event is queried about once.
    pub(crate) in_flight: VecDeque<EventKey>,
}

impl StreamState {
    pub(crate) fn list(&mut self, pool: PoolKind, pending: bool) -> &mut FreeList {
        if pending {
            &mut self.pending[pool as usize]
        } else {
            &mut self.ready[pool as usize]
        }
    }
}

/// Every stream the allocator has seen, in first-seen order.
#[derive(Debug, Default)]
pub(crate) struct StreamTable {
    pub(crate) states: Vec<StreamState>,
    index: HashMap<StreamId, StreamSlot, BuildAddrHasher>,
}

impl StreamTable {
    /// The slot of `id`, registering the stream on first sight.
    #[inline]
    pub(crate) fn slot(&mut self, id: StreamId) -> StreamSlot {
        if let Some(slot) = self.index.get(&id) {
            return *slot;
        }
        let slot = self.states.len() as StreamSlot;
        self.states.push(StreamState {
            id,
            ready: Default::default(),
            pending: Default::default(),
            hot: Vec::with_capacity(HOT_SLOTS),
            in_flight: VecDeque::new(),
        });
        self.index.insert(id, slot);
        slot
    }

    #[inline]
    pub(crate) fn get(&self, slot: StreamSlot) -> &StreamState {
        &self.states[slot as usize]
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, slot: StreamSlot) -> &mut StreamState {
        &mut self.states[slot as usize]
    }

    pub(crate) fn id(&self, slot: StreamSlot) -> StreamId {
        self.states[slot as usize].id
    }

    pub(crate) fn len(&self) -> usize {
        self.states.len()
    }
}
