//! # streamalloc
//!
//! The shared library users load: the C ABI that PyTorch's pluggable-allocator hook (and
//! any CUDA program) calls ([`ffi`]), over the per-device allocators of the process
//! ([`registry`]) and the engine in `streamalloc-allocator`. The `streamalloc` binary (see
//! `main.rs`) is a thin caller of the same crates.

#![warn(missing_docs, rust_2018_idioms)]

pub mod ffi;
pub mod process;
pub mod registry;

pub use streamalloc_allocator as allocator;
pub use streamalloc_p2p as p2p;

pub mod replay;
