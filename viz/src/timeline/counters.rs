//! The counters of a timeline whose lifetimes are paired: each counter after each event,
//! from per-event deltas, and each stream's cached bytes at every change.

use super::{Counter, Timeline, STAGE};
use crate::limits::{Budget, OverBudget};
use crate::model::TraceAction;

impl Timeline {
    /// The counters after each event, one at a time from per-event deltas, and each
    /// stream's cached bytes from its sorted changes.
    pub(super) fn compute_counters(
        &mut self,
        trace: &[crate::model::Event],
        budget: &mut Budget,
        charge_transient: &mut impl FnMut(&mut Budget, u64) -> Result<(), OverBudget>,
    ) -> Result<(), OverBudget> {
        let n = trace.len();
        let clamp = |v: i128| v.clamp(0, u64::MAX as i128) as u64;
        budget.charge_for(STAGE, (5 * n * size_of::<u64>()) as u64)?;
        charge_transient(budget, (n * size_of::<i128>()) as u64)?;
        let mut delta = vec![0i128; n];
        for k in Counter::ALL {
            delta.iter_mut().for_each(|d| *d = 0);
            let mut initial = 0i128;
            let mut add = |at: Option<u32>, v: i128| match at {
                Some(i) => delta[i as usize] += v,
                None => initial += v,
            };
            match k {
                Counter::Active | Counter::Allocated | Counter::Pending => {
                    for a in &self.allocs {
                        let size = a.size as i128;
                        match k {
                            Counter::Active => {
                                add(a.start, size);
                                if let Some(e) = a.end {
                                    add(Some(e), -size);
                                }
                            }
                            Counter::Allocated => {
                                add(a.start, size);
                                match (a.free_requested, a.end) {
                                    (Some(fr), _) => add(Some(fr), -size),
                                    (None, Some(e)) => add(Some(e), -size),
                                    (None, None) => {}
                                }
                            }
                            _ => {
                                if let Some(fr) = a.free_requested {
                                    add(Some(fr), size);
                                    if let Some(e) = a.end {
                                        add(Some(e), -size);
                                    }
                                }
                            }
                        }
                    }
                }
                Counter::Reserved => {
                    for s in &self.segments {
                        let size = s.size as i128;
                        add(s.start, size);
                        if let Some(e) = s.end {
                            add(Some(e), -size);
                        }
                    }
                }
                Counter::Staging => {
                    for (i, e) in trace.iter().enumerate() {
                        match e.action {
                            TraceAction::StagingAcquire => add(Some(i as u32), e.size as i128),
                            TraceAction::StagingRelease => add(Some(i as u32), -(e.size as i128)),
                            _ => {}
                        }
                    }
                }
            }
            self.initial[k as usize] = clamp(initial);
            let mut v = initial;
            self.counters[k as usize] = delta
                .iter()
                .map(|d| {
                    v += d;
                    clamp(v)
                })
                .collect();
        }
        drop(delta);

        // Cached bytes per stream: its segments' bytes not in active blocks, changing at
        // each event that starts or ends one of them.
        let streams = self.streams.len();
        let mut cached_initial = vec![0i128; streams];
        let mut changes: Vec<(u32, u32, i128)> = Vec::new();
        let count = 2 * (self.allocs.len() + self.segments.len());
        charge_transient(budget, (count * size_of::<(u32, u32, i128)>()) as u64)?;
        changes.reserve_exact(count);
        for a in &self.allocs {
            let size = a.size as i128;
            match a.start {
                Some(s) => changes.push((a.owner, s, -size)),
                None => cached_initial[a.owner as usize] -= size,
            }
            if let Some(e) = a.end {
                changes.push((a.owner, e, size));
            }
        }
        for s in &self.segments {
            let size = s.size as i128;
            match s.start {
                Some(at) => changes.push((s.stream, at, size)),
                None => cached_initial[s.stream as usize] += size,
            }
            if let Some(e) = s.end {
                changes.push((s.stream, e, -size));
            }
        }
        changes.sort_unstable_by_key(|&(stream, at, _)| (stream, at));
        self.cached_initial = cached_initial.iter().map(|&v| clamp(v)).collect();
        self.cached_changes = vec![Vec::new(); streams];
        let mut i = 0;
        while i < changes.len() {
            let (stream, at) = (changes[i].0, changes[i].1);
            let mut d = 0i128;
            while i < changes.len() && (changes[i].0, changes[i].1) == (stream, at) {
                d += changes[i].2;
                i += 1;
            }
            if d != 0 {
                let out = &mut self.cached_changes[stream as usize];
                budget.reserve(STAGE, out, 1)?;
                // The running value, kept exact beside the clamped one it shows.
                let exact = &mut cached_initial[stream as usize];
                *exact += d;
                out.push((at, clamp(*exact)));
            }
        }
        Ok(())
    }
}
