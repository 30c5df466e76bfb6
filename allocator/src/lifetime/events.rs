//! Pooled, reference-counted events.
//!
//! An event object is created once and recycled: recording it again is all a reuse costs
//! (`cuEventRecord`, ~141 ns, against ~2 µs for create and destroy). A recorded event is
//! referenced by the free blocks that must wait for it and by its stream's in-flight queue;
//! when the last reference goes, the handle returns to the idle pool. Nothing is leaked:
//! `outstanding() + idle handles == created - destroyed`, and `empty_cache` destroys the
//! idle handles.

use crate::backend::Backend;
use crate::counters::Counters;
use crate::error::BackendError;
use crate::pool::arena::StreamSlot;
pub(crate) use crate::types::EventKey;
use crate::types::{EventHandle, StreamId};
use slab::Slab;

/// What the engine knows of one recorded event.
#[derive(Debug)]
struct EventRecord {
    /// The backend's event object.
    handle: EventHandle,
    /// The stream it was recorded on.
    stream: StreamSlot,
    /// Free blocks and in-flight queue entries holding it.
    refs: u32,
    /// The host has seen it complete (a query said so, or the host synchronised).
    complete: bool,
}

/// All recorded events and the pool of idle event objects.
#[derive(Debug, Default)]
pub(crate) struct EventTable {
    records: Slab<EventRecord>,
    /// Event objects not recorded and not referenced, ready for reuse.
    idle: Vec<EventHandle>,
}

impl EventTable {
    /// Records an event on `stream` now; the caller holds the one reference returned.
    pub(crate) fn record<B: Backend>(
        &mut self,
        backend: &B,
        slot: StreamSlot,
        stream: StreamId,
        stats: &mut Counters,
    ) -> Result<EventKey, BackendError> {
        let handle = match self.idle.pop() {
            Some(handle) => handle,
            None => {
                let handle = backend.create_event()?;
                stats.events_created += 1;
                handle
            }
        };
        if let Err(err) = backend.record_event(handle, stream) {
            self.idle.push(handle);
            return Err(err);
        }
        stats.events_recorded += 1;
        let key = self.records.insert(EventRecord {
            handle,
            stream: slot,
            refs: 1,
            complete: false,
        });
        stats.events_outstanding = self.records.len() as u64;
        Ok(key)
    }

    pub(crate) fn retain(&mut self, key: EventKey) {
        self.records[key].refs += 1;
    }

    /// Drops one reference; the last one returns the object to the idle pool.
    pub(crate) fn release(&mut self, key: EventKey, stats: &mut Counters) {
        let record = &mut self.records[key];
        record.refs -= 1;
        if record.refs == 0 {
            let record = self.records.remove(key);
            self.idle.push(record.handle);
            stats.events_outstanding = self.records.len() as u64;
        }
    }

    pub(crate) fn handle(&self, key: EventKey) -> EventHandle {
        self.records[key].handle
    }

    pub(crate) fn stream(&self, key: EventKey) -> StreamSlot {
        self.records[key].stream
    }

    pub(crate) fn is_complete(&self, key: EventKey) -> bool {
        self.records[key].complete
    }

    pub(crate) fn mark_complete(&mut self, key: EventKey) {
        self.records[key].complete = true;
    }

    /// Marks every recorded event complete: the caller has synchronised the device.
    pub(crate) fn mark_all_complete(&mut self) {
        for (_, record) in self.records.iter_mut() {
            record.complete = true;
        }
    }

    /// Recorded events still referenced.
    pub(crate) fn outstanding(&self) -> usize {
        self.records.len()
    }

    /// Idle event objects kept for reuse.
    pub(crate) fn idle(&self) -> usize {
        self.idle.len()
    }

    /// Hands an event object straight back to the pool, for a one-shot event whose only
    /// consumer was a wait already enqueued (re-recording it later is safe).
    pub(crate) fn recycle_handle(&mut self, handle: EventHandle) {
        self.idle.push(handle);
    }

    /// Takes an idle object or creates one.
    pub(crate) fn acquire_handle<B: Backend>(
        &mut self,
        backend: &B,
        stats: &mut Counters,
    ) -> Result<EventHandle, BackendError> {
        match self.idle.pop() {
            Some(handle) => Ok(handle),
            None => {
                let handle = backend.create_event()?;
                stats.events_created += 1;
                Ok(handle)
            }
        }
    }

    /// Destroys every idle event object.
    pub(crate) fn destroy_idle<B: Backend>(
        &mut self,
        backend: &B,
        stats: &mut Counters,
    ) -> Result<(), BackendError> {
        while let Some(handle) = self.idle.pop() {
            if let Err(err) = backend.destroy_event(handle) {
                self.idle.push(handle);
                return Err(err);
            }
            stats.events_destroyed += 1;
        }
        Ok(())
    }
}
