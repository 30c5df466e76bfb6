//! A best-fit free list: free blocks ordered by (size, address).
//!
//! Pure data, no streams and no devices (in the manner of RMM's `free_list.hpp`): the
//! lifetime layer owns one of these per stream, pool and readiness class and decides
//! which list a block belongs in. Ordering by address among equal sizes makes the choice
//! deterministic and packs reuse toward low addresses, which keeps segments emptiable.
//!
//! # Structure
//! Segregated size classes in the manner of TLSF, but with an *exact* best fit: sizes are
//! binned by octave of 512-byte units, each octave cut into [`SUBS`] equal classes (sizes
//! below `SUBS` units get one class each). A class holds its blocks sorted by
//! `(size, address)` — in a vector while it has few, in a B-tree once it has many — and a
//! bitmap marks the non-empty classes. Classes are monotone in size, so the global order is
//! the classes' order, then each class's order:
//!
//! - best fit: in the request's own class, the first entry of at least the requested size
//!   (a binary search); failing that, the first entry of the next non-empty class (a bit
//!   scan). Same answer as a `BTreeSet<(size, addr, key)>`'s `range((size, 0, 0)..)`.
//! - insert and remove: a binary search and a shift within one class, which usually holds
//!   a few blocks of sizes within 1/8 of each other; O(log n) in a crowded class.
//!
//! The previous structure, one `BTreeSet<(u64, u64, BlockKey)>`, spent about 40% of a
//! mixed-size malloc+free in B-tree node searches, splits and shifts; it is the reference
//! model in the property tests below.

mod class;

use self::class::{class_of, Class, Entry, Take, WORDS};
use super::arena::BlockKey;

/// Free blocks of one class, best fit first.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    /// Per size class, the blocks in `(size, address)` order. Grown on demand up to the
    /// highest class used.
    classes: Vec<Class>,
    /// Bit `c` set ⇔ `classes[c]` is non-empty.
    nonempty: [u64; WORDS],
    /// Blocks listed.
    len: usize,
    /// Sum of the sizes, kept so stats and OOM reports need no walk.
    bytes: u64,
}

impl FreeList {
    pub(crate) fn insert(&mut self, size: u64, addr: u64, key: BlockKey) {
        let class = class_of(size);
        if class >= self.classes.len() {
            self.classes.resize_with(class + 1, Class::default);
        }
        let fresh = self.classes[class].insert(Entry { size, addr, key });
        debug_assert!(fresh, "block {key} inserted twice");
        if fresh {
            self.nonempty[class / 64] |= 1 << (class % 64);
            self.len += 1;
            self.bytes += size;
        }
        self.debug_check(class);
    }

    pub(crate) fn remove(&mut self, size: u64, addr: u64, key: BlockKey) {
        let class = class_of(size);
        let present = self
            .classes
            .get_mut(class)
            .is_some_and(|entries| entries.remove(&Entry { size, addr, key }));
        debug_assert!(present, "block {key} not in this free list");
        if present {
            self.removed(class, size);
        }
        self.debug_check(class);
    }

    /// Debug builds: `class`'s bit says whether it holds blocks, the count says whether any
    /// class does, and a short class is strictly ordered (no entry twice). Run after every
    /// change, on the class it touched: the bitmap is what best fit trusts to skip classes.
    #[inline]
    fn debug_check(&self, class: usize) {
        if !cfg!(debug_assertions) {
            return;
        }
        let held = self.classes.get(class).map_or(0, Class::len);
        let marked = self.nonempty[class / 64] & (1 << (class % 64)) != 0;
        debug_assert_eq!(
            marked,
            held > 0,
            "class {class} holds {held} blocks but its bit is {marked}"
        );
        debug_assert_eq!(
            self.len == 0,
            self.nonempty.iter().all(|&bits| bits == 0),
            "{} blocks listed, bitmap {:x?}",
            self.len,
            self.nonempty
        );
        if let Some(Class::Short(entries)) = self.classes.get(class) {
            debug_assert!(
                entries
                    .windows(2)
                    .all(|pair| pair[0].order() < pair[1].order()),
                "class {class} is out of order or holds an entry twice"
            );
        }
    }

