//! What a statistic's four numbers mean from one call to the next, on random programs of
//! malloc / free / record_use / stream work / empty_cache / reset_peak_stats on the
//! simulated device, with expandable or whole segments, under a memory limit or not.
//!
//! PyTorch's allocator changes each of its statistics at most once per call, by the call's
//! net effect. So for every statistic a malloc or a free can move (`allocation`,
//! `allocated_bytes`, `requested_bytes`, `active`, `active_bytes`, `inactive_split`,
//! `inactive_split_bytes`, each over all pools and per pool, and `oversize_allocations`),
//! after every call:
//! - what it added (`allocated`) grew by the rise of `current`, what it took (`freed`) by
//!   the fall, and nothing else;
//! - `peak` is the highest `current` after any call since the last reset, and a reset
//!   makes it `current`.
//!
//! Every other gauge (reserved memory and segments, which one call may return and obtain
//! again; the engine's own gauges) keeps `current == allocated - freed`, a peak no lower
//! than `current`, and `allocated`, `freed` and (between resets) `peak` never decreasing.
//! The engine keeps these numbers in a cheaper form than users read them, so this is what
//! holds the form it reads them from to their meaning.

use proptest::prelude::*;
use streamalloc_allocator::backend::sim::{Access, SimBackend};
use streamalloc_allocator::backend::{Events, Streams};
use streamalloc_allocator::testing::proptest_cases;
use streamalloc_allocator::{Allocator, Config, DevicePtr, Gauge, Stats, StreamId};

const MIB: u64 = 1 << 20;
const STREAMS: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    Malloc { stream: u8, size: u64 },
    Free { block: u16 },
    Use { block: u16, stream: u8 },
    Work { stream: u8, ns: u32 },
    SyncStream { stream: u8 },
    EmptyCache,
    ResetPeaks,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        4 => 1u64..=8192,
        3 => 8193u64..=MIB,
        2 => (MIB + 1)..=(12 * MIB),
        1 => (12 * MIB + 1)..=(40 * MIB),
    ];
    prop_oneof![
        8 => (any::<u8>(), size).prop_map(|(stream, size)| Op::Malloc { stream, size }),
        6 => any::<u16>().prop_map(|block| Op::Free { block }),
        2 => (any::<u16>(), any::<u8>()).prop_map(|(block, stream)| Op::Use { block, stream }),
        2 => (any::<u8>(), 1u32..100_000).prop_map(|(stream, ns)| Op::Work { stream, ns }),
        1 => any::<u8>().prop_map(|stream| Op::SyncStream { stream }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ResetPeaks),
    ]
}

/// Every gauge of `stats` by name, and whether one call changes it at most once.
fn gauges(stats: &Stats) -> Vec<(String, Gauge, bool)> {
    let torch = &stats.torch;
    let mut out = Vec::new();
    let arrays = [
        ("allocation", &torch.allocation, true),
        ("allocated_bytes", &torch.allocated_bytes, true),
        ("requested_bytes", &torch.requested_bytes, true),
        ("active", &torch.active, true),
        ("active_bytes", &torch.active_bytes, true),
        ("inactive_split", &torch.inactive_split, true),
        ("inactive_split_bytes", &torch.inactive_split_bytes, true),
        ("segment", &torch.segment, false),
        ("reserved_bytes", &torch.reserved_bytes, false),
    ];
    for (name, array, once) in arrays {
        for (pool, gauge) in ["all", "small_pool", "large_pool"].iter().zip(array) {
            out.push((format!("{name}.{pool}"), *gauge, once));
        }
    }
    out.push((
        "oversize_allocations".into(),
        torch.oversize_allocations,
        true,
    ));
    out.push(("oversize_segments".into(), torch.oversize_segments, false));
    for (name, gauge) in [
        ("engine allocated_bytes", stats.allocated_bytes),
        ("engine requested_bytes", stats.requested_bytes),
        ("engine reserved_bytes", stats.reserved_bytes),
        ("engine active_bytes", stats.active_bytes),
        ("engine pending_free_bytes", stats.pending_free_bytes),
    ] {
        out.push((name.into(), gauge, false));
    }
    out
}

/// Checks one call's change of every gauge: `before` and `after` it, `reset` if it was
/// `reset_peak_stats`.
fn check_step(before: &Stats, after: &Stats, reset: bool) -> Result<(), String> {
    for ((name, was, once), (_, now, _)) in gauges(before).into_iter().zip(gauges(after)) {
        if now.current + now.freed != now.allocated {
            return Err(format!("{name}: current + freed != allocated in {now:?}"));
        }
        if now.allocated < was.allocated || now.freed < was.freed {
            return Err(format!(
                "{name}: a running total went down: {was:?} -> {now:?}"
            ));
        }
        let peak = if reset {
            now.current
        } else if once {
            was.peak.max(now.current)
        } else {
            // Several changes in one call may have passed a higher value.
            now.peak.max(was.peak)
        };
        if now.peak != peak || now.peak < now.current {
            return Err(format!(
                "{name}: peak {} expected {peak}: {was:?} -> {now:?}",
                now.peak
            ));
        }
        if once {
            let rise = now.current.saturating_sub(was.current);
            let fall = was.current.saturating_sub(now.current);
            if now.allocated - was.allocated != rise || now.freed - was.freed != fall {
                return Err(format!(
                    "{name}: one call changed it by more than its net change: {was:?} -> {now:?}"
                ));
            }
        }
    }
    Ok(())
}

