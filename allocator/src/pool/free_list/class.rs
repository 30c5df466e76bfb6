//! One size class of a free list: its blocks sorted by `(size, address)`, in a vector
//! while few, in a B-tree once many, and the function that says which class a size is in
//! (see the structure in [`super`]).

use super::BlockKey;
use std::collections::BTreeSet;

/// Classes per octave of sizes (a power of two).
pub(super) const SUB_BITS: u32 = 3;
pub(super) const SUBS: usize = 1 << SUB_BITS;
/// Sizes are counted in units of `1 << UNIT_SHIFT` bytes (the minimum block size) when
/// choosing a class; any size is accepted.
pub(super) const UNIT_SHIFT: u32 = 9;
/// Classes needed for every `u64` size: the highest unit count has exponent 54.
pub(super) const CLASSES: usize = (64 - UNIT_SHIFT as usize - SUB_BITS as usize + 1) * SUBS;
/// Words of the non-empty-class bitmap.
pub(super) const WORDS: usize = CLASSES.div_ceil(64);

/// The class of a size: monotone non-decreasing in `size`.
#[inline]
pub(super) fn class_of(size: u64) -> usize {
    let units = size >> UNIT_SHIFT;
    if units < SUBS as u64 {
        return units as usize;
    }
    let exponent = 63 - units.leading_zeros();
    let sub = (units >> (exponent - SUB_BITS)) as usize - SUBS;
    (exponent - SUB_BITS + 1) as usize * SUBS + sub
}

/// One free block. Ordered by `(size, addr, key)`; `(size, addr)` alone is unique.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) size: u64,
    pub(super) addr: u64,
    pub(super) key: BlockKey,
}

impl Ord for Entry {
    #[inline]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.order(), self.key).cmp(&(other.order(), other.key))
    }
}

impl PartialOrd for Entry {
    #[inline]
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Entry {
    /// `(size, addr)` as one number, compared in one step.
    #[inline]
    pub(super) fn order(&self) -> u128 {
        (u128::from(self.size) << 64) | u128::from(self.addr)
    }

    /// The first entry of at least `size` bytes sorts at or after this one.
    pub(super) fn lowest_of(size: u64) -> Self {
        Entry {
            size,
            addr: 0,
            key: 0,
        }
    }
}

/// What [`Class::take_first_at_least`] found.
pub(super) enum Take {
    Taken(Entry),
    /// The first entry large enough is larger than allowed (and stays listed).
    TooLarge,
    /// No entry is large enough.
    NoneAtLeast,
}

/// A class that reaches this many blocks becomes a B-tree...
pub(super) const LONG_AT: usize = 128;
/// ...and a B-tree that falls to this many becomes a vector again (the gap keeps a class
/// near the boundary from converting back and forth).
pub(super) const SHORT_AT: usize = 32;

/// The blocks of one size class in order: a sorted vector while short (a binary search
/// and a shift of a few entries, no allocation), a B-tree once long, so that a class
/// crowded with thousands of same-size blocks costs O(log n) per change instead of a shift
/// of all of them (`benches/engine.rs`, `crowded_size_class`).
#[derive(Debug)]
pub(super) enum Class {
    Short(Vec<Entry>),
    Long(BTreeSet<Entry>),
}

impl Default for Class {
    fn default() -> Self {
        Class::Short(Vec::new())
    }
}

impl Class {
    #[inline]
    pub(super) fn len(&self) -> usize {
        match self {
            Class::Short(entries) => entries.len(),
            Class::Long(entries) => entries.len(),
        }
    }

    /// The first entry of at least `size` bytes.
    #[inline]
    pub(super) fn first_at_least(&self, size: u64) -> Option<Entry> {
        match self {
            Class::Short(entries) => {
                let at = entries.partition_point(|e| e.size < size);
                entries.get(at).copied()
            }
            Class::Long(entries) => entries.range(Entry::lowest_of(size)..).next().copied(),
        }
    }

