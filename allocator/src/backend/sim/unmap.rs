//! Unmapping as the simulated host does it, for `unmap_pages` and for closing an IPC
//! import: whole mappings only, no implicit synchronisation, and the race detector's check
//! that every earlier use of what goes away is known complete on the host.

use super::shadow::OpRef;
use super::{BackendError, BackendResult, Race, RaceKind, SimState, PAGE_SIZE};

impl SimState {
    /// Unmaps `[start, end)`, whole mappings; pages no other mapping holds go back to the
    /// device and descriptors exported for the mappings are closed. Every earlier use
    /// through these mappings, and every use of pages that go back to the device through
    /// whichever mapping, must be known complete on the host: each one that is not is a
    /// race with this unmap, named `call` in reports.
    pub(super) fn unmap_checked(
        &mut self,
        start: u64,
        end: u64,
        call: &str,
    ) -> BackendResult<usize> {
        let size = end.saturating_sub(start);
        if size == 0 || !start.is_multiple_of(PAGE_SIZE) || !size.is_multiple_of(PAGE_SIZE) {
            return Err(BackendError::new(
                "cuMemUnmap",
                format!("[{start:#x}, {end:#x}) is not page-aligned"),
            ));
        }
        if self.vm.translate(start, end).is_none() {
            return Err(BackendError::new(
                "cuMemUnmap",
                format!("[{start:#x}, {end:#x}) is not wholly mapped"),
            ));
        }
        let Some(whole) = self.vm.whole_mappings(start, end) else {
            return Err(BackendError::new(
                "cuMemUnmap",
                format!("[{start:#x}, {end:#x}) does not cover whole mappings"),
            ));
        };
        let mappings = whole.len();
        self.ipc.forget_exports(&whole);
        let unmapped = self.vm.unmap(&whole, PAGE_SIZE);
        let op = OpRef {
            op: self.log.len(),
            stream: usize::MAX,
            epoch: 0,
        };
        self.log
            .push(format!("{call} [{start:#x}, {end:#x}) (host)"));
        let host_clock = self.host_clock.clone();
        let mut races = Vec::new();
        for piece in &unmapped.released {
            let physical_end = piece.physical + piece.len;
            let conflicts = self
                .shadow
                .access(piece.physical, physical_end, op, true, |prior| {
                    host_clock.covers(prior.stream, prior.epoch)
                });
            for (prior, from, to) in conflicts {
                let from = piece.virt + (from.max(piece.physical) - piece.physical);
                let to = piece.virt + (to.min(physical_end) - piece.physical);
                races.push((prior.op, (from, to)));
            }
            self.shadow.forget(piece.physical, physical_end);
            self.contents.set(piece.physical, physical_end, 0);
            self.reserved -= piece.len;
        }
        for &(user, from, to) in &unmapped.users {
            let reported = races.iter().any(|&(earlier, _)| earlier == user.op);
            if !reported && !host_clock.covers(user.stream, user.epoch) {
                races.push((user.op, (from, to)));
            }
        }
        for (earlier, range) in races {
            let race = Race {
                earlier: self.log[earlier].clone(),
                later: self.log[op.op].clone(),
                range,
                kind: RaceKind::Unordered,
            };
            self.races.push(race);
        }
        Ok(mappings)
    }
}
