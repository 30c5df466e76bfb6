//! Property tests of the staged p2p planner on simulated ranks (threads that plan from the
//! encoded descriptions every rank gathers, as `streamalloc.p2p` does): identical plans on
//! every rank, at most one message per ordered pair and round, staging within the budget,
//! every byte delivered when the plan is followed, and mismatches reported identically on
//! every rank.

use proptest::prelude::*;
use std::collections::HashSet;
use std::thread;
use streamalloc::allocator::backend::sim::SimBackend;
use streamalloc::allocator::testing::SplitMix64;
use streamalloc::allocator::trace::TraceAction;
use streamalloc::allocator::{Allocator, Config};
use streamalloc::p2p::staging::plan::{
    Description, LocalDescription, Payload, Plan, StagingConfig, TensorMeta, ALIGN,
};
use streamalloc::p2p::staging::{StagingError, StagingPool};

/// Every rank's description for `total` tensors spread at random over the ordered pairs
/// (self included), sizes up to `max_bytes`, mostly small (parameter-like).
fn random_locals(world: u32, total: u64, max_bytes: u64, seed: u64) -> Vec<LocalDescription> {
    let mut rng = SplitMix64(seed);
    let mut locals: Vec<_> = (0..world)
        .map(|r| LocalDescription::empty(r, world))
        .collect();
    for _ in 0..total {
        let src = rng.below(u64::from(world)) as usize;
        let dst = rng.below(u64::from(world)) as usize;
        let bytes = match rng.below(10) {
            0 => 0,
            1 => rng.below(max_bytes + 1),
            2..=4 => rng.below((max_bytes / 64).max(1) + 1),
            _ => rng.below((max_bytes / 4096).max(1) + 1),
        };
        let meta = TensorMeta {
            bytes,
            dtype: rng.below(4) as u32,
        };
        locals[src].sends[dst].push(meta);
        locals[dst].recvs[src].push(meta);
    }
    locals
}