    /// Bookkeeping after an entry of `size` bytes left `class`.
    #[inline]
    fn removed(&mut self, class: usize, size: u64) {
        if self.classes[class].len() == 0 {
            self.nonempty[class / 64] &= !(1 << (class % 64));
        }
        self.len -= 1;
        self.bytes -= size;
    }

    /// The first non-empty class at or above `class`.
    #[inline]
    fn next_nonempty(&self, class: usize) -> Option<usize> {
        let mut word = class / 64;
        if word >= WORDS {
            return None;
        }
        let mut bits = self.nonempty[word] & (u64::MAX << (class % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            if word == WORDS {
                return None;
            }
            bits = self.nonempty[word];
        }
    }

    /// The best fit for `size` and its class.
    #[inline]
    fn find_best_fit(&self, size: u64) -> Option<(usize, Entry)> {
        let class = class_of(size);
        if let Some(found) = self.classes.get(class).and_then(|c| c.first_at_least(size)) {
            return Some((class, found));
        }
        let class = self.next_nonempty(class + 1)?;
        Some((class, self.classes[class].first()?))
    }

    /// The smallest block of at least `size` bytes, lowest address first among equals,
    /// and no larger than `max_size`.
    #[inline]
    pub(crate) fn best_fit(&self, size: u64, max_size: u64) -> Option<(u64, u64, BlockKey)> {
        let (_, found) = self.find_best_fit(size)?;
        (found.size <= max_size).then_some((found.size, found.addr, found.key))
    }

    /// [`FreeList::best_fit`], taken out of the list.
    #[inline]
    pub(crate) fn take_best_fit(
        &mut self,
        size: u64,
        max_size: u64,
    ) -> Option<(u64, u64, BlockKey)> {
        let own = class_of(size);
        // Classes past the end are empty, and so is every class above them.
        let (class, entry) = match self
            .classes
            .get_mut(own)?
            .take_first_at_least(size, max_size)
        {
            Take::Taken(entry) => (own, entry),
            Take::TooLarge => return None,
            Take::NoneAtLeast => {
                // Every entry of a later class is larger than every entry of this one: the
                // best fit is the first entry of the next non-empty class.
                let class = self.next_nonempty(own + 1)?;
                match self.classes[class].take_first_at_least(0, max_size) {
                    Take::Taken(entry) => (class, entry),
                    Take::TooLarge | Take::NoneAtLeast => return None,
                }
            }
        };
        self.removed(class, entry.size);
        self.debug_check(class);
        Some((entry.size, entry.addr, entry.key))
    }

    pub(crate) fn contains(&self, size: u64, addr: u64, key: BlockKey) -> bool {
        self.classes
            .get(class_of(size))
            .is_some_and(|entries| entries.contains(&Entry { size, addr, key }))
    }

    pub(crate) fn largest(&self) -> u64 {
        let top = self
            .nonempty
            .iter()
            .enumerate()
            .rev()
            .find(|(_, bits)| **bits != 0)
            .map(|(word, bits)| word * 64 + 63 - bits.leading_zeros() as usize);
        top.and_then(|class| self.classes[class].last())
            .map_or(0, |entry| entry.size)
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Every block, smallest first (lowest address first among equals).
    pub(crate) fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.keys_at_least(0)
    }

    /// Blocks of at least `size` bytes, smallest first (lowest address first among equals).
    pub(crate) fn keys_at_least(&self, size: u64) -> impl Iterator<Item = BlockKey> + '_ {
        let mut next = class_of(size);
        // Only the non-empty classes, found through the bitmap.
        let classes = std::iter::from_fn(move || {
            let class = self.next_nonempty(next)?;
            next = class + 1;
            Some(&self.classes[class])
        });
        classes.flat_map(move |entries| entries.iter_at_least(size).map(|e| e.key))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::class::{CLASSES, LONG_AT, SHORT_AT};
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

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
        assert_eq!(list.len(), 2);
    }

