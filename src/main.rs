//! `streamalloc`: the command-line front end. Each subcommand lives in its own module under
//! `cli/`; this file only parses arguments and dispatches.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cli;

/// streamalloc: a CUDA caching allocator with stream-aware lifetimes.
#[derive(Parser, Debug)]
#[command(name = "streamalloc", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a simulated workload (no GPU needed) and print what the allocator did, or
    /// write a sample snapshot (--write-trace).
    Demo(cli::demo::DemoArgs),
    /// Plan a staged many-tensor exchange on simulated ranks and check the plan.
    P2pSim(cli::p2p_sim::P2pSimArgs),
    /// Replay allocation traces (PyTorch snapshots or streamalloc JSON) on the simulated
    /// device and compare peak reserved memory with the recording allocator's.
    Replay(cli::replay::ReplayArgs),
    /// Run an unmodified program (python, torchrun, ...) with streamalloc as its allocator.
    Run(cli::run::RunArgs),
    /// Convert memory snapshots between our JSON, PyTorch pickles and Perfetto traces.
    Snapshot(cli::snapshot::SnapshotArgs),
    /// Open snapshots in the bundled memory-timeline viewer (served on 127.0.0.1); with
    /// --replay, with the memory streamalloc would reserve on the same run drawn over them.
    View(cli::view::ViewArgs),
    /// Render the active-memory timeline of a snapshot to SVG or PNG, without a browser;
    /// with --replay, with the memory streamalloc would reserve on the same run.
    Plot(cli::plot::PlotArgs),
    /// Check this machine: the library, GPUs and driver, NCCL, PyTorch, the native door and
    /// the configuration, one verdict per line.
    Doctor(cli::doctor::DoctorArgs),
    /// Compile the native PyTorch door for the installed PyTorch now, rather than on first use.
    BuildTorchExt(cli::build_torch_ext::BuildTorchExtArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("STREAMALLOC_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => cli::demo::run(args),
        Command::P2pSim(args) => cli::p2p_sim::run(args),
        Command::Replay(args) => cli::replay::run(args),
        Command::Run(args) => cli::run::run(args),
        Command::Snapshot(args) => cli::snapshot::run(args),
        Command::View(args) => cli::view::run(args),
        Command::Plot(args) => cli::plot::run(args),
        Command::Doctor(args) => cli::doctor::run(args),
        Command::BuildTorchExt(args) => cli::build_torch_ext::run(args),
    };
    match result {
        Ok(code) => code,
        // Whoever read the output has all they wanted (`| head -1`).
        Err(cli::CliError::StdoutClosed) => ExitCode::SUCCESS,
        Err(err) => {
            cli::out::errln!("streamalloc: {err}");
            ExitCode::from(2)
        }
    }
}
