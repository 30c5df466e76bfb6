//! One module per subcommand. Each exposes an `Args` struct (clap) and
//! `run(args) -> Result<ExitCode, CliError>`.

pub(crate) mod build_torch_ext;
pub(crate) mod demo;
pub(crate) mod doctor;
pub(crate) mod out;
pub(crate) mod overlay;
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
    /// Stdout is a pipe whose reader has gone (`| head -1`): the command ends quietly,
    /// with status 0 ([`out`]).
    #[error("stdout closed")]
    StdoutClosed,
}

/// Every key of `config` as `key:value`, defaults included (an unset limit reads `none`):
/// what `doctor` and `replay` print. Read off the `Config`'s own fields, so a key added
/// there is shown without a change here.
pub(crate) fn every_config_key(config: &streamalloc_allocator::Config) -> String {
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(config) else {
        return config.to_conf_string();
    };
    let pairs: Vec<String> = fields
        .into_iter()
        .map(|(key, value)| match value {
            serde_json::Value::Null => format!("{key}:none"),
            serde_json::Value::String(text) => format!("{key}:{text}"),
            other => format!("{key}:{other}"),
        })
        .collect();
    pairs.join(",")
}
