//! The viewer's HTTP server: serves the page compiled into the binary and the snapshots'
//! data, on 127.0.0.1 only.
//!
//! The page needs no network and no CDN: its HTML, JavaScript and CSS are `include_str!`ed
//! from `viz/assets/`. A small HTTP/1.1 server on `std::net` (a thread per connection,
//! `Connection: close`) is all a local viewer needs; only `GET`/`HEAD` are answered.
//!
//! Hostile clients are expected: a web page the user visits can make the browser send
//! requests here, and with DNS rebinding read the answers, so only requests whose `Host`
//! is the loopback name or address and the port the server listens on are answered (else
//! 403; [`parse_request`]). Each connection is held to its own limits: its request must
//! arrive whole within [`Limits::request_deadline`] (not per read, so a client trickling a
//! byte at a time is cut off) and within [`Limits::max_request_bytes`] (else 431), and its
//! answer must be read whole within [`Limits::response_deadline`]. Slots are shared fairly
//! ([`slots`]): at most [`Limits::max_connections`] connections at once, and a newcomer
//! takes the slot of a connection whose request is still arriving or whose reader has
//! stalled, rather than being turned away; it waits for a slot when none can be taken, and
//! gets 503 only when every slot stays in good use for [`Limits::admission_wait`].
//!
//! Routes: `/` (the page), `/app.js`, `/prepare.js`, `/style.css`, `/api/files` (JSON list
//! of the loaded files and their devices), `/api/data?f=F&d=D` (the [`crate::wire`] blob of
//! file `F`, device `D`, built once, within the file's memory budget, and cached), and for
//! `view --replay` `/replay.js` (the overlay's drawing) and `/api/replay?f=F&d=D` (the
//! [`crate::overlay`] of file `F`, device `D`, as JSON, charged to the file's budget; 404
//! without one).

mod http;
mod slots;

pub use http::{parse_request, Refusal, Request, SECURITY_HEADERS};

use crate::error::VizError;
use crate::limits::Budget;
use crate::model::Snapshot;
use crate::overlay::ReplayOverlay;
use serde_json::json;
use slots::{Conn, Slots, WaitingRoom};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const INDEX_HTML: &str = include_str!("../../assets/index.html");
const APP_JS: &str = include_str!("../../assets/app.js");
const PREPARE_JS: &str = include_str!("../../assets/prepare.js");
const STYLE_CSS: &str = include_str!("../../assets/style.css");
const REPLAY_JS: &str = include_str!("../../assets/replay.js");

/// An encoded response body, shared between requests.
type Blob = Arc<Vec<u8>>;

/// What the budget calls writing a replay overlay for the page.
const REPLAY_STAGE: &str = "the replay overlay";

/// The snapshots being shown.
#[derive(Debug)]
pub struct Viewer {
    /// `(display name, snapshot)`, in command-line order.
    files: Vec<(String, Snapshot)>,
    /// Encoded blobs by `(file, device position)`.
    cache: Mutex<HashMap<(usize, usize), Blob>>,
    /// What each file may still build: its snapshot's budget, charged with the blobs
    /// and replay overlays built from it.
    budgets: Mutex<Vec<Budget>>,
    /// Replay overlays as JSON, by `(file, device position)`.
    replays: HashMap<(usize, usize), Blob>,
}

impl Viewer {
    /// A viewer of `files` (`(display name, snapshot)`).
    pub fn new(files: Vec<(String, Snapshot)>) -> Self {
        let budgets = files.iter().map(|(_, s)| s.budget.clone()).collect();
        Viewer {
            files,
            cache: Mutex::new(HashMap::new()),
            budgets: Mutex::new(budgets),
            replays: HashMap::new(),
        }
    }

