//! The viewer's HTTP server: serves the page compiled into the binary and the snapshots'
//! data, on 127.0.0.1 only.
//!
//! The page needs no network and no CDN: its HTML, JavaScript and CSS are `include_str!`ed
//! from `viz/assets/`. A small HTTP/1.1 server on `std::net` (a thread per connection, at
//! most [`Limits::max_connections`] at once, `Connection: close`) is all a local viewer
//! needs; only `GET`/`HEAD` are answered.
//!
//! Hostile clients are expected: a web page the user visits can make the browser send
//! requests here, and with DNS rebinding read the answers, so only requests whose `Host`
//! is the loopback name or address and the port the server listens on are answered (else
//! 403). A request must arrive whole within [`Limits::request_deadline`] (not per read, so
//! a client trickling a byte at a time is cut off) and within [`Limits::max_request_bytes`]
//! (else 431); connections past the cap get 503 at once. The head is parsed by
//! [`parse_request`], a function of the bytes received so far rather than of the socket,
//! so the fuzz target `http` feeds it hostile heads directly.
//!
//! Routes: `/` (the page), `/app.js`, `/style.css`, `/api/files` (JSON list of the loaded
//! files and their devices), `/api/data?f=F&d=D` (the [`crate::wire`] blob of file `F`,
//! device `D`, built once and cached).

use crate::model::Snapshot;
use serde_json::json;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const INDEX_HTML: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const STYLE_CSS: &str = include_str!("../assets/style.css");

/// An encoded response body, shared between requests.
type Blob = Arc<Vec<u8>>;

/// The snapshots being shown.
#[derive(Debug)]
pub struct Viewer {
    /// `(display name, snapshot)`, in command-line order.
    files: Vec<(String, Snapshot)>,
    /// Encoded blobs by `(file, device position)`.
    cache: Mutex<HashMap<(usize, usize), Blob>>,
}

