//! Strategies shared by the property tests that drive `streamalloc_allocator::testing`.

use proptest::prelude::*;
use streamalloc_allocator::testing::{Op, STREAMS};

/// An operation that needs no live block: a malloc, host progress, a sync, `empty_cache`.
pub fn allocation_op(size: impl Strategy<Value = u64> + 'static) -> BoxedStrategy<Op> {
    let stream = 0..STREAMS as u8;
    let duration = 0u32..2_000_000;
    prop_oneof![
        6 => (stream.clone(), size, duration)
            .prop_map(|(stream, size, duration)| Op::Malloc { stream, size, duration }),
        2 => (0u32..3_000_000).prop_map(|ns| Op::AdvanceHost { ns }),
        1 => stream.prop_map(|stream| Op::SyncStream { stream }),
        1 => Just(Op::EmptyCache),
    ]
    .boxed()
}

/// An operation on a live block: free it, use it from another stream, work on it again.
pub fn block_op() -> BoxedStrategy<Op> {
    let stream = 0..STREAMS as u8;
    let duration = 0u32..2_000_000;
    prop_oneof![
        4 => any::<u16>().prop_map(|block| Op::Free { block }),
        3 => (any::<u16>(), stream, duration.clone())
            .prop_map(|(block, stream, duration)| Op::Use { block, stream, duration }),
        2 => (any::<u16>(), duration).prop_map(|(block, duration)| Op::Work { block, duration }),
    ]
    .boxed()
}
