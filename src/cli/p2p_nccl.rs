//! `streamalloc p2p-nccl`: the `p2p-sim` workload between real GPUs, over NCCL, from Rust.
//!
//! The launcher spawns one worker process of this same binary per rank (rank `r` uses CUDA
//! device `r`). Every worker rebuilds the same random workload as `p2p-sim` (same seed, same
//! generator), keeps its own rank's lists, joins an NCCL communicator through
//! [`NcclTransport::from_file`] (rank 0 writes the unique id to a fresh file in a temporary
//! directory), runs `agree_on_plan` and `execute` over it, checks every received byte and
//! prints one JSON line for the launcher, which prints the same summary as `p2p-sim`.
//!
//! `--mismatch-rank R` makes rank `R` drop one tensor from its send list, so the plan
//! agreement must fail: the launcher then shows every rank's error (they should be the
//! same) and how long the ranks took to fail. Every wait inside a worker is bounded by
//! `--timeout-s`, and the launcher kills workers still running after
//! `--launcher-timeout-s`. `--absent-rank R` never starts rank `R`, to show the others
//! giving up at the rendezvous within `--timeout-s` instead of hanging.
//!
//! Without NCCL, a CUDA driver or any device it prints `SKIP: why` and exits 0, like
//! `streamalloc-gpu-test`.

use super::p2p_sim::{rank_main, workload, RankOutcome, WorkloadArgs};
use super::CliError;
use clap::Args;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};
use streamalloc_p2p::staging::plan::{LocalDescription, StagingConfig};
use streamalloc_p2p::transport::nccl::{self, NcclTransport};

/// Arguments of `streamalloc p2p-nccl`.
#[derive(Args, Debug)]
pub(crate) struct P2pNcclArgs {
    /// Number of ranks (processes, one GPU each: rank r uses device r).
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Refuse runs needing more host memory than this, MiB (send and receive copies of
    /// all ranks together).
    #[arg(long, default_value_t = 16384)]
    max_total_mib: u64,
    /// Longest any single wait (rendezvous, one group, one all-gather) may take, seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout_s: f64,
    /// Kill workers still running after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    launcher_timeout_s: f64,
    /// Make this rank drop one tensor from its send list: every rank must fail with the
    /// same mismatch error.
    #[arg(long)]
    mismatch_rank: Option<u32>,
    /// Do not start this rank at all: the others must give up within --timeout-s (a
    /// timeout, not a hang) while waiting for it at the rendezvous.
    #[arg(long)]
    absent_rank: Option<u32>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// (Internal) run as this worker rank.
    #[arg(long, hide = true)]
    worker_rank: Option<u32>,
    /// (Internal) the unique-id file of the worker's job.
    #[arg(long, hide = true)]
    id_file: Option<PathBuf>,
}

/// What a worker prints (one JSON line on stdout).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct WorkerReport {
    rank: u32,
    outcome: Option<RankOutcome>,
    error: Option<String>,
}

pub(crate) fn run(args: P2pNcclArgs) -> Result<ExitCode, CliError> {
    let bad = |m: String| Err(CliError::Message(m));
    if args.ranks == 0 || args.ranks > 64 {
        return bad("--ranks must be between 1 and 64".into());
    }
    if !(args.timeout_s > 0.0 && args.timeout_s.is_finite()) {
        return bad("--timeout-s must be a positive number of seconds".into());
    }
    if !(args.launcher_timeout_s > 0.0 && args.launcher_timeout_s.is_finite()) {
        return bad("--launcher-timeout-s must be a positive number of seconds".into());
    }
    if let Some(r) = args.mismatch_rank {
        if r >= args.ranks || args.ranks < 2 {
            return bad(format!(
                "--mismatch-rank {r} needs at least 2 ranks and a rank below --ranks {}",
                args.ranks
            ));
        }
    }
    if let Some(r) = args.absent_rank {
        if r >= args.ranks || args.ranks < 2 {
            return bad(format!(
                "--absent-rank {r} needs at least 2 ranks and a rank below --ranks {}",
                args.ranks
            ));
        }
    }
    let config = args.workload.staging()?;
    match (args.worker_rank, &args.id_file) {
        (Some(rank), Some(path)) => {
            if rank >= args.ranks {
                return bad(format!("--worker-rank {rank} is not below --ranks"));
            }
            Ok(worker(&args, rank, path, config))
        }
        (None, None) => launch(&args, config),
        _ => bad("--worker-rank and --id-file go together".into()),
    }
}