    #[test]
    fn classes_are_monotone_and_cover_every_size() {
        let mut previous = 0;
        for exponent in 0..64 {
            let low = 1u64 << exponent;
            for size in [low, low + 1, low | (low - 1)] {
                let class = class_of(size);
                assert!(class < CLASSES, "{size} in class {class}");
                assert!(class >= previous, "class of {size} went down");
                previous = class;
            }
        }
        assert_eq!(class_of(u64::MAX), CLASSES - 1);
        // Below SUBS units every unit count has its own class; above, eight per octave.
        assert_eq!(class_of(512), 1);
        assert_eq!(class_of(7 * 512), 7);
        assert_eq!(class_of(8 * 512), 8);
        assert_eq!(class_of(9 * 512), 9);
        assert_eq!(class_of(16 * 512), 16);
        assert_eq!(class_of(17 * 512), 16);
        assert_eq!(class_of(18 * 512), 17);
    }

    #[test]
    fn search_crosses_empty_classes_and_bitmap_words() {
        let mut list = FreeList::default();
        list.insert(1 << 40, 0x10, 7);
        list.insert(512, 0x20, 8);
        assert_eq!(list.best_fit(1024, u64::MAX), Some((1 << 40, 0x10, 7)));
        assert_eq!(list.best_fit((1 << 40) + 1, u64::MAX), None);
        assert_eq!(list.largest(), 1 << 40);
        assert_eq!(list.keys().collect::<Vec<_>>(), [8, 7]);
        list.insert(1 << 62, 0x30, 9);
        assert_eq!(
            list.best_fit((1 << 40) + 1, u64::MAX),
            Some((1 << 62, 0x30, 9))
        );
        list.remove(1 << 62, 0x30, 9);
        list.remove(1 << 40, 0x10, 7);
        list.remove(512, 0x20, 8);
        assert_eq!((list.len(), list.bytes(), list.largest()), (0, 0, 0));
        assert_eq!(list.best_fit(1, u64::MAX), None);
    }

    /// One step against the list and the model.
    #[derive(Clone, Debug)]
    enum Step {
        /// Insert a block of `size` at a fresh address.
        Insert(u64),
        /// Remove the listed block at this index (modulo the count) of the model's order.
        Remove(usize),
        /// Ask for a best fit, with a cap.
        Fit(u64, u64),
        /// Take the best fit out, with a cap.
        Take(u64, u64),
    }

