//! The per-stream side of the pool: free lists by stream and readiness, and each stream's
//! queue of in-flight events.
//!
//! A slot is a stream *in one memory pool*: the same stream allocating for a CUDA graph's
//! pool and for ordinary tensors has two slots, so a block's owner slot also says which
//! pool it belongs to, and free lists never mix pools. Reuse across slots (step 3 of the
//! policy) only looks at slots of the caller's pool.
//!
//! Invariant on the lists (the heart of the lifetime model): a block in `ready[pool]` of
//! stream `s` may be handed to `s` with no synchronisation at all; a block in
//! `pending[pool]` carries events that must complete, or be waited on by the new owner's
//! stream on the device, before its bytes are reused. Handing any free block of `s` to
//! another stream `t` additionally needs `t` to wait for `s`'s own queued work.

use super::fences::Fences;
use super::EventKey;
use crate::pool::arena::{BlockKey, StreamSlot};
use crate::pool::free_list::FreeList;
use crate::types::{PoolId, PoolKind, StreamId};
use crate::util::BuildAddrHasher;
use std::collections::{HashMap, VecDeque};

/// Blocks kept in a stream's hot list.
pub(crate) const HOT_SLOTS: usize = 8;

/// Free lists and in-flight events of one stream.
#[derive(Debug)]
pub(crate) struct StreamState {
    /// The caller's handle for this stream.
    pub(crate) id: StreamId,
    /// The memory pool this slot allocates for.
    pub(crate) pool: PoolId,
    /// Blocks the stream may reuse at once, by pool.
    pub(crate) ready: [FreeList; 2],
    /// Blocks awaiting other streams' events, by pool.
    pub(crate) pending: [FreeList; 2],
    /// The stream's most recently freed ready blocks: kept unmerged so that the common
    /// pattern — free a block and allocate the same size again on the same stream — costs a
    /// short scan instead of a merge and a split. A hot block is invisible to best fit, so
    /// the first malloc that finds none of its size puts them all into the free lists
    /// (merged) before best fit looks, and stops parking frees until a probe hits again:
    /// left parked under sizes that do not repeat, they made best fit cut larger blocks
    /// (replayed ResNet-50 with expandable segments: 1.046 of peak live, 1.013 without).
    pub(crate) hot: HotList,
    /// Events recorded on this stream and not yet seen complete, oldest first. Events on
    /// one stream complete in order, so a completion pass stops at the first incomplete
    /// one: each event is queried about once.
    pub(crate) in_flight: VecDeque<EventKey>,
    /// The stream's free epochs and the fences that cover them.
    pub(crate) fences: Fences,
    /// The slot is in [`StreamTable::hot_slots`].
    in_hot_slots: bool,
    /// The slot is in [`StreamTable::free_slots`].
    in_free_slots: bool,
    /// The slot is in [`StreamTable::event_slots`].
    in_event_slots: bool,
}

impl StreamState {
    /// True if a completion or fence pass has something to do on the stream: events in
    /// flight, fences in flight or frees no fence covers yet. Such a slot must be among
    /// [`StreamTable::event_slots`], or the passes would never visit it.
    #[inline]
    pub(crate) fn has_events(&self) -> bool {
        !self.in_flight.is_empty() || self.fences.busy()
    }

    /// True if the slot is among [`StreamTable::event_slots`]: a free on a stream already
    /// there need not note it again (the hot free path reads this flag, not the table).
    #[inline]
    pub(crate) fn in_event_slots(&self) -> bool {
        self.in_event_slots
    }

    /// True if no free list of the slot holds a block.
    fn lists_empty(&self) -> bool {
        self.ready
            .iter()
            .chain(&self.pending)
            .all(|list| list.len() == 0)
    }
}

/// While a stream's hot list is disarmed, one free in this many is parked anyway, so that
/// a return of same-size reuse is seen.
const HOT_PROBE_EVERY: u8 = 16;