/// Why this machine cannot run the command at all (no NCCL, driver or device), if so.
fn unavailable() -> Option<String> {
    if let Err(err) = nccl::load() {
        return Some(err.to_string());
    }
    match nccl::device_count() {
        Err(err) => Some(err.to_string()),
        Ok(0) => Some("no CUDA device is visible".into()),
        Ok(_) => None,
    }
}

fn launch(args: &P2pNcclArgs, config: StagingConfig) -> Result<ExitCode, CliError> {
    if let Some(why) = unavailable() {
        println!("SKIP: {why}");
        return Ok(ExitCode::SUCCESS);
    }
    let devices = nccl::device_count().map_err(|e| CliError::Message(e.to_string()))?;
    if args.ranks > devices as u32 {
        return Err(CliError::Message(format!(
            "--ranks {} needs {} GPUs (one per rank); {devices} visible",
            args.ranks, args.ranks
        )));
    }
    // Validates the memory bound before any process starts.
    let (_, total_bytes) = workload(
        args.ranks,
        args.workload.tensors,
        args.workload.max_tensor_kib << 10,
        args.max_total_mib << 20,
        args.workload.seed,
    )?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!(
        "streamalloc-p2p-nccl-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::Message(format!("cannot create {}: {e}", dir.display())))?;
    let result = launch_in(args, config, total_bytes, &dir.join("nccl-unique-id"));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn launch_in(
    args: &P2pNcclArgs,
    config: StagingConfig,
    total_bytes: u64,
    id_file: &Path,
) -> Result<ExitCode, CliError> {
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Message(format!("cannot find this program's path: {e}")))?;
    let start = Instant::now();
    let mut children: Vec<(u32, Child)> = Vec::new();
    for rank in (0..args.ranks).filter(|&r| Some(r) != args.absent_rank) {
        let mut command = Command::new(&exe);
        command
            .arg("p2p-nccl")
            .args(["--ranks", &args.ranks.to_string()])
            .args(["--tensors", &args.workload.tensors.to_string()])
            .args(["--budget-mib", &args.workload.budget_mib.to_string()])
            .args(["--seed", &args.workload.seed.to_string()])
            .args([
                "--max-tensor-kib",
                &args.workload.max_tensor_kib.to_string(),
            ])
            .args(["--max-total-mib", &args.max_total_mib.to_string()])
            .args(["--timeout-s", &args.timeout_s.to_string()])
            .args(["--worker-rank", &rank.to_string()])
            .arg("--id-file")
            .arg(id_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(r) = args.mismatch_rank {
            command.args(["--mismatch-rank", &r.to_string()]);
        }
        if args.json {
            command.arg("--json");
        }
        match command.spawn() {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                stop_all(&mut children);
                return Err(CliError::Message(format!(
                    "cannot start rank {rank} ({}): {e}",
                    exe.display()
                )));
            }
        }
    }
    // Each worker's stdout is read on its own thread, so none blocks on a full pipe.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|(_, child)| {
            let mut stdout = child.stdout.take().expect("stdout is piped");
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = stdout.read_to_string(&mut text);
                text
            })
        })
        .collect();
    let deadline = start + Duration::from_secs_f64(args.launcher_timeout_s);
    let mut killed = false;
    loop {
        let mut running = false;
        for (_, child) in children.iter_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                running = true;
            }
        }
        if !running {
            break;
        }
        if Instant::now() >= deadline {
            stop_all(&mut children);
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut outcomes = Vec::new();
    let mut errors: Vec<(u32, String)> = Vec::new();
    for ((rank, mut child), reader) in children.into_iter().zip(readers) {
        let status = child.wait().ok();
        let text = reader.join().unwrap_or_default();
        let report = text
            .lines()
            .rev()
            .find_map(|line| serde_json::from_str::<WorkerReport>(line).ok());
        match report {
            Some(WorkerReport {
                outcome: Some(outcome),
                ..
            }) => outcomes.push(outcome),
            Some(WorkerReport {
                error: Some(error), ..
            }) => errors.push((rank, error)),
            _ => errors.push((
                rank,
                if killed {
                    format!(
                        "killed after --launcher-timeout-s {}",
                        args.launcher_timeout_s
                    )
                } else {
                    format!(
                        "exited ({}) without a report",
                        status.map_or("unknown status".into(), |s| s.to_string())
                    )
                },
            )),
        }
    }
    if !errors.is_empty() {
        for (rank, error) in &errors {
            eprintln!("p2p-nccl: rank {rank} failed: {error}");
        }
        let started = args.ranks as usize - usize::from(args.absent_rank.is_some());
        let same = errors.len() == started
            && started > 1
            && errors.windows(2).all(|pair| pair[0].1 == pair[1].1);
        return Err(CliError::Message(format!(
            "{} of {started} started ranks failed{} after {seconds:.2} s",
            errors.len(),
            if same {
                ", every rank with the same error,"
            } else {
                ""
            }
        )));
    }
    let exchange = outcomes
        .iter()
        .map(|o| o.exchange_seconds)
        .fold(0.0f64, f64::max);
    Ok(super::p2p_sim::report(
        &outcomes,
        args.workload.tensors,
        total_bytes,
        config,
        seconds,
        args.json,
        &[
            ("transport", serde_json::json!("nccl")),
            ("exchange_seconds", serde_json::json!(exchange)),
        ],
    ))
}

