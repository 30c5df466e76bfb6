//! What the fuzz target `json_budget` checks for one input: the JSON readers (our snapshot
//! reader `streamalloc_viz::model::parse_json` and the trace reader of `streamalloc
//! replay`) hold what they build to the input's memory budget. The budget is set small
//! ([`BUDGET`], through `STREAMALLOC_MAX_BUILT`) and the heap is counted by [`Counting`],
//! which the target and the test replaying its corpus (`tests/fuzz_corpus_budget.rs`)
//! install as their global allocator: whatever the input, the heap may grow by at most
//! the budget plus what reading the input itself needs (its keys and strings, at most
//! twice its length) while it is read, and a reader over budget answers an error.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The budget every read gets, as `STREAMALLOC_MAX_BUILT` spells it.
pub const BUDGET: &str = "256K";
const BUDGET_BYTES: usize = 256 << 10;
/// Heap a read may use besides its budget and its input's strings: the readers' small
/// fixed state.
const SLACK: usize = 64 << 10;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes it holds and their peak.
pub struct Counting;

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator with the caller's arguments;
// the counters are only bookkeeping beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is (see the impl).
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

/// The heap's growth while `read` runs.
fn peak_of(read: impl FnOnce()) -> usize {
    let before = CURRENT.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    read();
    PEAK.load(Ordering::Relaxed).saturating_sub(before)
}

/// `data` through both JSON readers, each held to the budget.
pub fn json_budget(data: &[u8]) {
    assert_eq!(
        std::env::var(streamalloc_viz::limits::BUDGET_ENV).as_deref(),
        Ok(BUDGET),
        "the caller sets the budget"
    );
    let path = Path::new("fuzz.json");
    let allowed = BUDGET_BYTES + 2 * data.len() + SLACK;
    let peak = peak_of(|| {
        let _ = streamalloc_viz::model::parse_json(path, data);
    });
    assert!(
        peak <= allowed,
        "the snapshot reader took {peak} bytes, {allowed} allowed"
    );
    let peak = peak_of(|| {
        let _ = streamalloc::replay::traces_from_bytes(path, data.to_vec());
    });
    // The trace reader keeps a copy of the input beside what it reads from it.
    assert!(
        peak <= allowed + data.len(),
        "the trace reader took {peak} bytes, {} allowed",
        allowed + data.len()
    );
}
