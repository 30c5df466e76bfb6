//! How ranks talk: the [`Transport`] trait the staging executor runs over.
//!
//! A transport offers what NCCL offers, reduced to what a staged exchange needs: an
//! all-gather (to share descriptions and plan digests) and grouped point-to-point sends and
//! receives. [`Transport::group`] is `ncclGroupStart`, one `ncclSend`/`ncclRecv` per
//! operation, `ncclGroupEnd`, and waiting for the group: operations of one group may be
//! matched in any order, so a group holding a send to and a receive from the same peer
//! cannot deadlock.
//!
//! [`sim::SimTransport`] runs ranks as threads over channels, for CI. Every wait in it has a
//! deadline, so a protocol error is an error, never a hang.
//!
//! `nccl::NcclTransport` (feature `nccl`) runs the same protocol over NCCL between GPUs,
//! from Rust: a non-blocking communicator bootstrapped from a unique id shared through a
//! file, every wait bounded by a deadline.

#[cfg(feature = "nccl")]
pub mod nccl;
pub mod sim;

/// One operation of a group.
#[derive(Debug)]
pub enum P2pOp<'a> {
    /// Send `data` to `peer`.
    Send {
        /// Receiving rank.
        peer: u32,
        /// Bytes to send.
        data: &'a [u8],
    },
    /// Receive exactly `buf.len()` bytes from `peer` into `buf`.
    Recv {
        /// Sending rank.
        peer: u32,
        /// Where the bytes land.
        buf: &'a mut [u8],
    },
}

/// A transport failure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransportError {
    /// No message arrived in time.
    #[error("rank {rank}: timed out after {seconds:.1} s waiting for rank {peer}")]
    Timeout {
        /// The waiting rank.
        rank: u32,
        /// The rank it waited for.
        peer: u32,
        /// How long it waited.
        seconds: f64,
    },
    /// The peer is gone (its side of the transport was dropped, e.g. after an error).
    #[error("rank {rank}: rank {peer} left the exchange")]
    PeerGone {
        /// The rank that noticed.
        rank: u32,
        /// The rank that left.
        peer: u32,
    },
    /// A message of the wrong kind or size arrived: the ranks are not running the same
    /// protocol.
    #[error("rank {rank}: protocol error with rank {peer}: {detail}")]
    Protocol {
        /// The rank that noticed.
        rank: u32,
        /// The other rank.
        peer: u32,
        /// What was wrong.
        detail: String,
    },
    /// A peer rank outside `0..world`.
    #[error("rank {rank}: peer {peer} out of range for world size {world}")]
    BadPeer {
        /// The calling rank.
        rank: u32,
        /// The peer named.
        peer: u32,
        /// Number of ranks.
        world: u32,
    },
    /// The underlying library failed.
    #[error("transport: {0}")]
    Backend(String),
}

/// Collective and point-to-point communication between `world` ranks.
pub trait Transport {
    /// This rank, in `0..world`.
    fn rank(&self) -> u32;

    /// Number of ranks.
    fn world(&self) -> u32;

    /// Every rank contributes `data` (any length); every rank gets all contributions, by rank.
    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, TransportError>;

    /// Runs the operations as one group and waits for all of them (see the module docs).
    fn group(&mut self, ops: &mut [P2pOp<'_>]) -> Result<(), TransportError>;
}
