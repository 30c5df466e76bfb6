//! The planner: every rank's tensor lists in, the same rounds out on every rank.
//!
//! The plan is a pure function of the [`Description`] (every rank's send and receive lists,
//! gathered from all ranks) and the [`StagingConfig`], so every rank that holds the same
//! inputs computes the same plan, byte for byte; its [`Plan::digest`] lets ranks check that
//! before any data moves.
//!
//! # How rounds are built
//! 1. Pairing: the circle method (round-robin tournament) splits the `world·(world−1)/2`
//!    unordered pairs into steps in which every rank has at most one partner. Both
//!    directions of a pair travel in the same step, in one group per round, so no rank ever
//!    waits on a rank that waits on a third: there is no cycle to deadlock on.
//! 2. Messages: the list a rank sends to a peer is cut into messages. A tensor of at least
//!    `zero_copy_min` bytes is a message of its own, sent straight from the tensor
//!    (zero-copy). Smaller tensors are packed, in order, into messages of at most one
//!    staging buffer: back to back while the dtype stays the same (so a run of same-dtype
//!    tensors is one contiguous typed region, packed and unpacked by one batched copy), at
//!    the next [`ALIGN`]-byte offset when it changes. A tensor that does not fit the room
//!    left is split across two (or more) buffers, so every packed message but the last is
//!    full. Offsets within a same-dtype run stay multiples of the element size, because
//!    every run starts aligned, tensors are whole elements and buffers are multiples of
//!    [`ALIGN`].
//! 3. Rounds: round `k` of a step carries message `k` of each direction of each pair of the
//!    step. So in a round each ordered pair exchanges at most one message, and each rank
//!    posts at most one send and one receive: two operations per group, whatever the
//!    number of tensors.
//!
//! Staging memory per rank is at most `buffers_per_direction` buffers for sending and as
//! many for receiving, each at most [`StagingConfig::buffer_bytes`]: within the budget by
//! construction ([`Plan::staging_need`]).

pub use super::config::StagingConfig;
pub use super::description::{Description, LocalDescription, TensorMeta};
use super::StagingError;

/// Byte alignment of the start of every same-dtype run in a staging buffer, so that the run
/// can be viewed in place with its own dtype (16 covers every PyTorch dtype).
pub const ALIGN: u64 = 16;

/// Smallest staging buffer the planner accepts.
pub const MIN_BUFFER_BYTES: u64 = 4096;

/// Version of the plan format and algorithm, mixed into the digest: ranks running different
/// planners disagree loudly instead of exchanging garbage.
const PLAN_VERSION: u64 = 2;

// ---- Plan ----

/// A contiguous piece of a tensor placed in a staging buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Index of the tensor in the pair's list.
    pub tensor: u32,
    /// First byte of the piece within the tensor.
    pub tensor_offset: u64,
    /// Where the piece sits in the staging buffer (a multiple of [`ALIGN`] where the dtype
    /// changes; right after the previous piece otherwise).
    pub buffer_offset: u64,
    /// Bytes of the piece.
    pub len: u64,
}

/// What one message carries.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Payload {
    /// Pieces of small tensors packed into a staging buffer; the message is the buffer's
    /// first `len` bytes.
    Packed {
        /// The pieces, in buffer order.
        segments: Vec<Segment>,
        /// Bytes on the wire.
        len: u64,
    },
    /// One large tensor sent straight from (and received straight into) its memory.
    ZeroCopy {
        /// Index of the tensor in the pair's list.
        tensor: u32,
        /// Bytes of the tensor.
        len: u64,
    },
}

impl Payload {
    /// Bytes on the wire.
    pub fn wire_len(&self) -> u64 {
        match self {
            Payload::Packed { len, .. } | Payload::ZeroCopy { len, .. } => *len,
        }
    }

    /// Tensor bytes carried (the wire length less alignment padding).
    pub fn tensor_bytes(&self) -> u64 {
        match self {
            Payload::Packed { segments, .. } => {
                segments.iter().map(|s| s.len).fold(0, u64::saturating_add)
            }
            Payload::ZeroCopy { len, .. } => *len,
        }
    }
}

/// One message of a round.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// Sending rank.
    pub src: u32,
    /// Receiving rank.
    pub dst: u32,
    /// What travels.
    pub payload: Payload,
}

/// A round: every transfer in it runs in one group on each rank involved.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Round {
    /// The pairing step (circle-method round) this round belongs to.
    pub step: u32,
    /// The messages; at most one per ordered pair.
    pub transfers: Vec<Transfer>,
}

/// One rank's part of a round: indexes into [`Round::transfers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankRound {
    /// Index of the round in [`Plan::rounds`].
    pub round: u32,
    /// The transfer this rank sends, if any.
    pub send: Option<u32>,
    /// The transfer this rank receives, if any.
    pub recv: Option<u32>,
}

