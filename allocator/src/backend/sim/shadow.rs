//! Shadow memory: for every byte range, the last write and the reads since, so each new
//! access can be checked against all earlier conflicting ones.
//!
//! Ranges are kept as non-overlapping intervals in a `BTreeMap` keyed by start address,
//! split where an access begins or ends inside one: cost grows with the number of distinct
//! access boundaries, not with bytes.

use std::collections::BTreeMap;

/// One past operation, as the detector remembers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpRef {
    /// Index into the simulator's operation log (for messages).
    pub(crate) op: usize,
    /// Simulated stream number.
    pub(crate) stream: usize,
    /// The operation's epoch on its stream.
    pub(crate) epoch: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Interval {
    end: u64,
    write: Option<OpRef>,
    reads: Vec<OpRef>,
}

/// Access history by address.
#[derive(Debug, Default)]
pub(crate) struct Shadow {
    intervals: BTreeMap<u64, Interval>,
}

impl Shadow {
    /// Makes `at` an interval boundary.
    fn split_at(&mut self, at: u64) {
        let Some((_, interval)) = self.intervals.range_mut(..at).next_back() else {
            return;
        };
        if interval.end > at {
            // The right half keeps the history and the original end.
            let right = interval.clone();
            interval.end = at;
            self.intervals.insert(at, right);
        }
    }

    /// Records an access to `[start, end)` by `op` and returns the earlier operations it
    /// conflicts with that `happened_before` does not order before it.
    pub(crate) fn access(
        &mut self,
        start: u64,
        end: u64,
        op: OpRef,
        write: bool,
        happened_before: impl Fn(&OpRef) -> bool,
    ) -> Vec<(OpRef, u64, u64)> {
        self.split_at(start);
        self.split_at(end);
        let mut conflicts = Vec::new();
        let mut cursor = start;
        let mut gaps = Vec::new();
        for (&at, interval) in self.intervals.range_mut(start..end) {
            if at > cursor {
                gaps.push((cursor, at));
            }
            let earlier = interval.write.iter().chain(if write {
                interval.reads.iter()
            } else {
                [].iter()
            });
            for prior in earlier {
                if prior.stream != op.stream && !happened_before(prior) {
                    conflicts.push((*prior, at, interval.end));
                }
            }
            if write {
                interval.write = Some(op);
                interval.reads.clear();
            } else {
                interval.reads.retain(|r| r.stream != op.stream);
                interval.reads.push(op);
            }
            cursor = interval.end;
        }
        if cursor < end {
            gaps.push((cursor, end));
        }
        for (gap_start, gap_end) in gaps {
            let interval = Interval {
                end: gap_end,
                write: write.then_some(op),
                reads: if write { Vec::new() } else { vec![op] },
            };
            self.intervals.insert(gap_start, interval);
        }
        conflicts
    }

    /// Forgets all history in `[start, end)` (the memory went back to the device).
    pub(crate) fn forget(&mut self, start: u64, end: u64) {
        self.split_at(start);
        self.split_at(end);
        let doomed: Vec<u64> = self
            .intervals
            .range(start..end)
            .map(|(at, _)| *at)
            .collect();
        for at in doomed {
            self.intervals.remove(&at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(op: usize, stream: usize) -> OpRef {
        OpRef {
            op,
            stream,
            epoch: 1,
        }
    }

    #[test]
    fn unordered_write_after_read_on_another_stream_conflicts() {
        let mut shadow = Shadow::default();
        assert!(shadow.access(0, 100, op(0, 0), true, |_| false).is_empty());
        assert!(
            shadow
                .access(50, 150, op(1, 0), false, |_| false)
                .is_empty(),
            "same stream is ordered"
        );
        let conflicts = shadow.access(120, 200, op(2, 1), true, |_| false);
        assert_eq!(conflicts.len(), 1);
        assert_eq!(conflicts[0].0.op, 1);
        assert!(
            shadow.access(0, 40, op(3, 1), true, |_| true).is_empty(),
            "ordered access is fine"
        );
    }

    #[test]
    fn reads_do_not_conflict_with_reads() {
        let mut shadow = Shadow::default();
        shadow.access(0, 100, op(0, 0), false, |_| false);
        assert!(shadow.access(0, 100, op(1, 1), false, |_| false).is_empty());
        shadow.forget(0, 100);
        assert!(shadow.access(0, 100, op(2, 2), true, |_| false).is_empty());
    }
}
