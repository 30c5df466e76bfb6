//! Where PyTorch's accumulated statistics count from: the engine's counters when
//! `torch.cuda.reset_accumulated_memory_stats()` last reset them. The engine's own counters
//! never reset, so the door keeps this baseline and subtracts it.

use super::{CallError, Device};
use std::sync::Mutex;
use streamalloc_allocator::{Backend, Stats};

/// A device's counters at the last reset of PyTorch's accumulated statistics (none:
/// never reset).
#[derive(Debug, Default)]
pub(super) struct Baseline(Mutex<Option<Stats>>);

impl<B: Backend> Device<B> {
    /// The engine's counters now, and where PyTorch's accumulated statistics count from
    /// (zero until [`Device::reset_accumulated_stats`]).
    pub fn stats_since_reset(&self) -> Result<(Stats, Stats), CallError> {
        let now = self.run(|allocator| allocator.stats())?;
        let since = self.baseline.0.lock().unwrap_or_else(|p| p.into_inner());
        Ok((now, since.unwrap_or_default()))
    }

    /// Starts PyTorch's accumulated statistics from the engine's counters now.
    pub fn reset_accumulated_stats(&self) -> Result<(), CallError> {
        let now = self.run(|allocator| allocator.stats())?;
        *self.baseline.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
        Ok(())
    }
}
