//! Replays the `json_budget` fuzz target's corpus (`fuzz/corpus/json_budget/`, and the
//! `json` target's, which suits it too) through the check the target runs
//! (`fuzz/checks/budget.rs`): with a small memory budget and the heap counted, the JSON
//! readers never hold more than the budget allows. One test, alone in this binary, so that
//! the heap it counts is its own.

use std::path::Path;

#[path = "../fuzz/checks/budget.rs"]
mod budget;
#[path = "../fuzz/checks/corpus.rs"]
mod corpus;

#[global_allocator]
static HEAP: budget::Counting = budget::Counting;

#[test]
fn the_json_readers_stay_within_their_budget_on_every_corpus_input() {
    std::env::set_var(streamalloc_viz::limits::BUDGET_ENV, budget::BUDGET);
    let corpora = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    corpus::replay(&corpora.join("json_budget"), budget::json_budget);
    corpus::replay(&corpora.join("json"), budget::json_budget);
}
