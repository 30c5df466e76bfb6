//! PyTorch's statistics, the policy's side: which pool kind a block counts in, which free
//! blocks PyTorch calls inactive-split, which kind each mapped page was counted in, and
//! the check that [`TorchStats`](crate::stats::TorchStats) adds up to the blocks.
//!
//! PyTorch keeps small (at most 1 MiB) and large blocks in separate pools and reports
//! every `memory_stats()` value for both. Whole segments here follow the same split, so a
//! block counts in its segment's kind. Expandable segments serve every size from one
//! reservation per stream: a block counts in the kind its size would have in PyTorch (the
//! same kind the request had, since blocks there are split to the request), and mapped
//! pages count in the kind of the request that mapped them, as PyTorch maps a small
//! request's pages into its small pool's segment.

use super::*;
use crate::pool::arena::Block;
use crate::stats::{kind_index, StatArray};
use std::collections::BTreeMap;

/// The pool kind `block` counts in (see the module docs).
#[inline]
pub(super) fn stat_kind(block: &Block) -> PoolKind {
    if block.is_expandable() || block.is_stitched() {
        pool_of(block.size())
    } else {
        block.pool()
    }
}

/// True if `block`, free and ready for reuse, is one of PyTorch's inactive-split blocks: it
/// shares a whole segment with other blocks, which keeps the segment from going back to the
/// device. Expandable segments never count (PyTorch leaves them out: their free whole pages
/// can always be unmapped), nor do stitched ranges (one block each).
#[inline]
pub(super) fn counts_split(block: &Block) -> bool {
    !block.is_expandable()
        && !block.is_stitched()
        && (block.prev().is_some() || block.next().is_some())
}

/// The kind each mapped stretch of the expandable segments was counted in: first byte →
/// (bytes, kind). Unmapping takes bytes back out of the kinds they were counted in, whatever
/// the stretches the unmapping covers.
#[derive(Debug, Default)]
pub(super) struct MappedKinds {
    ranges: BTreeMap<u64, (u64, PoolKind)>,
}

impl MappedKinds {
    /// Notes `[addr, addr + len)`, just mapped, as counted in `kind`.
    pub(super) fn insert(&mut self, addr: u64, len: u64, kind: PoolKind) {
        self.ranges.insert(addr, (len, kind));
    }

    /// Forgets `[addr, addr + len)`, just unmapped; returns the bytes it held per kind
    /// (`[small, large]`).
    pub(super) fn remove(&mut self, addr: u64, len: u64) -> [u64; 2] {
        let end = addr + len;
        let mut removed = [0u64; 2];
        let first = self
            .ranges
            .range(..=addr)
            .next_back()
            .map_or(addr, |(&start, _)| start);
        let overlapping: Vec<(u64, u64, PoolKind)> = self
            .ranges
            .range(first..end)
            .map(|(&start, &(bytes, kind))| (start, bytes, kind))
            .filter(|&(start, bytes, _)| start + bytes > addr)
            .collect();
        for (start, bytes, kind) in overlapping {
            self.ranges.remove(&start);
            let stop = start + bytes;
            let (cut_from, cut_to) = (start.max(addr), stop.min(end));
            removed[kind as usize] += cut_to - cut_from;
            if start < cut_from {
                self.ranges.insert(start, (cut_from - start, kind));
            }
            if cut_to < stop {
                self.ranges.insert(cut_to, (stop - cut_to, kind));
            }
        }
        removed
    }

    /// Bytes noted per kind (`[small, large]`).
    pub(super) fn totals(&self) -> [u64; 2] {
        let mut totals = [0u64; 2];
        for &(bytes, kind) in self.ranges.values() {
            totals[kind as usize] += bytes;
        }
        totals
    }
}

impl State {
    /// Counts `len` bytes just mapped at `addr` for a request of `size` bytes: one device
    /// call, the bytes in the request's kind.
    pub(super) fn count_mapped(&mut self, addr: u64, len: u64, size: u64) {
        let kind = pool_of(size);
        self.mapped_kinds.insert(addr, len, kind);
        self.stats.reserved(kind, len, false);
    }

    /// Counts `[addr, addr + len)` just unmapped: one device call, the bytes out of the
    /// kinds they were counted in.
    pub(super) fn count_unmapped(&mut self, addr: u64, len: u64) {
        let removed = self.mapped_kinds.remove(addr, len);
        for (kind, bytes) in [PoolKind::Small, PoolKind::Large].into_iter().zip(removed) {
            if bytes > 0 {
                self.stats.released(kind, bytes, false);
            }
        }
        self.stats.device_freed();
    }

