//! Agreeing on a plan across ranks, and running it over a [`Transport`].
//!
//! [`agree_on_plan`] is the only way a plan is made in a real exchange:
//! 1. every rank all-gathers its [`LocalDescription`];
//! 2. every rank checks all of them against each other and plans ([`Description`],
//!    [`Plan::build`]); since every rank holds the same inputs, every rank gets the same
//!    plan, or the same error;
//! 3. every rank all-gathers its plan digest (or the reason it could not plan) and compares.
//!    Only collectives run before step 3 succeeds, and every rank takes part in both
//!    all-gathers whatever happened, so a mismatch is the same error everywhere and never
//!    a rank left waiting on a send that will not come.
//!
//! [`execute`] then runs one rank's part of the plan with host buffers: copies to itself,
//! then per round pack (into the next of the rotating send buffers), one group of at most
//! one send and one receive, unpack.

use super::plan::{Description, LocalDescription, Payload, Plan, StagingConfig};
use super::pool::StagingPool;
use super::StagingError;
use crate::transport::{P2pOp, Transport};
use streamalloc_allocator::backend::Backend;
use streamalloc_allocator::types::Allocation;

/// What one rank's run of a plan did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Rounds this rank took part in.
    pub rounds: u32,
    /// Most operations this rank posted in one group.
    pub max_ops_per_group: u32,
    /// Bytes this rank put on the wire (tensor bytes plus packing alignment).
    pub wire_bytes_sent: u64,
    /// Tensor bytes this rank received from other ranks.
    pub tensor_bytes_received: u64,
    /// Most staging bytes held at once.
    pub peak_staging_bytes: u64,
}

/// Gathers every rank's description, plans, and checks that every rank planned the same
/// (see the module docs). Every rank must call it with its own description.
pub fn agree_on_plan<T: Transport + ?Sized>(
    transport: &mut T,
    local: &LocalDescription,
    config: StagingConfig,
) -> Result<Plan, StagingError> {
    let (rank, world) = (transport.rank(), transport.world());
    // A description that does not fit this transport still takes part in the gathers; the
    // planner then rejects it on every rank alike.
    let gathered = transport.all_gather(&local.encode())?;
    let planned = gathered
        .iter()
        .map(|bytes| LocalDescription::decode(bytes))
        .collect::<Result<Vec<_>, _>>()
        .and_then(|locals| Description::from_locals(&locals))
        .and_then(|description| {
            if description.world() != world {
                return Err(StagingError::Malformed(format!(
                    "descriptions are for {} ranks, the transport has {world}",
                    description.world()
                )));
            }
            Plan::build(&description, config)
        });
    let vote = match &planned {
        Ok(plan) => {
            let mut v = vec![0u8];
            v.extend_from_slice(&plan.digest().to_le_bytes());
            v
        }
        Err(err) => {
            let mut v = vec![1u8];
            v.extend_from_slice(err.to_string().as_bytes());
            v
        }
    };
    let votes = transport.all_gather(&vote)?;
    let mut digests = Vec::with_capacity(votes.len());
    let mut failures = Vec::new();
    for (r, v) in votes.iter().enumerate() {
        match v.split_first() {
            Some((0, d)) if d.len() == 8 => {
                digests.push(u64::from_le_bytes(d.try_into().expect("8 bytes")))
            }
            Some((1, message)) => failures.push((r as u32, message)),
            _ => {
                return Err(StagingError::Malformed(format!(
                    "rank {r} sent an unreadable plan digest"
                )))
            }
        }
    }
    if let Some(&(first, message)) = failures.first() {
        // Every rank failed alike (a mismatched description: all hold the same inputs):
        // each reports its own, identical, typed error. Otherwise the lowest failing
        // rank's reason is reported identically everywhere.
        if failures.len() == votes.len() && failures.iter().all(|(_, m)| *m == message) {
            return Err(planned.expect_err("this rank voted a failure"));
        }
        return Err(StagingError::RankFailed {
            rank: first,
            message: String::from_utf8_lossy(message).into_owned(),
        });
    }
    if digests.iter().any(|&d| d != digests[0]) {
        return Err(StagingError::DigestMismatch(digests));
    }
    let plan = planned.expect("every rank, this one included, voted a digest");
    debug_assert_eq!(plan.world(), world);
    debug_assert!(rank < world);
    Ok(plan)
}

/// Runs `transport.rank()`'s part of `plan`: `sends[p][i]` goes to rank `p` as its `i`-th
/// tensor; `recvs[p][i]` receives rank `p`'s `i`-th tensor. Buffer lengths must match
/// `local`, the description this rank gave [`agree_on_plan`].
pub fn execute<T: Transport + ?Sized, B: Backend>(
    transport: &mut T,
    plan: &Plan,
    local: &LocalDescription,
    pool: &mut StagingPool<'_, B>,
    sends: &[Vec<&[u8]>],
    recvs: &mut [Vec<&mut [u8]>],
) -> Result<ExecStats, StagingError> {
    execute_with_progress(transport, plan, local, pool, sends, recvs, |_, _| {})
}

