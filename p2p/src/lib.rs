//! # streamalloc-p2p
//!
//! Many-tensor point-to-point exchanges between ranks through a bounded staging budget.
//!
//! The engine (`streamalloc-allocator`) decides who may use which bytes of one device; an
//! exchange between ranks is a client of it, not part of it. This crate holds that client:
//! it draws its staging buffers from an engine's [`streamalloc_allocator::Allocator`] (so
//! they show in its stats and trace) and talks to other ranks over a transport. The engine
//! knows nothing of it.
//!
//! ## Layout
//! - [`staging`]: the deterministic planner (rounds every rank agrees on), the staging
//!   pool and the executor that runs a plan.
//! - [`transport`]: the [`transport::Transport`] trait the executor runs over, the
//!   simulated transport CI uses, and the NCCL transport (feature `nccl`).

#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

pub mod staging;
pub mod transport;
