//! Replays the `config` fuzz target's corpus (`fuzz/corpus/config/`) through the check
//! the target runs (`fuzz/checks/config.rs`): every configuration string parses or is
//! refused, writes back as text that parses to it, and byte counts never overflow.

use std::path::Path;

#[path = "../../fuzz/checks/config.rs"]
mod config;
#[path = "../../fuzz/checks/corpus.rs"]
mod corpus;

#[test]
fn every_config_corpus_input_parses_or_is_refused_and_round_trips() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/config");
    corpus::replay(&dir, config::config);
}