    /// Shows `overlay` over device position `device` of file `file`, its JSON charged to
    /// the file's budget: an error naming the file if the budget cannot afford it.
    pub fn set_replay(
        &mut self,
        file: usize,
        device: usize,
        overlay: &ReplayOverlay,
    ) -> Result<(), VizError> {
        let Some((name, _)) = self.files.get(file) else {
            return Ok(());
        };
        let over = |what: String| VizError::Limit {
            path: name.into(),
            what,
        };
        let budget = &mut self.budgets.get_mut().unwrap_or_else(|e| e.into_inner())[file];
        // Charged at an upper bound before it is written, then what was not used goes back.
        let bound = overlay.json_bytes_bound();
        budget
            .charge_for(REPLAY_STAGE, bound as u64)
            .map_err(|o| over(o.to_string()))?;
        let mut json = Vec::with_capacity(bound);
        if let Err(err) = serde_json::to_writer(&mut json, overlay) {
            budget.release(bound as u64);
            return Err(over(format!("the replay overlay cannot be written: {err}")));
        }
        json.shrink_to_fit();
        budget.release(bound.saturating_sub(json.len()) as u64);
        self.replays.insert((file, device), Arc::new(json));
        Ok(())
    }

    fn files_json(&self) -> String {
        let list: Vec<_> = self
            .files
            .iter()
            .enumerate()
            .map(|(i, (name, s))| {
                json!({
                    "id": i, "name": name, "source": s.source,
                    "devices": s.devices.iter().map(|d| json!({
                        "device": d.device, "events": d.trace.len(),
                        "segments": d.segments.len()})).collect::<Vec<_>>(),
                })
            })
            .collect();
        serde_json::Value::Array(list).to_string()
    }

    /// The blob of file `f`, device position `d`: `None` if there is no such device, an
    /// error naming the file if the file's budget cannot afford it.
    fn data(&self, f: usize, d: usize) -> Option<Result<Blob, VizError>> {
        let (name, snap) = self.files.get(f)?;
        let device = snap.devices.get(d)?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(blob) = cache.get(&(f, d)) {
            return Some(Ok(blob.clone()));
        }
        let mut budgets = self.budgets.lock().unwrap_or_else(|e| e.into_inner());
        let blob = crate::wire::encode_device_within(snap, device, &mut budgets[f]);
        Some(match blob {
            Ok(blob) => {
                let blob = Arc::new(blob);
                cache.insert((f, d), blob.clone());
                Ok(blob)
            }
            Err(over) => Err(VizError::Limit {
                path: name.into(),
                what: over.to_string(),
            }),
        })
    }

