//! # streamalloc-viz
//!
//! Snapshot formats and the bundled memory-timeline viewer of streamalloc.
//!
//! When memory runs out, users want to see why: which allocations were live at the peak,
//! what each stream held, which blocks waited on events. This crate reads and writes the
//! files that answer that:
//!
//! - [`pytorch`]: PyTorch's memory snapshots (`torch.cuda.memory._dump_snapshot` pickles,
//!   gzip or not), read for the viewer and the trace replayer, and written back so that
//!   PyTorch's own viewer opens ours.
//!
//! ## Example: count the allocations of a PyTorch snapshot
//! ```no_run
//! let snapshot = streamalloc_viz::pytorch::read_snapshot("gpt2.pickle.gz".as_ref())?;
//! println!("{} allocations", snapshot.alloc_count());
//! # Ok::<(), streamalloc_viz::VizError>(())
//! ```

#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod error;
pub mod pytorch;

pub use error::VizError;
