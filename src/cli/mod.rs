//! One module per subcommand. Each exposes an `Args` struct (clap) and
//! `run(args) -> Result<ExitCode, CliError>`.

pub(crate) mod build_torch_ext;
pub(crate) mod demo;
pub(crate) mod doctor;
pub(crate) mod p2p_sim;
pub(crate) mod plot;
pub(crate) mod replay;
pub(crate) mod run;
pub(crate) mod snapshot;
pub(crate) mod view;

/// An error a subcommand reports as one line on stderr, with exit code 2.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] streamalloc_allocator::ConfigError),
    /// The allocator failed.
    #[error(transparent)]
    Alloc(#[from] streamalloc_allocator::AllocError),
    /// A snapshot could not be read, converted or written.
    #[error(transparent)]
    Viz(#[from] streamalloc_viz::VizError),
    /// Anything else, already phrased for the user.
    #[error("{0}")]
    Message(String),
}
