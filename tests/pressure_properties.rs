//! Memory under pressure, as a property: with a memory limit, a request fails only if the
//! memory the engine cannot give back (live bytes, free bytes stranded in partly used
//! pages, other pools' pinned memory) and the request in whole pages exceed the limit.
//! Random programs of the engine harness (`streamalloc_allocator::testing`) run on the
//! simulated device under a limit a little above what they hold, with stitching on and
//! off, both reuse policies and reclaims on and off; every out-of-memory failure is held
//! to the bound ([`Harness::pressure_floor`]), besides every invariant the engine's own
//! property tests check. The test after the machine shows the property failing when the
//! policy's last step (synchronise, unmap, map) is skipped.

use common::{allocation_op, block_op};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use streamalloc_allocator::testing::{proptest_cases, Harness, Op, STREAMS};
use streamalloc_allocator::{Config, ReusePolicy};

mod common;

const MIB: u64 = 1 << 20;

/// The configuration under test and how many blocks the program holds.
#[derive(Clone, Debug)]
struct Model {
    policy: ReusePolicy,
    reclaim: bool,
    stitch: bool,
    event_batch: usize,
    limit: u64,
    live: usize,
    capturing: bool,
    graphs: usize,
}

/// Sizes from a few bytes to a third of the smallest limit: small blocks strand bytes in
/// partly used pages, large ones need room that only unmapping or stitching gives.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 1u64..=8192,
        2 => 8193u64..=(2 * MIB),
        3 => (2 * MIB + 1)..=(12 * MIB),
        2 => (12 * MIB + 1)..=(24 * MIB),
    ]
}

struct PressureMachine;

impl ReferenceStateMachine for PressureMachine {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        (
            prop_oneof![3 => Just(ReusePolicy::StreamWait), 1 => Just(ReusePolicy::Pytorch)],
            prop_oneof![Just(1usize), Just(64)],
            prop_oneof![Just(64 * MIB), Just(96 * MIB), Just(160 * MIB)],
            any::<bool>(),
            prop_oneof![3 => Just(true), 1 => Just(false)],
        )
            .prop_map(|(policy, event_batch, limit, reclaim, stitch)| Model {
                policy,
                reclaim,
                stitch,
                event_batch,
                limit,
                live: 0,
                capturing: false,
                graphs: 0,
            })
            .boxed()
    }

    fn transitions(model: &Model) -> BoxedStrategy<Op> {
        let stream = 0..STREAMS as u8;
        let mut choices: Vec<(u32, BoxedStrategy<Op>)> = vec![(10, allocation_op(size()))];
        choices.push((
            1,
            (stream.clone(), size(), 0u32..2_000_000)
                .prop_map(|(stream, size, duration)| Op::PoolMalloc {
                    stream,
                    size,
                    duration,
                })
                .boxed(),
        ));
        if model.live > 0 {
            choices.push((10, block_op()));
        }
        if model.capturing {
            choices.push((2, Just(Op::EndCapture).boxed()));
        } else {
            choices.push((
                1,
                stream
                    .prop_map(|stream| Op::BeginCapture { stream })
                    .boxed(),
            ));
        }
        if model.graphs > 0 {
            let replay = (any::<u16>(), 0..STREAMS as u8)
                .prop_map(|(graph, stream)| Op::Replay { graph, stream });
            choices.push((2, replay.boxed()));
            choices.push((
                1,
                any::<u16>()
                    .prop_map(|graph| Op::DestroyGraph { graph })
                    .boxed(),
            ));
        }
        proptest::strategy::Union::new_weighted(choices).boxed()
    }

    fn preconditions(model: &Model, op: &Op) -> bool {
        match op {
            Op::Free { .. } | Op::Use { .. } | Op::Work { .. } => model.live > 0,
            Op::BeginCapture { .. } => !model.capturing,
            Op::EndCapture => model.capturing,
            Op::Replay { .. } | Op::DestroyGraph { .. } => model.graphs > 0,
            _ => true,
        }
    }

    fn apply(mut model: Model, op: &Op) -> Model {
        match op {
            Op::Malloc { .. } | Op::PoolMalloc { .. } => model.live += 1,
            Op::Free { .. } => model.live = model.live.saturating_sub(1),
            Op::BeginCapture { .. } => model.capturing = true,
            Op::EndCapture => {
                model.capturing = false;
                model.graphs += 1;
            }
            Op::DestroyGraph { .. } => model.graphs -= 1,
            _ => {}
        }
        model
    }
}