impl Viewer {
    /// A viewer of `files` (`(display name, snapshot)`).
    pub fn new(files: Vec<(String, Snapshot)>) -> Self {
        Viewer {
            files,
            cache: Mutex::new(HashMap::new()),
        }
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

    fn data(&self, f: usize, d: usize) -> Option<Blob> {
        let (_, snap) = self.files.get(f)?;
        let device = snap.devices.get(d)?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        Some(
            cache
                .entry((f, d))
                .or_insert_with(|| Arc::new(crate::wire::encode_device(snap, device)))
                .clone(),
        )
    }

    /// Encodes every device of every file now, so the first page load does not wait.
    pub fn warm(&self) {
        for (f, (_, s)) in self.files.iter().enumerate() {
            for d in 0..s.devices.len() {
                let _ = self.data(f, d);
            }
        }
    }

    /// The response to `GET path`: status, content type, body.
    fn route(&self, path: &str) -> (u16, &'static str, Blob) {
        let text = |s: &str| Arc::new(s.as_bytes().to_vec());
        let (route, query) = path.split_once('?').unwrap_or((path, ""));
        match route {
            "/" | "/index.html" => (200, "text/html; charset=utf-8", text(INDEX_HTML)),
            "/app.js" => (200, "text/javascript; charset=utf-8", text(APP_JS)),
            "/style.css" => (200, "text/css; charset=utf-8", text(STYLE_CSS)),
            "/api/files" => (200, "application/json", text(&self.files_json())),
            "/api/data" => {
                let mut f = None;
                let mut d = None;
                for kv in query.split('&') {
                    match kv.split_once('=') {
                        Some(("f", v)) => f = v.parse().ok(),
                        Some(("d", v)) => d = v.parse().ok(),
                        _ => {}
                    }
                }
                match f.zip(d).and_then(|(f, d)| self.data(f, d)) {
                    Some(blob) => (200, "application/octet-stream", blob),
                    None => (404, "text/plain", text("no such file or device\n")),
                }
            }
            _ => (404, "text/plain", text("not found\n")),
        }
    }
}

/// Binds `127.0.0.1:port` (0: any free port).
pub fn bind(port: u16) -> std::io::Result<TcpListener> {
    TcpListener::bind(("127.0.0.1", port))
}

/// The server's bounds on its clients.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections handled at once; more get 503 and are closed.
    pub max_connections: usize,
    /// Time from accepting a connection to having read its whole request.
    pub request_deadline: Duration,
    /// Bytes of request line and headers.
    pub max_request_bytes: usize,
    /// Time allowed for each write of the response.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 32,
            request_deadline: Duration::from_secs(10),
            max_request_bytes: 16 << 10,
            write_timeout: Duration::from_secs(30),
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
    let active = Arc::new(AtomicUsize::new(0));
    let closer = closer();
    for stream in listener.incoming() {
        let mut stream = match stream {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(%err, "accept failed");
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= limits.max_connections {
            active.fetch_sub(1, Ordering::AcqRel);
            // A short answer fits the socket buffer: the accept loop does not wait on it.
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = respond(
                &mut stream,
                false,
                503,
                "text/plain",
                b"too many connections\n",
            );
            linger(&closer, stream);
            continue;
        }
        let viewer = viewer.clone();
        let active = active.clone();
        let closer = closer.clone();
        std::thread::spawn(move || {
            if let Err(err) = handle(stream, &viewer, port, &limits, &closer) {
                tracing::debug!(%err, "connection ended");
            }
            active.fetch_sub(1, Ordering::AcqRel);
        });
    }
    Ok(())
}

/// Where refused connections wait to be closed (see [`linger`]).
type Closer = std::sync::mpsc::SyncSender<(TcpStream, Instant)>;

/// At most this many refused connections linger at once; past it they are closed at once.
const MAX_LINGERING: usize = 256;

/// Starts the one thread that closes refused connections gracefully.
fn closer() -> Closer {
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
fn linger(closer: &Closer, stream: TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    if stream.set_nonblocking(true).is_ok() {
        let _ = closer.try_send((stream, Instant::now() + Duration::from_secs(1)));
    }
}

/// Reads from a socket until a fixed instant: each read waits only for the time left, so
/// the deadline holds for the whole request however the client paces its bytes.
struct Deadline<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

/// Whether `host` (a `Host` header's value) names this server: `127.0.0.1`, `localhost`
/// or `[::1]`, with the port it listens on.
fn host_allowed(host: &str, port: u16) -> bool {
    let host = host.trim();
    // Browsers leave out the default port.
    let (name, p) = match host.rsplit_once(':') {
        Some((name, p)) if !name.ends_with(':') => (name, p.parse::<u16>().ok()),
        _ => (host, Some(80)),
    };
    p == Some(port)
        && (name == "127.0.0.1" || name == "[::1]" || name.eq_ignore_ascii_case("localhost"))
}

/// A request the viewer answers: `GET` or `HEAD` of `path`, from an allowed `Host`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// `HEAD`: answer with the head only.
    pub head_only: bool,
    /// The request target as sent (`/api/data?f=0&d=0`).
    pub path: String,
}

/// Why a request gets no page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The head (request line and headers) has not ended yet and is within the cap: the
    /// server reads on, and answers nothing if the client stops here.
    Incomplete,
    /// The head is longer than the cap: 431.
    TooLarge,
    /// The head is not UTF-8 text: 400.
    Malformed,
    /// No `Host`, two of them, or one that does not name this server: 403.
    ForbiddenHost,
    /// Neither `GET` nor `HEAD`: 405.
    MethodNotAllowed,
}

impl Refusal {
    /// The status and body to answer with; `None` for [`Refusal::Incomplete`].
    pub fn answer(self) -> Option<(u16, &'static [u8])> {
        Some(match self {
            Refusal::Incomplete => return None,
            Refusal::TooLarge => (431, b"request too large\n"),
            Refusal::Malformed => (400, b"malformed request\n"),
            Refusal::ForbiddenHost => (403, b"forbidden host\n"),
            Refusal::MethodNotAllowed => (405, b"method not allowed\n"),
        })
    }
}