/// Kills and reaps every worker still running (only the processes this launcher started).
fn stop_all(children: &mut [(u32, Child)]) {
    for (_, child) in children.iter_mut() {
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

/// Drops the last tensor of this rank's first non-empty send list.
fn mismatch(local: &mut LocalDescription) -> bool {
    match local.sends.iter_mut().find(|list| !list.is_empty()) {
        Some(list) => {
            list.pop();
            true
        }
        None => false,
    }
}

/// One worker rank: its share of the workload over a fresh NCCL communicator. Always
/// prints one JSON line; exit status 0 only if every byte it received is intact.
fn worker(args: &P2pNcclArgs, rank: u32, id_file: &Path, config: StagingConfig) -> ExitCode {
    let result = (|| -> Result<RankOutcome, String> {
        let (mut locals, _) = workload(
            args.ranks,
            args.workload.tensors,
            args.workload.max_tensor_kib << 10,
            args.max_total_mib << 20,
            args.workload.seed,
        )
        .map_err(|e| e.to_string())?;
        let mut local = locals.swap_remove(rank as usize);
        if args.mismatch_rank == Some(rank) && !mismatch(&mut local) {
            return Err(format!(
                "rank {rank} has no tensor to drop for --mismatch-rank"
            ));
        }
        let timeout = Duration::from_secs_f64(args.timeout_s);
        let mut transport =
            NcclTransport::from_file(id_file, rank, args.ranks, rank as i32, timeout)
                .map_err(|e| e.to_string())?;
        rank_main(&mut transport, local, config, args.json, "p2p-nccl").map_err(|e| e.to_string())
    })();
    let (report, code) = match result {
        Ok(outcome) => {
            let code = if outcome.intact {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            };
            (
                WorkerReport {
                    rank,
                    outcome: Some(outcome),
                    error: None,
                },
                code,
            )
        }
        Err(error) => (
            WorkerReport {
                rank,
                outcome: None,
                error: Some(error),
            },
            ExitCode::from(2),
        ),
    };
    match serde_json::to_string(&report) {
        Ok(line) => println!("{line}"),
        Err(e) => eprintln!("p2p-nccl: rank {rank}: cannot encode the report: {e}"),
    }
    code
}
