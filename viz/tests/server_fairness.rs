//! The viewer's connection slots are shared fairly: clients that hold a connection without
//! using it (a request trickling in, an answer nobody reads) give their slot to a client
//! with a request, an answer is cut off at its deadline, and only clients that all keep up
//! fill the server.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use streamalloc_viz::model::{DeviceSnapshot, Event, Snapshot, TraceAction};
use streamalloc_viz::server;

/// A snapshot of `n` events whose viewer blob is about 40 bytes an event.
fn big_snapshot(n: u64) -> Snapshot {
    let mut trace = Vec::new();
    for i in 0..n / 3 {
        let addr = 0x1000_0000 + (i % 512) * 0x10_0000;
        let ev = |action, t| Event {
            action,
            addr,
            size: 0x10_0000,
            stream: i % 4,
            time_ns: 3 * i + t,
            stack: None,
            device_free: None,
        };
        trace.push(ev(TraceAction::Alloc, 0));
        trace.push(ev(TraceAction::FreeRequested, 1));
        trace.push(ev(TraceAction::FreeCompleted, 2));
    }
    let mut snap = Snapshot::new("streamalloc");
    snap.devices.push(DeviceSnapshot {
        device: 0,
        time_ns: None,
        trace_dropped: 0,
        segments: Vec::new(),
        trace,
    });
    snap
}

/// A viewer of a 12 MB blob on a free port, within `limits`.
fn start(limits: server::Limits) -> SocketAddr {
    let viewer = Arc::new(server::Viewer::new(vec![(
        "big.json".into(),
        big_snapshot(300_000),
    )]));
    viewer.warm().unwrap();
    let listener = server::bind(0).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || server::serve_with(listener, viewer, limits));
    addr
}

/// GETs `path`; the status line and the body, or why not, within `timeout`.
fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(String, usize), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no head in {} bytes", raw.len()))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.lines().next().unwrap_or("").to_string();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX);
    let body = raw.len() - split - 4;
    if body != length {
        return Err(format!("{status}: {body} of {length} body bytes"));
    }
    Ok((status, body))
}

/// A request for the blob whose answer is never read: the connection waits on its reader.
fn unread_blob_request(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(format!("GET /api/data?f=0&d=0 HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .unwrap();
    s
}

/// Whether the server has closed `s` (its read side ends, after whatever it had sent).
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut sink = vec![0u8; 1 << 20];
    let until = Instant::now() + limit;
    while Instant::now() < until {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
    false
}

#[test]
fn an_answer_nobody_reads_is_cut_off_at_the_response_deadline() {
    let addr = start(server::Limits {
        response_deadline: Duration::from_millis(800),
        ..server::Limits::default()
    });
    let mut s = unread_blob_request(addr);
    // Not read for two seconds: the answer overflows the socket buffers and stalls, and
    // the deadline passes.
    std::thread::sleep(Duration::from_secs(2));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    let whole = read.is_ok() && {
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0);
        let head = String::from_utf8_lossy(&raw[..split]);
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        raw.len() - split - 4 == length
    };
    assert!(
        !whole,
        "the answer was cut off, not delivered late ({} bytes)",
        raw.len()
    );
}

#[test]
fn a_stalled_reader_gives_its_slot_to_a_newcomer() {
    let addr = start(server::Limits {
        max_connections: 2,
        ..server::Limits::default()
    });
    let mut stalled: Vec<TcpStream> = (0..2).map(|_| unread_blob_request(addr)).collect();
    std::thread::sleep(Duration::from_millis(800));
    let (status, _) = get(addr, "/api/files", Duration::from_secs(5)).unwrap();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert!(
        stalled
            .iter_mut()
            .any(|s| closed_within(s, Duration::from_secs(3))),
        "one of the stalled answers was cut off for it"
    );
}

/// Reads the answer on `s` steadily, 64 KiB every `pause`, until `done` or its end; the
/// bytes read.
fn read_steadily(
    mut s: TcpStream,
    pause: Duration,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        let mut total = 0;
        while !done.load(Ordering::Relaxed) {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
            std::thread::sleep(pause);
        }
        total
    })
}

