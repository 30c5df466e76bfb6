//! Property tests of the staged p2p exchange on the simulated transport: identical plans on
//! every rank, at most one message per ordered pair and round, staging within the budget,
//! every byte intact, and mismatches reported identically on every rank without hanging.

use proptest::prelude::*;
use std::collections::HashSet;
use std::thread;
use std::time::{Duration, Instant};
use streamalloc::allocator::backend::sim::SimBackend;
use streamalloc::allocator::testing::SplitMix64;
use streamalloc::allocator::trace::TraceAction;
use streamalloc::allocator::{Allocator, Config};
use streamalloc::p2p::staging::exec::{agree_on_plan, execute};
use streamalloc::p2p::staging::plan::{
    LocalDescription, Payload, Plan, StagingConfig, TensorMeta, ALIGN,
};
use streamalloc::p2p::staging::{StagingError, StagingPool};
use streamalloc::p2p::transport::{sim::SimTransport, Transport};

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

/// Runs `f(transport, local)` on one thread per rank and returns the results by rank.
fn on_ranks<R: Send + 'static>(
    locals: Vec<LocalDescription>,
    f: impl Fn(&mut SimTransport, LocalDescription) -> R + Send + Sync + Copy + 'static,
) -> Vec<R> {
    let world = locals.len() as u32;
    let handles: Vec<_> = SimTransport::mesh(world, Duration::from_secs(20))
        .into_iter()
        .zip(locals)
        .map(|(mut t, local)| thread::spawn(move || f(&mut t, local)))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
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
        let plans = on_ranks(locals.clone(), move |t, local| agree_on_plan(t, &local, config).unwrap());
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

    /// Real bytes through the simulated transport and a staging pool on the simulated
    /// device: every byte arrives, staging stays within the budget and returns to the
    /// allocator, and the trace shows it.
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
        let results = on_ranks(locals, move |t, local| {
            let rank = local.rank;
            let plan = agree_on_plan(t, &local, config).unwrap();
            let sends: Vec<Vec<Vec<u8>>> = local.sends.iter().enumerate().map(|(dst, list)| {
                list.iter().enumerate().map(|(i, m)| {
                    (0..m.bytes as usize).map(|at| pattern(rank, dst as u32, i, at)).collect()
                }).collect()
            }).collect();
            let mut recvs: Vec<Vec<Vec<u8>>> = local.recvs.iter()
                .map(|list| list.iter().map(|m| vec![0xEEu8; m.bytes as usize]).collect())
                .collect();
            let device = SimBackend::new(1 << 30);
            let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
            let mut pool = StagingPool::new(&allocator, device.create_stream(), config.budget_bytes);
            let send_refs: Vec<Vec<&[u8]>> =
                sends.iter().map(|l| l.iter().map(Vec::as_slice).collect()).collect();
            let mut recv_refs: Vec<Vec<&mut [u8]>> =
                recvs.iter_mut().map(|l| l.iter_mut().map(Vec::as_mut_slice).collect()).collect();
            let stats = execute(t, &plan, &local, &mut pool, &send_refs, &mut recv_refs).unwrap();
            drop(recv_refs);
            let intact = recvs.iter().enumerate().all(|(src, list)| {
                list.iter().enumerate().all(|(i, bytes)| {
                    bytes.iter().enumerate().all(|(at, &b)| b == pattern(src as u32, rank, i, at))
                })
            });
            let acquires = allocator.snapshot().trace.iter()
                .filter(|e| e.action == TraceAction::StagingAcquire).count();
            let need = plan.staging_need(rank);
            (intact, stats, allocator.stats().allocated_bytes.current, acquires,
             (need.send_buffers + need.recv_buffers) as usize)
        });
        for (intact, stats, allocated_after, acquires, buffers) in results {
            prop_assert!(intact, "bytes corrupted");
            prop_assert!(stats.peak_staging_bytes <= config.budget_bytes);
            prop_assert!(stats.max_ops_per_group <= 2);
            prop_assert_eq!(allocated_after, 0);
            prop_assert_eq!(acquires, buffers);
        }
    }

    /// One rank's receive list is altered (a tensor dropped, or resized, or retyped): every
    /// rank fails with the same message, quickly.
    #[test]
    fn a_mismatched_rank_fails_every_rank_alike_without_hanging(
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
        let start = Instant::now();
        let errors = on_ranks(locals, |t, local| {
            agree_on_plan(t, &local, StagingConfig::default()).unwrap_err().to_string()
        });
        prop_assert!(start.elapsed() < Duration::from_secs(10));
        prop_assert!(errors[0].contains("mismatch"), "{}", errors[0]);
        for e in &errors {
            prop_assert_eq!(e, &errors[0]);
        }
    }
}

#[test]
fn a_rank_with_another_budget_fails_every_rank_with_a_digest_mismatch() {
    let locals = random_locals(4, 500, 1 << 20, 7);
    let errors = on_ranks(locals, |t, local| {
        let budget = if local.rank == 2 { 64 << 20 } else { 128 << 20 };
        agree_on_plan(t, &local, StagingConfig::with_budget(budget)).unwrap_err()
    });
    assert!(matches!(errors[0], StagingError::DigestMismatch(_)));
    assert!(errors.iter().all(|e| e == &errors[0]));
}

#[test]
fn a_rank_with_a_bad_budget_fails_every_rank_with_its_reason() {
    let locals = random_locals(3, 50, 1 << 20, 9);
    let errors = on_ranks(locals, |t, local| {
        let budget = if local.rank == 1 { 100 } else { 128 << 20 };
        agree_on_plan(t, &local, StagingConfig::with_budget(budget))
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[0].starts_with("rank 1 could not plan"),
        "{}",
        errors[0]
    );
    assert!(errors[0].contains("too small"), "{}", errors[0]);
    assert!(errors.iter().all(|e| e == &errors[0]));
}

#[test]
fn empty_lists_on_any_world_make_an_empty_plan() {
    for world in 1..=5 {
        let locals: Vec<_> = (0..world)
            .map(|r| LocalDescription::empty(r, world))
            .collect();
        let plans = on_ranks(locals, |t, local| {
            agree_on_plan(t, &local, StagingConfig::default()).unwrap()
        });
        assert!(plans[0].rounds().is_empty());
        assert_eq!(plans[0].bytes_moved(), 0);
    }
}

#[test]
fn a_rank_that_never_joins_fails_the_others_instead_of_hanging() {
    let world = 3;
    let mut mesh = SimTransport::mesh(world, Duration::from_secs(20));
    drop(mesh.pop()); // rank 2 is gone before the exchange starts
    let start = Instant::now();
    let handles: Vec<_> = mesh
        .into_iter()
        .map(|mut t| {
            thread::spawn(move || {
                let local = LocalDescription::empty(t.rank(), world);
                agree_on_plan(&mut t, &local, StagingConfig::default())
                    .unwrap_err()
                    .to_string()
            })
        })
        .collect();
    for h in handles {
        let err = h.join().unwrap();
        assert!(err.contains("left the exchange"), "{err}");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}
