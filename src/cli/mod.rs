//! One module per subcommand. Each exposes an `Args` struct (clap) and
//! `run(args) -> Result<ExitCode, CliError>`.

pub(crate) mod demo;
pub(crate) mod p2p_sim;
pub(crate) mod replay;
pub(crate) mod run;

/// An error a subcommand reports as one line on stderr, with exit code 2.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] streamalloc_allocator::ConfigError),
    /// The allocator failed.
    #[error(transparent)]
    Alloc(#[from] streamalloc_allocator::AllocError),
    /// Anything else, already phrased for the user.
    #[error("{0}")]
    Message(String),
}
