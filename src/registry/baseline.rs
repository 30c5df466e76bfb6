//! Where PyTorch's accumulated statistics count from: the engine's counters when
//! `torch.cuda.reset_accumulated_memory_stats()` last reset them. The engine's own counters
//! never reset, so the door keeps this baseline and subtracts it.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::Mutex;
use streamalloc_allocator::Stats;

/// A registry's counters at the last reset of PyTorch's accumulated statistics, by
/// device (none: never reset).
#[derive(Debug)]
pub(crate) struct AccumulatedSince {
    map: Mutex<BTreeMap<c_int, Stats>>,
}

impl AccumulatedSince {
    pub(crate) const fn new() -> Self {
        Self {
            map: Mutex::new(BTreeMap::new()),
        }
    }

    pub(crate) fn get(&self, device: c_int) -> Stats {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&device).copied().unwrap_or_default()
    }

    pub(crate) fn set(&self, device: c_int, stats: Stats) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(device, stats);
    }
}
