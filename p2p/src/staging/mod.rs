//! Bounded staging for many-tensor point-to-point exchanges.
//!
//! Users who resynchronise parameters between ranks send hundreds to tens of thousands of
//! differently shaped tensors to arbitrary peers. One NCCL operation per tensor in a group
//! is slow and can hang (NCCL splits big groups into launches at points that differ between
//! ranks); one concatenated buffer per peer doubles memory. This module moves any such
//! exchange through a fixed budget of staging memory, in rounds that every rank agrees on.
//!
//! - [`description`]: every rank's lists, encoded to travel and checked against each other.
//! - [`config`]: the staging budget and what it implies.
//! - [`plan`]: the deterministic planner (rounds, packing, zero-copy, splitting, circle
//!   pairing) and the plan digest.
//! - [`pool`]: the staging buffers, drawn from and returned to the engine's
//!   [`streamalloc_allocator::Allocator`], so they show in its stats and trace.
//!
//! Running a plan (packing, moving, unpacking on the GPU's streams) is `streamalloc.p2p`'s
//! job, in Python, next to the framework's tensors, streams and process group; it calls
//! the planner through the C ABI (`src/ffi/p2p.rs`). `docs/design.md` ("One executor")
//! says why.
//!
//! # Example
//! ```
//! use streamalloc_p2p::staging::plan::*;
//!
//! // Each rank's lists, as every rank sees them after the all-gather of descriptions.
//! let mut locals = vec![LocalDescription::empty(0, 2), LocalDescription::empty(1, 2)];
//! let meta = TensorMeta { bytes: 3, dtype: 0 };
//! locals[0].sends[1] = vec![meta];
//! locals[1].recvs[0] = vec![meta];
//! let plan = Plan::build(&Description::from_locals(&locals).unwrap(), StagingConfig::default())
//!     .unwrap();
//! assert_eq!(plan.rounds().len(), 1);
//! assert_eq!(plan.bytes_moved(), 3);
//! ```

pub mod config;
pub mod description;
pub mod plan;
pub mod pool;

pub use plan::{Description, LocalDescription, Plan, StagingConfig, TensorMeta};
pub use pool::StagingPool;

use streamalloc_allocator::error::AllocError;

/// Every way a staged exchange can fail. Errors that come from the gathered description
/// (mismatches, digest disagreement) are computed from data every rank holds, so every
/// rank reports the same one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StagingError {
    /// A staging configuration that cannot work.
    #[error("bad staging configuration: {0}")]
    BadConfig(String),
    /// A sender's list and its receiver's expectation disagree.
    #[error(
        "p2p exchange mismatch between rank {src} (sender) and rank {dst} (receiver): {detail}"
    )]
    Mismatch {
        /// Sending rank.
        src: u32,
        /// Receiving rank.
        dst: u32,
        /// What differs.
        detail: String,
    },
    /// Ranks computed different plans from the same description.
    #[error(
        "p2p plan digest mismatch across ranks [{}]: ranks planned differently \
         (different staging budgets or streamalloc versions)",
        .0.iter().map(|d| format!("{d:016x}")).collect::<Vec<_>>().join(", ")
    )]
    DigestMismatch(Vec<u64>),
    /// A rank could not plan (bad configuration, malformed or mismatched description):
    /// its reason, shared with every rank through the digest exchange.
    #[error("rank {rank} could not plan the p2p exchange: {message}")]
    RankFailed {
        /// The lowest rank that failed.
        rank: u32,
        /// Its error.
        message: String,
    },
    /// An encoded description that cannot be read.
    #[error("malformed p2p description: {0}")]
    Malformed(String),
    /// The caller's buffers do not match the description it gave.
    #[error("p2p buffers do not match the description: {0}")]
    BadBuffers(String),
    /// A staging acquire would have exceeded the budget (a planner bug, never expected).
    #[error(
        "staging budget exceeded: {in_use} bytes in use + {requested} requested > budget {budget}"
    )]
    BudgetExceeded {
        /// Bytes held.
        in_use: u64,
        /// Bytes asked for.
        requested: u64,
        /// The budget.
        budget: u64,
    },
    /// The allocator could not provide a staging buffer.
    #[error("staging buffer: {0}")]
    Alloc(#[from] AllocError),
}