/// Staging buffers one rank needs to run its part of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StagingNeed {
    /// Send buffers (≤ buffers per direction; 0 if nothing is packed).
    pub send_buffers: u32,
    /// Bytes of each send buffer (the largest packed message sent).
    pub send_buffer_bytes: u64,
    /// Receive buffers.
    pub recv_buffers: u32,
    /// Bytes of each receive buffer.
    pub recv_buffer_bytes: u64,
}

impl StagingNeed {
    /// Total staging bytes.
    pub fn total(&self) -> u64 {
        u64::from(self.send_buffers) * self.send_buffer_bytes
            + u64::from(self.recv_buffers) * self.recv_buffer_bytes
    }
}

/// The schedule every rank follows. Build it with [`Plan::build`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    world: u32,
    config: StagingConfig,
    rounds: Vec<Round>,
    /// `per_rank[r]`: the rounds rank `r` takes part in, in order.
    per_rank: Vec<Vec<RankRound>>,
    /// `self_copies[r]`: tensors rank `r` sends to itself (copied locally, no rounds).
    self_copies: Vec<u32>,
    digest: u64,
}

impl Plan {
    /// Plans the exchange described by `description`.
    pub fn build(description: &Description, config: StagingConfig) -> Result<Self, StagingError> {
        config.validate()?;
        let world = description.world();
        let buffer = config.buffer_bytes();
        let zero_copy_min = config.zero_copy_threshold();
        let mut rounds = Vec::new();
        for (step, pairs) in circle_steps(world).into_iter().enumerate() {
            let mut lanes: Vec<(u32, u32, std::vec::IntoIter<Payload>)> = Vec::new();
            for (a, b) in pairs {
                for (src, dst) in [(a, b), (b, a)] {
                    let messages = cut_messages(description.sends(src, dst), buffer, zero_copy_min);
                    if !messages.is_empty() {
                        lanes.push((src, dst, messages.into_iter()));
                    }
                }
            }
            loop {
                let transfers: Vec<Transfer> = lanes
                    .iter_mut()
                    .filter_map(|(src, dst, messages)| {
                        messages.next().map(|payload| Transfer {
                            src: *src,
                            dst: *dst,
                            payload,
                        })
                    })
                    .collect();
                if transfers.is_empty() {
                    break;
                }
                rounds.push(Round {
                    step: step as u32,
                    transfers,
                });
            }
        }
        let mut per_rank: Vec<Vec<RankRound>> = vec![Vec::new(); world as usize];
        for (index, round) in rounds.iter().enumerate() {
            for (t, transfer) in round.transfers.iter().enumerate() {
                for (rank, is_send) in [(transfer.src, true), (transfer.dst, false)] {
                    let list = &mut per_rank[rank as usize];
                    if list.last().is_none_or(|r| r.round != index as u32) {
                        list.push(RankRound {
                            round: index as u32,
                            send: None,
                            recv: None,
                        });
                    }
                    let entry = list.last_mut().expect("pushed above");
                    let slot = if is_send {
                        &mut entry.send
                    } else {
                        &mut entry.recv
                    };
                    debug_assert!(slot.is_none(), "two messages for one rank and direction");
                    *slot = Some(t as u32);
                }
            }
        }
        let self_copies = (0..world)
            .map(|r| description.sends(r, r).len() as u32)
            .collect();
        let mut plan = Self {
            world,
            config,
            rounds,
            per_rank,
            self_copies,
            digest: 0,
        };
        plan.digest = plan.compute_digest(description);
        Ok(plan)
    }

    /// Number of ranks.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// The configuration the plan was built with.
    pub fn config(&self) -> &StagingConfig {
        &self.config
    }

    /// Every round, in order.
    pub fn rounds(&self) -> &[Round] {
        &self.rounds
    }

    /// The rounds `rank` takes part in.
    pub fn rank_rounds(&self, rank: u32) -> &[RankRound] {
        &self.per_rank[rank as usize]
    }

    /// Tensors `rank` sends to itself.
    pub fn self_copies(&self, rank: u32) -> u32 {
        self.self_copies[rank as usize]
    }

    /// A 64-bit digest of the plan and the description it came from (`Digest`). Equal on
    /// every rank when the plans are equal.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// Most operations (sends plus receives) any rank posts in one group.
    pub fn max_ops_per_group(&self) -> u32 {
        self.per_rank
            .iter()
            .flatten()
            .map(|r| u32::from(r.send.is_some()) + u32::from(r.recv.is_some()))
            .max()
            .unwrap_or(0)
    }

