//! Fuzz target: bytes → a hostile C caller of the C ABI on simulated devices (see
//! `streamalloc::ffi::testing`): null, foreign and double frees, absurd sizes, bad
//! devices, bogus streams, pool calls out of order, junk checkpoints, stats and snapshot
//! calls, and panics planted in the simulated driver. A crash is a panic that escaped or
//! was caught where none was planted, a broken engine invariant, a stale or missing last
//! error, or a call the model of live pointers contradicts.
//!
//! `cargo fuzz run c_abi` (needs cargo-fuzz and a nightly toolchain). Stable CI replays
//! `fuzz/corpus/c_abi/` through `tests/fuzz_corpus_c_abi.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// libFuzzer's panic hook aborts at any panic, caught or not. Planted panics must unwind
/// to the registry, which catches them: they pass silently, every other panic still aborts.
fn let_planted_panics_unwind() {
    let abort = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planted = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|message| message.starts_with("injected panic in"));
        if !planted {
            abort(info);
        }
    }));
}

fuzz_target!(init: let_planted_panics_unwind(), |data: &[u8]| {
    if let Err(violation) = streamalloc::ffi::testing::run_bytes(data) {
        panic!("{violation}");
    }
});
