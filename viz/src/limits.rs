//! Every bound the readers put on untrusted input, in one place.
//!
//! Snapshots are anyone's files, and every command that reads one (view, plot, convert,
//! replay) must refuse a hostile file with one line rather than run out of memory or wrap
//! an integer. The readers share these limits, so that a file one command accepts the
//! others accept too, and a limit is raised in one place.
//!
//! - Input size: a file ([`MAX_INPUT_BYTES`]) and what a gzip file decompresses to
//!   ([`gunzip_limit`]), both replaced by [`LIMIT_ENV`].
//! - What is built from the input ([`Budget`]): bytes of memory, counted as the decoders,
//!   the timeline, the viewer's columns, plots and writers allocate them, at most
//!   [`BUILT_BYTES_PER_INPUT_BYTE`] per input byte (plus [`BUILT_BYTES_BASE`]) for one
//!   input and everything built from it. Counting bytes rather than values matters: a value
//!   of a few input bytes (a memo reference) can stand for an object of many.
//! - Values: device indices ([`MAX_DEVICE_INDEX`]) and address ranges
//!   ([`MAX_ADDRESS_END`], [`range_within`]).

use crate::error::VizError;
use std::path::Path;

/// The largest device index a snapshot may name. Writers allocate one entry per index up to
/// the largest (PyTorch's `device_traces` is a list indexed by device), so an unchecked
/// index of 2^31 in a 5 KB file would ask for tens of GB.
pub const MAX_DEVICE_INDEX: u32 = 1023;

/// Where an address range (`addr + size`) must end by. Real virtual addresses stay below
/// 2^57; refusing anything past 2^63 keeps every range's end, and the timeline's sums of a
/// few of them, representable, so a size of 2^64 - 1 is an error rather than a wrap.
pub const MAX_ADDRESS_END: u64 = 1 << 63;

/// Whether `addr + size` ends by [`MAX_ADDRESS_END`].
pub fn range_within(addr: u64, size: u64) -> bool {
    addr.checked_add(size)
        .is_some_and(|end| end <= MAX_ADDRESS_END)
}

/// The most bytes a file may hold, uncompressed (a gzip file is also held whole before it
/// is decompressed).
pub const MAX_INPUT_BYTES: u64 = 1 << 30;

/// The most bytes a gzip file may decompress to, whatever its ratio.
pub const GUNZIP_MAX_BYTES: u64 = 1 << 30;
/// The most a gzip file may expand by (real snapshots expand about 40 times), above
/// [`GUNZIP_RATIO_FLOOR`]: a 2 MB bomb must not become 2 GB in memory.
pub const GUNZIP_MAX_RATIO: u64 = 200;
/// Decompressed sizes up to this are allowed whatever the ratio, so small but very regular
/// files are not refused.
pub const GUNZIP_RATIO_FLOOR: u64 = 64 << 20;
/// Environment variable that replaces the input limits (a file's size, and what a gzip
/// file decompresses to) by one byte count (e.g. `4G`).
pub const LIMIT_ENV: &str = "STREAMALLOC_MAX_DECOMPRESSED";

/// Bytes of memory the readers and every later stage may build per byte of
/// (decompressed) input. Real snapshots need 2 to 5: a PyTorch trace entry of 50 to 190
/// pickled bytes becomes a 64-byte event, then a few hundred bytes of timeline and
/// viewer columns.
pub const BUILT_BYTES_PER_INPUT_BYTE: u64 = 8;
/// Bytes the readers may always build, whatever the input size.
pub const BUILT_BYTES_BASE: u64 = 64 << 20;
/// Environment variable that replaces the memory budget of every input by one byte count
/// (e.g. `8G`), for the rare real file that needs more.
pub const BUDGET_ENV: &str = "STREAMALLOC_MAX_BUILT";

/// The limit set by [`LIMIT_ENV`], if it is set. `path` names the file in errors.
fn env_limit(path: &Path) -> Result<Option<(u64, String)>, VizError> {
    let Some(text) = std::env::var_os(LIMIT_ENV) else {
        return Ok(None);
    };
    let text = text.to_string_lossy();
    let bytes = parse_byte_count(&text).ok_or_else(|| VizError::Limit {
        path: path.into(),
        what: format!("{LIMIT_ENV}={text:?} is not a byte count (e.g. 4G)"),
    })?;
    Ok(Some((bytes, format!("{LIMIT_ENV}={text}"))))
}

/// The size limit for a file, and how it was set.
pub fn input_limit(path: &Path) -> Result<(u64, String), VizError> {
    if let Some(set) = env_limit(path)? {
        return Ok(set);
    }
    Ok((
        MAX_INPUT_BYTES,
        format!(
            "at most {} MiB; set {LIMIT_ENV} to raise it",
            MAX_INPUT_BYTES >> 20
        ),
    ))
}

