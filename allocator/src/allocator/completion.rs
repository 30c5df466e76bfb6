//! Event completion: one batched pass over the outstanding events, which moves blocks whose
//! events all completed to their owners' ready lists.

use super::*;

impl State {
    /// One batched pass: on each stream, queries in-flight events oldest first up to the
    /// first incomplete one, then its fences the same way, then returns every pending block whose events all completed to
    /// its owner's ready list. Returns true if any block became ready.
    pub(super) fn collect_completed<B: Backend>(
        &mut self,
        backend: &B,
    ) -> Result<bool, BackendError> {
        let mut completed_any = false;
        // One walk of the busy streams for both passes: the events, then the fences.
        let slots = self.streams.take_event_slots();
        let queried = self
            .query_in_flight(backend, &slots, &mut completed_any)
            .and_then(|()| self.complete_fences_of(backend, &slots));
        self.streams.return_event_slots(slots);
        queried?;
        if completed_any {
            Ok(self.promote_completed(backend) > 0)
        } else {
            Ok(false)
        }
    }

    /// On each stream of `slots`, queries in-flight events oldest first up to the first
    /// incomplete one, releasing the completed; sets `completed_any` if one completed.
    fn query_in_flight<B: Backend>(
        &mut self,
        backend: &B,
        slots: &[StreamSlot],
        completed_any: &mut bool,
    ) -> Result<(), BackendError> {
        for &slot in slots {
            let index = slot as usize;
            while let Some(&event) = self.streams.states[index].in_flight.front() {
                if !self.events.is_complete(event) {
                    self.stats.event_queries += 1;
                    if !backend.query_event(self.events.handle(event))? {
                        break;
                    }
                    self.events.mark_complete(event);
                    *completed_any = true;
                }
                self.streams.states[index].in_flight.pop_front();
                self.events.release(event, &mut self.stats);
            }
        }
        Ok(())
    }

    /// On each stream, queries fences oldest first up to the first incomplete one: the
    /// blocks a completed fence covers are idle for every stream (`lifetime::fences`).
    pub(super) fn complete_fences<B: Backend>(&mut self, backend: &B) -> Result<(), BackendError> {
        let slots = self.streams.take_event_slots();
        let completed = self.complete_fences_of(backend, &slots);
        self.streams.return_event_slots(slots);
        completed
    }

    /// [`State::complete_fences`] on the streams of `slots`.
    fn complete_fences_of<B: Backend>(
        &mut self,
        backend: &B,
        slots: &[StreamSlot],
    ) -> Result<(), BackendError> {
        for &slot in slots {
            let index = slot as usize;
            while let Some(event) = self.streams.states[index].fences.oldest() {
                if !self.events.is_complete(event) {
                    self.stats.event_queries += 1;
                    if !backend.query_event(self.events.handle(event))? {
                        break;
                    }
                    self.events.mark_complete(event);
                }
                self.streams.states[index].fences.complete_oldest();
                self.events.release(event, &mut self.stats);
            }
        }
        Ok(())
    }

    /// Moves pending blocks whose events are all complete to the ready lists.
    pub(super) fn promote_completed<B: Backend>(&mut self, backend: &B) -> usize {
        let mut ready = Vec::new();
        // Pending blocks are listed: only slots that may hold listed blocks can have any.
        for &slot in self.streams.free_slots() {
            let state = self.streams.get(slot);
            for list in &state.pending {
                ready.extend(list.keys().filter(|key| {
                    self.arena
                        .block(*key)
                        .pending()
                        .iter()
                        .all(|event| self.events.is_complete(*event))
                }));
            }
        }
        for &key in &ready {
            self.unlist(key);
            self.release_pending(key);
            let block = self.arena.block(key);
            let (addr, size, owner) = (block.addr(), block.size(), block.owner());
            self.note(backend, TraceAction::FreeCompleted, addr, size, owner);
            self.insert_free(key);
        }
        ready.len()
    }
}
