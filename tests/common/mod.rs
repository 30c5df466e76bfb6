//! Strategies shared by the property tests that drive `streamalloc_allocator::testing`.

use proptest::prelude::*;
use streamalloc_allocator::testing::{Op, STREAMS};

/// One harness operation on any of the harness's streams, allocation sizes drawn from
/// `size` (each test chooses the size mix its property needs).
pub fn harness_op(size: impl Strategy<Value = u64> + 'static) -> BoxedStrategy<Op> {
    let stream = 0..STREAMS as u8;
    let duration = 0u32..2_000_000;
    prop_oneof![
        6 => (stream.clone(), size, duration.clone())
            .prop_map(|(stream, size, duration)| Op::Malloc { stream, size, duration }),
        4 => any::<u16>().prop_map(|block| Op::Free { block }),
        3 => (any::<u16>(), stream.clone(), duration.clone())
            .prop_map(|(block, stream, duration)| Op::Use { block, stream, duration }),
        2 => (any::<u16>(), duration).prop_map(|(block, duration)| Op::Work { block, duration }),
        2 => (0u32..3_000_000).prop_map(|ns| Op::AdvanceHost { ns }),
        1 => stream.prop_map(|stream| Op::SyncStream { stream }),
        1 => Just(Op::EmptyCache),
    ]
    .boxed()
}