fn config(model: &Model) -> Config {
    Config {
        reuse_policy: model.policy,
        event_batch: model.event_batch,
        reclaim: model.reclaim,
        stitch: model.stitch,
        memory_limit: Some(model.limit),
        ..Config::default()
    }
}

impl StateMachineTest for PressureMachine {
    type SystemUnderTest = Harness;
    type Reference = PressureMachine;

    fn init_test(model: &Model) -> Harness {
        let mut harness = Harness::new(config(model), 1 << 30).expect("harness");
        harness.check_pressure_bound();
        harness
    }

    fn apply(mut harness: Harness, _model: &Model, op: Op) -> Harness {
        if let Err(violation) = harness.apply(&op) {
            panic!("{violation}");
        }
        harness
    }

    fn teardown(harness: Harness, _model: Model) {
        if let Err(violation) = harness.finish() {
            panic!("{violation}");
        }
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: proptest_cases(256),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Under a limit, no request fails while the limit has room for it beside what cannot
    /// be given back; every engine invariant holds and nothing leaks.
    #[test]
    fn a_request_fails_only_when_the_limit_cannot_hold_it(sequential 1..100 => PressureMachine);
}

/// A program the property above once failed on, as it shrank. Under the limit, stream 1's
/// last request takes over free blocks of streams 1 and 2 whose boundary cuts a page and
/// joins them, so that stitching can use the page; the joined run is then stream 1's, ready,
/// beside a free block of stream 1's own, and must be merged with it, as every listed free
/// block is merged with the neighbours it may merge with.
#[test]
fn a_run_joined_across_streams_merges_with_its_own_free_neighbours() {
    use Op::{Free, Malloc, PoolMalloc, Use};
    let config = Config {
        reuse_policy: ReusePolicy::StreamWait,
        event_batch: 1,
        reclaim: false,
        stitch: true,
        memory_limit: Some(64 * MIB),
        ..Config::default()
    };
    let mut harness = Harness::new(config, 1 << 30).unwrap();
    harness.check_pressure_bound();
    let program = [
        PoolMalloc {
            stream: 0,
            size: 1,
            duration: 0,
        },
        Free { block: 0 },
        PoolMalloc {
            stream: 0,
            size: 4194305,
            duration: 0,
        },
        Malloc {
            stream: 1,
            size: 1,
            duration: 0,
        },
        Malloc {
            stream: 1,
            size: 2414081,
            duration: 0,
        },
        Malloc {
            stream: 1,
            size: 8849921,
            duration: 0,
        },
        Malloc {
            stream: 3,
            size: 6908417,
            duration: 0,
        },
        Malloc {
            stream: 3,
            size: 4150273,
            duration: 0,
        },
        Use {
            block: 21101,
            stream: 0,
            duration: 1,
        },
        Free { block: 52046 },
        Free { block: 4017 },
        Malloc {
            stream: 0,
            size: 20971521,
            duration: 0,
        },
        Use {
            block: 54288,
            stream: 0,
            duration: 0,
        },
        Malloc {
            stream: 3,
            size: 5717505,
            duration: 0,
        },
        Malloc {
            stream: 1,
            size: 1,
            duration: 0,
        },
        Free { block: 1483 },
        PoolMalloc {
            stream: 0,
            size: 1,
            duration: 0,
        },
        Free { block: 5739 },
        Malloc {
            stream: 2,
            size: 573953,
            duration: 0,
        },
        Malloc {
            stream: 0,
            size: 513,
            duration: 0,
        },
        Malloc {
            stream: 0,
            size: 1,
            duration: 0,
        },
        Free { block: 1977 },
        Malloc {
            stream: 0,
            size: 1,
            duration: 0,
        },
        Malloc {
            stream: 0,
            size: 1,
            duration: 0,
        },
        Malloc {
            stream: 0,
            size: 1,
            duration: 0,
        },
        Free { block: 2195 },
        Free { block: 38703 },
        Malloc {
            stream: 1,
            size: 12582913,
            duration: 0,
        },
    ];
    for op in &program {
        if let Err(violation) = harness.apply(op) {
            panic!("{violation}");
        }
    }
    harness.finish().unwrap();
}

/// Free memory in two runs around a live block, neither holding the next request, and a
/// limit with no room to map it beside them.
fn split_free_memory() -> Vec<Op> {
    let malloc = |size| Op::Malloc {
        stream: 0,
        size,
        duration: 1_000,
    };
    vec![
        malloc(24 * MIB),
        malloc(2 * MIB),
        malloc(20 * MIB),
        Op::Free { block: 0 },
        // The swap-remove put the 20 MiB block at index 0.
        Op::Free { block: 0 },
        malloc(30 * MIB),
    ]
}

/// Without reclaims, only the policy's step under pressure makes room (stitching the two
/// runs, or unmapping them and mapping the request).
#[test]
fn the_bound_holds_for_free_memory_split_around_a_live_block() {
    for stitch in [true, false] {
        let config = Config {
            stitch,
            reclaim: false,
            memory_limit: Some(48 * MIB),
            ..Config::default()
        };
        let mut harness = Harness::new(config, 1 << 30).unwrap();
        harness.check_pressure_bound();
        for op in split_free_memory() {
            harness.apply(&op).unwrap();
        }
        assert_eq!(
            harness.live_blocks(),
            2,
            "stitch:{stitch}: the 30 MiB request was served"
        );
        harness.finish().unwrap();
    }
}

/// A request the limit cannot hold beside a live block fails, within the bound.
#[test]
fn a_request_beyond_the_bound_fails_without_a_violation() {
    let config = Config {
        memory_limit: Some(40 * MIB),
        ..Config::default()
    };
    let mut harness = Harness::new(config, 1 << 30).unwrap();
    harness.check_pressure_bound();
    for size in [20 * MIB, 24 * MIB] {
        harness
            .apply(&Op::Malloc {
                stream: 0,
                size,
                duration: 1_000,
            })
            .unwrap();
    }
    assert_eq!(
        harness.live_blocks(),
        1,
        "20 MiB live and 24 more exceed 40"
    );
    assert_eq!(harness.allocator().stats().ooms, 1);
    harness.finish().unwrap();
}

/// A program without captures, reclaims or `empty_cache` (allocations, frees,
/// cross-stream uses, host progress, syncs), with blocks up to 320 MiB: runs that long are
/// mapped in pieces of several pages, which is where pieces and pages part.
fn plain_program() -> impl Strategy<Value = Vec<Op>> {
    let size = prop_oneof![
        2 => size(),
        1 => (24 * MIB + 1)..=(320 * MIB),
    ];
    let stream = 0..STREAMS as u8;
    let allocation = prop_oneof![
        6 => (stream.clone(), size, 0u32..2_000_000)
            .prop_map(|(stream, size, duration)| Op::Malloc { stream, size, duration }),
        2 => (0u32..3_000_000).prop_map(|ns| Op::AdvanceHost { ns }),
        1 => stream.prop_map(|stream| Op::SyncStream { stream }),
    ];
    proptest::collection::vec(prop_oneof![3 => allocation, 2 => block_op()], 1..120)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: proptest_cases(128),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Pressure decides, not the presence of a limit: under a limit that the program never
    /// comes near, where every page is its own physical allocation, the engine places and
    /// stitches as without one. After every operation both hold the same blocks at the
    /// same addresses in the same states, and their traces name the same events. (What
    /// gives memory back differs by nature: a page can be unmapped alone, a piece only
    /// whole, so reclaims and `empty_cache` are left out.)
    #[test]
    fn a_limit_that_never_binds_changes_no_choice(
        program in plain_program(),
        policy in prop_oneof![3 => Just(ReusePolicy::StreamWait), 1 => Just(ReusePolicy::Pytorch)],
    ) {
        let config = |memory_limit| Config {
            reuse_policy: policy,
            reclaim: false,
            memory_limit,
            ..Config::default()
        };
        // A device far larger than any program here, so that neither run nears it.
        let device = 64 << 30;
        let mut free = Harness::new(config(None), device).unwrap();
        let mut limited = Harness::new(config(Some(2 * device)), device).unwrap();
        for (step, op) in program.iter().enumerate() {
            free.apply(op).unwrap();
            limited.apply(op).unwrap();
            let (a, b) = (free.allocator().snapshot(), limited.allocator().snapshot());
            prop_assert_eq!(&a.segments, &b.segments, "after step {}: {:?}", step, op);
            let events = |trace: &[streamalloc_allocator::trace::TraceEntry]| -> Vec<_> {
                trace.iter().map(|e| (e.action, e.addr, e.size, e.stream)).collect()
            };
            prop_assert_eq!(events(&a.trace), events(&b.trace), "after step {}: {:?}", step, op);
        }
        free.finish().unwrap();
        limited.finish().unwrap();
    }
}
