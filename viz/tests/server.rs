//! The viewer's server over real sockets on 127.0.0.1: the bundled page, the data blob and
//! the replay overlay, and its limits against hostile clients (Host check, whole-request deadline, request size
//! cap, idle connections giving up their slots). Sharing slots among many slow clients is
//! specified in `server_fairness.rs`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};
use streamalloc_viz::limits::Budget;
use streamalloc_viz::{model, server};

fn get(addr: std::net::SocketAddr, path: &str) -> (String, Vec<u8>) {
    request(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n"),
    )
}

/// Sends `text` as is; returns the response's head and body.
fn request(addr: std::net::SocketAddr, text: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(text.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {raw:?}"));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    (head, raw[split + 4..].to_vec())
}

#[test]
fn serves_page_files_and_data() {
    let snap = model::from_engine(&common::engine::engine_snapshot());
    let events = snap.devices[0].trace.len();
    let viewer = Arc::new(server::Viewer::new(vec![("engine.json".into(), snap)]));
    let listener = server::bind(0).unwrap();
    let addr = listener.local_addr().unwrap();
    assert!(addr.ip().is_loopback());
    std::thread::spawn(move || server::serve(listener, viewer));

    let (head, body) = get(addr, "/");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let page = String::from_utf8(body).unwrap();
    assert!(page.contains("<canvas id=\"timeline\""));
    // No network: nothing is loaded from another host.
    assert!(!page.contains("http://") && !page.contains("https://"));
    let (_, js) = get(addr, "/app.js");
    let js = String::from_utf8(js).unwrap();
    assert!(!js.contains("http://") && !js.contains("https://"));

    let (head, body) = get(addr, "/api/files");
    assert!(head.contains("application/json"));
    let files: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(files[0]["devices"][0]["events"], events);

    let (_, blob) = get(addr, "/api/data?f=0&d=0");
    let len = u32::from_le_bytes(blob[..4].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&blob[4..4 + len]).unwrap();
    assert_eq!(header["events"], events);
    let base = (4 + len).next_multiple_of(8);
    // Every column lies inside the blob, 8-byte aligned.
    let width = |t: &str| match t {
        "f64" => 8,
        "i32" => 4,
        "u32" => 4,
        "u16" => 2,
        _ => 1,
    };
    for (name, col) in header["columns"].as_object().unwrap() {
        let off = col["offset"].as_u64().unwrap() as usize;
        let n = col["len"].as_u64().unwrap() as usize;
        assert_eq!(off % 8, 0, "{name}");
        assert!(
            base + off + n * width(col["type"].as_str().unwrap()) <= blob.len(),
            "{name}"
        );
    }
    let ev_size = &header["columns"]["ev_size"];
    assert_eq!(ev_size["len"], events);
    let first = base + ev_size["offset"].as_u64().unwrap() as usize;
    let size0 = f64::from_le_bytes(blob[first..first + 8].try_into().unwrap());
    assert!(size0 > 0.0);

    let (head, _) = get(addr, "/api/data?f=7&d=0");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let (head, _) = get(addr, "/../../etc/passwd");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
}

/// An overlay of `points` replayed values, for the viewer's replay route.
fn overlay(points: usize) -> streamalloc_viz::overlay::ReplayOverlay {
    use streamalloc_viz::overlay::{CapOutcome, Recorded, ReplayOverlay, SeriesBuilder};
    let mut series = SeriesBuilder::new(points as u64, 0);
    for i in 0..points as u64 {
        series.push(i << 20);
    }
    ReplayOverlay::new(
        Recorded {
            by: "PyTorch".into(),
            peak_reserved: 1 << 30,
            peak_live: 1 << 29,
            segment_events: true,
        },
        series,
        CapOutcome::NotSearched,
        "reuse_policy:stream_wait".into(),
    )
}

/// `view --replay`: the overlay's drawing and its data are served beside the timeline's,
/// the data only for the file and device it was set for; its JSON is charged to the file's
/// budget, and a budget that cannot afford it is an error naming the file and the stage.
#[test]
fn the_replay_overlay_is_served_for_its_device_within_the_files_budget() {
    let snap = model::from_engine(&common::engine::engine_snapshot());
    let devices = snap.devices.len();
    let mut viewer = server::Viewer::new(vec![("engine.json".into(), snap.clone())]);
    let shown = overlay(1000);
    viewer.set_replay(0, 0, &shown).unwrap();
    let viewer = Arc::new(viewer);
    let listener = server::bind(0).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || server::serve(listener, viewer));

    let (head, js) = get(addr, "/replay.js");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/javascript"), "{head}");
    assert!(String::from_utf8(js).unwrap().contains("/api/replay"));
    let (head, body) = get(addr, "/api/replay?f=0&d=0");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let served: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(served, serde_json::to_value(&shown).unwrap());
    for other in ["/api/replay?f=0&d=7", "/api/replay?f=1&d=0", "/api/replay"] {
        let (head, _) = get(addr, other);
        assert!(head.starts_with("HTTP/1.1 404"), "{other}: {head}");
    }
    assert_eq!(devices, 1, "the engine snapshot has one device");

    let mut poor = snap;
    poor.budget = Budget::new(4 << 10);
    let mut viewer = server::Viewer::new(vec![("poor.json".into(), poor)]);
    let err = viewer.set_replay(0, 0, &shown).unwrap_err().to_string();
    assert!(
        err.starts_with("poor.json: the replay overlay would build more than"),
        "{err}"
    );
}

