//! A simulated transport: ranks are threads, links are channels.
//!
//! Each ordered pair of ranks has its own FIFO channel, so messages between two ranks arrive
//! in the order they were sent, as with NCCL. Sends never block (the channel buffers them);
//! a group posts its sends first and then waits for its receives, which gives NCCL's
//! "any order within a group" semantics. Every receive has a deadline: a rank that waits on
//! a peer that never sends gets [`TransportError::Timeout`], and a peer whose transport was
//! dropped gives [`TransportError::PeerGone`] at once.

use super::{P2pOp, Transport, TransportError};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// What travels on a link.
#[derive(Debug)]
enum Packet {
    /// One rank's contribution to an all-gather.
    Gather(Vec<u8>),
    /// A point-to-point message.
    Message(Vec<u8>),
}

/// One rank's end of a simulated mesh. Build all of them with [`SimTransport::mesh`].
#[derive(Debug)]
pub struct SimTransport {
    rank: u32,
    world: u32,
    /// `to[p]`: the link to rank `p`.
    to: Vec<Sender<Packet>>,
    /// `from[p]`: the link from rank `p`.
    from: Vec<Receiver<Packet>>,
    /// How long a receive waits before failing.
    timeout: Duration,
    /// Bytes this rank has sent point-to-point.
    bytes_sent: u64,
}

impl SimTransport {
    /// `world` connected transports, one per rank (move each into its own thread).
    pub fn mesh(world: u32, timeout: Duration) -> Vec<SimTransport> {
        let n = world as usize;
        let mut senders: Vec<Vec<Option<Sender<Packet>>>> = (0..n).map(|_| vec![None; n]).collect();
        let mut receivers: Vec<Vec<Option<Receiver<Packet>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for src in 0..n {
            for dst in 0..n {
                let (tx, rx) = channel();
                senders[src][dst] = Some(tx);
                receivers[dst][src] = Some(rx);
            }
        }
        senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(rank, (to, from))| SimTransport {
                rank: rank as u32,
                world,
                to: to
                    .into_iter()
                    .map(|s| s.expect("every link made"))
                    .collect(),
                from: from
                    .into_iter()
                    .map(|r| r.expect("every link made"))
                    .collect(),
                timeout,
                bytes_sent: 0,
            })
            .collect()
    }

    /// Bytes sent point-to-point so far.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    fn check_peer(&self, peer: u32) -> Result<(), TransportError> {
        if peer >= self.world {
            return Err(TransportError::BadPeer {
                rank: self.rank,
                peer,
                world: self.world,
            });
        }
        Ok(())
    }

    fn post(&self, peer: u32, packet: Packet) -> Result<(), TransportError> {
        self.to[peer as usize]
            .send(packet)
            .map_err(|_| TransportError::PeerGone {
                rank: self.rank,
                peer,
            })
    }

    fn take(&self, peer: u32, deadline: Instant) -> Result<Packet, TransportError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        self.from[peer as usize]
            .recv_timeout(wait)
            .map_err(|e| match e {
                RecvTimeoutError::Timeout => TransportError::Timeout {
                    rank: self.rank,
                    peer,
                    seconds: self.timeout.as_secs_f64(),
                },
                RecvTimeoutError::Disconnected => TransportError::PeerGone {
                    rank: self.rank,
                    peer,
                },
            })
    }

    fn protocol(&self, peer: u32, detail: impl Into<String>) -> TransportError {
        TransportError::Protocol {
            rank: self.rank,
            peer,
            detail: detail.into(),
        }
    }
}

impl Transport for SimTransport {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        for peer in 0..self.world {
            if peer != self.rank {
                self.post(peer, Packet::Gather(data.to_vec()))?;
            }
        }
        let deadline = Instant::now() + self.timeout;
        (0..self.world)
            .map(|peer| {
                if peer == self.rank {
                    return Ok(data.to_vec());
                }
                match self.take(peer, deadline)? {
                    Packet::Gather(bytes) => Ok(bytes),
                    Packet::Message(_) => {
                        Err(self.protocol(peer, "a message arrived during an all-gather"))
                    }
                }
            })
            .collect()
    }

    fn group(&mut self, ops: &mut [P2pOp<'_>]) -> Result<(), TransportError> {
        for op in ops.iter() {
            if let P2pOp::Send { peer, data } = op {
                self.check_peer(*peer)?;
                self.post(*peer, Packet::Message(data.to_vec()))?;
                self.bytes_sent += data.len() as u64;
            }
        }
        let deadline = Instant::now() + self.timeout;
        for op in ops.iter_mut() {
            if let P2pOp::Recv { peer, buf } = op {
                let peer = *peer;
                self.check_peer(peer)?;
                match self.take(peer, deadline)? {
                    Packet::Message(bytes) if bytes.len() == buf.len() => {
                        buf.copy_from_slice(&bytes)
                    }
                    Packet::Message(bytes) => {
                        return Err(self.protocol(
                            peer,
                            format!(
                                "expected a {}-byte message, got {} bytes",
                                buf.len(),
                                bytes.len()
                            ),
                        ))
                    }
                    Packet::Gather(_) => {
                        return Err(self.protocol(peer, "an all-gather arrived during a receive"))
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receive_with_no_sender_times_out() {
        let mut mesh = SimTransport::mesh(2, Duration::from_millis(50));
        let mut buf = [0u8; 4];
        let err = mesh[0]
            .group(&mut [P2pOp::Recv {
                peer: 1,
                buf: &mut buf,
            }])
            .unwrap_err();
        assert!(matches!(
            err,
            TransportError::Timeout {
                rank: 0,
                peer: 1,
                ..
            }
        ));
    }

    #[test]
    fn all_gather_returns_contributions_by_rank() {
        let handles: Vec<_> = SimTransport::mesh(3, Duration::from_secs(5))
            .into_iter()
            .map(|mut t| std::thread::spawn(move || t.all_gather(&[t.rank() as u8]).unwrap()))
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![vec![0], vec![1], vec![2]]);
        }
    }
}
