//! Every bound the readers put on untrusted input, in one place.
//!
//! Snapshots are anyone's files, and every command that reads one (view, plot, convert,
//! replay) must refuse a hostile file with one line rather than run out of memory or wrap
//! an integer. The readers share these limits, so that a file one command accepts the
//! others accept too, and a limit is raised in one place.
//!
//! - Input size: a file ([`MAX_INPUT_BYTES`]) and what a gzip file decompresses to
//!   ([`gunzip_limit`]), both replaced by [`LIMIT_ENV`].
//! - What is built from the input ([`Budget`]): bytes of memory, counted as the decoders
//!   and converters allocate them, at most [`BUILT_BYTES_PER_INPUT_BYTE`] per input byte
//!   (plus [`BUILT_BYTES_BASE`]). Counting bytes rather than values matters: a value of a
//!   few input bytes (a memo reference) can stand for an object of many.
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

/// Bytes of memory the readers may build per byte of (decompressed) input. Real snapshots
/// need 2 to 4: a trace entry of about 60 pickled bytes becomes a few hundred bytes of
/// decoded containers, then a 64-byte event.
pub const BUILT_BYTES_PER_INPUT_BYTE: u64 = 8;
/// Bytes the readers may always build, whatever the input size.
pub const BUILT_BYTES_BASE: u64 = 64 << 20;

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

/// Bytes of memory a reader may still build from one input. Decoders and converters
/// charge what they allocate (at its in-memory size, not its encoded size) as they go, so
/// the memory of a read is bounded by its input whatever the input's sharing.
#[derive(Clone, Debug)]
pub struct Budget {
    limit: u64,
    used: u64,
}

/// A [`Budget`] ran out: what was built and what the limit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverBudget {
    /// The limit, in bytes.
    pub limit: u64,
}

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "decoding would build more than {} MiB in memory ({BUILT_BYTES_PER_INPUT_BYTE} \
             bytes per input byte + {} MiB): the file refers to shared data too often",
            self.limit >> 20,
            BUILT_BYTES_BASE >> 20
        )
    }
}

impl Budget {
    /// The budget for an input of `input_bytes`.
    pub fn for_input(input_bytes: usize) -> Self {
        Self::new(
            BUILT_BYTES_BASE
                .saturating_add((input_bytes as u64).saturating_mul(BUILT_BYTES_PER_INPUT_BYTE)),
        )
    }

    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Budget { limit, used: 0 }
    }

    /// Takes `bytes` from the budget, or says it is spent.
    pub fn charge(&mut self, bytes: u64) -> Result<(), OverBudget> {
        match self.used.checked_add(bytes) {
            Some(used) if used <= self.limit => {
                self.used = used;
                Ok(())
            }
            _ => Err(OverBudget { limit: self.limit }),
        }
    }

    /// Bytes charged so far.
    pub fn used(&self) -> u64 {
        self.used
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
        assert_eq!(b.charge(1), Err(OverBudget { limit: 10 }));
        assert_eq!(b.used(), 10);
        assert!(Budget::new(5).charge(u64::MAX).is_err());
    }
}