    /// Encodes every device of every file now, so the first page load does not wait; the
    /// first file whose data its budget cannot afford is an error.
    pub fn warm(&self) -> Result<(), VizError> {
        for (f, (_, s)) in self.files.iter().enumerate() {
            for d in 0..s.devices.len() {
                if let Some(Err(err)) = self.data(f, d) {
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// The response to `GET path`: status, content type, body.
    fn route(&self, path: &str) -> (u16, &'static str, Blob) {
        let text = |s: &str| Arc::new(s.as_bytes().to_vec());
        let (route, query) = path.split_once('?').unwrap_or((path, ""));
        match route {
            "/" | "/index.html" => (200, "text/html; charset=utf-8", text(INDEX_HTML)),
            "/app.js" => (200, "text/javascript; charset=utf-8", text(APP_JS)),
            "/prepare.js" => (200, "text/javascript; charset=utf-8", text(PREPARE_JS)),
            "/style.css" => (200, "text/css; charset=utf-8", text(STYLE_CSS)),
            "/replay.js" => (200, "text/javascript; charset=utf-8", text(REPLAY_JS)),
            "/api/replay" => match file_and_device(query).and_then(|k| self.replays.get(&k)) {
                Some(json) => (200, "application/json", json.clone()),
                None => (
                    404,
                    "text/plain",
                    text("no replay for this file and device\n"),
                ),
            },
            "/api/files" => (200, "application/json", text(&self.files_json())),
            "/api/data" => match file_and_device(query).and_then(|(f, d)| self.data(f, d)) {
                Some(Ok(blob)) => (200, "application/octet-stream", blob),
                Some(Err(err)) => (500, "text/plain", text(&format!("{err}\n"))),
                None => (404, "text/plain", text("no such file or device\n")),
            },
            _ => (404, "text/plain", text("not found\n")),
        }
    }
}

/// The `f` and `d` of a query (`f=0&d=1`).
fn file_and_device(query: &str) -> Option<(usize, usize)> {
    let (mut f, mut d) = (None, None);
    for kv in query.split('&') {
        match kv.split_once('=') {
            Some(("f", v)) => f = v.parse().ok(),
            Some(("d", v)) => d = v.parse().ok(),
            _ => {}
        }
    }
    f.zip(d)
}

/// Binds `127.0.0.1:port` (0: any free port).
pub fn bind(port: u16) -> std::io::Result<TcpListener> {
    TcpListener::bind(("127.0.0.1", port))
}

/// The server's bounds on its clients.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections handled at once; past it a newcomer takes the slot of one that does not
    /// use it, or waits for one (as many newcomers as slots wait), or gets 503.
    pub max_connections: usize,
    /// How long a newcomer waits for a slot before it gets 503.
    pub admission_wait: Duration,
    /// Time from accepting a connection to having read its whole request.
    pub request_deadline: Duration,
    /// Bytes of request line and headers.
    pub max_request_bytes: usize,
    /// Time from the request to the last byte of the answer sent.
    pub response_deadline: Duration,
    /// A connection whose request is still arriving this long after it came gives its slot
    /// to a newcomer when all are taken.
    pub arrival_grace: Duration,
    /// An answer whose reader has taken none of it for this long gives its slot to a
    /// newcomer when all are taken. Well above TCP's own pauses: a reader that takes its
    /// answer steadily but slowly lets the window close, and the writer may then wait for
    /// a window probe (200 ms and more) before it moves again.
    pub stall: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 32,
            admission_wait: Duration::from_secs(2),
            request_deadline: Duration::from_secs(10),
            max_request_bytes: 16 << 10,
            response_deadline: Duration::from_secs(60),
            arrival_grace: Duration::from_millis(250),
            stall: Duration::from_secs(1),
        }
    }
}

/// Serves `viewer` on `listener` until the process ends, with the default [`Limits`].
pub fn serve(listener: TcpListener, viewer: Arc<Viewer>) -> std::io::Result<()> {
    serve_with(listener, viewer, Limits::default())
}

/// Serves `viewer` on `listener` until the process ends, within `limits`.
pub fn serve_with(
    listener: TcpListener,
    viewer: Arc<Viewer>,
    limits: Limits,
) -> std::io::Result<()> {
    let port = listener.local_addr()?.port();
    let slots = Arc::new(Slots::new(
        limits.max_connections,
        limits.arrival_grace,
        limits.stall,
    ));
    let closer = slots::closer();
    let start = {
        let (slots, closer) = (slots.clone(), closer.clone());
        move |stream: TcpStream, conn: Arc<Conn>| {
            let (viewer, slots, closer) = (viewer.clone(), slots.clone(), closer.clone());
            std::thread::spawn(move || {
                if let Err(err) = handle(stream, &conn, &viewer, port, &limits, &closer) {
                    tracing::debug!(%err, "connection ended");
                }
                slots.release(&conn);
            });
        }
    };
    let refuse = {
        let closer = closer.clone();
        move |mut stream: TcpStream| {
            // A short answer fits the socket buffer: the caller does not wait on it.
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let head = http::response_head(503, "text/plain", 21);
            let _ = stream.write_all(format!("{head}too many connections\n").as_bytes());
            slots::linger(&closer, stream);
        }
    };
    let waiting = WaitingRoom::open(
        slots.clone(),
        limits.max_connections.max(1),
        limits.admission_wait,
        start.clone(),
        refuse.clone(),
    );
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(%err, "accept failed");
                continue;
            }
        };
        if waiting.is_empty() {
            if let Some(conn) = slots.admit(&stream) {
                start(stream, conn);
                continue;
            }
        }
        if let Err(stream) = waiting.enter(stream) {
            refuse(stream);
        }
    }
    Ok(())
}

