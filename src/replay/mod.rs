//! `streamalloc replay`'s two halves: reading a recorded trace from any format the project
//! writes ([`load`]), and running it through the engine on the simulated device against the
//! recording allocator's figures ([`run`]). Replay is a tool built on the engine's public
//! API, not part of the engine, so it lives here, beside the CLI that runs it.

pub mod load;
pub mod run;

pub use load::*;
pub use run::*;
