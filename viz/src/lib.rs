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
//! - [`pickle`]: the bounded pickle decoder those snapshots are read with (plain data
//!   only, shared references resolved, no code run).
//! - [`limits`]: every bound on untrusted input (sizes, memory built, devices, addresses),
//!   shared by all readers, the replayer's included.
//! - [`sniff`]: which of those formats a file holds, told from its content.
//! - [`input`]: reading a file within the size limits, gunzipping it within its own.
//! - [`json`]: reading JSON within the memory budget.
//! - [`output`]: writing a file whole or not at all.
//! - [`stacks`]: call stacks held once, frames and stacks by index.
//! - [`model`]: the one model every format converts through, which is also our versioned
//!   JSON format (schema in the module docs).
//! - [`files`]: [`files::load`] opens any supported file, [`files::save`] writes one
//!   without ever leaving a partial file.
//! - [`timeline`]: allocation and segment lifetimes and memory counters over time.
//! - [`perfetto`]: Chrome JSON counter tracks for Perfetto.
//! - [`overlay`]: a replayed allocator's reserved memory over a recorded timeline, with
//!   its legend (`view --replay`, `plot --replay`).
//! - [`plot`]: the timeline as SVG or PNG, without a browser ([`plot_svg`] writes the SVG,
//!   [`plot_png`] draws the PNG's pixels with [`font`]'s bitmap font; `plot_axes` their
//!   ticks and units).
//! - [`server`]: the viewer, a page compiled into the binary served on 127.0.0.1, fed by
//!   [`wire`]'s typed-array columns.
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

//! ## Layers
//! A module uses only modules listed before it here: `error`, `limits`, `sniff`, `input`,
//! `output`, `pickle`, `json`, `stacks`, `model`, `timeline`, `pytorch`, `perfetto`,
//! `overlay`, `font`, `plot_axes`, `plot`, `plot_svg`, `plot_png`, `wire`, `files`, `server`.

mod error;
pub mod files;
pub mod font;
pub mod input;
pub mod json;
pub mod limits;
pub mod model;
pub mod output;
pub mod overlay;
pub mod perfetto;
pub mod pickle;
pub mod plot;
mod plot_axes;
pub mod plot_png;
pub mod plot_svg;
pub mod pytorch;
pub mod server;
pub mod sniff;
pub mod stacks;
pub mod timeline;
pub mod wire;

pub use error::VizError;
