//! `streamalloc p2p-sim`: the staged many-tensor exchange's plan, on simulated ranks.
//!
//! Every rank (a thread) describes `--tensors` parameter-shaped tensors sent in random order
//! to random peers; every rank then does what the executor (`streamalloc.p2p`, in Python)
//! asks of the planner: encodes its description, decodes every rank's (what the
//! all-gather hands it), plans, and the digests must agree. Each rank draws the staging
//! its part needs from the engine's allocator on a simulated device, within the budget,
//! and the plan must carry every tensor byte of every ordered pair. Needs no GPU: it shows
//! what the plan does with a given budget (rounds, group sizes, staging memory). The bytes
//! themselves move in Python (`benches/gpu/p2p/` runs them on GPUs, and
//! `dropin_cpu_check.py` on CPU over gloo).

use super::out::outln;
use super::CliError;
use clap::Args;
use std::process::ExitCode;
use std::thread;
use std::time::Instant;
use streamalloc_allocator::backend::sim::SimBackend;
use streamalloc_allocator::config::format_bytes;
use streamalloc_allocator::rng::SplitMix64;
use streamalloc_allocator::{Allocator, Config};
use streamalloc_p2p::staging::plan::{
    Description, LocalDescription, Payload, Plan, StagingConfig, TensorMeta,
};
use streamalloc_p2p::staging::{StagingError, StagingPool};

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

/// The random workload of `p2p-sim`: the same arguments give every rank the same tensors,
/// peers and order.
#[derive(Args, Debug)]
struct WorkloadArgs {
    /// Tensors each rank sends (spread over random peers).
    #[arg(long, default_value_t = 1000)]
    tensors: u64,
    /// Staging budget per rank, MiB.
    #[arg(long, default_value_t = 128)]
    budget_mib: u64,
    /// Seed of the random sizes, peers and order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest tensor, KiB (parameter shapes are scaled down to it; real bytes are moved
    /// in host memory).
    #[arg(long, default_value_t = 256)]
    max_tensor_kib: u64,
}

impl WorkloadArgs {
    /// The staging configuration, after checking the arguments.
    fn staging(&self) -> Result<StagingConfig, CliError> {
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

/// What one rank's planning gave.
#[derive(Debug, Clone)]
struct RankOutcome {
    rounds_total: usize,
    max_ops_per_group: u32,
    digest: u64,
    peak_staging_bytes: u64,
    bytes_moved: u64,
    /// The plan carries every byte of every list this rank sends, in full.
    covered: bool,
}

/// The random workload every rank's description is drawn from: `tensors`
/// parameter-shaped tensors per rank (at most `max_tensor_bytes` each), to random peers, in
/// random order. The same arguments give the same lists, so separate processes can each
/// rebuild it and take their own rank's part. Returns the descriptions, by rank, and the
/// bytes sent in all; fails if the send and receive copies would need more than
/// `max_total_bytes` of host memory.
fn workload(
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
    // One rank has no peer: the exchange would move nothing and still report "covered".
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
    // What the all-gather of descriptions hands every rank.
    let gathered: Vec<Vec<u8>> = locals.iter().map(LocalDescription::encode).collect();
    let handles: Vec<_> = locals
        .into_iter()
        .map(|local| {
            let gathered = gathered.clone();
            thread::spawn(move || plan_rank(&gathered, &local, config))
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
    report(
        &outcomes,
        args.workload.tensors,
        total_bytes,
        config,
        seconds,
        args.json,
    )
}

/// Prints the run's summary from every rank's outcome (text, or one JSON object with
/// `rounds`, `max_ops_per_group`, `peak_staging_bytes`, `budget_bytes`, `bytes_moved`,
/// `agreed`, `covered`, `seconds`); success if every rank planned the same and the plan
/// carries every byte within the budget.
fn report(
    outcomes: &[RankOutcome],
    tensors_per_rank: u64,
    total_bytes: u64,
    config: StagingConfig,
    seconds: f64,
    json: bool,
) -> Result<ExitCode, CliError> {
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
    let agreed = outcomes.iter().all(|o| o.digest == outcomes[0].digest);
    let covered = outcomes.iter().all(|o| o.covered) && bytes_moved == total_bytes;
    let tensors = u64::from(world) * tensors_per_rank;
    if json {
        let value = serde_json::json!({
            "ranks": world,
            "tensors": tensors,
            "rounds": rounds,
            "max_ops_per_group": max_ops,
            "peak_staging_bytes": peak,
            "budget_bytes": config.budget_bytes,
            "bytes_moved": bytes_moved,
            "agreed": agreed,
            "covered": covered,
            "seconds": seconds,
        });
        outln!("{value}")?;
    } else {
        outln!(
            "{world} ranks, {tensors} tensors ({}), staging budget {} per rank",
            format_bytes(total_bytes),
            format_bytes(config.budget_bytes)
        )?;
        outln!("rounds              {rounds}")?;
        outln!("max ops per group   {max_ops}")?;
        outln!(
            "peak staging        {} ({:.1}% of budget)",
            format_bytes(peak),
            100.0 * peak as f64 / config.budget_bytes as f64
        )?;
        outln!("bytes moved         {}", format_bytes(bytes_moved))?;
        outln!("same plan on all    {}", if agreed { "yes" } else { "NO" })?;
        outln!("every byte planned  {}", if covered { "yes" } else { "NO" })?;
        outln!("wall time           {seconds:.2} s")?;
    }
    Ok(if agreed && covered {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One rank: decode every rank's description, plan, take this rank's staging from the
/// engine's allocator on a simulated device, and check that the plan carries every byte
/// this rank sends.
fn plan_rank(
    gathered: &[Vec<u8>],
    local: &LocalDescription,
    config: StagingConfig,
) -> Result<RankOutcome, StagingError> {
    let locals = gathered
        .iter()
        .map(|bytes| LocalDescription::decode(bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let plan = Plan::build(&Description::from_locals(&locals)?, config)?;
    let rank = local.rank;

    // The staging the executor holds for this rank's part, drawn as one set of buffers.
    let device = SimBackend::new(1 << 40);
    let allocator = Allocator::new(device.clone(), Config::default())?;
    let mut pool = StagingPool::new(&allocator, device.create_stream(), config.budget_bytes);
    let need = plan.staging_need(rank);
    let mut held = Vec::new();
    for (count, bytes) in [
        (need.send_buffers, need.send_buffer_bytes),
        (need.recv_buffers, need.recv_buffer_bytes),
    ] {
        for _ in 0..count {
            held.push(pool.acquire(bytes)?);
        }
    }
    let peak_staging_bytes = pool.peak();
    for block in held {
        pool.release(block)?;
    }

    // Tensor bytes the plan carries from this rank to each peer.
    let mut carried = vec![0u64; locals.len()];
    for round in plan.rounds() {
        for transfer in round.transfers.iter().filter(|t| t.src == rank) {
            carried[transfer.dst as usize] += match &transfer.payload {
                Payload::Packed { segments, .. } => segments.iter().map(|s| s.len).sum(),
                Payload::ZeroCopy { len, .. } => *len,
            };
        }
    }
    let covered = local.sends.iter().enumerate().all(|(dst, list)| {
        dst as u32 == rank || carried[dst] == list.iter().map(|m| m.bytes).sum::<u64>()
    });
    Ok(RankOutcome {
        rounds_total: plan.rounds().len(),
        max_ops_per_group: plan.max_ops_per_group(),
        digest: plan.digest(),
        peak_staging_bytes,
        bytes_moved: plan.bytes_moved(),
        covered,
    })
}