/// A viewer of the engine snapshot on a free port, within `limits`.
fn start(limits: server::Limits) -> std::net::SocketAddr {
    let snap = model::from_engine(&common::engine::engine_snapshot());
    let viewer = Arc::new(server::Viewer::new(vec![("engine.json".into(), snap)]));
    let listener = server::bind(0).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || server::serve_with(listener, viewer, limits));
    addr
}

#[test]
fn only_the_loopback_host_and_port_it_listens_on_are_answered() {
    let addr = start(server::Limits::default());
    let port = addr.port();
    let with_host = |host: &str| {
        let (head, _) = request(addr, &format!("GET /api/files HTTP/1.1\r\n{host}\r\n"));
        head
    };
    for ok in [
        format!("Host: 127.0.0.1:{port}\r\n"),
        format!("Host: localhost:{port}\r\n"),
        format!("host:   LOCALHOST:{port}  \r\n"),
    ] {
        assert!(with_host(&ok).starts_with("HTTP/1.1 200"), "{ok}");
    }
    for bad in [
        "Host: evil.example.com\r\n".to_string(),
        format!("Host: evil.example.com:{port}\r\n"),
        format!("Host: 127.0.0.1:{}\r\n", port.wrapping_add(1)),
        "Host: 127.0.0.1\r\n".to_string(),
        String::new(),
        format!("Host: 127.0.0.1:{port}\r\nHost: evil.example.com\r\n"),
    ] {
        let head = with_host(&bad);
        assert!(head.starts_with("HTTP/1.1 403"), "{bad:?}: {head}");
    }
}

#[test]
fn requests_over_the_size_cap_get_431() {
    let addr = start(server::Limits::default());
    let big = "a".repeat(20 << 10);
    let (head, _) = request(
        addr,
        &format!("GET / HTTP/1.1\r\nHost: {addr}\r\nX-Pad: {big}\r\n\r\n"),
    );
    assert!(head.starts_with("HTTP/1.1 431"), "{head}");
    let (head, _) = request(
        addr,
        &format!("GET /{big} HTTP/1.1\r\nHost: {addr}\r\n\r\n"),
    );
    assert!(head.starts_with("HTTP/1.1 431"), "{head}");
}

