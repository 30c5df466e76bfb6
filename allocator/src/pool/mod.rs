//! Segments, blocks and free lists: the data structures of the pool, with no policy.
//!
//! - [`size`]: rounding and the small/large split (every size decision lives there).
//! - `arena`: segments tiled by address-linked blocks; split and merge.
//! - `free_list`: best-fit sets of free blocks.
//! - `expandable`: address reservations with pages mapped on demand (expandable segments).
//! - `stitch`: free pages of expandable segments mapped a second time into one range.
//! - [`sleep`]: tags, and what a sleeping memory pool gave back and kept.
//!
//! Which free list a block belongs in (its stream, whether it awaits events) is the
//! lifetime layer's decision, in `crate::lifetime`.

pub(crate) mod arena;
pub(crate) mod expandable;
pub(crate) mod free_list;
pub mod size;
pub mod sleep;
pub(crate) mod stitch;

pub use size::{
    round_size, segment_size_for, LARGE_SEGMENT_SIZE, MIN_BLOCK_SIZE, SMALL_REQUEST_LIMIT,
    SMALL_SEGMENT_SIZE,
};