    /// PyTorch's statistics are settled and their current values are what the blocks and
    /// segments add up to, per kind, with `all` the sum of both kinds.
    pub(super) fn check_torch_stats(&self) -> Result<(), String> {
        if !self.stats.settled() {
            return Err("an operation left net changes of PyTorch's statistics unapplied".into());
        }
        let stats = self.stats.read();
        let torch = &stats.torch;
        // [blocks, bytes] per kind index (1: small, 2: large) for each array checked.
        let mut allocation = [[0u64; 2]; 3];
        let mut requested = [0u64; 3];
        let mut allocated_bytes = [0u64; 3];
        let mut active = [[0u64; 2]; 3];
        let mut split = [[0u64; 2]; 3];
        let mut oversize_allocations = 0;
        for (key, block) in self.arena.blocks() {
            let kind = kind_index(stat_kind(block));
            let size = block.size();
            let tally = |array: &mut [[u64; 2]; 3]| {
                array[kind][0] += 1;
                array[kind][1] += size;
            };
            if block.is_allocated() {
                tally(&mut active);
                let deferred = self.deferred_frees.iter().any(|&(k, _, _)| k == key);
                if deferred {
                    continue;
                }
                allocated_bytes[kind] += size;
                if self.allocated.get(&block.addr()) == Some(&key) {
                    tally(&mut allocation);
                    requested[kind] += block.requested();
                    oversize_allocations += u64::from(size >= torch.max_split_size);
                }
            } else if (block.is_free() || block.is_hot()) && !block.pending().is_empty() {
                tally(&mut active);
            } else if (block.is_free() || block.is_hot()) && counts_split(block) {
                tally(&mut split);
            }
        }
        let mut segments = [0u64; 3];
        let mut reserved = [0u64; 3];
        let mut oversize_segments = 0;
        for (_, segment) in self.arena.segments() {
            if segment.is_expandable() || segment.is_stitched() {
                continue;
            }
            let kind = kind_index(segment.pool());
            segments[kind] += 1;
            reserved[kind] += segment.size();
            oversize_segments += u64::from(segment.size() >= torch.max_split_size);
        }
        for (kind, bytes) in self.mapped_kinds.totals().into_iter().enumerate() {
            reserved[kind + 1] += bytes;
        }
        let blocks_of = |array: &[[u64; 2]; 3]| [array[1][0], array[2][0]];
        let bytes_of = |array: &[[u64; 2]; 3]| [array[1][1], array[2][1]];
        let checks: [(&str, &StatArray, [u64; 2]); 9] = [
            ("allocation", &torch.allocation, blocks_of(&allocation)),
            (
                "allocated_bytes",
                &torch.allocated_bytes,
                [allocated_bytes[1], allocated_bytes[2]],
            ),
            (
                "requested_bytes",
                &torch.requested_bytes,
                [requested[1], requested[2]],
            ),
            ("active", &torch.active, blocks_of(&active)),
            ("active_bytes", &torch.active_bytes, bytes_of(&active)),
            ("inactive_split", &torch.inactive_split, blocks_of(&split)),
            (
                "inactive_split_bytes",
                &torch.inactive_split_bytes,
                bytes_of(&split),
            ),
            ("segment", &torch.segment, [segments[1], segments[2]]),
            (
                "reserved_bytes",
                &torch.reserved_bytes,
                [reserved[1], reserved[2]],
            ),
        ];
        for (name, array, [small, large]) in checks {
            let counted = [array[0].current, array[1].current, array[2].current];
            if counted != [small + large, small, large] {
                return Err(format!(
                    "PyTorch's {name} (all, small, large) is {counted:?} but the blocks add up to {:?}",
                    [small + large, small, large]
                ));
            }
        }
        let engine = [
            (
                "allocated_bytes",
                torch.allocated_bytes[0].current,
                self.stats.allocated_bytes.current,
            ),
            (
                "active_bytes",
                torch.active_bytes[0].current,
                self.stats.active_bytes.current,
            ),
            (
                "reserved_bytes",
                torch.reserved_bytes[0].current,
                self.stats.reserved_bytes.current,
            ),
            (
                "oversize_allocations",
                torch.oversize_allocations.current,
                oversize_allocations,
            ),
            (
                "oversize_segments",
                torch.oversize_segments.current,
                oversize_segments,
            ),
        ];
        for (name, torch_value, engine_value) in engine {
            if torch_value != engine_value {
                return Err(format!(
                    "PyTorch's {name} is {torch_value}, the engine counts {engine_value}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn unmapping_takes_bytes_out_of_the_kinds_they_were_mapped_in() {
        let mut kinds = MappedKinds::default();
        kinds.insert(0, 4 * MIB, PoolKind::Small);
        kinds.insert(4 * MIB, 8 * MIB, PoolKind::Large);
        assert_eq!(kinds.totals(), [4 * MIB, 8 * MIB]);
        // Across both stretches, cutting each.
        assert_eq!(kinds.remove(2 * MIB, 4 * MIB), [2 * MIB, 2 * MIB]);
        assert_eq!(kinds.totals(), [2 * MIB, 6 * MIB]);
        // Inside what is left of the large stretch, splitting it in two.
        assert_eq!(kinds.remove(8 * MIB, 2 * MIB), [0, 2 * MIB]);
        assert_eq!(kinds.totals(), [2 * MIB, 4 * MIB]);
        assert_eq!(kinds.remove(0, 12 * MIB), [2 * MIB, 4 * MIB]);
        assert_eq!(kinds.totals(), [0, 0]);
        assert_eq!(kinds.remove(0, MIB), [0, 0], "nothing mapped there");
    }
}
