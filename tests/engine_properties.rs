//! Property tests of the engine, state-machine style: random programs of malloc / free /
//! record_use / stream work / host progress / stream syncs / empty_cache, CUDA-graph
//! capture / replay / destruction and user-pool allocations on four streams, run on the
//! simulated device under both reuse policies, with and without reclaims, with expandable
//! or whole segments, the user pool plain, growing by whole segments or never splitting.
//! After every step:
//! - the race detector finds no race (no byte reused before its earlier uses
//!   happen-before the new owner's work, and no graph replay over memory eager code took);
//! - no two live blocks overlap, by address or by physical page (stitching maps a page at
//!   two addresses);
//! - memory handed out in a pool with uses left (a live graph's, the user pool) is never
//!   handed to an allocation of another pool;
//! - the engine's invariants hold and the stats add up to the live blocks and segments;
//!
//! and at the end, after destroying every graph, releasing every pool, freeing everything
//! and `empty_cache`, nothing is reserved and no event is outstanding. Failures shrink to
//! short programs. The tests after the machine show that each property can fail.

use common::{allocation_op, block_op};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use streamalloc_allocator::testing::{proptest_cases, Harness, Op, PoolRule, STREAMS};

mod common;
use streamalloc_allocator::{Config, ReusePolicy};

/// The model: the configuration under test and how many blocks the program holds.
#[derive(Clone, Debug)]
struct Model {
    policy: ReusePolicy,
    /// `reclaim`: expandable segments unmap to stay near the live peak, or only for a limit.
    reclaim: bool,
    /// `stitch`: free pages are mapped into one range for requests no free block fits.
    stitch: bool,
    /// `page_allocations`: every page its own physical allocation, or runs mapped in pieces
    /// (stitches then take whole pieces).
    page_allocations: bool,
    /// `expandable_segments`: pages mapped on demand, or whole segments (PyTorch's rules).
    expandable: bool,
    /// The user pool's rule: none, whole segments (another allocator's), or no splitting.
    user_pool: PoolRule,
    event_batch: usize,
    capacity: u64,
    live: usize,
    capturing: bool,
    graphs: usize,
}

struct EngineMachine;

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..=8192,
        3 => 8193u64..=(1 << 20),
        2 => ((1u64 << 20) + 1)..=(12 << 20),
        1 => ((12u64 << 20) + 1)..=(48 << 20),
    ]
}

