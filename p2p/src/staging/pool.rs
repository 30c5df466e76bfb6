//! The staging pool: a byte budget of buffers drawn from the engine's allocator.
//!
//! Buffers come from [`Allocator::malloc`] on the pool's stream and go back through
//! [`Allocator::free`], so staging shows in the allocator's stats and snapshots like any
//! other memory; each acquire and release is also recorded as
//! [`TraceAction::StagingAcquire`] / [`TraceAction::StagingRelease`]. The pool refuses any
//! acquire that would take it over its budget: the invariant `in_use ≤ budget` holds at
//! every instant, and [`StagingPool::peak`] records the highest `in_use` seen.

use super::StagingError;
use streamalloc_allocator::backend::Backend;
use streamalloc_allocator::trace::TraceAction;
use streamalloc_allocator::types::{Allocation, StreamId};
use streamalloc_allocator::Allocator;

/// A bounded set of staging buffers over an [`Allocator`].
#[derive(Debug)]
pub struct StagingPool<'a, B: Backend> {
    /// Where buffers come from.
    allocator: &'a Allocator<B>,
    /// The stream buffers are allocated on (the stream that packs and unpacks).
    stream: StreamId,
    /// Most bytes held at once.
    budget: u64,
    /// Bytes held now (requested sizes).
    in_use: u64,
    /// Highest `in_use` since creation.
    peak: u64,
}

impl<'a, B: Backend> StagingPool<'a, B> {
    /// A pool of at most `budget` bytes drawn from `allocator` on `stream`.
    pub fn new(allocator: &'a Allocator<B>, stream: StreamId, budget: u64) -> Self {
        Self {
            allocator,
            stream,
            budget,
            in_use: 0,
            peak: 0,
        }
    }

    /// Takes a buffer of `bytes` bytes.
    pub fn acquire(&mut self, bytes: u64) -> Result<Allocation, StagingError> {
        if self.in_use + bytes > self.budget {
            return Err(StagingError::BudgetExceeded {
                in_use: self.in_use,
                requested: bytes,
                budget: self.budget,
            });
        }
        let block = self.allocator.malloc(bytes, self.stream)?;
        self.allocator
            .trace_event(TraceAction::StagingAcquire, block.ptr, bytes, self.stream);
        self.in_use += bytes;
        self.peak = self.peak.max(self.in_use);
        Ok(block)
    }

    /// Returns a buffer taken with [`StagingPool::acquire`].
    pub fn release(&mut self, block: Allocation) -> Result<(), StagingError> {
        self.allocator.free(block.ptr)?;
        self.allocator.trace_event(
            TraceAction::StagingRelease,
            block.ptr,
            block.requested,
            self.stream,
        );
        self.in_use -= block.requested;
        Ok(())
    }

    /// Bytes held now.
    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    /// Highest number of bytes held at once.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// The budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamalloc_allocator::backend::sim::SimBackend;
    use streamalloc_allocator::Config;

    #[test]
    fn buffers_show_in_stats_and_trace_and_respect_the_budget() {
        let device = SimBackend::new(1 << 30);
        let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
        let stream = device.create_stream();
        let mut pool = StagingPool::new(&allocator, stream, 3 << 20);
        let a = pool.acquire(2 << 20).unwrap();
        assert_eq!(allocator.stats().allocated_bytes.current, 2 << 20);
        assert!(matches!(
            pool.acquire(2 << 20),
            Err(StagingError::BudgetExceeded { .. })
        ));
        pool.release(a).unwrap();
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.peak(), 2 << 20);
        let actions: Vec<_> = allocator
            .snapshot()
            .trace
            .iter()
            .map(|e| e.action)
            .filter(|a| matches!(a, TraceAction::StagingAcquire | TraceAction::StagingRelease))
            .collect();
        assert_eq!(
            actions,
            [TraceAction::StagingAcquire, TraceAction::StagingRelease]
        );
    }
}