/// At most [`HOT_SLOTS`] free blocks with their sizes, oldest first, in place (no heap, no
/// block lookups to scan). A block's size cannot change while it is hot: hot blocks are
/// never merged or split.
#[derive(Debug, Clone)]
pub(crate) struct HotList {
    /// `(size, block)`; the first `len` are in use.
    slots: [(u64, BlockKey); HOT_SLOTS],
    len: usize,
    /// Whether frees are parked: set by a hit, cleared by a malloc that found none.
    armed: bool,
    /// Frees seen while disarmed, modulo [`HOT_PROBE_EVERY`].
    probe: u8,
}

impl Default for HotList {
    fn default() -> Self {
        Self {
            slots: Default::default(),
            len: 0,
            armed: true,
            probe: 0,
        }
    }
}

impl HotList {
    /// Takes out the newest block of exactly `size` bytes; a hit arms the list.
    #[inline]
    pub(crate) fn take(&mut self, size: u64) -> Option<BlockKey> {
        let position = self.slots[..self.len]
            .iter()
            .rposition(|&(hot_size, _)| hot_size == size)?;
        let key = self.slots[position].1;
        // Usually the newest: nothing to move. A loop, not `copy_within`, which calls
        // `memmove` even for no element.
        for index in position..self.len - 1 {
            self.slots[index] = self.slots[index + 1];
        }
        self.len -= 1;
        self.armed = true;
        Some(key)
    }

    /// Whether to park the block being freed: always while armed, otherwise one free in
    /// [`HOT_PROBE_EVERY`].
    #[inline]
    pub(crate) fn admit(&mut self) -> bool {
        if self.armed {
            return true;
        }
        self.probe = (self.probe + 1) % HOT_PROBE_EVERY;
        self.probe == 0
    }

    /// Takes every block out, oldest first, for a malloc that found no hit (which disarms
    /// the list) or a slow path.
    pub(crate) fn drain(&mut self, disarm: bool) -> impl Iterator<Item = BlockKey> {
        self.armed &= !disarm;
        let slots = self.slots;
        let len = std::mem::take(&mut self.len);
        (0..len).map(move |index| slots[index].1)
    }

    /// Adds `key` as the newest block; returns the oldest if the list was full.
    #[inline]
    pub(crate) fn push(&mut self, size: u64, key: BlockKey) -> Option<BlockKey> {
        let evicted = if self.len == HOT_SLOTS {
            let oldest = self.slots[0].1;
            self.slots.copy_within(1.., 0);
            self.len -= 1;
            Some(oldest)
        } else {
            None
        };
        self.slots[self.len] = (size, key);
        self.len += 1;
        evicted
    }

    /// The blocks, oldest first.
    pub(crate) fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.slots[..self.len].iter().map(|&(_, key)| key)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
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

/// Adds `slot` to one of [`StreamTable`]'s slot lists unless `listed` (its flag for that
/// list) says it is there already: each slot at most once, found without a search.
#[inline]
fn add_once(slots: &mut Vec<StreamSlot>, listed: &mut bool, slot: StreamSlot) {
    if !*listed {
        *listed = true;
        slots.push(slot);
    }
}

/// Every (stream, pool) the allocator has seen, in first-seen order.
#[derive(Debug, Default)]
pub(crate) struct StreamTable {
    pub(crate) states: Vec<StreamState>,
    /// Slots of the default pool.
    index: HashMap<StreamId, StreamSlot, BuildAddrHasher>,
    /// Slots of other pools.
    pooled: HashMap<(StreamId, PoolId), StreamSlot>,
    /// The default-pool stream looked up last, which is nearly always the next one asked for.
    last: Option<(StreamId, StreamSlot)>,
    /// Slots that may hold hot blocks, each once: what flushing the hot lists visits, so
    /// that a slow-path malloc costs no walk over every stream a program ever used.
    hot_slots: Vec<StreamSlot>,
    /// Slots that may hold listed free blocks, each once (emptied ones are pruned now and
    /// then): what looking for another stream's block visits.
    free_slots: Vec<StreamSlot>,
    /// `free_slots.len()` after the last pruning.
    free_slots_pruned: usize,
    /// Slots that may have events or fences in flight, or frees no fence covers yet, each
    /// once (idle ones are dropped by the completion pass): what the completion and fence
    /// passes visit. A program that makes a stream per request (its own streams, marked
    /// volatile) would otherwise make every slow path walk every stream it ever used.
    event_slots: Vec<StreamSlot>,
}

impl StreamTable {
    /// The slot of `id` in the default pool, registering the stream on first sight.
    #[inline]
    pub(crate) fn slot(&mut self, id: StreamId) -> StreamSlot {
        if let Some((last, slot)) = self.last {
            if last == id {
                return slot;
            }
        }
        if let Some(&slot) = self.index.get(&id) {
            self.last = Some((id, slot));
            return slot;
        }
        let slot = self.push(id, PoolId::DEFAULT);
        self.index.insert(id, slot);
        self.last = Some((id, slot));
        slot
    }