impl ReferenceStateMachine for EngineMachine {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        (
            prop_oneof![Just(ReusePolicy::StreamWait), Just(ReusePolicy::Pytorch)],
            prop_oneof![Just(1usize), Just(4), Just(64)],
            prop_oneof![Just(96u64 << 20), Just(1u64 << 30)],
            prop_oneof![3 => Just(true), 1 => Just(false)],
            prop_oneof![3 => Just(true), 1 => Just(false)],
            prop_oneof![3 => Just(true), 1 => Just(false)],
            prop_oneof![1 => Just(true), 1 => Just(false)],
            prop_oneof![
                2 => Just(PoolRule::Plain),
                1 => Just(PoolRule::WholeSegments),
                1 => Just(PoolRule::NoSplit)
            ],
        )
            .prop_map(
                |(
                    policy,
                    event_batch,
                    capacity,
                    reclaim,
                    stitch,
                    expandable,
                    page_allocations,
                    user_pool,
                )| Model {
                    policy,
                    reclaim,
                    stitch,
                    page_allocations,
                    expandable,
                    user_pool,
                    event_batch,
                    capacity,
                    live: 0,
                    capturing: false,
                    graphs: 0,
                },
            )
            .boxed()
    }

    /// Only operations the program can take in `model`'s state, so that no generated
    /// program is thrown away by the preconditions.
    fn transitions(model: &Model) -> BoxedStrategy<Op> {
        let stream = 0..STREAMS as u8;
        let mut choices: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (10, allocation_op(size())),
            (
                2,
                (stream.clone(), size(), 0u32..2_000_000)
                    .prop_map(|(stream, size, duration)| Op::PoolMalloc {
                        stream,
                        size,
                        duration,
                    })
                    .boxed(),
            ),
        ];
        if model.live > 0 {
            choices.push((9, block_op()));
        }
        if model.capturing {
            choices.push((2, Just(Op::EndCapture).boxed()));
        } else {
            let begin = stream
                .clone()
                .prop_map(|stream| Op::BeginCapture { stream });
            choices.push((2, begin.boxed()));
        }
        if model.graphs > 0 {
            let replay =
                (any::<u16>(), stream).prop_map(|(graph, stream)| Op::Replay { graph, stream });
            choices.push((3, replay.boxed()));
            let destroy = any::<u16>().prop_map(|graph| Op::DestroyGraph { graph });
            choices.push((1, destroy.boxed()));
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
            Op::Free { .. } => model.live -= 1,
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

impl StateMachineTest for EngineMachine {
    type SystemUnderTest = Harness;
    type Reference = EngineMachine;

    fn init_test(model: &Model) -> Harness {
        let config = Config {
            reuse_policy: model.policy,
            event_batch: model.event_batch,
            reclaim: model.reclaim,
            stitch: model.stitch,
            page_allocations: model.page_allocations,
            expandable_segments: model.expandable,
            ..Config::default()
        };
        Harness::new(config, model.capacity)
            .expect("harness")
            .with_user_pool_rule(model.user_pool)
    }

    fn apply(mut harness: Harness, _model: &Model, op: Op) -> Harness {
        // A malloc may fail for lack of memory; keep the model's count in step with what the
        // program actually holds so preconditions stay meaningful.
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
        cases: proptest_cases(512),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Every invariant holds after every step of every program, and nothing leaks.
    #[test]
    fn engine_invariants_hold_on_random_programs(sequential 1..120 => EngineMachine);
}

const MIB: u64 = 1 << 20;

/// Runs `program` and returns the first violation, the teardown's included.
fn run(config: Config, program: &[Op]) -> Result<(), String> {
    let mut harness = Harness::new(config, 1 << 30).map_err(|err| err.to_string())?;
    for op in program {
        harness.apply(op)?;
    }
    harness.finish()
}

/// Capture `tmp`, free it after the capture, allocate the same size eagerly on the same
/// stream, then replay.
fn graph_memory_reuse() -> Vec<Op> {
    let malloc = Op::Malloc {
        stream: 0,
        size: 4 * MIB,
        duration: 1_000,
    };
    vec![
        Op::BeginCapture { stream: 0 },
        malloc.clone(),
        Op::EndCapture,
        Op::Free { block: 0 },
        malloc,
        Op::Replay {
            graph: 0,
            stream: 1,
        },
    ]
}

#[test]
fn pool_isolation_fails_when_graph_memory_returns_to_the_default_pool() {
    assert_eq!(run(Config::default(), &graph_memory_reuse()), Ok(()));
    let planted = Config {
        graph_pools: false,
        ..Config::default()
    };
    let violation = run(planted, &graph_memory_reuse()).unwrap_err();
    assert!(
        violation.contains("after step 5") || violation.starts_with("step 5"),
        "{violation}"
    );
    assert!(
        violation.contains("overlaps") && violation.contains("pool(1, 0)"),
        "{violation}"
    );
}

#[test]
fn no_race_fails_when_a_replay_writes_memory_eager_code_took() {
    let planted = Config {
        graph_pools: false,
        ..Config::default()
    };
    let mut harness = Harness::new(planted, 1 << 30).unwrap();
    // Without the isolation check, only the race detector stands between the replay and
    // the eager block.
    harness.skip_pool_isolation_check();
    let program = graph_memory_reuse();
    for op in &program[..5] {
        harness.apply(op).unwrap();
    }
    let violation = harness.apply(&program[5]).unwrap_err();
    assert!(violation.starts_with("after step 6"), "{violation}");
    assert!(
        violation.contains("step 5: first write of new block")
            && violation.contains("replay 1 of graph 1: step 2: first write of new block"),
        "{violation}"
    );
}

#[test]
fn teardown_fails_when_a_pool_keeps_a_use() {
    let mut harness = Harness::new(Config::default(), 1 << 30).unwrap();
    let program = graph_memory_reuse();
    for op in &program {
        harness.apply(op).unwrap();
    }
    let pool = harness.live_pools()[0];
    harness.allocator().create_or_incref_pool(pool).unwrap();
    let violation = harness.finish().unwrap_err();
    assert!(violation.contains("uses left"), "{violation}");
}

#[test]
fn stats_fail_when_an_allocation_is_unaccounted_for() {
    let mut harness = Harness::new(Config::default(), 1 << 30).unwrap();
    harness
        .apply(&Op::PoolMalloc {
            stream: 0,
            size: MIB,
            duration: 0,
        })
        .unwrap();
    let stream = harness.device().create_stream();
    harness.allocator().malloc(MIB, stream).unwrap();
    let violation = harness.check().unwrap_err();
    assert!(violation.starts_with("stats say"), "{violation}");
}

/// Graph 1 writes a block it allocated; graph 2 reads it as an input and is replayed on
/// another stream, then destroyed, and the block is freed back to graph 1's pool. The
/// next replay of graph 1 still writes those bytes, so the program must order it after
/// graph 2's last replay even though neither the block nor graph 2 is live any more.
#[test]
fn replays_over_a_freed_input_follow_the_last_replay_that_read_it() {
    let program = vec![
        Op::BeginCapture { stream: 0 },
        Op::Malloc {
            stream: 0,
            size: 4 * MIB,
            duration: 1_000,
        },
        Op::EndCapture,
        Op::BeginCapture { stream: 0 },
        Op::Work {
            block: 0,
            duration: 1_000_000,
        },
        Op::EndCapture,
        Op::Replay {
            graph: 1,
            stream: 3,
        },
        Op::DestroyGraph { graph: 1 },
        Op::Free { block: 0 },
        Op::Replay {
            graph: 0,
            stream: 2,
        },
    ];
    assert_eq!(run(Config::default(), &program), Ok(()));
}
