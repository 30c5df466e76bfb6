//! A best-fit free list: free blocks ordered by (size, address).
//!
//! Pure data, no streams and no devices (in the manner of RMM's `free_list.hpp`): the
//! lifetime layer owns one of these per stream, pool and readiness class and decides
//! which list a block belongs in. Ordering by address among equal sizes makes the choice
//! deterministic and packs reuse toward low addresses, which keeps segments emptiable.

use super::arena::BlockKey;
use std::collections::BTreeSet;

/// Free blocks of one class, best fit first.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    /// `(size, address, block)`; the address makes every entry unique.
    entries: BTreeSet<(u64, u64, BlockKey)>,
    /// Sum of the sizes, kept so stats and OOM reports need no walk.
    bytes: u64,
}

impl FreeList {
    pub(crate) fn insert(&mut self, size: u64, addr: u64, key: BlockKey) {
        let fresh = self.entries.insert((size, addr, key));
        debug_assert!(fresh, "block {key} inserted twice");
        self.bytes += size;
    }

    pub(crate) fn remove(&mut self, size: u64, addr: u64, key: BlockKey) {
        let present = self.entries.remove(&(size, addr, key));
        debug_assert!(present, "block {key} not in this free list");
        self.bytes -= size;
    }

    /// The smallest block of at least `size` bytes, lowest address first among equals,
    /// and no larger than `max_size`.
    #[inline]
    pub(crate) fn best_fit(&self, size: u64, max_size: u64) -> Option<(u64, u64, BlockKey)> {
        self.entries
            .range((size, 0, 0)..)
            .next()
            .copied()
            .filter(|(found, _, _)| *found <= max_size)
    }

    pub(crate) fn contains(&self, size: u64, addr: u64, key: BlockKey) -> bool {
        self.entries.contains(&(size, addr, key))
    }

    pub(crate) fn largest(&self) -> u64 {
        self.entries.last().map_or(0, |(size, _, _)| *size)
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.entries.iter().map(|(_, _, key)| *key)
    }

    /// Blocks of at least `size` bytes, smallest first.
    pub(crate) fn keys_at_least(&self, size: u64) -> impl Iterator<Item = BlockKey> + '_ {
        self.entries.range((size, 0, 0)..).map(|(_, _, key)| *key)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_prefers_the_smallest_then_the_lowest_address() {
        let mut list = FreeList::default();
        list.insert(4096, 0x3000, 3);
        list.insert(2048, 0x2000, 2);
        list.insert(2048, 0x1000, 1);
        assert_eq!(list.best_fit(1024, u64::MAX), Some((2048, 0x1000, 1)));
        assert_eq!(list.best_fit(3000, u64::MAX), Some((4096, 0x3000, 3)));
        assert_eq!(list.best_fit(3000, 3500), None);
        assert_eq!(list.best_fit(5000, u64::MAX), None);
        assert_eq!(list.bytes(), 8192);
        list.remove(2048, 0x1000, 1);
        assert_eq!(list.best_fit(1024, u64::MAX), Some((2048, 0x2000, 2)));
        assert_eq!(list.largest(), 4096);
    }
}
