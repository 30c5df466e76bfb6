//! `streamalloc demo`: the `record_stream` pipeline (docs/design.md, "The lifetime model:
//! streams") on the simulated device, under both reuse policies, printed side by side.
//! Needs no GPU.

use super::CliError;
use clap::Args;
use std::process::ExitCode;
use streamalloc_allocator::config::format_bytes;
use streamalloc_allocator::scenarios::record_stream_pipeline;
use streamalloc_allocator::ReusePolicy;

/// Arguments of `streamalloc demo`.
#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    /// Activations sent by the pipeline stage.
    #[arg(long, default_value_t = 32)]
    iterations: u32,
    /// Activation size in MiB.
    #[arg(long, default_value_t = 64)]
    size_mib: u64,
}

pub(crate) fn run(args: DemoArgs) -> Result<ExitCode, CliError> {
    if args.iterations == 0 || args.size_mib == 0 {
        return Err(CliError::Message(
            "--iterations and --size-mib must be positive".into(),
        ));
    }
    let size = args.size_mib << 20;
    println!(
        "Simulated pipeline stage: {} activations of {} produced on a compute stream,\n\
         each read by a 5x slower communication stream (record_use), freed at once.\n",
        args.iterations,
        format_bytes(size)
    );
    println!(
        "{:<12} {:>14} {:>14} {:>12} {:>10} {:>12} {:>6}",
        "policy", "peak reserved", "peak alloc", "dev waits", "queries", "device ms", "races"
    );
    let mut failed = false;
    for (name, policy) in [
        ("pytorch", ReusePolicy::Pytorch),
        ("stream_wait", ReusePolicy::StreamWait),
    ] {
        let report = record_stream_pipeline(policy, args.iterations, size)?;
        println!(
            "{:<12} {:>14} {:>14} {:>12} {:>10} {:>12.1} {:>6}",
            name,
            format_bytes(report.peak_reserved),
            format_bytes(report.peak_allocated),
            report.cross_stream_waits,
            report.event_queries,
            report.device_time_ns as f64 / 1e6,
            report.races.len()
        );
        for race in &report.races {
            eprintln!("  {race}");
            failed = true;
        }
    }
    println!("\nstream_wait keeps one activation in flight per stream instead of one per send.");
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
