//! The viewer's connection slots, shared fairly.
//!
//! Each connection is one request (`Connection: close`) handled by a thread of its own, at
//! most [`Limits::max_connections`](super::Limits) at once. A slot must not be kept by a
//! client that does nothing with it: when a connection arrives and every slot is taken, the
//! slot of a connection that does not use it is taken back for it — a request still
//! arriving [`Limits::arrival_grace`](super::Limits) after the connection (oldest first; a
//! real client sends its request at once, but may be a moment late on a busy machine),
//! else an answer whose reader has not taken any of it for [`Limits::stall`](super::Limits)
//! (stalled longest first). A request counts as arriving only while
//! the socket does not yet hold its whole head: one that has arrived but waits for its
//! thread to read it (a busy machine schedules threads late too) is in good use. Taking a slot back shuts the
//! connection's socket down, which ends its thread's blocked read or write at once.
//!
//! A newcomer that finds no slot to take waits for one in the [`WaitingRoom`], first come
//! first served, for at most [`Limits::admission_wait`](super::Limits): a slot may be freed
//! or its answer stall at any moment, and a client that arrives just after every slot was
//! filled deserves the next one rather than a refusal. Only when every slot serves a client
//! that keeps up for that whole wait is the newcomer refused (503).

use std::collections::VecDeque;
use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
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
    grace: Duration,
    stall: Duration,
}

impl Slots {
    /// `max` slots; a request may take `grace` to arrive, an answer stall for `stall`,
    /// before its slot may be taken back.
    pub(super) fn new(max: usize, grace: Duration, stall: Duration) -> Self {
        Slots {
            conns: Mutex::new(Vec::new()),
            max: max.max(1),
            grace,
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
                .filter(|(_, c)| now.saturating_duration_since(c.accepted) >= self.grace)
                .filter(|(_, c)| !head_is_waiting(&c.socket))
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

/// Newcomers waiting for a slot, served in the order they came.
pub(super) struct WaitingRoom {
    arrivals: std::sync::mpsc::SyncSender<(TcpStream, Instant)>,
    waiting: Arc<AtomicUsize>,
}

/// How often the waiting room looks for a slot: answers stall with time, not on an event.
const WAITING_POLL: Duration = Duration::from_millis(10);

impl WaitingRoom {
    /// Starts the thread that admits waiting newcomers into `slots` as slots come free,
    /// `start`ing each admitted one and `refuse`ing one that waited `wait` in vain. At most
    /// `capacity` wait at once.
    pub(super) fn open(
        slots: Arc<Slots>,
        capacity: usize,
        wait: Duration,
        mut start: impl FnMut(TcpStream, Arc<Conn>) + Send + 'static,
        mut refuse: impl FnMut(TcpStream) + Send + 'static,
    ) -> WaitingRoom {
        let (arrivals, rx) = std::sync::mpsc::sync_channel::<(TcpStream, Instant)>(capacity);
        let waiting = Arc::new(AtomicUsize::new(0));
        let count = waiting.clone();
        std::thread::spawn(move || {
            let mut queue: VecDeque<(TcpStream, Instant)> = VecDeque::new();
            loop {
                let timeout = if queue.is_empty() {
                    Duration::from_secs(3600)
                } else {
                    WAITING_POLL
                };
                match rx.recv_timeout(timeout) {
                    Ok(arrival) => queue.push_back(arrival),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
                queue.extend(rx.try_iter());
                // First come, first admitted: when the first finds no slot, none would.
                while let Some((stream, _)) = queue.front() {
                    let Some(conn) = slots.admit(stream) else {
                        break;
                    };
                    let (stream, _) = queue.pop_front().expect("looked at above");
                    count.fetch_sub(1, Ordering::AcqRel);
                    start(stream, conn);
                }
                let now = Instant::now();
                while queue
                    .front()
                    .is_some_and(|(_, since)| now.saturating_duration_since(*since) >= wait)
                {
                    let (stream, _) = queue.pop_front().expect("looked at above");
                    count.fetch_sub(1, Ordering::AcqRel);
                    refuse(stream);
                }
            }
        });
        WaitingRoom { arrivals, waiting }
    }

    /// Whether nobody is waiting: a newcomer may then take a slot at once without passing
    /// anyone.
    pub(super) fn is_empty(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// `stream` waits for a slot; it is handed back when the room is full.
    pub(super) fn enter(&self, stream: TcpStream) -> Result<(), TcpStream> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        match self.arrivals.try_send((stream, Instant::now())) {
            Ok(()) => Ok(()),
            Err(
                std::sync::mpsc::TrySendError::Full((stream, _))
                | std::sync::mpsc::TrySendError::Disconnected((stream, _)),
            ) => {
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                Err(stream)
            }
        }
    }
}

/// Whether `socket` holds a whole request head not yet read: looked at without taking it
/// and without waiting. A head longer than the look is not whole (the reader refuses it).
fn head_is_waiting(socket: &TcpStream) -> bool {
    let mut look = [0u8; 16 << 10];
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    match rustix::net::recv(socket, &mut look[..], flags) {
        Ok((n, _)) => look[..n].windows(4).any(|w| w == b"\r\n\r\n"),
        Err(_) => false,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    /// A connected pair on loopback: the server's side, and the client's.
    fn connection(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (server, client)
    }

    /// One slot, taken by a connection whose client has sent `sent`, judged with `grace`:
    /// whether a newcomer gets it (and then the first client sees its connection end).
    fn newcomer_admitted_after(sent: &[u8], grace: Duration) -> bool {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let slots = Slots::new(1, grace, Duration::from_secs(3600));
        let (first, mut first_client) = connection(&listener);
        let (second, _second_client) = connection(&listener);
        assert!(slots.admit(&first).is_some());
        first_client.write_all(sent).unwrap();
        // Loopback delivers within the writer's call: the bytes are in the server's socket.
        let admitted = slots.admit(&second).is_some();
        if admitted {
            first_client
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut sink = [0u8; 16];
            assert_eq!(first_client.read(&mut sink).unwrap(), 0, "taken back");
        }
        admitted
    }

    #[test]
    fn a_request_still_arriving_gives_its_slot() {
        assert!(newcomer_admitted_after(b"", Duration::ZERO));
        let part = b"GET / HTTP/1.1\r\nHost: x\r\n";
        assert!(newcomer_admitted_after(part, Duration::ZERO));
    }

    #[test]
    fn a_request_within_its_grace_keeps_its_slot() {
        assert!(!newcomer_admitted_after(b"", Duration::from_secs(3600)));
    }

    #[test]
    fn a_request_waiting_for_its_thread_keeps_its_slot() {
        let whole = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert!(!newcomer_admitted_after(whole, Duration::ZERO));
    }
}