fn run(config: Config, capacity: u64, ops: &[Op]) -> Result<(), String> {
    let device = SimBackend::new(capacity);
    let allocator = Allocator::new(device.clone(), config).map_err(|e| e.to_string())?;
    let streams: Vec<StreamId> = (0..STREAMS).map(|_| device.create_stream()).collect();
    let mut live: Vec<(DevicePtr, u64, usize)> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        let before = allocator.stats();
        let pick = |block: u16, len: usize| usize::from(block) % len;
        match *op {
            Op::Malloc { stream, size } => {
                let stream = usize::from(stream) % STREAMS;
                if let Ok(block) = allocator.malloc(size, streams[stream]) {
                    device.launch(
                        streams[stream],
                        &[Access::write(block.ptr, size)],
                        1000,
                        "write",
                    );
                    live.push((block.ptr, size, stream));
                }
            }
            Op::Free { block } if !live.is_empty() => {
                let (ptr, _, _) = live.swap_remove(pick(block, live.len()));
                allocator
                    .free(ptr)
                    .map_err(|e| format!("step {step}: free: {e}"))?;
            }
            Op::Use { block, stream } if !live.is_empty() => {
                let (ptr, size, owner) = live[pick(block, live.len())];
                let user = streams[usize::from(stream) % STREAMS];
                // Ordered after the owner's work, as a program would.
                let event = device.create_event().map_err(|e| e.to_string())?;
                device
                    .record_event(event, streams[owner])
                    .and_then(|()| device.stream_wait_event(user, event))
                    .map_err(|e| e.to_string())?;
                device.launch(user, &[Access::read(ptr, size)], 50_000, "read");
                allocator
                    .record_use(ptr, user)
                    .map_err(|e| format!("step {step}: record_use: {e}"))?;
            }
            Op::Work { stream, ns } => {
                device.launch(
                    streams[usize::from(stream) % STREAMS],
                    &[],
                    u64::from(ns),
                    "work",
                );
                device.advance_host(u64::from(ns) / 2);
            }
            Op::SyncStream { stream } => {
                device.synchronize_stream(streams[usize::from(stream) % STREAMS]);
            }
            Op::EmptyCache => {
                allocator
                    .empty_cache()
                    .map_err(|e| format!("step {step}: empty_cache: {e}"))?;
            }
            Op::ResetPeaks => allocator.reset_peak_stats(),
            Op::Free { .. } | Op::Use { .. } => {}
        }
        let after = allocator.stats();
        check_step(&before, &after, matches!(op, Op::ResetPeaks))
            .map_err(|e| format!("step {step} ({op:?}): {e}"))?;
    }
    allocator.check_invariants()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(proptest_cases(256)))]

    #[test]
    fn every_statistic_changes_once_per_call_by_its_net_change(
        expandable in any::<bool>(),
        limit in prop_oneof![Just(None), Just(Some(64 * MIB))],
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let config = Config {
            expandable_segments: expandable,
            memory_limit: limit,
            ..Config::default()
        };
        if let Err(err) = run(config, 1 << 30, &ops) {
            prop_assert!(false, "{}", err);
        }
    }
}

#[test]
fn a_reset_makes_every_peak_current_and_later_peaks_start_there() {
    let device = SimBackend::new(1 << 30);
    let allocator = Allocator::new(device.clone(), Config::default()).unwrap();
    let stream = device.create_stream();
    let a = allocator.malloc(8 * MIB, stream).unwrap();
    let b = allocator.malloc(4 * MIB, stream).unwrap();
    allocator.free(a.ptr).unwrap();
    let torch = allocator.stats().torch;
    assert_eq!(torch.allocation[0].peak, 2);
    assert_eq!(torch.allocated_bytes[0].peak, 12 * MIB);
    allocator.reset_peak_stats();
    let torch = allocator.stats().torch;
    assert_eq!(torch.allocation[0].peak, 1);
    assert_eq!(torch.allocated_bytes[0].peak, 4 * MIB);
    assert_eq!(torch.active_bytes[2].peak, 4 * MIB);
    let c = allocator.malloc(MIB, stream).unwrap();
    let torch = allocator.stats().torch;
    assert_eq!(torch.allocation[0].peak, 2);
    assert_eq!(torch.allocated_bytes[0].peak, 5 * MIB);
    assert_eq!(
        torch.allocation[0].allocated, 3,
        "running totals survive the reset"
    );
    assert_eq!(torch.allocation[0].freed, 1);
    for block in [b, c] {
        allocator.free(block.ptr).unwrap();
    }
}
