//! Size rounding and the small/large split: one source of truth for every size decision.
//!
//! The constants follow PyTorch's caching allocator, whose numbers are tuned on real
//! workloads: blocks are multiples of 512 bytes; requests of at most 1 MiB come from 2 MiB
//! small segments; requests up to 10 MiB get 20 MiB segments; larger ones a segment of their
//! own rounded to 2 MiB.

use crate::types::PoolKind;

/// Every block size is a multiple of this, and no block is smaller.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Requests of at most this many bytes are served from the small pool.
pub const SMALL_REQUEST_LIMIT: u64 = 1 << 20;
/// Size of a small-pool segment.
pub const SMALL_SEGMENT_SIZE: u64 = 2 << 20;
/// Requests below this share a [`LARGE_SEGMENT_SIZE`] segment.
pub const MEDIUM_REQUEST_LIMIT: u64 = 10 << 20;
/// Size of a shared large-pool segment.
pub const LARGE_SEGMENT_SIZE: u64 = 20 << 20;
/// Granularity of segments made for one large request.
pub const SEGMENT_ROUNDING: u64 = 2 << 20;
/// The largest request accepted (beyond any device's memory, below u64 overflow).
pub const MAX_REQUEST: u64 = 1 << 50;

const _: () = assert!(SMALL_SEGMENT_SIZE.is_multiple_of(MIN_BLOCK_SIZE));
const _: () = assert!(LARGE_SEGMENT_SIZE.is_multiple_of(SEGMENT_ROUNDING));
const _: () = assert!(SMALL_REQUEST_LIMIT <= SMALL_SEGMENT_SIZE);

/// The block size that serves a request of `requested` bytes.
#[inline]
pub fn round_size(requested: u64) -> u64 {
    if requested <= MIN_BLOCK_SIZE {
        MIN_BLOCK_SIZE
    } else {
        requested.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }
}

/// The pool a rounded size belongs to.
#[inline]
pub fn pool_of(size: u64) -> PoolKind {
    if size <= SMALL_REQUEST_LIMIT {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// Bytes to ask the device for when no cached block fits a rounded `size`.
pub fn segment_size_for(size: u64) -> u64 {
    if size <= SMALL_REQUEST_LIMIT {
        SMALL_SEGMENT_SIZE
    } else if size < MEDIUM_REQUEST_LIMIT {
        LARGE_SEGMENT_SIZE
    } else {
        size.div_ceil(SEGMENT_ROUNDING) * SEGMENT_ROUNDING
    }
}

/// Whether a free block of `block_size` bytes, chosen for a request of `size`, should be
/// split, leaving the remainder free. Small blocks split down to the minimum; large ones
/// only when more than 1 MiB would remain, so the large pool never fills with slivers.
#[inline]
pub fn should_split(block_size: u64, size: u64, pool: PoolKind) -> bool {
    let remaining = block_size - size;
    match pool {
        PoolKind::Small => remaining >= MIN_BLOCK_SIZE,
        PoolKind::Large => remaining > SMALL_REQUEST_LIMIT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn rounding_covers_the_request_with_minimal_granules(req in 1u64..(1 << 40)) {
            let size = round_size(req);
            prop_assert!(size >= req);
            prop_assert_eq!(size % MIN_BLOCK_SIZE, 0);
            prop_assert!(size - req < MIN_BLOCK_SIZE || req < MIN_BLOCK_SIZE);
            let segment = segment_size_for(size);
            prop_assert!(segment >= size);
        }
    }

    #[test]
    fn pools_and_segments_follow_pytorch() {
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(pool_of(1 << 20), PoolKind::Small);
        assert_eq!(pool_of((1 << 20) + 512), PoolKind::Large);
        assert_eq!(segment_size_for(4096), 2 << 20);
        assert_eq!(segment_size_for(5 << 20), 20 << 20);
        assert_eq!(segment_size_for((64 << 20) + 512), 66 << 20);
        assert!(!should_split(2 << 20, (2 << 20) - 512, PoolKind::Large));
        assert!(should_split(1024, 512, PoolKind::Small));
    }
}
