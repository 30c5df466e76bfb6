//! The viewer's HTTP server: serves the page compiled into the binary and the snapshots'
//! data, on 127.0.0.1 only.
//!
//! The page needs no network and no CDN: its HTML, JavaScript and CSS are `include_str!`ed
//! from `viz/assets/`. A small HTTP/1.1 server on `std::net` (one thread per connection,
//! `Connection: close`) is all a local viewer needs; only `GET`/`HEAD` are answered.
//!
//! Routes: `/` (the page), `/app.js`, `/style.css`, `/api/files` (JSON list of the loaded
//! files and their devices), `/api/data?f=F&d=D` (the [`crate::wire`] blob of file `F`,
//! device `D`, built once and cached).

use crate::model::Snapshot;
use serde_json::json;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

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

/// Serves `viewer` on `listener` until the process ends.
pub fn serve(listener: TcpListener, viewer: Arc<Viewer>) -> std::io::Result<()> {
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(%err, "accept failed");
                continue;
            }
        };
        let viewer = viewer.clone();
        std::thread::spawn(move || {
            if let Err(err) = handle(stream, &viewer) {
                tracing::debug!(%err, "connection ended");
            }
        });
    }
    Ok(())
}

fn handle(stream: TcpStream, viewer: &Viewer) -> std::io::Result<()> {
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    // Requests are a line and a few headers: read at most 64 KiB of them.
    let mut reader = BufReader::new(stream.try_clone()?.take(64 << 10));
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Skip the headers (bounded).
    let mut line = String::new();
    for _ in 0..100 {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    let (status, ctype, body) = match method {
        "GET" | "HEAD" => viewer.route(path),
        _ => (
            405,
            "text/plain",
            Arc::new(b"method not allowed\n".to_vec()),
        ),
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        _ => "Method Not Allowed",
    };
    let mut out = std::io::BufWriter::new(stream);
    write!(
        out,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    if method != "HEAD" {
        out.write_all(&body)?;
    }
    out.flush()
}