/// The decompressed-size limit for a gzip file of `compressed` bytes, and how it was set.
pub fn gunzip_limit(path: &Path, compressed: usize) -> Result<(u64, String), VizError> {
    if let Some(set) = env_limit(path)? {
        return Ok(set);
    }
    let by_ratio = (compressed as u64)
        .saturating_mul(GUNZIP_MAX_RATIO)
        .max(GUNZIP_RATIO_FLOOR);
    Ok((
        by_ratio.min(GUNZIP_MAX_BYTES),
        format!(
            "{GUNZIP_MAX_RATIO}x the compressed size, at most {} MiB; set {LIMIT_ENV} \
             to raise it",
            GUNZIP_MAX_BYTES >> 20
        ),
    ))
}

/// `123`, `64K`, `512M`, `4G` (binary multiples).
pub fn parse_byte_count(text: &str) -> Option<u64> {
    let t = text.trim();
    let (digits, shift) = match t.char_indices().last()? {
        (i, 'k' | 'K') => (&t[..i], 10),
        (i, 'm' | 'M') => (&t[..i], 20),
        (i, 'g' | 'G') => (&t[..i], 30),
        _ => (t, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// The memory one input may cost: what its reader builds and, after it, every stage that
/// builds from what was read (the timeline, the viewer's columns and blob, a plot, a
/// converted file). Each charges what it allocates, at its in-memory size (an interned
/// frame or stack once, a memo reference as the eight bytes it takes), before or as it
/// allocates, and gives back what it frees; so the memory of a command is bounded by its
/// input whatever the input's sharing, and running out is an error, never an abort.
#[derive(Clone, Debug)]
pub struct Budget {
    limit: u64,
    used: u64,
    /// Bytes the limit grows by per input byte received ([`Budget::add_input`]); 0 for a
    /// fixed limit.
    per_input_byte: u64,
    /// What the process's address-space limit leaves, if it has one: the limit never
    /// grows past it.
    ceiling: Option<u64>,
    /// The last charge refused, so that a caller that sees only an I/O error (a writer
    /// charging as it writes) can tell what happened.
    refused: Option<OverBudget>,
    /// How the limit was set, for the error message.
    how: &'static str,
}

/// A [`Budget`] ran out: which stage would have built more than the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverBudget {
    /// The limit, in bytes.
    pub limit: u64,
    /// What was being built (`decoding`, `the timeline`, ...).
    pub stage: &'static str,
    /// How the limit was set.
    pub how: &'static str,
}

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} would build more than {} MiB in memory (limit: {})",
            self.stage,
            self.limit >> 20,
            self.how,
        )?;
        if self.how == PER_BYTE {
            write!(
                f,
                ": the file refers to shared data too often or expands too much; set \
                 {BUDGET_ENV} to raise the limit"
            )?;
        }
        Ok(())
    }
}

/// How [`Budget::for_input`] sets its limit.
const PER_BYTE: &str = "8 bytes per input byte + 64 MiB";
/// How the limit was set when the address-space limit set it.
const ADDRESS_SPACE: &str = "what the process's address-space limit leaves";
/// How the limit was met when the system refused memory within it.
const REFUSED: &str = "the memory the system would give";

/// Bytes of address space the process may still map, if it runs under a limit
/// (`RLIMIT_AS`), read from `/proc/self`.
pub fn address_space_headroom() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?
        .split_whitespace()
        .nth(3)?
        .parse::<u64>()
        .ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let size_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(soft.saturating_sub(size_kib << 10))
}

impl Default for Budget {
    /// No limit: for snapshots built in code, which no file bounds.
    fn default() -> Self {
        Budget::new(u64::MAX)
    }
}

impl Budget {
    /// The budget for an input of `input_bytes`: [`BUILT_BYTES_PER_INPUT_BYTE`] per byte
    /// plus [`BUILT_BYTES_BASE`], or what [`BUDGET_ENV`] says.
    ///
    /// Under an address-space limit (`ulimit -v`, `prlimit --as`) the budget is at most
    /// what the process can still map, less a margin for what is not budgeted (the input
    /// itself, threads), so that running short of memory is this budget's one-line error
    /// rather than an allocation failure that aborts.
    pub fn for_input(input_bytes: usize) -> Self {
        let mut budget = match std::env::var_os(BUDGET_ENV) {
            None => Budget {
                per_input_byte: BUILT_BYTES_PER_INPUT_BYTE,
                how: PER_BYTE,
                ..Budget::new(BUILT_BYTES_BASE)
            },
            Some(text) => match text.to_str().and_then(parse_byte_count) {
                Some(limit) => Budget {
                    how: "set by STREAMALLOC_MAX_BUILT",
                    ..Budget::new(limit)
                },
                // Said, not ignored: every read fails, naming the variable.
                None => Budget {
                    how: "STREAMALLOC_MAX_BUILT, which is not a byte count such as 8G",
                    ..Budget::new(0)
                },
            },
        };
        budget.ceiling =
            address_space_headroom().map(|room| room - room / 4 - (96 << 20).min(room / 2));
        budget.add_input(input_bytes);
        budget
    }

