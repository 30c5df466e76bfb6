//! Bounded staging for many-tensor point-to-point exchanges.
//!
//! Users who resynchronise parameters between ranks send hundreds to tens of thousands of
//! differently shaped tensors to arbitrary peers. One NCCL operation per tensor in a group
//! is slow and can hang (NCCL splits big groups into launches at points that differ between
//! ranks); one concatenated buffer per peer doubles memory. This module moves any such
//! exchange through a fixed budget of staging memory, in rounds that every rank agrees on.
//!
//! - [`plan`]: the deterministic planner (rounds, packing, zero-copy, splitting, circle
//!   pairing) and the plan digest.
//! - [`pool`]: the staging buffers, drawn from and returned to the engine's
//!   [`streamalloc_allocator::Allocator`], so they show in its stats and trace.
//! - [`exec`]: agreeing on a plan across ranks (description all-gather, validation, digest
//!   check) and running it over a [`crate::transport::Transport`] with host buffers.
//!
//! # Example
//! ```
//! use streamalloc_p2p::staging::{exec, plan::*};
//! use streamalloc_p2p::transport::{sim::SimTransport, Transport};
//!
//! let handles: Vec<_> = SimTransport::mesh(2, std::time::Duration::from_secs(5))
//!     .into_iter()
//!     .map(|mut t| std::thread::spawn(move || {
//!         let (rank, peer) = (t.rank(), 1 - t.rank());
//!         let mut local = LocalDescription::empty(rank, 2);
//!         local.sends[peer as usize] = vec![TensorMeta { bytes: 3, dtype: 0 }];
//!         local.recvs[peer as usize] = vec![TensorMeta { bytes: 3, dtype: 0 }];
//!         let plan = exec::agree_on_plan(&mut t, &local, StagingConfig::default()).unwrap();
//!         plan.digest()
//!     }))
//!     .collect();
//! let digests: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
//! assert_eq!(digests[0], digests[1]);
//! ```

pub mod exec;
pub mod plan;
pub mod pool;

pub use exec::{agree_on_plan, execute, ExecStats};
pub use plan::{Description, LocalDescription, Plan, StagingConfig, TensorMeta};
pub use pool::StagingPool;

use crate::transport::TransportError;
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
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}
