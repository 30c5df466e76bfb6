//! Replays the `http` fuzz target's corpus (`fuzz/corpus/http/`) through the check the
//! target runs (`fuzz/checks/http.rs`): every request head the viewer could receive is
//! answered or refused as its size cap and `Host` rule say, and the answer does not change
//! when more bytes arrive. (The `pickle` corpus is replayed by `pickle_decoder.rs`.)

use std::path::Path;

#[path = "../../fuzz/checks/corpus.rs"]
mod corpus;
#[path = "../../fuzz/checks/http.rs"]
mod http;

#[test]
fn every_http_corpus_input_is_answered_or_refused_within_the_cap() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/http");
    corpus::replay(&dir, http::http);
}
