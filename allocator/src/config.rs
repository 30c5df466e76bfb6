//! The allocator's configuration, parsed once from `STREAMALLOC_CONF`.
//!
//! The string has PyTorch's `PYTORCH_CUDA_ALLOC_CONF` shape: `key:value` pairs separated by
//! commas, e.g. `reuse_policy:pytorch,memory_limit:8GiB`. This module is the only code that
//! reads the environment; everything else receives a typed [`Config`]. An unknown key or a
//! bad value is an error naming the key and what it accepts, never silently ignored.
//!
//! | key | values | default |
//! | --- | --- | --- |
//! | `reuse_policy` | `stream_wait` (device-side waits) or `pytorch` (hold blocks until the host sees their events complete) | `stream_wait` |
//! | `memory_limit` | bytes, with an optional `KiB`/`MiB`/`GiB`/`TiB` (or `KB`/`MB`/`GB`) suffix; `0` or `none` for no limit | none |
//! | `memory_fraction` | a fraction of device memory in (0, 1] | none |
//! | `max_split_size` | bytes: larger cached blocks are never split for smaller requests | none |
//! | `trace_capacity` | entries kept in the trace ring; `0` turns tracing off | 65536 |
//! | `trace_clock` | the clock of the trace ring's records on a GPU: `coarse`, the kernel's tick-resolution monotonic clock (1–4 ms; a few ns a read), or `precise`, the time-stamp counter (ns; ~20 ns a read on some virtual machines, two per malloc+free pair) | `coarse` |
//! | `event_batch` | outstanding events that trigger a batched completion query | 64 |
//! | `graph_pools` | `true`: allocations made for a pool (CUDA graph capture, `torch.cuda.MemPool`) come from that pool's own segments; `false`: from the default pool, as before pools existed, so graph replays can overwrite eager tensors (only to demonstrate that failure) | `true` |
//! | `expandable_segments` | `true`: reserve address space per stream and map memory on demand (mappings sized to the live peak, 2–128 MiB), unmapping free mappings when mapping would go past the live peak plus a slack (needs a backend with virtual memory; others fall back to whole segments); `false`: whole segments, PyTorch's rules | `true` (`false` under the LD_PRELOAD interposer) |
//! | `stitch` | with expandable segments, `true`: a request that no free block fits is served from free pages of its pool mapped into one range (no memory added), and such ranges are kept after their free for later requests; `false`: such a request grows memory | `true` |
//! | `reclaim` | with expandable segments, `true`: when mapping would go past the live peak plus a slack, synchronise the device and unmap free mappings first; `false`: never for that, so a malloc never synchronises the device to stay near the peak (memory still goes back through `empty_cache`, under `memory_limit` and before an out-of-memory error) | `true` |

use serde::{Deserialize, Serialize};

/// The environment variable read by [`Config::from_env`].
pub const ENV_VAR: &str = "STREAMALLOC_CONF";

const KNOWN_KEYS: &str = "reuse_policy, memory_limit, memory_fraction, max_split_size, trace_capacity, trace_clock, event_batch, expandable_segments, reclaim, stitch, page_allocations, graph_pools";

/// How a freed block that other streams still use comes back into circulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReusePolicy {
    /// streamalloc's policy: the block returns to its stream's free list at once, carrying
    /// its pending events; the next stream to take it waits on them on the device.
    StreamWait,
    /// PyTorch's policy, kept to measure against: the block is held out of circulation
    /// until the host observes its events complete, and blocks never move between streams.
    Pytorch,
}

/// The clock the trace ring stamps its records with (see [`crate::Backend::set_trace_clock`]).
/// Every malloc and free reads it once while the ring records, so its cost is part of
/// every call; the order of records is exact whatever the clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceClock {
    /// The kernel's coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`): a few nanoseconds a
    /// read, with the resolution of the kernel's tick (1–4 ms). Records within one tick share
    /// their time.
    #[default]
    Coarse,
    /// The time-stamp counter: nanosecond resolution, but a read costs ~20 ns on some virtual
    /// machines (16–20 ns measured on the GPU hosts), paid twice by every malloc+free pair.
    Precise,
}