/// Plans on one thread per rank, each from the encoded descriptions of every rank (what the
/// all-gather hands it) and its own configuration; results by rank.
fn plan_on_ranks(
    locals: &[LocalDescription],
    config: impl Fn(u32) -> StagingConfig,
) -> Vec<Result<Plan, StagingError>> {
    let gathered: Vec<Vec<u8>> = locals.iter().map(LocalDescription::encode).collect();
    let handles: Vec<_> = (0..locals.len() as u32)
        .map(|rank| {
            let (gathered, config) = (gathered.clone(), config(rank));
            thread::spawn(move || {
                let locals = gathered
                    .iter()
                    .map(|b| LocalDescription::decode(b))
                    .collect::<Result<Vec<_>, _>>()?;
                Plan::build(&Description::from_locals(&locals)?, config)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Follows the plan as an executor does, in host memory: every round, each transfer's
/// pieces are packed into a staging buffer (or sent whole) and unpacked at the receiver.
/// Returns every rank's received lists.
fn deliver(
    plan: &Plan,
    sends: &[Vec<Vec<Vec<u8>>>],
    locals: &[LocalDescription],
) -> Vec<Vec<Vec<Vec<u8>>>> {
    let mut recvs: Vec<Vec<Vec<Vec<u8>>>> = locals
        .iter()
        .map(|l| {
            l.recvs
                .iter()
                .map(|list| list.iter().map(|m| vec![0xEE; m.bytes as usize]).collect())
                .collect()
        })
        .collect();
    for round in plan.rounds() {
        for t in &round.transfers {
            let (src, dst) = (t.src as usize, t.dst as usize);
            match &t.payload {
                Payload::ZeroCopy { tensor, .. } => {
                    let i = *tensor as usize;
                    recvs[dst][src][i].copy_from_slice(&sends[src][dst][i]);
                }
                Payload::Packed { segments, len } => {
                    let mut wire = vec![0u8; *len as usize];
                    for s in segments {
                        let (at, n) = (s.tensor_offset as usize, s.len as usize);
                        let b = s.buffer_offset as usize;
                        wire[b..b + n]
                            .copy_from_slice(&sends[src][dst][s.tensor as usize][at..at + n]);
                    }
                    for s in segments {
                        let (at, n) = (s.tensor_offset as usize, s.len as usize);
                        let b = s.buffer_offset as usize;
                        recvs[dst][src][s.tensor as usize][at..at + n]
                            .copy_from_slice(&wire[b..b + n]);
                    }
                }
            }
        }
    }
    recvs
}

/// Checks the plan's structural properties against the description.
fn check_plan(plan: &Plan, locals: &[LocalDescription], config: &StagingConfig) {
    let world = plan.world();
    let buffer = config.buffer_bytes();
    for round in plan.rounds() {
        let mut pairs = HashSet::new();
        let (mut senders, mut receivers) = (HashSet::new(), HashSet::new());
        for t in &round.transfers {
            assert_ne!(t.src, t.dst);
            assert!(
                pairs.insert((t.src, t.dst)),
                "two messages on one ordered pair"
            );
            assert!(senders.insert(t.src) && receivers.insert(t.dst));
            if let Payload::Packed { segments, len } = &t.payload {
                assert!(*len <= buffer, "packed message larger than a buffer");
                let list = &locals[t.src as usize].sends[t.dst as usize];
                let mut end = 0;
                let mut last_dtype = None;
                for s in segments {
                    let dtype = list[s.tensor as usize].dtype;
                    if last_dtype == Some(dtype) {
                        assert_eq!(s.buffer_offset, end, "gap inside a same-dtype run");
                    } else {
                        assert_eq!(s.buffer_offset % ALIGN, 0, "unaligned run");
                        assert!(s.buffer_offset >= end, "segments overlap");
                    }
                    last_dtype = Some(dtype);
                    end = s.buffer_offset + s.len;
                }
                assert_eq!(end, *len);
            }
        }
    }
    assert!(plan.max_ops_per_group() <= 2);
    // Every byte of every tensor is carried exactly once.
    for src in 0..world {
        for dst in (0..world).filter(|&d| d != src) {
            let list = &locals[src as usize].sends[dst as usize];
            let mut pieces: Vec<Vec<(u64, u64)>> = vec![Vec::new(); list.len()];
            for round in plan.rounds() {
                for t in round
                    .transfers
                    .iter()
                    .filter(|t| (t.src, t.dst) == (src, dst))
                {
                    match &t.payload {
                        Payload::ZeroCopy { tensor, len } => {
                            pieces[*tensor as usize].push((0, *len))
                        }
                        Payload::Packed { segments, .. } => {
                            for s in segments {
                                pieces[s.tensor as usize].push((s.tensor_offset, s.len));
                            }
                        }
                    }
                }
            }
            for (meta, mut p) in list.iter().zip(pieces) {
                p.sort_unstable();
                let mut at = 0;
                for (offset, len) in p {
                    assert_eq!(offset, at, "gap or overlap in a tensor");
                    assert!(len > 0);
                    at += len;
                }
                assert_eq!(at, meta.bytes);
            }
        }
    }
    for rank in 0..world {
        let need = plan.staging_need(rank);
        assert!(need.total() <= config.budget_bytes, "staging over budget");
        assert!(need.send_buffers <= config.buffers_per_direction);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Plans only (no bytes): up to 20,000 tensors of up to 256 MiB.
    #[test]
    fn every_rank_agrees_on_a_plan_that_respects_pairs_budget_and_coverage(
        world in 2u32..=8,
        total in prop_oneof![0u64..200, 0u64..=20_000],
        seed in any::<u64>(),
        budget_kib in prop_oneof![Just(128u64 * 1024), 16u64..=65_536],
        zero_copy in prop::option::of(1u64..=(64 << 20)),
    ) {
        let locals = random_locals(world, total, 256 << 20, seed);
        let config = StagingConfig {
            budget_bytes: budget_kib << 10,
            zero_copy_min: zero_copy,
            ..StagingConfig::default()
        };
        let plans: Vec<Plan> = plan_on_ranks(&locals, |_| config).into_iter().map(Result::unwrap).collect();
        for plan in &plans[1..] {
            prop_assert_eq!(plan, &plans[0]);
        }
        check_plan(&plans[0], &locals, &config);
    }
}

/// A byte pattern that differs per pair, tensor and offset.
fn pattern(src: u32, dst: u32, tensor: usize, at: usize) -> u8 {
    (src as usize * 131 + dst as usize * 31 + tensor * 7 + at * 13 + at / 251) as u8
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// Real bytes moved by following the plan: every byte arrives, and each rank's staging
    /// drawn from the engine stays within the budget, returns to the allocator and shows
    /// in its trace.
    #[test]
    fn every_byte_arrives_intact_within_the_budget(
        world in 2u32..=6,
        total in 0u64..=300,
        seed in any::<u64>(),
        budget_kib in 16u64..=512,
        zero_copy in prop::option::of(1u64..=(64 << 10)),
    ) {
        let locals = random_locals(world, total, 96 << 10, seed);
        let config = StagingConfig {
            budget_bytes: budget_kib << 10,
            zero_copy_min: zero_copy,
            ..StagingConfig::default()
        };
        let plan = plan_on_ranks(&locals, |_| config).remove(0).unwrap();
        let sends: Vec<Vec<Vec<Vec<u8>>>> = locals.iter().map(|local| {
            local.sends.iter().enumerate().map(|(dst, list)| {
                list.iter().enumerate().map(|(i, m)| {
                    (0..m.bytes as usize).map(|at| pattern(local.rank, dst as u32, i, at)).collect()
                }).collect()
            }).collect()
        }).collect();
        let recvs = deliver(&plan, &sends, &locals);
        for (rank, lists) in recvs.iter().enumerate() {
            for (src, list) in lists.iter().enumerate().filter(|&(src, _)| src != rank) {
                for (i, bytes) in list.iter().enumerate() {
                    let intact = bytes.iter().enumerate()
                        .all(|(at, &b)| b == pattern(src as u32, rank as u32, i, at));
                    prop_assert!(intact, "bytes corrupted from {} to {} in tensor {}", src, rank, i);
                }
            }
            let need = plan.staging_need(rank as u32);
            let device = SimBackend::new(1 << 30);
            let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
            let mut pool = StagingPool::new(&allocator, device.create_stream(), config.budget_bytes);
            let mut held = Vec::new();
            for (count, bytes) in [(need.send_buffers, need.send_buffer_bytes), (need.recv_buffers, need.recv_buffer_bytes)] {
                for _ in 0..count {
                    held.push(pool.acquire(bytes).unwrap());
                }
            }
            prop_assert!(pool.peak() <= config.budget_bytes);
            for block in held {
                pool.release(block).unwrap();
            }
            let acquires = allocator.snapshot().trace.iter()
                .filter(|e| e.action == TraceAction::StagingAcquire).count();
            prop_assert_eq!(allocator.stats().allocated_bytes.current, 0);
            prop_assert_eq!(acquires, (need.send_buffers + need.recv_buffers) as usize);
        }
        prop_assert!(plan.max_ops_per_group() <= 2);
    }

    /// One rank's receive list is altered (a tensor dropped, or resized, or retyped): every
    /// rank fails with the same message.
    #[test]
    fn a_mismatched_rank_fails_every_rank_alike(
        world in 2u32..=8,
        total in 1u64..=2_000,
        seed in any::<u64>(),
        how in 0u8..3,
    ) {
        let mut locals = random_locals(world, total, 1 << 20, seed);
        let mut rng = SplitMix64(seed ^ 0xABCD);
        // A rank and peer with something to receive; or add an unexpected receive.
        let candidates: Vec<(usize, usize)> = (0..world as usize)
            .flat_map(|r| (0..world as usize).map(move |p| (r, p)))
            .filter(|&(r, p)| !locals[r].recvs[p].is_empty())
            .collect();
        let (rank, peer) = candidates[rng.below(candidates.len() as u64) as usize];
        let list = &mut locals[rank].recvs[peer];
        match how {
            0 => { list.pop(); }
            1 => list[0].bytes += 1,
            _ => list[0].dtype += 1,
        }
        let errors: Vec<String> = plan_on_ranks(&locals, |_| StagingConfig::default())
            .into_iter()
            .map(|r| r.unwrap_err().to_string())
            .collect();
        prop_assert!(errors[0].contains("mismatch"), "{}", errors[0]);
        for e in &errors {
            prop_assert_eq!(e, &errors[0]);
        }
    }
}

#[test]
fn a_rank_with_another_budget_plans_another_digest() {
    // The executor compares digests before any data moves: a budget that differs on one
    // rank must show in its digest.
    let locals = random_locals(4, 500, 1 << 20, 7);
    let plans = plan_on_ranks(&locals, |rank| {
        StagingConfig::with_budget(if rank == 2 { 64 << 20 } else { 128 << 20 })
    });
    let digests: Vec<u64> = plans.iter().map(|p| p.as_ref().unwrap().digest()).collect();
    assert_eq!(digests[0], digests[1]);
    assert_eq!(digests[0], digests[3]);
    assert_ne!(digests[0], digests[2]);
}

proptest! {
    /// The digest is a function of every tensor's place in every list: two descriptions that
    /// differ only in the order of two tensors of different sizes, or in one tensor's size or
    /// dtype, plan with different digests (so ranks that described their lists differently,
    /// or run planners that differ, are refused before any data moves).
    #[test]
    fn the_digest_sees_every_tensor_in_its_place(
        seed in any::<u64>(),
        world in 2u32..5,
        change in 0usize..3,
    ) {
        let locals = random_locals(world, 60, 1 << 20, seed);
        let digest = |locals: &[LocalDescription]| {
            Plan::build(&Description::from_locals(locals).unwrap(), StagingConfig::default())
                .unwrap()
                .digest()
        };
        let Some((src, dst)) = (0..world as usize)
            .flat_map(|s| (0..world as usize).map(move |d| (s, d)))
            .find(|&(s, d)| {
                let list = &locals[s].sends[d];
                list.len() >= 2 && list[0].bytes != list[1].bytes
            })
        else {
            return Ok(());
        };
        let alter = |list: &mut Vec<TensorMeta>| match change {
            0 => list.swap(0, 1),
            1 => list[0].bytes += 512,
            _ => list[0].dtype ^= 1,
        };
        let mut changed = locals.clone();
        alter(&mut changed[src].sends[dst]);
        alter(&mut changed[dst].recvs[src]);
        prop_assert_ne!(digest(&locals), digest(&changed));
    }
}

#[test]
fn a_bad_budget_is_a_clear_error() {
    let locals = random_locals(3, 50, 1 << 20, 9);
    let errors = plan_on_ranks(&locals, |_| StagingConfig::with_budget(100));
    for e in errors {
        let e = e.unwrap_err().to_string();
        assert!(e.contains("too small"), "{e}");
    }
}

#[test]
fn empty_lists_on_any_world_make_an_empty_plan() {
    for world in 1..=5 {
        let locals: Vec<_> = (0..world)
            .map(|r| LocalDescription::empty(r, world))
            .collect();
        for plan in plan_on_ranks(&locals, |_| StagingConfig::default()) {
            let plan = plan.unwrap();
            assert!(plan.rounds().is_empty());
            assert_eq!(plan.bytes_moved(), 0);
        }
    }
}