    /// Takes out the first entry of at least `size` bytes, unless it is larger than
    /// `max_size`: a short class is searched once, where a lookup and a removal would
    /// search it twice.
    #[inline]
    pub(super) fn take_first_at_least(&mut self, size: u64, max_size: u64) -> Take {
        let found = match self {
            Class::Short(entries) => {
                let at = entries.partition_point(|e| e.size < size);
                match entries.get(at) {
                    None => return Take::NoneAtLeast,
                    Some(e) if e.size > max_size => return Take::TooLarge,
                    Some(&e) => {
                        remove_shifting(entries, at);
                        return Take::Taken(e);
                    }
                }
            }
            Class::Long(entries) => match entries.range(Entry::lowest_of(size)..).next() {
                None => return Take::NoneAtLeast,
                Some(e) if e.size > max_size => return Take::TooLarge,
                Some(&e) => e,
            },
        };
        self.remove(&found);
        Take::Taken(found)
    }

    #[inline]
    pub(super) fn first(&self) -> Option<Entry> {
        match self {
            Class::Short(entries) => entries.first().copied(),
            Class::Long(entries) => entries.first().copied(),
        }
    }

    pub(super) fn last(&self) -> Option<Entry> {
        match self {
            Class::Short(entries) => entries.last().copied(),
            Class::Long(entries) => entries.last().copied(),
        }
    }

    /// Adds `entry`; false if it was there already.
    #[inline]
    pub(super) fn insert(&mut self, entry: Entry) -> bool {
        match self {
            Class::Short(entries) => {
                let at = entries.partition_point(|e| e.order() < entry.order());
                if entries.get(at).is_some_and(|e| e.order() == entry.order()) {
                    return false;
                }
                insert_shifting(entries, at, entry);
                if entries.len() >= LONG_AT {
                    *self = Class::Long(entries.drain(..).collect());
                }
                true
            }
            Class::Long(entries) => entries.insert(entry),
        }
    }

    /// Removes `entry`; false if it was not there.
    #[inline]
    pub(super) fn remove(&mut self, entry: &Entry) -> bool {
        match self {
            Class::Short(entries) => {
                let at = entries.partition_point(|e| e.order() < entry.order());
                if entries.get(at) != Some(entry) {
                    return false;
                }
                remove_shifting(entries, at);
                true
            }
            Class::Long(entries) => {
                if !entries.remove(entry) {
                    return false;
                }
                if entries.len() <= SHORT_AT {
                    // A BTreeSet iterates in order: the vector comes out sorted.
                    *self = Class::Short(std::mem::take(entries).into_iter().collect());
                }
                true
            }
        }
    }

    pub(super) fn contains(&self, entry: &Entry) -> bool {
        match self {
            Class::Short(entries) => {
                let at = entries.partition_point(|e| e.order() < entry.order());
                entries.get(at) == Some(entry)
            }
            Class::Long(entries) => entries.contains(entry),
        }
    }

    /// Entries of at least `size` bytes, in order.
    pub(super) fn iter_at_least(&self, size: u64) -> impl Iterator<Item = &Entry> {
        let (short, long) = match self {
            Class::Short(entries) => {
                let at = entries.partition_point(|e| e.size < size);
                (Some(entries[at..].iter()), None)
            }
            Class::Long(entries) => (None, Some(entries.range(Entry::lowest_of(size)..))),
        };
        short
            .into_iter()
            .flatten()
            .chain(long.into_iter().flatten())
    }
}

/// `entries.insert(at, entry)` for a short class, shifting with swaps. `Vec::insert`
/// shifts with a call to libc's `memmove`, whose code is one more place a Python loop
/// fetches from L2 on every call; a class holds a few entries, so swaps cost less.
#[inline]
pub(super) fn insert_shifting(entries: &mut Vec<Entry>, at: usize, entry: Entry) {
    entries.push(entry);
    for index in (at + 1..entries.len()).rev() {
        entries.swap(index, index - 1);
    }
}

/// `entries.remove(at)` for a short class, shifting with swaps (see [`insert_shifting`]).
#[inline]
pub(super) fn remove_shifting(entries: &mut Vec<Entry>, at: usize) {
    for index in at + 1..entries.len() {
        entries.swap(index - 1, index);
    }
    entries.pop();
}