/// Typed configuration. Build it with [`Config::parse`] / [`Config::from_env`], or start from
/// [`Config::default`] and set fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// See [`ReusePolicy`].
    pub reuse_policy: ReusePolicy,
    /// Reserved bytes the allocator never grows beyond.
    pub memory_limit: Option<u64>,
    /// A limit as a fraction of device memory, resolved when the allocator is created.
    pub memory_fraction: Option<f64>,
    /// Cached blocks larger than this are not split to serve smaller requests.
    pub max_split_size: Option<u64>,
    /// Trace ring capacity in entries (0: tracing off).
    pub trace_capacity: usize,
    /// The trace ring's clock. Records written before the key existed were precise.
    #[serde(default = "default_trace_clock")]
    pub trace_clock: TraceClock,
    /// Outstanding events that trigger a batched completion query.
    pub event_batch: usize,
    /// Serve requests from expandable segments (address reservations with pages mapped on
    /// demand) when the backend supports virtual memory.
    #[serde(default = "default_expandable_segments")]
    pub expandable_segments: bool,
    /// With expandable segments, unmap free mappings (after synchronising the device) when
    /// mapping would take reserved memory past the live peak plus a slack. Off, reserved
    /// memory follows the high-water mark of what was mapped and no malloc synchronises to
    /// stay near the peak: for latency-bound serving, at the price of fragmentation (KV-cache
    /// generation replays at 1.043 of its live peak instead of 1.015–1.036, remapping
    /// nothing; GPT-2 training at 1.108 instead of 1.015).
    #[serde(default = "default_reclaim")]
    pub reclaim: bool,
    /// With expandable segments, serve a request that no free block fits from free pages
    /// scattered over its pool, mapped a second time into one range (stitching), before
    /// growing; keep such ranges after their free for later requests of a fitting size.
    /// Off, such a request grows memory (and reclaims) as without stitching. Stitched
    /// memory cannot be exported through CUDA IPC.
    #[serde(default = "default_stitch")]
    pub stitch: bool,
    /// With expandable segments, make every 2 MiB page its own physical allocation even
    /// without a memory limit (under one, pages always are): any free page can then be
    /// stitched or unmapped alone, for less memory, at the driver's price per allocation
    /// (on an H200 ~55 µs a page to grow, ~37 to stitch). Off, runs are mapped in pieces
    /// of up to 128 MiB and stitches take whole pieces, until the device refuses memory or
    /// a mapping would leave it less than a sixteenth free.
    #[serde(default)]
    pub page_allocations: bool,
    /// Serve allocations made for a pool from that pool's segments. Off, a graph's memory
    /// returns to the default pool and eager allocations can take it while replays still
    /// write it: the switch exists to show that failure, never for use.
    #[serde(default = "default_graph_pools")]
    pub graph_pools: bool,
}

fn default_graph_pools() -> bool {
    true
}

/// `trace_clock` of a snapshot written before the key existed: the time-stamp counter.
fn default_trace_clock() -> TraceClock {
    TraceClock::Precise
}

/// `stitch` of a snapshot written before the key existed: nothing was stitched.
fn default_stitch() -> bool {
    false
}

/// `reclaim` of a snapshot written before the key existed: expandable segments reclaimed.
fn default_reclaim() -> bool {
    true
}

/// `expandable_segments` of a snapshot written before the key existed: whole segments,
/// the only kind there was.
fn default_expandable_segments() -> bool {
    false
}

/// Default of `expandable_segments`: on. On an H200 it takes GPT-2 and ResNet-50 from
/// 1.047 and 1.185 peak reserved / allocated (whole segments, PyTorch's figures) to 1.008
/// and 1.016 at the same step time. Its memory cannot be exported with
/// `cuIpcGetMemHandle`; the PyTorch door shares it through the VMM API instead, and the
/// LD_PRELOAD interposer, whose programs may call `cudaIpcGetMemHandle` themselves, reads
/// the configuration over whole segments (`Registry::config_over`).
const DEFAULT_EXPANDABLE_SEGMENTS: bool = true;

