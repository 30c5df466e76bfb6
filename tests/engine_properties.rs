//! Property tests of the engine, state-machine style: random programs of malloc / free /
//! record_use / stream work / host progress / stream syncs / empty_cache on four streams,
//! run on the simulated device under both reuse policies. After every step:
//! - the race detector finds no race (no byte reused before its earlier uses
//!   happen-before the new owner's work);
//! - no two live blocks overlap;
//! - the engine's invariants hold and the stats add up to the live blocks and segments;
//!
//! and at the end, after freeing everything and `empty_cache`, nothing is reserved and no
//! event is outstanding. Failures shrink to short programs.

use common::harness_op;
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use streamalloc_allocator::testing::{proptest_cases, Harness, Op};

mod common;
use streamalloc_allocator::{Config, ReusePolicy};

/// The model: the configuration under test and how many blocks the program holds.
#[derive(Clone, Debug)]
struct Model {
    policy: ReusePolicy,
    event_batch: usize,
    capacity: u64,
    live: usize,
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
        )
            .prop_map(|(policy, event_batch, capacity)| Model {
                policy,
                event_batch,
                capacity,
                live: 0,
            })
            .boxed()
    }

    fn transitions(_model: &Model) -> BoxedStrategy<Op> {
        harness_op(size())
    }

    fn preconditions(model: &Model, op: &Op) -> bool {
        match op {
            Op::Free { .. } | Op::Use { .. } | Op::Work { .. } => model.live > 0,
            _ => true,
        }
    }

    fn apply(mut model: Model, op: &Op) -> Model {
        match op {
            Op::Malloc { .. } => model.live += 1,
            Op::Free { .. } => model.live -= 1,
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
            ..Config::default()
        };
        Harness::new(config, model.capacity).expect("harness")
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