#[test]
fn a_trickling_client_is_cut_off_at_the_whole_request_deadline() {
    let limits = server::Limits {
        request_deadline: Duration::from_millis(800),
        ..server::Limits::default()
    };
    let addr = start(limits);
    let mut s = TcpStream::connect(addr).unwrap();
    let started = Instant::now();
    // One byte every 200 ms: each read is quick, the whole request never arrives.
    let mut closed = false;
    for b in "GET / HTTP/1.1\r\nHost: x".bytes() {
        if s.write_all(&[b]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        if started.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    let _ = closed;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(
        rest.is_empty(),
        "no answer to a request that never completed"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cut off at the deadline, not kept alive by trickling"
    );
}

/// HEAD gets the head GET would get, its Content-Length included, and no body.
#[test]
fn head_answers_with_the_length_of_the_body_it_leaves_out() {
    let addr = start(server::Limits::default());
    let (_, body) = get(addr, "/api/data?f=0&d=0");
    let (head, rest) = request(
        addr,
        &format!("HEAD /api/data?f=0&d=0 HTTP/1.1\r\nHost: {addr}\r\n\r\n"),
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.contains(&format!("\r\nContent-Length: {}\r\n", body.len())),
        "{head}"
    );
    assert!(rest.is_empty());
}

/// A connection that sends nothing holds no slot against a client with a request: with
/// both slots taken by idle connections, a third is served, in one of their slots.
#[test]
fn an_idle_connection_gives_its_slot_to_a_newcomer() {
    let limits = server::Limits {
        max_connections: 2,
        ..server::Limits::default()
    };
    let addr = start(limits);
    let mut idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Let the server accept both, and their grace pass, before the third arrives.
    std::thread::sleep(limits.arrival_grace + Duration::from_millis(200));
    let started = Instant::now();
    let (head, _) = get(addr, "/api/files");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(started.elapsed() < Duration::from_secs(2), "served at once");
    // The oldest idle connection was closed for it.
    idle[0]
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut rest = Vec::new();
    assert_eq!(
        idle[0].read_to_end(&mut rest).map(|_| rest.len()).ok(),
        Some(0)
    );
}

#[test]
fn a_head_that_is_not_text_gets_400() {
    let addr = start(server::Limits::default());
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(format!("GET / HTTP/1.1\r\nHost: {addr}\r\n").as_bytes())
        .unwrap();
    s.write_all(b"X-Bytes: \xff\xfe\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let head = String::from_utf8_lossy(&raw);
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
}

/// The parser the server runs on the bytes received so far: the answer depends only on the
/// head (request line and headers up to the empty line), whatever follows it.
#[test]
fn a_request_is_parsed_from_its_head_alone() {
    use server::{parse_request, Refusal, Request};
    let cap = 256;
    let get = b"GET /api/files HTTP/1.1\r\nHost: localhost:8765\r\n\r\n";
    let request = Request {
        head_only: false,
        path: "/api/files".into(),
    };
    assert_eq!(parse_request(get, 8765, cap), Ok(request.clone()));
    let mut with_body = get.to_vec();
    with_body.extend_from_slice(&[0xff; 1000]);
    assert_eq!(parse_request(&with_body, 8765, cap), Ok(request));
    assert_eq!(
        parse_request(&get[..get.len() - 2], 8765, cap),
        Err(Refusal::Incomplete)
    );
    assert_eq!(parse_request(get, 8766, cap), Err(Refusal::ForbiddenHost));
    assert_eq!(
        parse_request(b"HEAD / HTTP/1.1\nHost: [::1]:8765\n\n", 8765, cap),
        Ok(Request {
            head_only: true,
            path: "/".into()
        })
    );
    assert_eq!(
        parse_request(
            b"DELETE / HTTP/1.1\r\nHost: 127.0.0.1:8765\r\n\r\n",
            8765,
            cap
        ),
        Err(Refusal::MethodNotAllowed)
    );
    let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(cap));
    assert_eq!(
        parse_request(long.as_bytes(), 8765, cap),
        Err(Refusal::TooLarge)
    );
}

/// Every answer carries the headers that keep file text from ever running as script: a
/// strict Content-Security-Policy (no inline code, nothing from elsewhere, no framing),
/// nosniff and no framing for old browsers.
#[test]
fn every_answer_forbids_scripts_from_elsewhere_sniffing_and_framing() {
    let addr = start(server::Limits::default());
    let (forbidden, _) = request(addr, "GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n");
    for head in [
        get(addr, "/").0,
        get(addr, "/app.js").0,
        get(addr, "/api/files").0,
        get(addr, "/api/data?f=0&d=0").0,
        get(addr, "/nothing").0,
        forbidden,
    ] {
        let csp = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Security-Policy: "))
            .unwrap_or_else(|| panic!("no CSP in {head}"));
        for directive in [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(csp.contains(directive), "{directive} missing from {csp}");
        }
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert!(
            head.contains("\r\nX-Content-Type-Options: nosniff"),
            "{head}"
        );
        assert!(head.contains("\r\nX-Frame-Options: DENY"), "{head}");
    }
}

/// The page puts text from files (file names, stream names, call sites) into the document
/// only as text: no HTML is built from strings, and no inline script or style exists for
/// the CSP to have to allow.
#[test]
fn the_page_never_parses_file_text_as_html() {
    let js = [
        include_str!("../assets/app.js"),
        include_str!("../assets/prepare.js"),
    ]
    .concat();
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
    ] {
        assert!(!js.contains(sink), "app.js uses {sink}");
    }
    let html = include_str!("../assets/index.html");
    let handler = html
        .split_whitespace()
        .any(|w| w.starts_with("on") && w.contains('='));
    assert!(
        !html.contains("style=") && !handler,
        "inline code in index.html"
    );
    assert!(!html.contains("<script>"), "inline script in index.html");
}