    /// `bytes` more of the input have arrived: a budget proportional to its input grows by
    /// what they allow (a reader of a stream is held at each point to what it has read so
    /// far).
    pub fn add_input(&mut self, bytes: usize) {
        self.limit = self
            .limit
            .saturating_add((bytes as u64).saturating_mul(self.per_input_byte));
        if let Some(ceiling) = self.ceiling {
            if self.limit > ceiling {
                self.limit = ceiling;
                self.how = ADDRESS_SPACE;
            }
        }
    }

    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Budget {
            limit,
            used: 0,
            per_input_byte: 0,
            ceiling: None,
            refused: None,
            how: "a fixed budget",
        }
    }

    /// Takes `bytes` for `stage` from the budget, or says it is spent (taking nothing).
    pub fn charge_for(&mut self, stage: &'static str, bytes: u64) -> Result<(), OverBudget> {
        match self.used.checked_add(bytes) {
            Some(used) if used <= self.limit => {
                self.used = used;
                Ok(())
            }
            _ => {
                let over = OverBudget {
                    limit: self.limit,
                    stage,
                    how: self.how,
                };
                self.refused = Some(over);
                Err(over)
            }
        }
    }

    /// The last charge this budget refused, if any.
    pub fn refused(&self) -> Option<OverBudget> {
        self.refused
    }

    /// [`Budget::charge_for`] while decoding.
    pub fn charge(&mut self, bytes: u64) -> Result<(), OverBudget> {
        self.charge_for("decoding", bytes)
    }

    /// Gives back `bytes` charged earlier, once what they paid for is freed.
    pub fn release(&mut self, bytes: u64) {
        self.used = self.used.saturating_sub(bytes);
    }

    /// Makes room in `v` for `additional` more items, charging the growth of its capacity
    /// before it happens (doubling, as `Vec` grows, so pushing stays amortised O(1)):
    /// what is charged is what the vector holds.
    pub fn reserve<T>(
        &mut self,
        stage: &'static str,
        v: &mut Vec<T>,
        additional: usize,
    ) -> Result<(), OverBudget> {
        let needed = v.len().saturating_add(additional);
        if needed <= v.capacity() {
            return Ok(());
        }
        let capacity = needed.max(v.capacity().saturating_mul(2)).max(4);
        let bytes = (capacity - v.capacity()).saturating_mul(std::mem::size_of::<T>()) as u64;
        self.charge_for(stage, bytes)?;
        // Even within the budget the system may refuse the memory: that is this error too,
        // never an abort.
        if v.try_reserve_exact(capacity - v.len()).is_err() {
            self.release(bytes);
            return Err(OverBudget {
                limit: self.used.saturating_add(bytes),
                stage,
                how: REFUSED,
            });
        }
        Ok(())
    }

    /// Bytes charged and not given back.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The limit, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_binary_suffixes() {
        assert_eq!(parse_byte_count("123"), Some(123));
        assert_eq!(parse_byte_count("64K"), Some(64 << 10));
        assert_eq!(parse_byte_count(" 4g "), Some(4 << 30));
        assert_eq!(parse_byte_count("x"), None);
        assert_eq!(parse_byte_count("99999999999999G"), None);
    }

    #[test]
    fn ranges_end_by_the_address_limit() {
        assert!(range_within(0, MAX_ADDRESS_END));
        assert!(!range_within(1, MAX_ADDRESS_END));
        assert!(!range_within(u64::MAX, 1));
    }

    #[test]
    fn a_budget_refuses_the_byte_past_its_limit() {
        let mut b = Budget::new(10);
        assert!(b.charge(10).is_ok());
        let over = b.charge_for("the timeline", 1).unwrap_err();
        assert_eq!((over.limit, over.stage), (10, "the timeline"));
        assert_eq!(b.used(), 10);
        assert!(Budget::new(5).charge(u64::MAX).is_err());
        b.release(4);
        assert!(b.charge(4).is_ok());
    }

    /// The only test of this binary that sets the variable, and none other reads it.
    #[test]
    fn the_budget_variable_replaces_the_limit_or_is_said_to_be_wrong() {
        std::env::set_var(BUDGET_ENV, "1M");
        assert_eq!(Budget::for_input(10 << 20).limit(), 1 << 20);
        std::env::set_var(BUDGET_ENV, "lots");
        let over = Budget::for_input(10).charge(1).unwrap_err();
        assert!(
            over.to_string()
                .contains("STREAMALLOC_MAX_BUILT, which is not a byte count"),
            "{over}"
        );
        std::env::remove_var(BUDGET_ENV);
        assert_eq!(
            Budget::for_input(1).limit(),
            BUILT_BYTES_BASE + BUILT_BYTES_PER_INPUT_BYTE
        );
    }

    #[test]
    fn reserving_charges_the_capacity_a_vector_grows_to() {
        let mut b = Budget::new(2000);
        let mut v: Vec<u64> = Vec::new();
        for i in 0..100 {
            b.reserve("test", &mut v, 1).unwrap();
            v.push(i);
            assert_eq!(b.used(), 8 * v.capacity() as u64);
        }
        let mut small = Budget::new(100);
        let mut w: Vec<u64> = Vec::new();
        assert!(small.reserve("test", &mut w, 13).is_err());
        assert_eq!((w.capacity(), small.used()), (0, 0));
    }
}
