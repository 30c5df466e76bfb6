//! The viewer's HTTP: parsing a request head, and what every answer's head carries.
//!
//! The parser is a function of the bytes received so far rather than of the socket, so
//! the fuzz target `http` feeds it hostile heads directly.

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

/// The head of an answer of `status` with a body of `len` bytes of `ctype`.
pub(super) fn response_head(status: u16, ctype: &str, len: usize) -> String {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n{SECURITY_HEADERS}\r\n"
    )
}
