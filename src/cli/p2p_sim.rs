//! `streamalloc p2p-sim`: a staged many-tensor exchange between simulated ranks.
//!
//! Every rank (a thread) sends `--tensors` parameter-shaped tensors, in random order and to
//! random peers, through the planner, the staging pool (on a simulated device, through the
//! engine's allocator) and the simulated transport; every received byte is then checked.
//! Needs no GPU: it shows what the plan does with a given budget (rounds, group sizes,
//! staging memory) and that it delivers.

use super::CliError;
use clap::Args;
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::config::format_bytes;
use streamalloc_allocator::rng::SplitMix64;
use streamalloc_allocator::{Allocator, Config};
use streamalloc_p2p::staging::exec::{agree_on_plan, execute_with_progress};
use streamalloc_p2p::staging::plan::{LocalDescription, StagingConfig, TensorMeta};
use streamalloc_p2p::staging::StagingPool;
use streamalloc_p2p::transport::{sim::SimTransport, Transport};

/// Arguments of `streamalloc p2p-sim`.
#[derive(Args, Debug)]
pub(crate) struct P2pSimArgs {
    /// Number of ranks (threads), 2 to 256.
    #[arg(long, default_value_t = 4)]
    ranks: u32,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Refuse runs needing more host memory than this, MiB (send and receive copies).
    #[arg(long, default_value_t = 4096)]
    max_total_mib: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The random workload of `p2p-sim` and `p2p-nccl`: the same arguments give every rank the
/// same tensors, peers and order in both.
#[derive(Args, Debug)]
pub(crate) struct WorkloadArgs {
    /// Tensors each rank sends (spread over random peers).
    #[arg(long, default_value_t = 1000)]
    pub(crate) tensors: u64,
    /// Staging budget per rank, MiB.
    #[arg(long, default_value_t = 128)]
    pub(crate) budget_mib: u64,
    /// Seed of the random sizes, peers and order.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Largest tensor, KiB (parameter shapes are scaled down to it; real bytes are moved
    /// in host memory).
    #[arg(long, default_value_t = 256)]
    pub(crate) max_tensor_kib: u64,
}

impl WorkloadArgs {
    /// The staging configuration, after checking the arguments.
    pub(crate) fn staging(&self) -> Result<StagingConfig, CliError> {
        let bad = |m: &str| Err(CliError::Message(m.to_string()));
        if self.budget_mib == 0 {
            return bad("--budget-mib must be positive");
        }
        if self.max_tensor_kib == 0 {
            return bad("--max-tensor-kib must be positive");
        }
        let config = StagingConfig::with_budget(self.budget_mib << 20);
        config
            .validate()
            .map_err(|e| CliError::Message(e.to_string()))?;
        Ok(config)
    }
}

/// A GPT-like mix of element counts (norms and biases, medium matrices, a few large ones),
/// as in the baseline `p2p.py`, with dtypes f32 / bf16 / u8; capped at `max_bytes`.
fn parameter_tensor(rng: &mut SplitMix64, max_bytes: u64) -> TensorMeta {
    let elements = match rng.next_u64() % 100 {
        0..=49 => rng.range(256, 8192),
        50..=84 => rng.range(65_536, 1 << 21),
        _ => rng.range(1 << 22, 1 << 25),
    };
    let (dtype, width) = [(0u32, 4u64), (1, 2), (2, 1)][(rng.next_u64() % 3) as usize];
    let bytes = (elements * width).min(max_bytes / width * width);
    TensorMeta { bytes, dtype }
}

/// The byte at `at` of tensor `index` sent from `src` to `dst`.
#[inline]
fn pattern(src: u32, dst: u32, index: usize, at: usize) -> u8 {
    let seed = (u64::from(src) << 48) ^ (u64::from(dst) << 32) ^ index as u64;
    let word = (seed ^ (at as u64 >> 3)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (word >> (8 * (at & 7))) as u8
}

/// What one rank reports (also what a `p2p-nccl` worker process prints for its launcher).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct RankOutcome {
    pub(crate) rounds_total: usize,
    pub(crate) max_ops_per_group: u32,
    pub(crate) peak_staging_bytes: u64,
    pub(crate) tensor_bytes_received: u64,
    pub(crate) bytes_moved: u64,
    pub(crate) intact: bool,
    /// Seconds spent agreeing on the plan and executing it (not filling or checking).
    pub(crate) exchange_seconds: f64,
}

/// The random workload every rank's description is drawn from: `tensors`
/// parameter-shaped tensors per rank (at most `max_tensor_bytes` each), to random peers, in
/// random order. The same arguments give the same lists, so separate processes can each
/// rebuild it and take their own rank's part. Returns the descriptions, by rank, and the
/// bytes sent in all; fails if the send and receive copies would need more than
/// `max_total_bytes` of host memory.
pub(crate) fn workload(
    world: u32,
    tensors: u64,
    max_tensor_bytes: u64,
    max_total_bytes: u64,
    seed: u64,
) -> Result<(Vec<LocalDescription>, u64), CliError> {
    let mut rng = SplitMix64(seed);
    let mut locals: Vec<LocalDescription> = (0..world)
        .map(|r| LocalDescription::empty(r, world))
        .collect();
    let mut total_bytes = 0u64;
    if world > 1 {
        for src in 0..world {
            for _ in 0..tensors {
                let dst = (src + 1 + (rng.next_u64() % u64::from(world - 1)) as u32) % world;
                let meta = parameter_tensor(&mut rng, max_tensor_bytes);
                total_bytes += meta.bytes;
                if 2 * total_bytes > max_total_bytes {
                    return Err(CliError::Message(format!(
                        "this workload needs more than {} of host memory (send and receive \
                         copies), over --max-total-mib {}; lower --tensors or --max-tensor-kib, \
                         or raise --max-total-mib",
                        format_bytes(2 * total_bytes),
                        max_total_bytes >> 20
                    )));
                }
                locals[src as usize].sends[dst as usize].push(meta);
                locals[dst as usize].recvs[src as usize].push(meta);
            }
        }
    }
    Ok((locals, total_bytes))
}

pub(crate) fn run(args: P2pSimArgs) -> Result<ExitCode, CliError> {
    let bad = |m: &str| Err(CliError::Message(m.to_string()));
    // One rank has no peer: the exchange would move nothing and still report "intact".
    if args.ranks < 2 || args.ranks > 256 {
        return bad("--ranks must be between 2 and 256 (an exchange needs a peer)");
    }
    let config = args.workload.staging()?;
    let world = args.ranks;

    // The workload: each rank's tensors, to random peers, in random order.
    let (locals, total_bytes) = workload(
        world,
        args.workload.tensors,
        args.workload.max_tensor_kib << 10,
        args.max_total_mib << 20,
        args.workload.seed,
    )?;
    let start = Instant::now();
    let json = args.json;
    let handles: Vec<_> = SimTransport::mesh(world, Duration::from_secs(60))
        .into_iter()
        .zip(locals)
        .map(|(mut transport, local)| {
            thread::spawn(move || rank_main(&mut transport, local, config, json, "p2p-sim"))
        })
        .collect();
    let mut outcomes = Vec::with_capacity(handles.len());
    for handle in handles {
        let outcome = handle
            .join()
            .map_err(|_| CliError::Message("a simulated rank panicked".into()))?
            .map_err(|e| CliError::Message(e.to_string()))?;
        outcomes.push(outcome);
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(report(
        &outcomes,
        args.workload.tensors,
        total_bytes,
        config,
        seconds,
        args.json,
        &[],
    ))
}

/// Prints the run's summary from every rank's outcome (text, or one JSON object with
/// `rounds`, `max_ops_per_group`, `peak_staging_bytes`, `budget_bytes`, `bytes_moved`,
/// `intact`, `seconds`); success if every byte arrived intact.
pub(crate) fn report(
    outcomes: &[RankOutcome],
    tensors_per_rank: u64,
    total_bytes: u64,
    config: StagingConfig,
    seconds: f64,
    json: bool,
    extra: &[(&str, serde_json::Value)],
) -> ExitCode {
    let world = outcomes.len() as u32;
    let rounds = outcomes.first().map_or(0, |o| o.rounds_total);
    let max_ops = outcomes
        .iter()
        .map(|o| o.max_ops_per_group)
        .max()
        .unwrap_or(0);
    let peak = outcomes
        .iter()
        .map(|o| o.peak_staging_bytes)
        .max()
        .unwrap_or(0);
    let bytes_moved = outcomes.first().map_or(0, |o| o.bytes_moved);
    let received: u64 = outcomes.iter().map(|o| o.tensor_bytes_received).sum();
    let intact = outcomes.iter().all(|o| o.intact) && received == bytes_moved;
    let tensors = u64::from(world) * tensors_per_rank;
    if json {
        let mut value = serde_json::json!({
            "ranks": world,
            "tensors": if world > 1 { tensors } else { 0 },
            "rounds": rounds,
            "max_ops_per_group": max_ops,
            "peak_staging_bytes": peak,
            "budget_bytes": config.budget_bytes,
            "bytes_moved": bytes_moved,
            "intact": intact,
            "seconds": seconds,
        });
        for (key, extra) in extra {
            value[*key] = extra.clone();
        }
        println!("{value}");
    } else {
        println!(
            "{world} ranks, {} tensors ({}), staging budget {} per rank",
            if world > 1 { tensors } else { 0 },
            format_bytes(total_bytes),
            format_bytes(config.budget_bytes)
        );
        println!("rounds              {rounds}");
        println!("max ops per group   {max_ops}");
        println!(
            "peak staging        {} ({:.1}% of budget)",
            format_bytes(peak),
            100.0 * peak as f64 / config.budget_bytes as f64
        );
        println!("bytes moved         {}", format_bytes(bytes_moved));
        println!("intact              {}", if intact { "yes" } else { "NO" });
        println!("wall time           {seconds:.2} s");
        for (key, extra) in extra {
            println!("{:<19} {extra}", key.replace('_', " "));
        }
    }
    if intact {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One rank, over any transport: agree on the plan, run it with real bytes (staging
/// through the engine's allocator on a simulated device), check what arrived. `label`
/// prefixes rank 0's progress lines.
pub(crate) fn rank_main<T: Transport + ?Sized>(
    transport: &mut T,
    local: LocalDescription,
    config: StagingConfig,
    quiet: bool,
    label: &str,
) -> Result<RankOutcome, streamalloc_p2p::staging::StagingError> {
    let rank = transport.rank();
    let agreeing = Instant::now();
    let plan = agree_on_plan(transport, &local, config)?;
    let mut exchange_seconds = agreeing.elapsed().as_secs_f64();
    let sends: Vec<Vec<Vec<u8>>> = local
        .sends
        .iter()
        .enumerate()
        .map(|(dst, list)| {
            list.iter()
                .enumerate()
                .map(|(i, m)| {
                    (0..m.bytes as usize)
                        .map(|at| pattern(rank, dst as u32, i, at))
                        .collect()
                })
                .collect()
        })
        .collect();
    let mut recvs: Vec<Vec<Vec<u8>>> = local
        .recvs
        .iter()
        .map(|list| list.iter().map(|m| vec![0u8; m.bytes as usize]).collect())
        .collect();
    let device = SimBackend::new(1 << 40);
    let allocator = Allocator::new(device.clone(), Config::default())
        .map_err(streamalloc_p2p::staging::StagingError::Alloc)?;
    let mut pool = StagingPool::new(&allocator, device.create_stream(), config.budget_bytes);
    let send_refs: Vec<Vec<&[u8]>> = sends
        .iter()
        .map(|l| l.iter().map(Vec::as_slice).collect())
        .collect();
    let mut recv_refs: Vec<Vec<&mut [u8]>> = recvs
        .iter_mut()
        .map(|l| l.iter_mut().map(Vec::as_mut_slice).collect())
        .collect();
    let mut last = Instant::now();
    let executing = Instant::now();
    let stats = execute_with_progress(
        transport,
        &plan,
        &local,
        &mut pool,
        &send_refs,
        &mut recv_refs,
        |done, total| {
            if rank == 0 && !quiet && last.elapsed() > Duration::from_secs(1) {
                eprintln!("{label}: rank 0 at round {done}/{total}");
                last = Instant::now();
            }
        },
    )?;
    exchange_seconds += executing.elapsed().as_secs_f64();
    drop(recv_refs);
    let intact = recvs.iter().enumerate().all(|(src, list)| {
        list.iter().enumerate().all(|(i, bytes)| {
            bytes
                .iter()
                .enumerate()
                .all(|(at, &b)| b == pattern(src as u32, rank, i, at))
        })
    });
    Ok(RankOutcome {
        peak_staging_bytes: stats.peak_staging_bytes,
        tensor_bytes_received: stats.tensor_bytes_received,
        rounds_total: plan.rounds().len(),
        max_ops_per_group: plan.max_ops_per_group().max(stats.max_ops_per_group),
        bytes_moved: plan.bytes_moved(),
        intact,
        exchange_seconds,
    })
}
