//! The viewer's connection slots, shared fairly.
//!
//! Each connection is one request (`Connection: close`) handled by a thread of its own, at
//! most [`Limits::max_connections`](super::Limits) at once. A slot must not be kept by a
//! client that does nothing with it: when a connection arrives and every slot is taken, the
//! slot of the connection furthest from done is taken back for it — a request still
//! arriving (oldest first; a real client sends its request at once), else an answer whose
//! reader has not taken any of it for [`Limits::stall`](super::Limits) (stalled longest
//! first). Only when every slot serves a client that keeps up is the newcomer refused
//! (503). Taking a slot back shuts the connection's socket down, which ends its thread's
//! blocked read or write at once.

use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A connection in a slot.
#[derive(Debug)]
pub(super) struct Conn {
    /// A handle on the socket, to shut it down when the slot is taken back.
    socket: TcpStream,
    accepted: Instant,
    /// [`READING`] until the request has arrived, then [`WRITING`].
    phase: AtomicU8,
    /// When the answer last made progress, in milliseconds since `accepted`.
    progress_ms: AtomicU64,
}

const READING: u8 = 0;
const WRITING: u8 = 1;

impl Conn {
    /// The request has arrived: the answer starts.
    pub(super) fn writing(&self) {
        self.progress();
        self.phase.store(WRITING, Ordering::Release);
    }

    /// The client took some of the answer.
    pub(super) fn progress(&self) {
        let ms = self.accepted.elapsed().as_millis() as u64;
        self.progress_ms.store(ms, Ordering::Release);
    }

    /// How long the answer has waited for its reader.
    fn stalled_for(&self, now: Instant) -> Duration {
        let since = now.saturating_duration_since(self.accepted);
        since.saturating_sub(Duration::from_millis(
            self.progress_ms.load(Ordering::Acquire),
        ))
    }
}

/// The slots, and the connections in them.
#[derive(Debug)]
pub(super) struct Slots {
    conns: Mutex<Vec<Arc<Conn>>>,
    max: usize,
    stall: Duration,
}

impl Slots {
    pub(super) fn new(max: usize, stall: Duration) -> Self {
        Slots {
            conns: Mutex::new(Vec::new()),
            max: max.max(1),
            stall,
        }
    }

    /// A slot for `stream`, taking one back from a connection that does not use it if
    /// all are taken; `None` when every slot is in good use.
    pub(super) fn admit(&self, stream: &TcpStream) -> Option<Arc<Conn>> {
        let socket = stream.try_clone().ok()?;
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.len() >= self.max {
            let now = Instant::now();
            let reading = conns
                .iter()
                .enumerate()
                .filter(|(_, c)| c.phase.load(Ordering::Acquire) == READING)
                .min_by_key(|(_, c)| c.accepted)
                .map(|(i, _)| i);
            let stalled = || {
                conns
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.phase.load(Ordering::Acquire) == WRITING)
                    .map(|(i, c)| (i, c.stalled_for(now)))
                    .filter(|&(_, stalled)| stalled >= self.stall)
                    .max_by_key(|&(_, stalled)| stalled)
                    .map(|(i, _)| i)
            };
            let victim = reading.or_else(stalled)?;
            let taken = conns.swap_remove(victim);
            tracing::debug!("a slot taken back for a new connection");
            let _ = taken.socket.shutdown(std::net::Shutdown::Both);
        }
        let conn = Arc::new(Conn {
            socket,
            accepted: Instant::now(),
            phase: AtomicU8::new(READING),
            progress_ms: AtomicU64::new(0),
        });
        conns.push(conn.clone());
        Some(conn)
    }

    /// `conn`'s connection has ended: its slot is free (if it was not taken back).
    pub(super) fn release(&self, conn: &Arc<Conn>) {
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = conns.iter().position(|c| Arc::ptr_eq(c, conn)) {
            conns.swap_remove(i);
        }
    }
}

/// Where refused connections wait to be closed (see [`linger`]).
pub(super) type Closer = std::sync::mpsc::SyncSender<(TcpStream, Instant)>;

/// At most this many refused connections linger at once; past it they are closed at once.
const MAX_LINGERING: usize = 256;

/// Starts the one thread that closes refused connections gracefully.
pub(super) fn closer() -> Closer {
    let (tx, rx) = std::sync::mpsc::sync_channel::<(TcpStream, Instant)>(MAX_LINGERING);
    std::thread::spawn(move || {
        let mut held: Vec<(TcpStream, Instant)> = Vec::new();
        let mut sink = [0u8; 4096];
        loop {
            let wait = if held.is_empty() {
                Duration::from_secs(3600)
            } else {
                Duration::from_millis(20)
            };
            match rx.recv_timeout(wait) {
                Ok(entry) if held.len() < MAX_LINGERING => held.push(entry),
                Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            }
            let now = Instant::now();
            // Keep a socket while its client may still be sending and has not hung up.
            held.retain_mut(|(s, until)| {
                now < *until
                    && loop {
                        match (&*s).read(&mut sink) {
                            Ok(0) => break false,
                            Ok(_) => continue,
                            Err(e) => break e.kind() == std::io::ErrorKind::WouldBlock,
                        }
                    }
            });
        }
    });
    tx
}

/// Closes `stream` after its answer: the write side now, the socket once the client has
/// stopped sending (at most a second later). Closing with unread request bytes would reset
/// the connection and could discard the answer before the client reads it.
pub(super) fn linger(closer: &Closer, stream: TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    if stream.set_nonblocking(true).is_ok() {
        let _ = closer.try_send((stream, Instant::now() + Duration::from_secs(1)));
    }
}
