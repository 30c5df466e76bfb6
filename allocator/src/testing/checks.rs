//! The invariants the harness checks after every step, and the drain at the end of a
//! program (see the module docs of [`super`]).

use super::{Harness, USER_POOL};

impl Harness {
    /// Checks every invariant now.
    pub fn check(&self) -> Result<(), String> {
        if let Some(race) = self.device.races().first() {
            return Err(race.to_string());
        }
        self.allocator.check_invariants()?;
        let mut ranges: Vec<(u64, u64)> = self
            .live
            .iter()
            .map(|l| (l.ptr.0, l.ptr.0 + l.size))
            .collect();
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            if pair[0].1 > pair[1].0 {
                return Err(format!(
                    "live blocks overlap: {:#x?} and {:#x?}",
                    pair[0], pair[1]
                ));
            }
        }
        // Stitching maps one physical page at several addresses: live blocks must not share
        // a physical byte either.
        let mut physical: Vec<(u64, u64, u64)> = Vec::new();
        for live in &self.live {
            let ranges = self
                .device
                .physical_ranges(live.ptr, live.size)
                .ok_or_else(|| format!("live block {:#x} is not all mapped", live.ptr.0))?;
            physical.extend(ranges.into_iter().map(|(from, to)| (from, to, live.ptr.0)));
        }
        physical.sort_unstable();
        for pair in physical.windows(2) {
            if pair[0].1 > pair[1].0 {
                return Err(format!(
                    "live blocks {:#x} and {:#x} share physical bytes at {:#x}",
                    pair[0].2, pair[1].2, pair[1].0
                ));
            }
        }
        let stats = self.allocator.stats();
        let live_bytes: u64 = self.live.iter().map(|l| l.size).sum();
        if stats.allocated_bytes.current != live_bytes {
            return Err(format!(
                "stats say {} allocated, live blocks add up to {live_bytes}",
                stats.allocated_bytes.current
            ));
        }
        if stats.reserved_bytes.current != self.device.reserved() {
            return Err(format!(
                "stats say {} reserved, the device has {} in segments",
                stats.reserved_bytes.current,
                self.device.reserved()
            ));
        }
        Ok(())
    }

    /// Ends the capture under way, destroys every graph, releases every pool, frees every
    /// live block, empties the cache and checks that nothing is left: no reserved byte, no
    /// segment, no event object, no graph, no race.
    pub fn finish(mut self) -> Result<(), String> {
        self.end_capture()?;
        let alive: Vec<u64> = self
            .graphs
            .iter()
            .filter(|(_, g)| g.alive)
            .map(|(&key, _)| key)
            .collect();
        for key in alive {
            self.destroy_graph(key)?;
        }
        if self.pool_ranges.contains_key(&USER_POOL) {
            self.release_pool(USER_POOL)?;
        }
        for live in std::mem::take(&mut self.live) {
            self.allocator
                .free(live.ptr)
                .map_err(|err| format!("final free: {err}"))?;
        }
        self.allocator
            .empty_cache()
            .map_err(|err| format!("final empty_cache: {err}"))?;
        self.check()?;
        let stats = self.allocator.stats();
        let leftovers = [
            ("reserved bytes", stats.reserved_bytes.current),
            ("segments", self.device.live_segments() as u64),
            ("outstanding events", stats.events_outstanding),
            ("event objects", self.device.live_events() as u64),
            ("graphs", self.device.live_graphs() as u64),
        ];
        for (what, count) in leftovers {
            if count != 0 {
                return Err(format!(
                    "after freeing everything and empty_cache: {count} {what} left"
                ));
            }
        }
        Ok(())
    }
}