    /// The slot of `id` in `pool`, registering it on first sight.
    #[inline]
    pub(crate) fn slot_in(&mut self, id: StreamId, pool: PoolId) -> StreamSlot {
        if pool.is_default() {
            return self.slot(id);
        }
        if let Some(&slot) = self.pooled.get(&(id, pool)) {
            return slot;
        }
        let slot = self.push(id, pool);
        self.pooled.insert((id, pool), slot);
        slot
    }

    fn push(&mut self, id: StreamId, pool: PoolId) -> StreamSlot {
        let slot = self.states.len() as StreamSlot;
        self.states.push(StreamState {
            id,
            pool,
            ready: Default::default(),
            pending: Default::default(),
            hot: HotList::default(),
            in_flight: VecDeque::new(),
            fences: Fences::default(),
            in_hot_slots: false,
            in_free_slots: false,
            in_event_slots: false,
        });
        slot
    }

    /// Notes that `slot` holds a hot block.
    #[inline]
    pub(crate) fn note_hot(&mut self, slot: StreamSlot) {
        add_once(
            &mut self.hot_slots,
            &mut self.states[slot as usize].in_hot_slots,
            slot,
        );
    }

    /// Takes the slots that may hold hot blocks (the caller drains their hot lists).
    pub(crate) fn take_hot_slots(&mut self) -> Vec<StreamSlot> {
        let slots = std::mem::take(&mut self.hot_slots);
        for &slot in &slots {
            self.states[slot as usize].in_hot_slots = false;
        }
        slots
    }

    /// Notes that `slot` holds a listed free block.
    #[inline]
    pub(crate) fn note_free(&mut self, slot: StreamSlot) {
        add_once(
            &mut self.free_slots,
            &mut self.states[slot as usize].in_free_slots,
            slot,
        );
    }

    /// The slots that may hold listed free blocks (a superset of those that do).
    pub(crate) fn free_slots(&self) -> &[StreamSlot] {
        &self.free_slots
    }

    /// Drops slots whose lists are empty from [`StreamTable::free_slots`] once it has
    /// doubled since the last time: amortised constant per malloc.
    pub(crate) fn prune_free_slots(&mut self) {
        if self.free_slots.len() < 64 || self.free_slots.len() < 2 * self.free_slots_pruned {
            return;
        }
        let states = &mut self.states;
        self.free_slots.retain(|&slot| {
            let state = &mut states[slot as usize];
            let keep = !state.lists_empty();
            state.in_free_slots = keep;
            keep
        });
        self.free_slots_pruned = self.free_slots.len();
    }

    /// Notes that `slot` may have events or fences in flight, or frees no fence covers.
    #[inline]
    pub(crate) fn note_events(&mut self, slot: StreamSlot) {
        add_once(
            &mut self.event_slots,
            &mut self.states[slot as usize].in_event_slots,
            slot,
        );
    }