impl Default for Config {
    fn default() -> Self {
        Self {
            reuse_policy: ReusePolicy::StreamWait,
            memory_limit: None,
            memory_fraction: None,
            max_split_size: None,
            trace_capacity: 65_536,
            trace_clock: TraceClock::Coarse,
            event_batch: 64,
            expandable_segments: DEFAULT_EXPANDABLE_SEGMENTS,
            reclaim: true,
            stitch: true,
            page_allocations: false,
            graph_pools: true,
        }
    }
}

impl Config {
    /// Reads `STREAMALLOC_CONF`; unset or empty gives the defaults.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_env_over(Self::default())
    }

    /// Reads `STREAMALLOC_CONF` over `base` (a door's own defaults): keys it sets win, the
    /// rest stay as in `base`. A value that is not UTF-8 is an error, never ignored.
    pub fn from_env_over(base: Self) -> Result<Self, ConfigError> {
        match std::env::var(ENV_VAR) {
            Ok(text) => Self::parse_over(base, &text),
            Err(std::env::VarError::NotPresent) => Ok(base),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError::NotUnicode),
        }
    }

    /// Parses `key:value,key:value`. Whitespace around keys and values is ignored.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        Self::parse_over(Self::default(), text)
    }

    /// Parses `key:value,key:value` over `base`.
    pub fn parse_over(base: Self, text: &str) -> Result<Self, ConfigError> {
        let mut config = base;
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (key, value) = entry
                .split_once(':')
                .ok_or_else(|| ConfigError::Malformed(entry.to_string()))?;
            config.set(key.trim(), value.trim())?;
        }
        Ok(config)
    }

    /// Sets one key from its textual value.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        match key {
            "reuse_policy" => {
                self.reuse_policy = match value {
                    "stream_wait" => ReusePolicy::StreamWait,
                    "pytorch" => ReusePolicy::Pytorch,
                    _ => return Err(bad("reuse_policy", value, "`stream_wait` or `pytorch`")),
                }
            }
            "memory_limit" => {
                // Zero however written (`0`, `0GiB`) is no limit, as `to_conf_string` reads it.
                self.memory_limit = match value {
                    "none" => None,
                    _ => Some(parse_bytes(value).ok_or_else(|| {
                        bad(
                            "memory_limit",
                            value,
                            "a byte count such as 8GiB, 512MiB or 0",
                        )
                    })?)
                    .filter(|limit| *limit > 0),
                }
            }
            "memory_fraction" => {
                let fraction: f64 = value
                    .parse()
                    .ok()
                    .filter(|f: &f64| *f > 0.0 && *f <= 1.0)
                    .ok_or_else(|| bad("memory_fraction", value, "a number in (0, 1]"))?;
                self.memory_fraction = Some(fraction);
            }
            "max_split_size" => {
                self.max_split_size = match value {
                    "none" => None,
                    _ => Some(parse_bytes(value).filter(|b| *b > 0).ok_or_else(|| {
                        bad(
                            "max_split_size",
                            value,
                            "a byte count such as 64MiB, or none",
                        )
                    })?),
                }
            }
            "trace_capacity" => {
                self.trace_capacity = value.parse().map_err(|_| {
                    bad(
                        "trace_capacity",
                        value,
                        "a number of entries (0 turns tracing off)",
                    )
                })?
            }
            "trace_clock" => {
                self.trace_clock = match value {
                    "coarse" => TraceClock::Coarse,
                    "precise" => TraceClock::Precise,
                    _ => return Err(bad("trace_clock", value, "`coarse` or `precise`")),
                }
            }
            "event_batch" => {
                self.event_batch = value
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| bad("event_batch", value, "a positive number of events"))?
            }
            "expandable_segments" => {
                self.expandable_segments = parse_bool("expandable_segments", value)?
            }
            "reclaim" => self.reclaim = parse_bool("reclaim", value)?,
            "stitch" => self.stitch = parse_bool("stitch", value)?,
            "page_allocations" => self.page_allocations = parse_bool("page_allocations", value)?,
            "graph_pools" => self.graph_pools = parse_bool("graph_pools", value)?,
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                    known: KNOWN_KEYS,
                })
            }
        }
        Ok(())
    }

    /// The configuration written back in `STREAMALLOC_CONF` form.
    pub fn to_conf_string(&self) -> String {
        let mut parts = vec![format!(
            "reuse_policy:{}",
            match self.reuse_policy {
                ReusePolicy::StreamWait => "stream_wait",
                ReusePolicy::Pytorch => "pytorch",
            }
        )];
        if let Some(limit) = self.memory_limit {
            parts.push(format!("memory_limit:{limit}"));
        }
        if let Some(fraction) = self.memory_fraction {
            parts.push(format!("memory_fraction:{fraction}"));
        }
        if let Some(split) = self.max_split_size {
            parts.push(format!("max_split_size:{split}"));
        }
        parts.push(format!("trace_capacity:{}", self.trace_capacity));
        if self.trace_clock == TraceClock::Precise {
            parts.push("trace_clock:precise".to_string());
        }
        parts.push(format!("event_batch:{}", self.event_batch));
        parts.push(format!("expandable_segments:{}", self.expandable_segments));
        if !self.reclaim {
            parts.push("reclaim:false".to_string());
        }
        if !self.stitch {
            parts.push("stitch:false".to_string());
        }
        if self.page_allocations {
            parts.push("page_allocations:true".to_string());
        }
        if !self.graph_pools {
            parts.push("graph_pools:false".to_string());
        }
        parts.join(",")
    }
}

