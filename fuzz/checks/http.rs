//! What the fuzz target `http` checks for one input: the viewer's request parser
//! (`streamalloc_viz::server::parse_request`) on the bytes a client sent. The target and
//! the test that replays its corpus on stable Rust (`viz/tests/fuzz_corpus.rs`) include
//! this file, so both run exactly the same checks.
//!
//! Any input must give a request or a refusal: a panic (a failed check below included), a
//! timeout or running out of memory is a crash.

use streamalloc_viz::server::{parse_request, Limits, Refusal};

/// The port the parsed requests are addressed to (`Host: 127.0.0.1:8765`).
pub const PORT: u16 = 8765;

/// `data` as what a client sent, under a small, a medium and the default size cap.
pub fn http(data: &[u8]) {
    for cap in [64, 1024, Limits::default().max_request_bytes] {
        let whole = parse_request(data, PORT, cap);
        match &whole {
            Err(Refusal::Incomplete) => assert!(data.len() <= cap, "waits past the cap"),
            Err(Refusal::TooLarge) => assert!(data.len() > cap, "431 within the cap"),
            Err(refusal) => {
                let (status, _) = refusal.answer().expect("a refusal gets an answer");
                assert!(matches!(status, 400 | 403 | 405), "{refusal:?}: {status}");
            }
            Ok(request) => {
                assert!(!request.path.is_empty());
                assert!(!request.path.contains(char::is_whitespace));
            }
        }
        // The server stops reading at the first answer: more bytes must not change it.
        for split in [data.len() / 2, data.len().saturating_sub(1)] {
            let early = parse_request(&data[..split], PORT, cap);
            if early != Err(Refusal::Incomplete) {
                assert_eq!(early, whole, "answer after {split} of {} bytes", data.len());
            }
        }
    }
}