    /// Sizes around class boundaries, in the small and large ranges, and huge ones.
    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![
            (1u64..64).prop_map(|units| units * 512),
            (1u64..4096).prop_map(|units| units * 512),
            (1u64..(1 << 20)).prop_map(|units| units * 512),
            (20u32..56).prop_map(|exponent| 1u64 << exponent),
            1u64..(1 << 56),
        ]
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => size().prop_map(Step::Insert),
            2 => any::<usize>().prop_map(Step::Remove),
            3 => (size(), prop_oneof![Just(u64::MAX), size()]).prop_map(|(s, m)| Step::Fit(s, m)),
            1 => (size(), prop_oneof![Just(u64::MAX), size()]).prop_map(|(s, m)| Step::Take(s, m)),
        ]
    }

    /// Runs `steps` against a list and a `BTreeSet<(size, addr, key)>` model and checks
    /// they answer alike: best fits, takes, iteration orders, largest, count and bytes.
    fn check_against_model(steps: Vec<Step>) -> Result<(), TestCaseError> {
        let mut list = FreeList::default();
        let mut model: BTreeSet<(u64, u64, BlockKey)> = BTreeSet::new();
        let (mut next_addr, mut model_bytes) = (0u64, 0u64);
        for step in steps {
            match step {
                Step::Insert(size) => {
                    next_addr += 512;
                    let key = next_addr as usize / 512;
                    list.insert(size, next_addr, key);
                    model.insert((size, next_addr, key));
                    model_bytes += size;
                }
                Step::Remove(index) => {
                    if let Some(&(size, addr, key)) = model.iter().nth(index % model.len().max(1)) {
                        list.remove(size, addr, key);
                        model.remove(&(size, addr, key));
                        model_bytes -= size;
                        prop_assert!(!list.contains(size, addr, key));
                    }
                }
                Step::Fit(size, max) => {
                    let expected = model
                        .range((size, 0, 0)..)
                        .next()
                        .copied()
                        .filter(|(found, _, _)| *found <= max);
                    prop_assert_eq!(list.best_fit(size, max), expected);
                    let at_least: Vec<_> = list.keys_at_least(size).collect();
                    let modelled: Vec<_> = model.range((size, 0, 0)..).map(|e| e.2).collect();
                    prop_assert_eq!(at_least, modelled);
                }
                Step::Take(size, max) => {
                    let expected = model
                        .range((size, 0, 0)..)
                        .next()
                        .copied()
                        .filter(|(found, _, _)| *found <= max);
                    if let Some(found) = expected {
                        model.remove(&found);
                        model_bytes -= found.0;
                    }
                    prop_assert_eq!(list.take_best_fit(size, max), expected);
                }
            }
            prop_assert_eq!(list.len(), model.len());
            prop_assert_eq!(list.bytes(), model_bytes);
            prop_assert_eq!(list.largest(), model.last().map_or(0, |e| e.0));
        }
        let keys: Vec<_> = list.keys().collect();
        let modelled: Vec<_> = model.iter().map(|e| e.2).collect();
        prop_assert_eq!(keys, modelled);
        for &(size, addr, key) in &model {
            prop_assert!(list.contains(size, addr, key));
        }
        Ok(())
    }

    /// Sizes of one class (64 to 71 units), so that it grows past [`LONG_AT`] blocks.
    fn crowded_size() -> impl Strategy<Value = u64> {
        (64u64..72).prop_map(|units| units * 512)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Spread over many classes, each short.
        #[test]
        fn matches_the_btreeset_model(steps in proptest::collection::vec(step(), 1..300)) {
            check_against_model(steps)?;
        }

        /// One class filled past [`LONG_AT`] (a B-tree), then drained below [`SHORT_AT`]
        /// (a vector again), with searches from below, inside and above it throughout.
        #[test]
        fn a_crowded_class_matches_the_btreeset_model(
            fill in proptest::collection::vec(crowded_size().prop_map(Step::Insert), 130..300),
            churn in proptest::collection::vec(prop_oneof![
                1 => crowded_size().prop_map(Step::Insert),
                4 => any::<usize>().prop_map(Step::Remove),
                2 => (prop_oneof![Just(512u64), crowded_size(), Just(1 << 20)], Just(u64::MAX))
                    .prop_map(|(s, m)| Step::Fit(s, m)),
                2 => (crowded_size(), prop_oneof![Just(u64::MAX), crowded_size()])
                    .prop_map(|(s, m)| Step::Take(s, m)),
            ], 0..600),
        ) {
            let steps: Vec<Step> = fill.into_iter().chain(churn).collect();
            check_against_model(steps)?;
        }
    }

    #[test]
    fn a_class_converts_both_ways_and_keeps_its_order() {
        let mut list = FreeList::default();
        let class = class_of(64 * 512);
        for i in 0..LONG_AT as u64 {
            // Sizes descending, addresses ascending: the order is by size first.
            list.insert((71 - i % 8) * 512, 0x10_0000 + i * 512, i as usize);
        }
        assert!(matches!(list.classes[class], Class::Long(_)));
        assert_eq!(
            list.best_fit(64 * 512, u64::MAX),
            Some((64 * 512, 0x10_0000 + 7 * 512, 7))
        );
        let mut taken = 0;
        while list.len() > SHORT_AT {
            assert!(list.take_best_fit(1, u64::MAX).is_some());
            taken += 1;
        }
        assert!(matches!(list.classes[class], Class::Short(_)));
        assert_eq!(taken, LONG_AT - SHORT_AT);
        let sizes: Vec<u64> = list.classes[class]
            .iter_at_least(0)
            .map(|e| e.size)
            .collect();
        assert!(sizes.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(list.largest(), 71 * 512);
    }
}
