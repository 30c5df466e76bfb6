//! Event completion: one batched pass over the outstanding events, which moves blocks whose
//! events all completed to their owners' ready lists.

use super::*;

impl State {
    /// One batched pass: on each stream, queries in-flight events oldest first up to the
    /// first incomplete one, then returns every pending block whose events all completed to
    /// its owner's ready list. Returns true if any block became ready.
    pub(super) fn collect_completed<B: Backend>(
        &mut self,
        backend: &B,
    ) -> Result<bool, BackendError> {
        let mut completed_any = false;
        for index in 0..self.streams.len() {
            while let Some(&event) = self.streams.states[index].in_flight.front() {
                if !self.events.is_complete(event) {
                    self.stats.event_queries += 1;
                    if !backend.query_event(self.events.handle(event))? {
                        break;
                    }
                    self.events.mark_complete(event);
                    completed_any = true;
                }
                self.streams.states[index].in_flight.pop_front();
                self.events.release(event, &mut self.stats);
            }
        }
        self.complete_fences(backend)?;
        if completed_any {
            Ok(self.promote_completed(backend) > 0)
        } else {
            Ok(false)
        }
    }

    /// On each stream, queries fences oldest first up to the first incomplete one: the
    /// blocks a completed fence covers are idle for every stream (`lifetime::fences`).
    pub(super) fn complete_fences<B: Backend>(&mut self, backend: &B) -> Result<(), BackendError> {
        for index in 0..self.streams.len() {
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
        for state in &self.streams.states {
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
            for event in self.arena.take_pending(key) {
                self.events.release(event, &mut self.stats);
            }
            let block = self.arena.block(key);
            let (addr, size, owner) = (block.addr(), block.size(), block.owner());
            self.note(backend, TraceAction::FreeCompleted, addr, size, owner);
            self.insert_free(key);
        }
        ready.len()
    }
}
