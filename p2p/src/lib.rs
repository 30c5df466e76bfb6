//! # streamalloc-p2p
//!
//! Many-tensor point-to-point exchanges between ranks through a bounded staging budget.
//!
//! The engine (`streamalloc-allocator`) decides who may use which bytes of one device; an
//! exchange between ranks is a client of it, not part of it. This crate holds that client:
//! it plans rounds every rank agrees on, and its staging pool draws buffers from an engine's
//! [`streamalloc_allocator::Allocator`] (so they show in its stats and trace). The engine
//! knows nothing of it.
//!
//! ## Layout
//! - [`staging`]: the deterministic planner (rounds every rank agrees on) and the staging
//!   pool. The executor that runs a plan is `streamalloc.p2p`, in Python: it calls the
//!   planner through the C ABI.

#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

pub mod staging;
