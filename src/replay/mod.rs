//! `streamalloc replay`'s two halves: reading a recorded trace from any format the project
//! writes ([`load`]), and running it through the engine on the simulated device against the
//! recording allocator's figures ([`run`], which fills a [`report`]). Replay is a tool
//! built on the engine's public API, not part of the engine, so it lives here, beside the
//! CLI that runs it. For `view --replay` and `plot --replay`: the replay event by event and
//! the lowest cap it completes under ([`series`]), drawn over a recorded timeline
//! ([`overlay`]).

pub mod load;
pub mod overlay;
pub mod report;
pub mod run;
pub mod series;

pub use load::*;
pub use overlay::*;
pub use report::*;
pub use run::*;
pub use series::*;
