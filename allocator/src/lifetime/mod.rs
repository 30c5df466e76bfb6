//! Stream-ordered lifetimes: which free list a block belongs in and what a stream must
//! wait for before reusing it.
//!
//! # The model
//! - A block belongs to the stream that allocated it; reuse on that stream is safe by
//!   stream order and costs nothing.
//! - `record_use(ptr, s)` adds `s` to the block's uses. On free, one pooled event is
//!   recorded on each use stream and the block goes straight back to its owner's free
//!   list carrying them (`pending`).
//! - An allocation that takes a pending block, or any block of another stream, makes its
//!   stream wait for them on the device (`cuStreamWaitEvent`, ~97 ns) instead of holding
//!   the block out of circulation until the host sees the events complete (PyTorch's
//!   `record_stream`, which piles blocks up while the host runs ahead).
//! - Another stream's free block is taken after a wait for its owner's work up to the
//!   free, not for everything the owner has queued since: streams record *fences* as they
//!   free ([`fences`]), and a block a completed fence covers needs no wait at all.
//! - Events are queried rarely and in batches ([`streams::StreamState::in_flight`]), since a
//!   query (~1.25 µs) costs more than a wait.
//! - Memory pools ([`pools`]) add a second axis: a block serves only allocations of its own
//!   pool, and a pool with uses left keeps its memory even when every block in it is free,
//!   because a captured graph replays into addresses, not into tensors.

pub(crate) mod events;
pub(crate) mod fences;
pub(crate) mod pools;
pub(crate) mod streams;

pub(crate) use events::{EventKey, EventTable};
pub(crate) use pools::PoolTable;
pub(crate) use streams::StreamTable;
