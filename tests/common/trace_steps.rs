//! Random recorded traces for the replay's property tests: steps drawn by proptest, turned
//! into trace entries with recorder addresses.

use proptest::prelude::*;
use streamalloc::replay::entry;
use streamalloc_allocator::trace::{TraceAction, TraceEntry};

/// One step of a generated trace: allocate, free the `pick`-th live block (at completion,
/// or at the request only), or free an address never allocated.
#[derive(Clone, Debug)]
pub enum Step {
    Alloc { size: u64, stream: u64 },
    Free { pick: usize, completed: bool },
    UnknownFree,
}

/// Fewer than `most` steps on 3 streams, allocations of `size`.
pub fn steps(
    size: impl Strategy<Value = u64> + 'static,
    most: usize,
) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            5 => (size, 0u64..3).prop_map(|(size, stream)| Step::Alloc { size, stream }),
            4 => (any::<usize>(), prop::bool::weighted(0.8))
                .prop_map(|(pick, completed)| Step::Free { pick, completed }),
            1 => Just(Step::UnknownFree),
        ],
        1..most,
    )
}

/// Trace entries for `steps`, with recorder addresses that are not reused.
pub fn trace_of(steps: &[Step]) -> Vec<TraceEntry> {
    let mut events = Vec::new();
    let mut live: Vec<(u64, u64, u64)> = Vec::new();
    let mut next_addr = 0x1000u64;
    for step in steps {
        match step {
            Step::Alloc { size, stream } => {
                next_addr += 0x1000;
                events.push(entry(TraceAction::Alloc, next_addr, *size, *stream));
                live.push((next_addr, *size, *stream));
            }
            Step::Free { pick, completed } => {
                if live.is_empty() {
                    continue;
                }
                let (addr, size, stream) = live.swap_remove(pick % live.len());
                events.push(entry(TraceAction::FreeRequested, addr, size, stream));
                if *completed {
                    events.push(entry(TraceAction::FreeCompleted, addr, size, stream));
                }
            }
            Step::UnknownFree => {
                events.push(entry(TraceAction::FreeCompleted, 0xdead_0000, 4096, 0));
            }
        }
    }
    events
}
