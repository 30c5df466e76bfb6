//! Vector clocks: the happens-before relation between streams and the host.
//!
//! Component `i` of a clock counts the operations of stream `i` that are known to have
//! happened before the clock's owner. An operation `(stream j, epoch e)` happens before
//! whatever holds clock `c` iff `c[j] >= e`.

/// A vector clock indexed by simulated stream number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VectorClock(Vec<u64>);

impl VectorClock {
    pub(crate) fn get(&self, stream: usize) -> u64 {
        self.0.get(stream).copied().unwrap_or(0)
    }

    /// Advances the owner's own component and returns the new epoch.
    pub(crate) fn tick(&mut self, stream: usize) -> u64 {
        if self.0.len() <= stream {
            self.0.resize(stream + 1, 0);
        }
        self.0[stream] += 1;
        self.0[stream]
    }

    /// Pointwise maximum: everything `other` knows happened, this now knows too.
    pub(crate) fn merge(&mut self, other: &VectorClock) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (mine, theirs) in self.0.iter_mut().zip(&other.0) {
            *mine = (*mine).max(*theirs);
        }
    }

    /// True if operation `epoch` of `stream` happens before this clock's owner.
    pub(crate) fn covers(&self, stream: usize, epoch: u64) -> bool {
        self.get(stream) >= epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_and_cover() {
        let mut a = VectorClock::default();
        let mut b = VectorClock::default();
        let first = a.tick(0);
        b.tick(1);
        assert!(!b.covers(0, first));
        b.merge(&a);
        assert!(b.covers(0, first));
        assert!(!b.covers(0, first + 1));
    }
}
