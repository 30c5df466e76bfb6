//! How the engine works, for readers of the code (this module holds no code).
//!
//! # The map
//! - A **segment** is one range from the device ([`crate::backend::Segments::alloc_segment`]),
//!   tiled exactly by **blocks** linked in address order (`pool::arena`).
//! - A free block is in exactly one place: its owner stream's **hot list** (recently
//!   freed, ready, unmerged), its owner's **ready** list for its pool, or its owner's
//!   **pending** list (it carries events of other streams). Allocated blocks are in the
//!   address map only; hot blocks stay in it too (flagged free), so that a same-size
//!   free and malloc leave the map alone. Hot blocks are invisible to best fit, so a
//!   malloc that finds none of its size first merges them into the free lists (and
//!   parking pauses until same-size reuse shows up again): placement stays best fit.
//! - Counting invariants, checked by [`crate::Allocator::check_invariants`]:
//!   `allocated + Σ free == reserved`, `active == allocated + pending_free`,
//!   `event objects created − destroyed == outstanding + idle`.
//!
//! # Why per-stream lists
//! Reuse on the stream that freed a block is ordered by the stream itself, so the fast
//! path needs no event at all: a scan of at most eight hot blocks for the same size, or
//! a best-fit lookup in size classes with a bitmap (`pool::free_list`). Only when the stream
//! has nothing suitable does the slow path look at pending blocks and other streams, and
//! only there does it talk to the driver.
//!
//! # Why waits instead of queries
//! `cuStreamWaitEvent` (~97 ns) orders the new owner after the old users on the device
//! without the host learning anything; `cuEventQuery` (~1.25 µs) would have to be repeated
//! until the GPU catches up with a host that runs ahead. Events are therefore queried only
//! in batches (when `event_batch` are in flight, or before growing under the PyTorch
//! policy), oldest first per stream, stopping at the first incomplete one — events on a
//! stream complete in order, so each is queried about once.
//!
//! # Merging rules
//! Two free neighbours merge only if the result needs no more synchronisation than either
//! (same owner, both ready or both pending), so a ready block never inherits a wait. After
//! a device-wide synchronisation (`empty_cache`, the out-of-memory retry) every free byte
//! is safe for every stream, and runs of free blocks merge regardless of owner so whole
//! segments can be returned.
//!
//! # Failure
//! A driver error while recording a use event would leave a block whose reuse cannot be
//! ordered: it is quarantined (counted as allocated to nobody) until the next device-wide
//! synchronisation frees it. Nothing is ever handed out unordered.