/// Parses what a client has sent so far to the server listening on `port`: the request
/// line and the headers up to the empty line that ends them (anything after it is
/// ignored), which must fit in `max_bytes`. Once the answer is not
/// [`Refusal::Incomplete`], more bytes do not change it.
pub fn parse_request(received: &[u8], port: u16, max_bytes: usize) -> Result<Request, Refusal> {
    let end = match head_end(received) {
        Some(end) if end <= max_bytes => end,
        Some(_) => return Err(Refusal::TooLarge),
        None if received.len() > max_bytes => return Err(Refusal::TooLarge),
        None => return Err(Refusal::Incomplete),
    };
    let head = std::str::from_utf8(&received[..end]).map_err(|_| Refusal::Malformed)?;
    let mut lines = head.split('\n');
    let request_line = lines.next().unwrap_or("");
    let mut host = None;
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            if name.trim().eq_ignore_ascii_case("host") {
                // Two Host headers are a request smuggling trick: refuse them.
                host = if host.is_none() {
                    Some(value.trim())
                } else {
                    Some("")
                };
            }
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    if !host.is_some_and(|h| host_allowed(h, port)) {
        return Err(Refusal::ForbiddenHost);
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Err(Refusal::MethodNotAllowed),
    };
    Ok(Request {
        head_only,
        path: path.to_string(),
    })
}

/// Where a request's head ends: just past the first empty line (`\r\n` or `\n`) after the
/// request line, if one has arrived.
fn head_end(bytes: &[u8]) -> Option<usize> {
    let mut start = bytes.iter().position(|&b| b == b'\n')? + 1;
    loop {
        let newline = start + bytes[start..].iter().position(|&b| b == b'\n')?;
        if matches!(&bytes[start..newline], b"" | b"\r") {
            return Some(newline + 1);
        }
        start = newline + 1;
    }
}

fn handle(
    mut stream: TcpStream,
    viewer: &Viewer,
    port: u16,
    limits: &Limits,
    closer: &Closer,
) -> std::io::Result<()> {
    stream.set_write_timeout(Some(limits.write_timeout))?;
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
        let n = match reader.read(&mut chunk[..room]) {
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        if n == 0 {
            // The client closed early, or sent an incomplete request: nothing to answer.
            return Ok(());
        }
        received.extend_from_slice(&chunk[..n]);
    };
    match parsed {
        Ok(request) => {
            let (status, ctype, body) = viewer.route(&request.path);
            respond(&mut stream, request.head_only, status, ctype, &body)
        }
        Err(refusal) => {
            let Some((status, body)) = refusal.answer() else {
                return Ok(());
            };
            respond(&mut stream, false, status, "text/plain", body)?;
            if refusal == Refusal::TooLarge {
                // Unread request bytes would reset the connection before the answer is read.
                linger(closer, stream);
            }
            Ok(())
        }
    }
}

/// Sent with every response. The page shows text from files anyone may have written, so
/// even if some of it ever reached the page as markup it could not run: scripts, styles
/// and requests only from this server, no inline code, no plugins; no other site may frame
/// the page (clickjacking) and no browser may guess a content type (a JSON or binary
/// answer sniffed as HTML).
pub const SECURITY_HEADERS: &str = "Content-Security-Policy: default-src 'none'; \
     script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; \
     base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n\
     X-Content-Type-Options: nosniff\r\nX-Frame-Options: DENY\r\n\
     Referrer-Policy: no-referrer\r\n";

fn respond(
    stream: &mut TcpStream,
    head_only: bool,
    status: u16,
    ctype: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let mut out = std::io::BufWriter::new(stream);
    write!(
        out,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n{SECURITY_HEADERS}\r\n",
        body.len()
    )?;
    if !head_only {
        out.write_all(body)?;
    }
    out.flush()
}
