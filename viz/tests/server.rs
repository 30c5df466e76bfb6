//! The viewer's server over real sockets on 127.0.0.1: the bundled page and the data blob.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use streamalloc_viz::{model, server};

fn get(addr: std::net::SocketAddr, path: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
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