/// When every slot serves a reader that keeps up, a newcomer waits and is then refused
/// rather than taking a slot from a client in good use.
#[test]
fn readers_that_keep_up_keep_their_slots() {
    let addr = start(server::Limits {
        max_connections: 1,
        admission_wait: Duration::from_millis(200),
        ..server::Limits::default()
    });
    let done = Arc::new(AtomicBool::new(false));
    // 1.3 MB/s: the answer is still being sent (beyond the socket buffers) at the end.
    let pause = Duration::from_millis(50);
    let steady = read_steadily(unread_blob_request(addr), pause, done.clone());
    std::thread::sleep(Duration::from_millis(400));
    let (status, _) = get(addr, "/api/files", Duration::from_secs(5)).unwrap();
    assert!(status.starts_with("HTTP/1.1 503"), "{status}");
    done.store(true, Ordering::Relaxed);
    assert!(steady.join().unwrap() > 0);
}

/// A newcomer that finds every slot in good use waits for one, and is served when the
/// client in it is done, which keeps its whole answer.
#[test]
fn a_newcomer_waits_for_a_slot_to_come_free() {
    let addr = start(server::Limits {
        max_connections: 1,
        admission_wait: Duration::from_secs(30),
        ..server::Limits::default()
    });
    let (_, whole) = get(addr, "/api/data?f=0&d=0", Duration::from_secs(5)).unwrap();
    let pause = Duration::from_millis(10);
    let steady = read_steadily(
        unread_blob_request(addr),
        pause,
        Arc::new(AtomicBool::new(false)),
    );
    std::thread::sleep(Duration::from_millis(400));
    let (status, _) = get(addr, "/api/files", Duration::from_secs(30)).unwrap();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let read = steady.join().unwrap();
    assert!(
        read > whole,
        "the reader in the slot got its whole answer ({read} bytes)"
    );
}

/// 32 clients trickling requests and 32 requesting the blob without reading it, each
/// reconnecting as soon as it is cut off: every legitimate request is still served, whole,
/// promptly.
#[test]
fn legitimate_requests_are_served_while_64_slow_clients_are_connected() {
    let addr = start(server::Limits::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    for k in 0..64 {
        let stop = stop.clone();
        attackers.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect(addr) else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                if k % 2 == 0 {
                    // A request trickling in, a byte every 200 ms.
                    for b in format!("GET / HTTP/1.1\r\nHost: {addr}\r\n").bytes() {
                        if stop.load(Ordering::Relaxed) || s.write_all(&[b]).is_err() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                } else {
                    // The blob, never read, the connection held for a second, then again.
                    let request = format!("GET /api/data?f=0&d=0 HTTP/1.1\r\nHost: {addr}\r\n\r\n");
                    if s.write_all(request.as_bytes()).is_ok() {
                        for _ in 0..10 {
                            if stop.load(Ordering::Relaxed) {
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            }
        }));
    }
    // Let the attackers fill every slot.
    std::thread::sleep(Duration::from_secs(2));
    let mut served = 0;
    for i in 0..20 {
        let path = if i % 2 == 0 {
            "/api/files"
        } else {
            "/api/data?f=0&d=0"
        };
        let started = Instant::now();
        match get(addr, path, Duration::from_secs(5)) {
            Ok((status, _)) if status.starts_with("HTTP/1.1 200") => {
                assert!(
                    started.elapsed() < Duration::from_secs(3),
                    "request {i} took {:?}",
                    started.elapsed()
                );
                served += 1;
            }
            other => eprintln!("request {i}: {other:?}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        a.join().unwrap();
    }
    assert_eq!(served, 20, "legitimate requests served");
}
