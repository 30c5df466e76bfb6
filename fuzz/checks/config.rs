//! What the fuzz target `config` checks for one input: the configuration parser
//! (`Config::parse`, `Config::parse_over`, `parse_bytes`) on any text. The target and the
//! test that replays its corpus on stable Rust (`allocator/tests/fuzz_corpus.rs`) include
//! this file, so both run exactly the same checks.
//!
//! Any input must give a configuration or an error: a panic (an arithmetic overflow or a
//! failed check below included) is a crash.

use streamalloc_allocator::config::{format_bytes, parse_bytes};
use streamalloc_allocator::{Config, ReusePolicy, TraceClock};

/// `data` (as text, invalid UTF-8 replaced) as a configuration string and as a byte count.
pub fn config(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    byte_count(&text);
    let other_base = Config {
        reuse_policy: ReusePolicy::Pytorch,
        memory_limit: Some(1 << 30),
        memory_fraction: Some(0.5),
        max_split_size: Some(64 << 20),
        trace_capacity: 0,
        trace_clock: TraceClock::Precise,
        event_batch: 1,
        expandable_segments: false,
        reclaim: false,
        stitch: false,
        page_allocations: true,
        graph_pools: false,
    };
    for base in [Config::default(), other_base] {
        match Config::parse_over(base, &text) {
            // What a parsed configuration writes back parses to it.
            Ok(config) => {
                let written = config.to_conf_string();
                assert_eq!(
                    Config::parse(&written).as_ref(),
                    Ok(&config),
                    "{text:?} written back as {written:?}"
                );
            }
            Err(err) => assert!(!err.to_string().is_empty()),
        }
    }
}

/// `parse_bytes` gives exactly the number written times its unit, or `None` past `u64`.
fn byte_count(text: &str) {
    let parsed = parse_bytes(text);
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, suffix) = trimmed.split_at(split);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => Some(0),
        "k" | "kb" | "kib" => Some(10),
        "m" | "mb" | "mib" => Some(20),
        "g" | "gb" | "gib" => Some(30),
        "t" | "tb" | "tib" => Some(40),
        _ => None,
    };
    // Digits past u64 (even with leading zeros) make the u128 too: both are refused.
    let expected = shift
        .zip(digits.parse::<u128>().ok())
        .and_then(|(shift, number)| {
            u64::try_from(number << shift)
                .ok()
                .filter(|_| number <= u64::MAX as u128)
        });
    assert_eq!(parsed, expected, "{text:?}");
    if let Some(bytes) = parsed {
        assert!(!format_bytes(bytes).is_empty());
    }
}