/// A switch: `true`/`True`/`1` or `false`/`False`/`0`.
fn parse_bool(key: &'static str, value: &str) -> Result<bool, ConfigError> {
    match value {
        "true" | "True" | "1" => Ok(true),
        "false" | "False" | "0" => Ok(false),
        _ => Err(bad(key, value, "`true` or `false`")),
    }
}

fn bad(key: &'static str, value: &str, expected: &'static str) -> ConfigError {
    ConfigError::BadValue {
        key,
        value: value.to_string(),
        expected,
    }
}

/// Parses `123`, `4KiB`, `8GiB`, `512MB` (decimal suffixes are taken as binary, as
/// PyTorch's `_mb` keys do). Returns `None` on anything else or on overflow.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let number: u64 = digits.parse().ok()?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    number.checked_mul(1u64 << shift)
}

/// Formats a byte count for humans: `1.50 GiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let config = Config::parse(
            "reuse_policy:pytorch, memory_limit:8GiB,memory_fraction:0.5,max_split_size:64MiB,trace_capacity:0,trace_clock:precise,event_batch:8,expandable_segments:true,reclaim:false,page_allocations:true,graph_pools:false",
        )
        .unwrap();
        assert!(config.page_allocations);
        assert_eq!(config.trace_clock, TraceClock::Precise);
        assert_eq!(config.reuse_policy, ReusePolicy::Pytorch);
        assert_eq!(config.memory_limit, Some(8 << 30));
        assert_eq!(config.memory_fraction, Some(0.5));
        assert_eq!(config.max_split_size, Some(64 << 20));
        assert_eq!(config.trace_capacity, 0);
        assert_eq!(config.event_batch, 8);
        assert!(config.expandable_segments);
        assert!(!config.reclaim);
        assert!(!config.graph_pools);
        assert_eq!(Config::parse(&config.to_conf_string()).unwrap(), config);
    }

    #[test]
    fn the_trace_clock_is_coarse_unless_asked_and_names_its_values() {
        assert_eq!(Config::default().trace_clock, TraceClock::Coarse);
        assert_eq!(
            Config::parse("trace_clock:coarse").unwrap().trace_clock,
            TraceClock::Coarse
        );
        let err = Config::parse("trace_clock:tsc").unwrap_err().to_string();
        assert!(err.contains("`tsc`") && err.contains("precise"), "{err}");
    }

    #[test]
    fn empty_string_gives_defaults() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn unknown_key_names_the_key_and_the_known_ones() {
        let err = Config::parse("reuse_polcy:pytorch")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`reuse_polcy`"), "{err}");
        assert!(err.contains("reuse_policy"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key_and_the_accepted_values() {
        let err = Config::parse("reuse_policy:eager").unwrap_err().to_string();
        assert!(
            err.contains("`eager`") && err.contains("stream_wait"),
            "{err}"
        );
        let err = Config::parse("memory_limit:lots").unwrap_err().to_string();
        assert!(err.contains("memory_limit") && err.contains("GiB"), "{err}");
        assert!(Config::parse("memory_fraction:1.5").is_err());
        assert!(Config::parse("event_batch:0").is_err());
        assert!(matches!(
            Config::parse("novalue"),
            Err(ConfigError::Malformed(_))
        ));
    }

    #[test]
    fn a_zero_memory_limit_in_any_spelling_is_no_limit() {
        for zero in ["0", "00", "0GiB", "0 KiB"] {
            let config = Config::parse(&format!("memory_limit:{zero}")).unwrap();
            assert_eq!(config.memory_limit, None, "{zero}");
            assert_eq!(Config::parse(&config.to_conf_string()).unwrap(), config);
        }
    }

    #[test]
    fn byte_suffixes() {
        assert_eq!(parse_bytes("512"), Some(512));
        assert_eq!(parse_bytes("4KiB"), Some(4096));
        assert_eq!(parse_bytes("2mb"), Some(2 << 20));
        assert_eq!(parse_bytes("1T"), Some(1 << 40));
        assert_eq!(parse_bytes("99999999999999TiB"), None);
        assert_eq!(parse_bytes("x"), None);
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
    }
}

/// A configuration string (`STREAMALLOC_CONF`, or a `--conf` flag) that cannot be parsed.
/// It displays as coming from `STREAMALLOC_CONF`; [`ConfigError::describe`] names another
/// source, so a flag's error does not blame the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// A key no version of streamalloc knows.
    UnknownKey {
        /// The key as written.
        key: String,
        /// The accepted keys, comma separated.
        known: &'static str,
    },
    /// A known key with a value it does not accept.
    BadValue {
        /// The key.
        key: &'static str,
        /// The value as written.
        value: String,
        /// What the key accepts.
        expected: &'static str,
    },
    /// An entry that is not `key:value`.
    Malformed(String),
    /// The variable holds bytes that are not UTF-8.
    NotUnicode,
}

/// The most characters of a key, value or entry an error message quotes: the text may be
/// anyone's, and a 100 KB value must not become a 100 KB message.
const QUOTED_CHARS: usize = 64;

/// `text` as quoted in a message: at most [`QUOTED_CHARS`] characters, then `…`.
fn quoted(text: &str) -> String {
    match text.char_indices().nth(QUOTED_CHARS) {
        Some((cut, _)) => format!("{}… ({} bytes)", &text[..cut], text.len()),
        None => text.to_string(),
    }
}

impl ConfigError {
    /// The message with `source` (e.g. `--conf`) named as where the text came from. Keys,
    /// values and entries are quoted shortened.
    pub fn describe(&self, source: &str) -> String {
        match self {
            Self::UnknownKey { key, known } => {
                format!(
                    "{source}: unknown key `{}`; known keys: {known}",
                    quoted(key)
                )
            }
            Self::BadValue {
                key,
                value,
                expected,
            } => format!(
                "{source}: bad value `{}` for `{key}`; expected {expected}",
                quoted(value)
            ),
            Self::Malformed(entry) => {
                format!("{source}: `{}` is not of the form key:value", quoted(entry))
            }
            Self::NotUnicode => format!("{source} is not valid UTF-8"),
        }
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe(ENV_VAR))
    }
}

impl std::error::Error for ConfigError {}
