//! What every rank hands the planner: its send and receive lists (a byte count and a dtype
//! per tensor), encoded to travel through the all-gather, and every rank's lists checked
//! against each other before anything is planned.

use super::StagingError;

/// Magic number opening an encoded [`LocalDescription`].
const DESCRIPTION_MAGIC: u32 = 0x5350_3250; // "SP2P"

/// One tensor as the planner sees it: a byte count and an opaque dtype code that sender
/// and receiver must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    /// Bytes of the tensor.
    pub bytes: u64,
    /// Dtype code (any numbering, as long as every rank uses the same one).
    pub dtype: u32,
}

/// What one rank knows: its send and receive lists, one per peer (index = peer rank,
/// including itself). This is what ranks all-gather before planning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalDescription {
    /// This rank.
    pub rank: u32,
    /// Number of ranks.
    pub world: u32,
    /// `sends[p]`: tensors sent to rank `p`, in order.
    pub sends: Vec<Vec<TensorMeta>>,
    /// `recvs[p]`: tensors received from rank `p`, in order.
    pub recvs: Vec<Vec<TensorMeta>>,
}

impl LocalDescription {
    /// An empty description (nothing sent or received) for `rank` of `world`.
    pub fn empty(rank: u32, world: u32) -> Self {
        Self {
            rank,
            world,
            sends: vec![Vec::new(); world as usize],
            recvs: vec![Vec::new(); world as usize],
        }
    }

    /// The compact little-endian encoding all-gathered between ranks.
    pub fn encode(&self) -> Vec<u8> {
        let tensors: usize = self.sends.iter().chain(&self.recvs).map(Vec::len).sum();
        let mut out = Vec::with_capacity(12 + 8 * self.world as usize + 12 * tensors);
        out.extend_from_slice(&DESCRIPTION_MAGIC.to_le_bytes());
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.world.to_le_bytes());
        for lists in [&self.sends, &self.recvs] {
            for list in lists {
                out.extend_from_slice(&(list.len() as u32).to_le_bytes());
                for t in list {
                    out.extend_from_slice(&t.bytes.to_le_bytes());
                    out.extend_from_slice(&t.dtype.to_le_bytes());
                }
            }
        }
        out
    }

    /// Decodes [`LocalDescription::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Result<Self, StagingError> {
        let mut reader = Reader { bytes, pos: 0 };
        if reader.u32()? != DESCRIPTION_MAGIC {
            return Err(StagingError::Malformed(
                "not a streamalloc p2p description (bad magic)".into(),
            ));
        }
        let rank = reader.u32()?;
        let world = reader.u32()?;
        if world == 0 || rank >= world {
            return Err(StagingError::Malformed(format!(
                "rank {rank} out of range for world size {world}"
            )));
        }
        let mut lists = || -> Result<Vec<Vec<TensorMeta>>, StagingError> {
            (0..world)
                .map(|_| {
                    let n = reader.u32()? as usize;
                    if n > reader.remaining() / 12 {
                        return Err(StagingError::Malformed("truncated tensor list".into()));
                    }
                    (0..n)
                        .map(|_| {
                            Ok(TensorMeta {
                                bytes: reader.u64()?,
                                dtype: reader.u32()?,
                            })
                        })
                        .collect()
                })
                .collect()
        };
        let sends = lists()?;
        let recvs = lists()?;
        if reader.remaining() != 0 {
            return Err(StagingError::Malformed("trailing bytes".into()));
        }
        Ok(Self {
            rank,
            world,
            sends,
            recvs,
        })
    }
}

/// A cursor over an encoded description.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], StagingError> {
        let end = self.pos + N;
        let chunk = self
            .bytes
            .get(self.pos..end)
            .ok_or_else(|| StagingError::Malformed("truncated description".into()))?;
        self.pos = end;
        Ok(chunk.try_into().expect("slice of length N"))
    }
    fn u32(&mut self) -> Result<u32, StagingError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, StagingError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }
}

/// The global picture: what every rank sends to every rank, checked against what every
/// receiver expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Description {
    world: u32,
    /// `sends[src][dst]`: the tensors `src` sends to `dst`, in order.
    sends: Vec<Vec<Vec<TensorMeta>>>,
}

impl Description {
    /// Checks every rank's lists against its peers' and builds the global picture. Every
    /// rank that calls this with the same gathered descriptions gets the same result, error
    /// included: a mismatch names the first disagreeing pair in (sender, receiver) order.
    pub fn from_locals(locals: &[LocalDescription]) -> Result<Self, StagingError> {
        let world = locals.len() as u32;
        if world == 0 {
            return Err(StagingError::Malformed("no ranks".into()));
        }
        for (i, local) in locals.iter().enumerate() {
            if local.world != world || local.rank != i as u32 {
                return Err(StagingError::Malformed(format!(
                    "description #{i} claims rank {} of world {}, expected rank {i} of {world}",
                    local.rank, local.world
                )));
            }
            if local.sends.len() != world as usize || local.recvs.len() != world as usize {
                return Err(StagingError::Malformed(format!(
                    "rank {i} lists {} send and {} receive peers, expected {world}",
                    local.sends.len(),
                    local.recvs.len()
                )));
            }
        }
        for src in 0..world as usize {
            for dst in 0..world as usize {
                check_pair(src, dst, &locals[src].sends[dst], &locals[dst].recvs[src])?;
            }
        }
        Ok(Self {
            world,
            sends: locals.iter().map(|l| l.sends.clone()).collect(),
        })
    }

    /// Number of ranks.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// The tensors `src` sends to `dst`.
    pub fn sends(&self, src: u32, dst: u32) -> &[TensorMeta] {
        &self.sends[src as usize][dst as usize]
    }
}

/// Compares one ordered pair's send list with the receiver's expectation.
fn check_pair(
    src: usize,
    dst: usize,
    sent: &[TensorMeta],
    expected: &[TensorMeta],
) -> Result<(), StagingError> {
    let mismatch = |detail: String| StagingError::Mismatch {
        src: src as u32,
        dst: dst as u32,
        detail,
    };
    if sent.len() != expected.len() {
        return Err(mismatch(format!(
            "rank {src} sends {} tensors to rank {dst}, which expects {}",
            sent.len(),
            expected.len()
        )));
    }
    if let Some((k, (s, e))) = sent
        .iter()
        .zip(expected)
        .enumerate()
        .find(|(_, (s, e))| s != e)
    {
        return Err(mismatch(format!(
            "tensor #{k}: sender has {} bytes of dtype {}, receiver expects {} bytes of dtype {}",
            s.bytes, s.dtype, e.bytes, e.dtype
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(bytes: u64) -> TensorMeta {
        TensorMeta { bytes, dtype: 0 }
    }

    #[test]
    fn description_round_trips_through_its_encoding() {
        let mut local = LocalDescription::empty(1, 3);
        local.sends[0] = vec![meta(5), TensorMeta { bytes: 7, dtype: 9 }];
        local.recvs[2] = vec![meta(0)];
        assert_eq!(LocalDescription::decode(&local.encode()).unwrap(), local);
        assert!(LocalDescription::decode(&local.encode()[..10]).is_err());
    }

    #[test]
    fn a_count_mismatch_names_the_pair() {
        let mut a = LocalDescription::empty(0, 2);
        let b = LocalDescription::empty(1, 2);
        a.sends[1] = vec![meta(5)];
        let err = Description::from_locals(&[a, b]).unwrap_err().to_string();
        assert!(
            err.contains("rank 0 sends 1 tensors to rank 1, which expects 0"),
            "{err}"
        );
    }
}
