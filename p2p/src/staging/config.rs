//! The staging budget and what it implies: the size of a buffer, the zero-copy threshold,
//! and the checks that say what to change.

use super::plan::{ALIGN, MIN_BUFFER_BYTES};
use super::StagingError;

/// Sizing of the staging pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Most staging bytes one rank holds at once, send and receive buffers together.
    pub budget_bytes: u64,
    /// Buffers per direction (≥ 2: packing round k+1 overlaps sending round k).
    pub buffers_per_direction: u32,
    /// Tensors of at least this many bytes are sent zero-copy; `None` means one buffer.
    pub zero_copy_min: Option<u64>,
}

impl Default for StagingConfig {
    fn default() -> Self {
        Self {
            budget_bytes: 128 << 20,
            buffers_per_direction: 2,
            zero_copy_min: None,
        }
    }
}

impl StagingConfig {
    /// A configuration with `budget_bytes` and the other settings at their defaults.
    pub fn with_budget(budget_bytes: u64) -> Self {
        Self {
            budget_bytes,
            ..Self::default()
        }
    }

    /// Bytes of one staging buffer: the budget split over both directions'
    /// buffers, rounded down to [`ALIGN`].
    pub fn buffer_bytes(&self) -> u64 {
        let buffers = 2 * u64::from(self.buffers_per_direction.max(1));
        (self.budget_bytes / buffers) / ALIGN * ALIGN
    }

    /// The zero-copy threshold in force.
    pub fn zero_copy_threshold(&self) -> u64 {
        self.zero_copy_min.unwrap_or_else(|| self.buffer_bytes())
    }

    /// Checks the configuration, with a message naming what to change.
    pub fn validate(&self) -> Result<(), StagingError> {
        if self.buffers_per_direction < 2 {
            return Err(StagingError::BadConfig(format!(
                "buffers_per_direction must be at least 2 (got {})",
                self.buffers_per_direction
            )));
        }
        let min = 2 * u64::from(self.buffers_per_direction) * MIN_BUFFER_BYTES;
        if self.budget_bytes < min {
            return Err(StagingError::BadConfig(format!(
                "staging budget of {} bytes is too small: need at least {min} bytes \
                 ({} buffers per direction of at least {MIN_BUFFER_BYTES} bytes)",
                self.budget_bytes, self.buffers_per_direction
            )));
        }
        if self.zero_copy_min == Some(0) {
            return Err(StagingError::BadConfig(
                "zero_copy_min must be positive".into(),
            ));
        }
        Ok(())
    }
}