    /// Tensor bytes that cross between distinct ranks.
    /// Saturates at `u64::MAX` rather than wrapping (tensors of 2^63 bytes are accepted).
    pub fn bytes_moved(&self) -> u64 {
        self.rounds
            .iter()
            .flat_map(|r| &r.transfers)
            .map(|t| t.payload.tensor_bytes())
            .fold(0, u64::saturating_add)
    }

    /// The staging buffers `rank` needs: as many as the plan can use (up to
    /// `buffers_per_direction`), each as large as its largest packed message.
    pub fn staging_need(&self, rank: u32) -> StagingNeed {
        let mut need = StagingNeed::default();
        let (mut sends, mut recvs) = (0u64, 0u64);
        for rr in self.rank_rounds(rank) {
            let round = &self.rounds[rr.round as usize];
            for (slot, count, bytes) in [
                (rr.send, &mut sends, &mut need.send_buffer_bytes),
                (rr.recv, &mut recvs, &mut need.recv_buffer_bytes),
            ] {
                if let Some(t) = slot {
                    if let Payload::Packed { len, .. } = round.transfers[t as usize].payload {
                        *count += 1;
                        *bytes = (*bytes).max(len);
                    }
                }
            }
        }
        let per_direction = u64::from(self.config.buffers_per_direction);
        need.send_buffers = sends.min(per_direction) as u32;
        need.recv_buffers = recvs.min(per_direction) as u32;
        need
    }

    fn compute_digest(&self, description: &Description) -> u64 {
        let mut h = Digest::default();
        h.u64(PLAN_VERSION);
        h.u64(u64::from(self.world));
        h.u64(self.config.budget_bytes);
        h.u64(u64::from(self.config.buffers_per_direction));
        h.u64(self.config.zero_copy_threshold());
        for src in 0..self.world {
            for dst in 0..self.world {
                let list = description.sends(src, dst);
                h.u64(list.len() as u64);
                for t in list {
                    h.u64(t.bytes);
                    h.u64(u64::from(t.dtype));
                }
            }
        }
        h.u64(self.rounds.len() as u64);
        for round in &self.rounds {
            h.u64(u64::from(round.step));
            h.u64(round.transfers.len() as u64);
            for t in &round.transfers {
                h.u64(u64::from(t.src) << 32 | u64::from(t.dst));
                match &t.payload {
                    Payload::ZeroCopy { tensor, len } => {
                        h.u64(1);
                        h.u64(u64::from(*tensor));
                        h.u64(*len);
                    }
                    Payload::Packed { segments, len } => {
                        h.u64(2);
                        h.u64(*len);
                        h.u64(segments.len() as u64);
                        for s in segments {
                            h.u64(u64::from(s.tensor));
                            h.u64(s.tensor_offset);
                            h.u64(s.buffer_offset);
                            h.u64(s.len);
                        }
                    }
                }
            }
        }
        h.0
    }
}

/// A digest built a 64-bit word at a time: each word is xored in, then the state is
/// multiplied by an odd constant and folded (a multiply-xorshift step, as in splitmix64's
/// finaliser), so a difference in any bit of any word spreads over the whole state.
/// Deterministic across platforms and runs (std's hasher is randomly seeded per process, so
/// it cannot be compared between ranks). One multiply per word, not one per byte as FNV-1a
/// takes: a plan of 116,000 tensors over 4 ranks hashes about 700,000 words, which took
/// longer byte by byte than planning them.
struct Digest(u64);