/// [`execute`], calling `progress(rounds_done, rounds_total)` after each round.
pub fn execute_with_progress<T: Transport + ?Sized, B: Backend>(
    transport: &mut T,
    plan: &Plan,
    local: &LocalDescription,
    pool: &mut StagingPool<'_, B>,
    sends: &[Vec<&[u8]>],
    recvs: &mut [Vec<&mut [u8]>],
    mut progress: impl FnMut(usize, usize),
) -> Result<ExecStats, StagingError> {
    let rank = transport.rank();
    check_buffers(local, plan.world(), sends, recvs)?;
    let need = plan.staging_need(rank);
    if need.total() > pool.budget() {
        return Err(StagingError::BudgetExceeded {
            in_use: pool.in_use(),
            requested: need.total(),
            budget: pool.budget(),
        });
    }
    let mut held: Vec<Allocation> = Vec::new();
    let result = (|| {
        let mut send_bufs = Vec::new();
        let mut recv_bufs = Vec::new();
        for (count, bytes, bufs) in [
            (need.send_buffers, need.send_buffer_bytes, &mut send_bufs),
            (need.recv_buffers, need.recv_buffer_bytes, &mut recv_bufs),
        ] {
            for _ in 0..count {
                held.push(pool.acquire(bytes)?);
                bufs.push(vec![0u8; bytes as usize]);
            }
        }
        run_rounds(
            transport,
            plan,
            sends,
            recvs,
            &mut send_bufs,
            &mut recv_bufs,
            &mut progress,
        )
    })();
    let mut released = Ok(());
    for block in held {
        released = released.and(pool.release(block));
    }
    let mut stats = result?;
    released?;
    stats.peak_staging_bytes = pool.peak();
    Ok(stats)
}

fn check_buffers(
    local: &LocalDescription,
    world: u32,
    sends: &[Vec<&[u8]>],
    recvs: &[Vec<&mut [u8]>],
) -> Result<(), StagingError> {
    let bad = |m: String| Err(StagingError::BadBuffers(m));
    if sends.len() != world as usize || recvs.len() != world as usize {
        return bad(format!(
            "need one send and one receive list per rank ({world}), got {} and {}",
            sends.len(),
            recvs.len()
        ));
    }
    for peer in 0..world as usize {
        for (what, lens, metas) in [
            (
                "send",
                sends[peer].iter().map(|b| b.len()).collect::<Vec<_>>(),
                &local.sends[peer],
            ),
            (
                "receive",
                recvs[peer].iter().map(|b| b.len()).collect::<Vec<_>>(),
                &local.recvs[peer],
            ),
        ] {
            if lens.len() != metas.len() {
                return bad(format!(
                    "{what} list for rank {peer} has {} buffers, the description {}",
                    lens.len(),
                    metas.len()
                ));
            }
            if let Some(i) = (0..lens.len()).find(|&i| lens[i] as u64 != metas[i].bytes) {
                return bad(format!(
                    "{what} buffer #{i} for rank {peer} has {} bytes, the description {}",
                    lens[i], metas[i].bytes
                ));
            }
        }
    }
    Ok(())
}

fn run_rounds<T: Transport + ?Sized>(
    transport: &mut T,
    plan: &Plan,
    sends: &[Vec<&[u8]>],
    recvs: &mut [Vec<&mut [u8]>],
    send_bufs: &mut [Vec<u8>],
    recv_bufs: &mut [Vec<u8>],
    progress: &mut impl FnMut(usize, usize),
) -> Result<ExecStats, StagingError> {
    let rank = transport.rank();
    let mut stats = ExecStats::default();
    for (dst, src) in recvs[rank as usize].iter_mut().zip(&sends[rank as usize]) {
        dst.copy_from_slice(src);
    }
    let mine = plan.rank_rounds(rank);
    let (mut packed_sent, mut packed_recv) = (0usize, 0usize);
    for (done, rr) in mine.iter().enumerate() {
        let round = &plan.rounds()[rr.round as usize];
        let send = rr.send.map(|i| &round.transfers[i as usize]);
        let recv = rr.recv.map(|i| &round.transfers[i as usize]);
        let mut ops: Vec<P2pOp<'_>> = Vec::with_capacity(2);
        if let Some(t) = send {
            let tensors = &sends[t.dst as usize];
            let data: &[u8] = match &t.payload {
                Payload::ZeroCopy { tensor, len } => &tensors[*tensor as usize][..*len as usize],
                Payload::Packed { segments, len } => {
                    let buf = &mut send_bufs[packed_sent % send_bufs.len()];
                    packed_sent += 1;
                    for s in segments {
                        let from = s.tensor_offset as usize..(s.tensor_offset + s.len) as usize;
                        let to = s.buffer_offset as usize..(s.buffer_offset + s.len) as usize;
                        buf[to].copy_from_slice(&tensors[s.tensor as usize][from]);
                    }
                    &buf[..*len as usize]
                }
            };
            stats.wire_bytes_sent += data.len() as u64;
            ops.push(P2pOp::Send { peer: t.dst, data });
        }
        let mut unpack = None;
        if let Some(t) = recv {
            stats.tensor_bytes_received += t.payload.tensor_bytes();
            let buf: &mut [u8] = match &t.payload {
                Payload::ZeroCopy { tensor, len } => {
                    &mut recvs[t.src as usize][*tensor as usize][..*len as usize]
                }
                Payload::Packed { segments, len } => {
                    let index = packed_recv % recv_bufs.len();
                    packed_recv += 1;
                    unpack = Some((t.src, segments, index));
                    &mut recv_bufs[index][..*len as usize]
                }
            };
            ops.push(P2pOp::Recv { peer: t.src, buf });
        }
        stats.max_ops_per_group = stats.max_ops_per_group.max(ops.len() as u32);
        transport.group(&mut ops)?;
        drop(ops);
        if let Some((src, segments, index)) = unpack {
            let tensors = &mut recvs[src as usize];
            for s in segments {
                let to = s.tensor_offset as usize..(s.tensor_offset + s.len) as usize;
                let from = s.buffer_offset as usize..(s.buffer_offset + s.len) as usize;
                tensors[s.tensor as usize][to].copy_from_slice(&recv_bufs[index][from]);
            }
        }
        stats.rounds += 1;
        progress(done + 1, mine.len());
    }
    Ok(stats)
}
