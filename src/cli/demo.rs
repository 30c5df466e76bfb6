//! `streamalloc demo`: the `record_stream` pipeline (docs/design.md, "The lifetime model:
//! streams") on the simulated device, under both reuse policies, printed side by side with
//! what each column means. Needs no GPU.
//!
//! `demo --write-trace PATH` writes the sample PyTorch memory snapshot compiled into the
//! program instead, so that every snapshot example (`view`, `plot`, `replay`) runs from any
//! folder of any installation, with no checkout beside it.

use super::out::outln;
use super::CliError;
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use streamalloc_allocator::config::format_bytes;
use streamalloc_allocator::scenarios::{record_stream_pipeline, ScenarioReport};
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
    /// Write the sample PyTorch memory snapshot (BERT training with varying sequence
    /// lengths, recorded on a GPU) to PATH instead of running the demo, e.g. for
    /// `streamalloc view PATH --replay`.
    #[arg(long, value_name = "PATH")]
    write_trace: Option<PathBuf>,
}

/// The sample trace: a PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`) of
/// BERT training on 12 batches of varying shape, recorded from process start on an H200
/// under PyTorch 2.11's own allocator (also a test trace of the replay).
pub(crate) const SAMPLE_TRACE: &[u8] =
    include_bytes!("../../tests/data/traces/bert_varlen.pickle.gz");

/// What [`SAMPLE_TRACE`] holds, for the line `--write-trace` prints.
const SAMPLE_TRACE_ABOUT: &str = "a PyTorch memory snapshot of BERT training on 12 batches \
     of varying shape (20,905 events, 7,153 allocations), recorded on an H200 under PyTorch's \
     own allocator";

/// Simulated device time of the producer's kernel and of the send, as the scenario
/// launches them (`record_stream_pipeline`).
const MATMUL_MS: f64 = 1.0;
const SEND_MS: f64 = 5.0;

pub(crate) fn run(args: DemoArgs) -> Result<ExitCode, CliError> {
    if let Some(path) = &args.write_trace {
        return write_trace(path);
    }
    if args.iterations == 0 || args.size_mib == 0 {
        return Err(CliError::Message(
            "--iterations and --size-mib must be positive".into(),
        ));
    }
    let size = args.size_mib << 20;
    outln!(
        "Simulated pipeline stage: {} activations of {} produced on a compute stream,\n\
         each read by a 5x slower communication stream (record_use), freed at once.\n",
        args.iterations,
        format_bytes(size)
    )?;
    outln!(
        "{:<12} {:>14} {:>14} {:>12} {:>10} {:>12} {:>6}",
        "policy",
        "peak reserved",
        "peak alloc",
        "dev waits",
        "queries",
        "device ms",
        "races"
    )?;
    let mut reports = Vec::new();
    for (name, policy) in [
        ("pytorch", ReusePolicy::Pytorch),
        ("stream_wait", ReusePolicy::StreamWait),
    ] {
        let report = record_stream_pipeline(policy, args.iterations, size)?;
        outln!(
            "{:<12} {:>14} {:>14} {:>12} {:>10} {:>12.1} {:>6}",
            name,
            format_bytes(report.peak_reserved),
            format_bytes(report.peak_allocated),
            report.cross_stream_waits,
            report.event_queries,
            report.device_time_ns as f64 / 1e6,
            report.races.len()
        )?;
        reports.push(report);
    }
    outln!()?;
    outln!("{}", legend())?;
    outln!()?;
    outln!("{}", verdict(&reports[0], &reports[1]))?;
    let races: Vec<&String> = reports.iter().flat_map(|r| &r.races).collect();
    for race in &races {
        super::out::errln!("  {race}");
    }
    Ok(if races.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What each column of the table means.
fn legend() -> String {
    [
        "peak reserved  the most device memory the allocator held (what nvidia-smi shows)",
        "peak alloc     the most memory in live activations at once",
        "dev waits      waits queued on the GPU (cuStreamWaitEvent) before the compute stream",
        "               reuses a block the send may still read; the host never stops for them",
        "queries        times the host asked whether a send had finished (cuEventQuery), to",
        "               know whether its block could be reused",
        "device ms      simulated GPU time until both streams are done",
        &format!("               ({MATMUL_MS:.0} ms per matmul, {SEND_MS:.0} ms per send)"),
        "races          a block written while another stream still read it (the simulator's",
        "               race detector; any is a bug)",
    ]
    .join("\n")
}

/// The comparison in words, from the two reports (PyTorch's policy first), wrapped to the
/// table's width.
fn verdict(pytorch: &ScenarioReport, stream_wait: &ScenarioReport) -> String {
    let ms = |r: &ScenarioReport| r.device_time_ns as f64 / 1e6;
    let extra = ms(stream_wait) - ms(pytorch);
    let mut text = format!(
        "stream_wait holds {} where pytorch holds {}: a freed block is reused after a wait \
         on the device, not kept until the host sees its send finish.",
        format_bytes(stream_wait.peak_reserved),
        format_bytes(pytorch.peak_reserved)
    );
    if extra > 0.0 {
        text.push_str(&format!(
            " Its device time is {extra:.1} ms ({:.0}%) longer in this toy, where the send is \
             the bottleneck and the compute stream has nothing else to do: each matmul waits \
             for the send still reading the block it reuses, where pytorch overlaps them by \
             holding a new block per send. On real training steps the step time measured the \
             same (README, \"Measured against PyTorch's allocator\").",
            100.0 * extra / ms(pytorch).max(f64::MIN_POSITIVE)
        ));
    }
    wrap(&text, 86)
}

/// `text` with its spaces turned into line breaks where a line would pass `width`.
fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = 0;
    for word in text.split(' ') {
        if line > 0 && line + 1 + word.len() > width {
            out.push('\n');
            line = 0;
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(word);
        line += word.len();
    }
    out
}

/// `demo --write-trace PATH`: the sample trace, written whole or not at all. A file
/// already there is left alone: kept if it is the sample, refused otherwise (it may be a
/// snapshot of the user's own).
fn write_trace(path: &Path) -> Result<ExitCode, CliError> {
    match std::fs::read(path) {
        Ok(existing) if existing == SAMPLE_TRACE => {}
        Ok(_) => {
            return Err(CliError::Message(format!(
                "{}: a file is already there; write the sample trace under another name",
                path.display()
            )))
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => write_sample(path)?,
        Err(err) => return Err(CliError::Message(format!("{}: {err}", path.display()))),
    }
    outln!("{}: {SAMPLE_TRACE_ABOUT}", path.display())?;
    outln!(
        "try: streamalloc view {0} --replay   (or: streamalloc plot {0} --replay -o replay.svg)",
        path.display()
    )?;
    Ok(ExitCode::SUCCESS)
}

fn write_sample(path: &Path) -> Result<(), CliError> {
    streamalloc_viz::output::write_whole(path, |out| {
        out.write_all(SAMPLE_TRACE)
            .map_err(|source| streamalloc_viz::VizError::Io {
                path: path.to_path_buf(),
                source,
            })
    })?;
    Ok(())
}