impl Default for Digest {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Digest {
    fn u64(&mut self, value: u64) {
        let mixed = (self.0 ^ value).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = mixed ^ (mixed >> 29);
    }
}

/// The circle method: steps of disjoint pairs `(a, b)`, `a < b`, covering every unordered
/// pair of `0..world` exactly once. With an odd world a phantom rank is added and whoever
/// it meets sits the step out.
pub fn circle_steps(world: u32) -> Vec<Vec<(u32, u32)>> {
    if world < 2 {
        return Vec::new();
    }
    let m = world + world % 2; // even
    let spin = m - 1;
    (0..spin)
        .map(|r| {
            let mut pairs = vec![(r, m - 1)];
            for k in 1..m / 2 {
                pairs.push(((r + k) % spin, (r + spin - k) % spin));
            }
            pairs
                .into_iter()
                .filter(|&(a, b)| a < world && b < world)
                .map(|(a, b)| (a.min(b), a.max(b)))
                .collect()
        })
        .collect()
}

/// Cuts one ordered pair's list into messages (see the module docs).
fn cut_messages(list: &[TensorMeta], buffer: u64, zero_copy_min: u64) -> Vec<Payload> {
    let mut out = Vec::new();
    let mut segments = Vec::new();
    let mut fill = 0u64;
    // The dtype of the last piece in the open buffer (None: buffer empty).
    let mut last_dtype: Option<u32> = None;
    let flush = |segments: &mut Vec<Segment>,
                 fill: &mut u64,
                 last: &mut Option<u32>,
                 out: &mut Vec<Payload>| {
        if !segments.is_empty() {
            out.push(Payload::Packed {
                segments: std::mem::take(segments),
                len: *fill,
            });
        }
        *fill = 0;
        *last = None;
    };
    for (index, tensor) in list.iter().enumerate() {
        let size = tensor.bytes;
        if size == 0 {
            continue;
        }
        if size >= zero_copy_min {
            out.push(Payload::ZeroCopy {
                tensor: index as u32,
                len: size,
            });
            continue;
        }
        let mut offset = 0;
        while offset < size {
            let start = if last_dtype == Some(tensor.dtype) {
                fill
            } else {
                fill.div_ceil(ALIGN) * ALIGN
            };
            if start >= buffer {
                flush(&mut segments, &mut fill, &mut last_dtype, &mut out);
                continue;
            }
            last_dtype = Some(tensor.dtype);
            let len = (buffer - start).min(size - offset);
            segments.push(Segment {
                tensor: index as u32,
                tensor_offset: offset,
                buffer_offset: start,
                len,
            });
            offset += len;
            fill = start + len;
            if fill == buffer {
                flush(&mut segments, &mut fill, &mut last_dtype, &mut out);
            }
        }
    }
    flush(&mut segments, &mut fill, &mut last_dtype, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(bytes: u64) -> TensorMeta {
        TensorMeta { bytes, dtype: 0 }
    }

    #[test]
    fn bytes_moved_saturates_rather_than_wrapping() {
        let mut locals = vec![LocalDescription::empty(0, 2), LocalDescription::empty(1, 2)];
        let huge = meta(1 << 63);
        locals[0].sends[1] = vec![huge, huge];
        locals[1].recvs[0] = vec![huge, huge];
        let plan = Plan::build(
            &Description::from_locals(&locals).unwrap(),
            StagingConfig::default(),
        )
        .unwrap();
        assert_eq!(plan.bytes_moved(), u64::MAX);
    }

    #[test]
    fn circle_method_covers_every_pair_once_with_disjoint_steps() {
        for world in 1..=9 {
            let steps = circle_steps(world);
            let mut seen = std::collections::HashSet::new();
            for step in &steps {
                let mut busy = std::collections::HashSet::new();
                for &(a, b) in step {
                    assert!(busy.insert(a) && busy.insert(b), "rank twice in a step");
                    assert!(seen.insert((a, b)), "pair twice");
                }
            }
            assert_eq!(seen.len() as u32, world * world.saturating_sub(1) / 2);
        }
    }

    #[test]
    fn small_tensors_pack_and_split_at_buffer_boundaries() {
        let mut list = [meta(3000), meta(3000), meta(0), meta(100)];
        list[1].dtype = 1;
        let messages = cut_messages(&list, 4096, 4096);
        assert_eq!(messages.len(), 2);
        let Payload::Packed { segments, len } = &messages[0] else {
            panic!("packed expected")
        };
        assert_eq!(*len, 4096);
        assert_eq!(segments[1].buffer_offset, 3008); // aligned
        assert_eq!(segments[1].len, 4096 - 3008);
        let Payload::Packed { segments, .. } = &messages[1] else {
            panic!("packed expected")
        };
        assert_eq!(segments[0].tensor_offset, 4096 - 3008);
        assert_eq!(segments[1].tensor, 3);
        // Tensor 3 has the dtype of tensor 0, not of the piece before it: aligned.
        assert_eq!(
            segments[1].buffer_offset,
            (3000u64 - (4096 - 3008)).div_ceil(16) * 16
        );
    }

    #[test]
    fn same_dtype_tensors_pack_back_to_back() {
        let messages = cut_messages(&[meta(6), meta(10), meta(4)], 4096, 4096);
        let Payload::Packed { segments, len } = &messages[0] else {
            panic!("packed expected")
        };
        let offsets: Vec<u64> = segments.iter().map(|s| s.buffer_offset).collect();
        assert_eq!(offsets, [0, 6, 16]);
        assert_eq!(*len, 20);
    }

    #[test]
    fn large_tensors_go_zero_copy() {
        let messages = cut_messages(&[meta(10), meta(1 << 20), meta(10)], 4096, 4096);
        assert!(matches!(
            messages[0],
            Payload::ZeroCopy {
                tensor: 1,
                len: 1048576
            }
        ));
        assert_eq!(messages.len(), 2);
    }

    #[test]
    fn a_tiny_budget_is_refused_clearly() {
        let err = StagingConfig::with_budget(1000).validate().unwrap_err();
        assert!(err.to_string().contains("too small"), "{err}");
    }
}
