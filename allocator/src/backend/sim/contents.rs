//! What the simulated memory holds: per byte range, which write put its bytes there.
//!
//! The race detector's shadow memory says *who* touched a byte and whether that was
//! ordered; this says what the byte *is*, so that a round trip through host memory (a
//! sleeping memory pool's backup, then its wake) can be checked to restore it. A byte's
//! content is a *version*: the number of the operation that last wrote it (its index in
//! the simulator's log, plus one), carried along unchanged by copies; 0 means never
//! written since the memory was mapped (what a fresh page holds).
//!
//! Device memory is keyed like the shadow memory (whole segments by address, mapped pages
//! by physical address, so two mappings of one page share its bytes); page-locked host
//! buffers are keyed by their own addresses, far from both.

use std::collections::BTreeMap;

/// Where simulated host buffers start: apart from device addresses (virtual ones start at
/// `0x7f00_0000_0000`, physical ones at 2^56).
const HOST_BASE: u64 = 1 << 60;

/// Versions by byte range: non-overlapping `[start, end)` intervals, version 0 absent.
#[derive(Debug, Default)]
pub(super) struct Contents {
    /// start → (end, version).
    intervals: BTreeMap<u64, (u64, u64)>,
}

impl Contents {
    /// Makes `at` an interval boundary.
    fn split_at(&mut self, at: u64) {
        let Some((&start, &(end, version))) = self.intervals.range(..at).next_back() else {
            return;
        };
        if end > at {
            self.intervals.insert(start, (at, version));
            self.intervals.insert(at, (end, version));
        }
    }

    /// `[start, end)` now holds `version` (0: nothing written).
    pub(super) fn set(&mut self, start: u64, end: u64, version: u64) {
        if start >= end {
            return;
        }
        self.split_at(start);
        self.split_at(end);
        let inside: Vec<u64> = self.intervals.range(start..end).map(|(&s, _)| s).collect();
        for at in inside {
            self.intervals.remove(&at);
        }
        if version != 0 {
            self.intervals.insert(start, (end, version));
        }
    }

    /// What `[start, end)` holds, as `(start, end, version)` runs covering it in order,
    /// with 0 where nothing was written; neighbouring runs of one version are joined.
    pub(super) fn get(&self, start: u64, end: u64) -> Vec<(u64, u64, u64)> {
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        let mut push = |from: u64, to: u64, version: u64| {
            if from >= to {
                return;
            }
            match runs.last_mut() {
                Some(last) if last.1 == from && last.2 == version => last.1 = to,
                _ => runs.push((from, to, version)),
            }
        };
        let mut cursor = start;
        let first = self
            .intervals
            .range(..=start)
            .next_back()
            .map_or(start, |(&s, _)| s);
        for (&s, &(e, version)) in self.intervals.range(first..end) {
            if e <= cursor {
                continue;
            }
            push(cursor, s.max(cursor), 0);
            push(s.max(cursor), e.min(end), version);
            cursor = e.min(end);
        }
        push(cursor, end, 0);
        runs
    }

    /// Copies what `[from, from + len)` holds to `[to, to + len)` of `dst`.
    pub(super) fn copy_into(&self, from: u64, len: u64, dst: &mut Contents, to: u64) {
        for (start, end, version) in self.get(from, from + len) {
            dst.set(to + (start - from), to + (end - from), version);
        }
    }
}

/// Page-locked host buffers and what they hold.
#[derive(Debug, Default)]
pub(super) struct HostMemory {
    /// Live buffers: address → bytes.
    buffers: BTreeMap<u64, u64>,
    /// What the buffers hold.
    pub(super) contents: Contents,
    /// The next address to hand out (never reused).
    next: u64,
    /// Bytes of live buffers.
    pub(super) bytes: u64,
}

impl HostMemory {
    /// A new buffer of `size` bytes.
    pub(super) fn alloc(&mut self, size: u64) -> u64 {
        let at = self.next.max(HOST_BASE);
        // A page of guard between buffers, so that an overrun is never another buffer.
        self.next = at + size.div_ceil(4096) * 4096 + 4096;
        self.buffers.insert(at, size);
        self.bytes += size;
        at
    }

    /// Frees the buffer at `at` of `size` bytes; false if there is none.
    pub(super) fn free(&mut self, at: u64, size: u64) -> bool {
        if self.buffers.get(&at) != Some(&size) {
            return false;
        }
        self.buffers.remove(&at);
        self.bytes -= size;
        self.contents.set(at, at + size, 0);
        true
    }

    /// True if `[at, at + len)` lies inside one live buffer.
    pub(super) fn inside(&self, at: u64, len: u64) -> bool {
        let Some(end) = at.checked_add(len) else {
            return false;
        };
        self.buffers
            .range(..=at)
            .next_back()
            .is_some_and(|(&start, &size)| end <= start + size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_split_join_and_copy_by_range() {
        let mut device = Contents::default();
        device.set(100, 200, 7);
        device.set(150, 160, 9);
        assert_eq!(
            device.get(90, 210),
            [
                (90, 100, 0),
                (100, 150, 7),
                (150, 160, 9),
                (160, 200, 7),
                (200, 210, 0)
            ]
        );
        let mut host = Contents::default();
        device.copy_into(140, 30, &mut host, 1000);
        assert_eq!(
            host.get(1000, 1030),
            [(1000, 1010, 7), (1010, 1020, 9), (1020, 1030, 7)]
        );
        device.set(100, 200, 0);
        assert_eq!(device.get(100, 200), [(100, 200, 0)], "forgotten");
        host.copy_into(1000, 30, &mut device, 140);
        assert_eq!(
            device.get(130, 175),
            [
                (130, 140, 0),
                (140, 150, 7),
                (150, 160, 9),
                (160, 170, 7),
                (170, 175, 0)
            ],
            "restored where it was copied back"
        );
    }

    #[test]
    fn host_buffers_are_disjoint_and_bounded() {
        let mut host = HostMemory::default();
        let a = host.alloc(10);
        let b = host.alloc(5000);
        assert!(b - a >= 10 + 4096, "a guard page apart");
        assert!(host.inside(a, 10) && !host.inside(a, 11) && host.inside(b + 4999, 1));
        assert_eq!(host.bytes, 5010);
        assert!(!host.free(a, 9), "the size must match");
        assert!(host.free(a, 10) && !host.inside(a, 1));
        assert_eq!(host.bytes, 5000);
    }
}
