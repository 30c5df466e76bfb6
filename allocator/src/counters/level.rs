//! The counters' building blocks: a gauge kept as a level ([`Level`]), the three levels of
//! a PyTorch `StatArray` ([`Levels`]), and the net changes of one operation ([`Nets`])
//! applied when it ends. Apart from the counters because they are the arithmetic, the
//! counters the meaning.

use crate::stats::{kind_index, Gauge, StatArray};
use crate::types::PoolKind;

/// A gauge without its running total of increases: that is `current + freed`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Level {
    /// Value now.
    pub(crate) current: u64,
    /// Highest value since creation or the last peak reset.
    pub(super) peak: u64,
    /// Everything taken away, over the allocator's life.
    pub(super) freed: u64,
}

impl Level {
    #[inline]
    pub(crate) fn add(&mut self, amount: u64) {
        self.current += amount;
        // A branch, not a conditional move: once warm, a new peak is rare, and a branch
        // not taken writes nothing.
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    #[inline]
    pub(crate) fn sub(&mut self, amount: u64) {
        debug_assert!(self.current >= amount, "gauge underflow");
        self.current -= amount;
        self.freed += amount;
    }

    /// Adds `delta` if positive, takes it away if negative: one net change.
    #[inline]
    pub(super) fn apply(&mut self, delta: i64) {
        if delta > 0 {
            self.add(delta.unsigned_abs());
        } else if delta < 0 {
            self.sub(delta.unsigned_abs());
        }
    }

    pub(super) fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// The [`Gauge`] users read.
    pub(crate) fn gauge(&self) -> Gauge {
        Gauge {
            current: self.current,
            peak: self.peak,
            allocated: self.current + self.freed,
            freed: self.freed,
        }
    }
}

/// One [`StatArray`] kept as levels: `all`, `small_pool`, `large_pool`.
pub(super) type Levels = [Level; 3];

pub(super) fn gauges(levels: &Levels) -> StatArray {
    levels.map(|level| level.gauge())
}

/// Adds `amount` to the `all` level of `levels` and to `kind`'s.
pub(super) fn add(levels: &mut Levels, kind: PoolKind, amount: u64) {
    levels[0].add(amount);
    levels[kind_index(kind)].add(amount);
}

/// Takes `amount` from the `all` level of `levels` and from `kind`'s.
pub(super) fn sub(levels: &mut Levels, kind: PoolKind, amount: u64) {
    levels[0].sub(amount);
    levels[kind_index(kind)].sub(amount);
}

/// Net changes of active and inactive-split blocks within one engine operation, per pool
/// kind (`[small, large]`): (blocks, bytes). A block moves between the engine's lists
/// several times in one call (unlisted, merged, split, listed again); only the net change
/// is PyTorch's event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Nets {
    pub(super) active: [(i64, i64); 2],
    pub(super) inactive_split: [(i64, i64); 2],
    /// Which nets were touched: bit `kind` for active, bit `2 + kind` for inactive-split.
    pub(super) touched: u8,
    /// The operation changed PyTorch's active statistics at once (`*_alone`): no other
    /// active change may follow before it ends (checked in debug builds).
    #[cfg(debug_assertions)]
    pub(super) active_changed: bool,
}

impl Nets {
    #[inline]
    pub(super) fn add_active(&mut self, kind: PoolKind, blocks: i64, bytes: u64) {
        #[cfg(debug_assertions)]
        assert!(
            !self.active_changed,
            "an active change after one applied at once in the same operation"
        );
        let net = &mut self.active[kind as usize];
        net.0 += blocks;
        net.1 += blocks.signum() * bytes as i64;
        self.touched |= 1 << kind as u8;
    }

    #[inline]
    pub(super) fn add_split(&mut self, kind: PoolKind, blocks: i64, bytes: u64) {
        let net = &mut self.inactive_split[kind as usize];
        net.0 += blocks;
        net.1 += blocks.signum() * bytes as i64;
        self.touched |= 4 << kind as u8;
    }
}

/// Applies the nets of the kinds in `touched` (bit 0 small, bit 1 large) to `blocks` and
/// `bytes`: one change per kind, and one to `all` for both together.
pub(super) fn settle_array(
    blocks: &mut Levels,
    bytes: &mut Levels,
    nets: &[(i64, i64); 2],
    touched: u8,
) {
    let (mut all_blocks, mut all_bytes) = (0, 0);
    for (kind, &(count, size)) in nets.iter().enumerate() {
        if touched & (1 << kind) != 0 {
            blocks[kind + 1].apply(count);
            bytes[kind + 1].apply(size);
            all_blocks += count;
            all_bytes += size;
        }
    }
    blocks[0].apply(all_blocks);
    bytes[0].apply(all_bytes);
}