/// Reads from a socket until a fixed instant: each read waits only for the time left, so
/// the deadline holds for the whole request however the client paces its bytes.
struct Deadline<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Deadline<'_> {
    /// Waits for the time left, then looks at the waiting bytes without taking them.
    fn peek(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.wait_at_most()?;
        self.stream.peek(buf)
    }

    fn wait_at_most(&self) -> std::io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.wait_at_most()?;
        (&mut &*self.stream).read(buf)
    }
}

fn handle(
    mut stream: TcpStream,
    conn: &Conn,
    viewer: &Viewer,
    port: u16,
    limits: &Limits,
    closer: &slots::Closer,
) -> std::io::Result<()> {
    let mut reader = Deadline {
        stream: &stream,
        until: Instant::now() + limits.request_deadline,
    };
    let mut received = Vec::with_capacity(1 << 10);
    let mut chunk = [0u8; 4 << 10];
    let parsed = loop {
        match parse_request(&received, port, limits.max_request_bytes) {
            Err(Refusal::Incomplete) => {}
            parsed => break parsed,
        }
        // One byte past the cap tells a request at the cap from one over it.
        let room = (limits.max_request_bytes + 1)
            .saturating_sub(received.len())
            .min(chunk.len());
        // Looked at before it is taken: a request whose head is now whole is marked so while
        // its end is still in the socket, where the slots look ([`slots`]), so that a
        // request waiting on this thread never looks like one still arriving.
        let n = match reader.peek(&mut chunk[..room]) {
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        if n == 0 {
            // The client closed early, or sent an incomplete request: nothing to answer.
            return Ok(());
        }
        let with_waiting = [&received[..], &chunk[..n]].concat();
        if !matches!(
            parse_request(&with_waiting, port, limits.max_request_bytes),
            Err(Refusal::Incomplete)
        ) {
            conn.writing();
        }
        let n = match reader.read(&mut chunk[..n]) {
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        if n == 0 {
            return Ok(());
        }
        received.extend_from_slice(&chunk[..n]);
    };
    conn.writing();
    let until = Instant::now() + limits.response_deadline;
    match parsed {
        Ok(request) => {
            let (status, ctype, body) = viewer.route(&request.path);
            // HEAD: the head GET would get, Content-Length included, without the body.
            let head = http::response_head(status, ctype, body.len());
            let body: &[u8] = if request.head_only { &[] } else { &body };
            send(&mut stream, conn, until, &[head.as_bytes(), body])
        }
        Err(refusal) => {
            let Some((status, body)) = refusal.answer() else {
                return Ok(());
            };
            let head = http::response_head(status, "text/plain", body.len());
            send(&mut stream, conn, until, &[head.as_bytes(), body])?;
            if refusal == Refusal::TooLarge {
                // Unread request bytes would reset the connection before the answer is read.
                slots::linger(closer, stream);
            }
            Ok(())
        }
    }
}

/// How much of an answer is written at a time: progress is noted between pieces.
const WRITE_PIECE: usize = 64 << 10;

/// Writes `parts` by the instant `until`, noting progress on `conn` after each piece; a
/// reader that has not taken it all by then is cut off.
fn send(
    stream: &mut TcpStream,
    conn: &Conn,
    until: Instant,
    parts: &[&[u8]],
) -> std::io::Result<()> {
    for part in parts {
        for piece in part.chunks(WRITE_PIECE) {
            let mut piece = piece;
            while !piece.is_empty() {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                stream.set_write_timeout(Some(left))?;
                match stream.write(piece) {
                    Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                    Ok(n) => {
                        piece = &piece[n..];
                        conn.progress();
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    stream.flush()
}