    /// Takes the slots that may have events, fences or unfenced frees, for a pass over
    /// them; [`StreamTable::return_event_slots`] puts them back.
    pub(crate) fn take_event_slots(&mut self) -> Vec<StreamSlot> {
        std::mem::take(&mut self.event_slots)
    }

    /// Puts back the slots [`StreamTable::take_event_slots`] took, dropping those with
    /// nothing left in flight and no unfenced free (the pass may have noted others since).
    pub(crate) fn return_event_slots(&mut self, mut slots: Vec<StreamSlot>) {
        let states = &mut self.states;
        slots.retain(|&slot| {
            let state = &mut states[slot as usize];
            let keep = state.has_events();
            state.in_event_slots = keep;
            keep
        });
        // Slots noted during the pass were not in `slots` (theirs were marked in).
        let noted = std::mem::replace(&mut self.event_slots, slots);
        self.event_slots.extend(noted);
    }

    /// The pool `slot` allocates for.
    #[inline]
    pub(crate) fn pool(&self, slot: StreamSlot) -> PoolId {
        self.states[slot as usize].pool
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_list_takes_the_newest_of_a_size_and_evicts_the_oldest() {
        let mut hot = HotList::default();
        for key in 0..HOT_SLOTS {
            assert_eq!(hot.push(512 * (key as u64 % 3 + 1), key), None);
        }
        // Sizes 512, 1024, 1536, 512, ...: the newest 1024 is block 7.
        assert_eq!(hot.take(1024), Some(7));
        assert_eq!(hot.take(4096), None);
        assert_eq!(hot.len(), HOT_SLOTS - 1);
        assert_eq!(hot.push(4096, 8), None);
        assert_eq!(hot.push(4096, 9), Some(0));
        let keys: Vec<_> = hot.keys().collect();
        assert_eq!(keys, [1, 2, 3, 4, 5, 6, 8, 9]);
        assert_eq!(hot.take(4096), Some(9));
        assert_eq!(hot.take(4096), Some(8));
        assert_eq!(hot.take(512), Some(6));
        assert_eq!(hot.keys().collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_miss_disarms_the_hot_list_until_a_probe_hits() {
        let mut hot = HotList::default();
        assert!(hot.admit(), "armed at first");
        hot.push(512, 0);
        hot.push(1024, 1);
        assert_eq!(hot.drain(true).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(hot.len(), 0);
        // Disarmed: one free in HOT_PROBE_EVERY is parked.
        let admitted = (0..2 * u32::from(HOT_PROBE_EVERY))
            .filter(|_| hot.admit())
            .count();
        assert_eq!(admitted, 2);
        // A slow path's drain keeps the state; a probe that hits arms the list again.
        hot.push(4096, 2);
        assert_eq!(hot.drain(false).count(), 1);
        assert!(!hot.admit());
        hot.push(4096, 3);
        assert_eq!(hot.take(4096), Some(3));
        assert!((0..100).all(|_| hot.admit()));
    }

    #[test]
    fn stream_slots_are_stable_and_first_seen_order() {
        let mut table = StreamTable::default();
        assert_eq!(table.slot(StreamId(40)), 0);
        assert_eq!(table.slot(StreamId(7)), 1);
        assert_eq!(table.slot(StreamId(40)), 0);
        assert_eq!(table.slot(StreamId(40)), 0);
        assert_eq!(table.slot(StreamId(7)), 1);
        assert_eq!(table.id(1), StreamId(7));
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn a_stream_has_one_slot_per_pool() {
        let mut table = StreamTable::default();
        let graph = PoolId(1, 0);
        assert_eq!(table.slot(StreamId(40)), 0);
        assert_eq!(table.slot_in(StreamId(40), graph), 1);
        assert_eq!(table.slot_in(StreamId(40), PoolId::DEFAULT), 0);
        assert_eq!(table.slot_in(StreamId(40), graph), 1);
        assert_eq!(table.slot(StreamId(40)), 0);
        assert_eq!((table.id(1), table.pool(1)), (StreamId(40), graph));
        assert_eq!(table.pool(0), PoolId::DEFAULT);
    }
}
