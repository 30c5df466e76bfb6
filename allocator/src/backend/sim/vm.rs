//! The simulated device's virtual memory: address reservations, the mappings made into
//! them, and the physical pages behind the mappings.
//!
//! A physical page may be mapped at several virtual addresses at once (`cuMemMap` of one
//! allocation handle into two ranges, which is what stitching does), so the simulator keeps
//! the two apart: every mapping translates a virtual range to a physical one, and the race
//! detector's shadow memory is keyed by physical address for mapped memory. A byte written
//! through one mapping and read through another is then one byte, and an unordered pair of
//! such accesses is a race like any other.
//!
//! A physical page is counted by the mappings that hold it: it stays allocated (and counted
//! against the device's capacity) until the last of them is unmapped, as the driver keeps
//! an allocation alive while any mapping of it remains. Physical addresses are never
//! reused, so a touch of memory that went back to the device is always caught.

use super::shadow::OpRef;
use std::collections::BTreeMap;

/// Where physical addresses of mapped pages start: far from every virtual address the
/// simulator hands out, so the shadow memory can key whole segments by virtual address
/// and mapped pages by physical address without overlap.
const PHYSICAL_BASE: u64 = 1 << 56;

/// One mapping: a virtual range backed by a physical one of the same length.
#[derive(Debug)]
struct Mapping {
    /// One past the last virtual byte.
    end: u64,
    /// Physical address of the first byte.
    physical: u64,
    /// The latest operation of each stream that touched memory through this mapping: what
    /// must be complete before it is unmapped.
    users: Vec<OpRef>,
    /// A second mapping of pages mapped elsewhere first (a stitched range, an IPC import):
    /// it has no allocation of its own to export.
    alias: bool,
}

/// A mapping as IPC sees it: the allocation behind it, mapped there first or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Allocation {
    /// First virtual byte of the mapping.
    pub(super) start: u64,
    /// Bytes.
    pub(super) len: u64,
    /// Physical address of its first byte.
    pub(super) physical: u64,
    /// A second mapping (see [`Mapping`]'s field).
    pub(super) alias: bool,
}

/// A stretch of a virtual range and the physical bytes behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    /// First virtual byte.
    pub(super) virt: u64,
    /// Bytes.
    pub(super) len: u64,
    /// Physical address of `virt`.
    pub(super) physical: u64,
    /// The mapping it lies in (its first virtual byte).
    mapping: u64,
    /// It covers its mapping whole: what a driver can map a second time.
    pub(super) whole: bool,
}

/// What unmapping a range gave back or left behind.
#[derive(Debug, Default)]
pub(super) struct Unmapped {
    /// Physical ranges no mapping holds any more, with the virtual address they were
    /// unmapped from: returned to the device.
    pub(super) released: Vec<Piece>,
    /// Operations that touched memory through the unmapped mappings (a caller checks that
    /// the host has seen them complete).
    pub(super) users: Vec<(OpRef, u64, u64)>,
}

/// Reservations, mappings and physical pages of one simulated device.
#[derive(Debug, Default)]
pub(super) struct VirtualMemory {
    /// Address reservations: start → size.
    reservations: BTreeMap<u64, u64>,
    /// Every mapping, by first virtual byte. Each `map_pages` call is one mapping (one
    /// physical allocation); an `alias_pages` call makes one per mapping it copies from.
    mappings: BTreeMap<u64, Mapping>,
    /// Physical page → the number of mappings that hold it.
    page_refs: BTreeMap<u64, u32>,
    /// The next physical address to hand out.
    next_physical: u64,
    /// Bytes of physical pages held by at least one mapping.
    pub(super) physical_bytes: u64,
}

impl VirtualMemory {
    /// Records a reservation of `size` bytes at `addr`.
    pub(super) fn reserve(&mut self, addr: u64, size: u64) {
        self.reservations.insert(addr, size);
    }

    /// The size of the reservation at `addr`, if there is one.
    pub(super) fn reservation(&self, addr: u64) -> Option<u64> {
        self.reservations.get(&addr).copied()
    }

    /// Forgets the reservation at `addr`.
    pub(super) fn release(&mut self, addr: u64) {
        self.reservations.remove(&addr);
    }

    /// True if one reservation contains all of `[start, end)`.
    pub(super) fn reserved(&self, start: u64, end: u64) -> bool {
        self.reservations
            .range(..=start)
            .next_back()
            .is_some_and(|(at, size)| end <= at + size)
    }

    /// True if any byte of `[start, end)` is mapped.
    pub(super) fn any_mapped(&self, start: u64, end: u64) -> bool {
        self.mappings
            .range(..end)
            .next_back()
            .is_some_and(|(_, mapping)| mapping.end > start)
    }

    /// The pieces that back all of `[start, end)`, in order; `None` if some byte of it is
    /// not mapped.
    pub(super) fn translate(&self, start: u64, end: u64) -> Option<Vec<Piece>> {
        let (&first, _) = self.mappings.range(..=start).next_back()?;
        let mut pieces = Vec::new();
        let mut cursor = start;
        for (&at, mapping) in self.mappings.range(first..) {
            if cursor >= end {
                break;
            }
            if at > cursor || mapping.end <= cursor {
                return None;
            }
            let to = mapping.end.min(end);
            pieces.push(Piece {
                virt: cursor,
                len: to - cursor,
                physical: mapping.physical + (cursor - at),
                mapping: at,
                whole: cursor == at && to == mapping.end,
            });
            cursor = to;
        }
        (cursor >= end).then_some(pieces)
    }

    /// Maps fresh physical pages of `page` bytes each over `[start, end)`, which the caller
    /// checked is reserved and unmapped: one allocation (one mapping), or one per page.
    pub(super) fn map_fresh(&mut self, start: u64, end: u64, page: u64, per_page: bool) {
        let physical = self.next_physical.max(PHYSICAL_BASE);
        self.next_physical = physical + (end - start);
        if per_page {
            for at in (start..end).step_by(page as usize) {
                self.insert(at, at + page, physical + (at - start), page, false);
            }
        } else {
            self.insert(start, end, physical, page, false);
        }
    }

    /// Maps the physical pages behind `source` (from [`VirtualMemory::translate`]) again,
    /// contiguously from `dst`, which the caller checked is reserved and unmapped.
    pub(super) fn map_alias(&mut self, dst: u64, source: &[Piece], page: u64) {
        let mut at = dst;
        for piece in source {
            self.insert(at, at + piece.len, piece.physical, page, true);
            at += piece.len;
        }
    }

    /// Maps the physical ranges `allocations` (first byte, bytes) again, back to back from
    /// `dst`, which the caller checked is reserved and unmapped: another process's
    /// allocations imported through IPC.
    pub(super) fn map_imported(&mut self, dst: u64, allocations: &[(u64, u64)], page: u64) {
        let mut at = dst;
        for &(physical, len) in allocations {
            self.insert(at, at + len, physical, page, true);
            at += len;
        }
    }

    /// The mappings covering `[start, end)`, from the one holding `start` on, each
    /// following the last without a gap; `None` if some byte is not mapped.
    pub(super) fn allocations_over(&self, start: u64, end: u64) -> Option<Vec<Allocation>> {
        let end = end.max(start + 1);
        let (&first, holding) = self.mappings.range(..=start).next_back()?;
        if holding.end <= start {
            return None;
        }
        let mut out = Vec::new();
        let mut cursor = first;
        for (&at, mapping) in self.mappings.range(first..) {
            if cursor >= end {
                break;
            }
            if at != cursor {
                return None;
            }
            out.push(Allocation {
                start: at,
                len: mapping.end - at,
                physical: mapping.physical,
                alias: mapping.alias,
            });
            cursor = mapping.end;
        }
        (cursor >= end).then_some(out)
    }

    fn insert(&mut self, start: u64, end: u64, physical: u64, page: u64, alias: bool) {
        for offset in (0..end - start).step_by(page as usize) {
            let refs = self.page_refs.entry(physical + offset).or_insert(0);
            if *refs == 0 {
                self.physical_bytes += page;
            }
            *refs += 1;
        }
        self.mappings.insert(
            start,
            Mapping {
                end,
                physical,
                users: Vec::new(),
                alias,
            },
        );
    }

    /// The first virtual bytes of the mappings that tile `[start, end)` exactly; `None` if
    /// the range is not a run of whole mappings (`cuMemUnmap`'s rule).
    pub(super) fn whole_mappings(&self, start: u64, end: u64) -> Option<Vec<u64>> {
        let mut covered = start;
        let mut starts = Vec::new();
        for (&at, mapping) in self.mappings.range(start..end) {
            if at != covered || mapping.end > end {
                return None;
            }
            starts.push(at);
            covered = mapping.end;
        }
        (covered == end && !starts.is_empty()).then_some(starts)
    }

    /// Unmaps the mappings starting at `starts` (from [`VirtualMemory::whole_mappings`]):
    /// their pages go back to the device where no other mapping holds them.
    pub(super) fn unmap(&mut self, starts: &[u64], page: u64) -> Unmapped {
        let mut result = Unmapped::default();
        for at in starts {
            let mapping = self.mappings.remove(at).expect("listed by whole_mappings");
            for user in &mapping.users {
                result.users.push((*user, *at, mapping.end));
            }
            for offset in (0..mapping.end - at).step_by(page as usize) {
                let physical = mapping.physical + offset;
                let refs = self.page_refs.get_mut(&physical).expect("mapped page");
                *refs -= 1;
                if *refs > 0 {
                    continue;
                }
                self.page_refs.remove(&physical);
                self.physical_bytes -= page;
                match result.released.last_mut() {
                    Some(last) if last.physical + last.len == physical => last.len += page,
                    _ => result.released.push(Piece {
                        virt: at + offset,
                        len: page,
                        physical,
                        mapping: *at,
                        whole: false,
                    }),
                }
            }
        }
        result
    }

    /// Notes that `op` touched memory through the mapping of `piece`.
    pub(super) fn note_use(&mut self, piece: &Piece, op: OpRef) {
        let mapping = self.mappings.get_mut(&piece.mapping).expect("translated");
        match mapping.users.iter_mut().find(|u| u.stream == op.stream) {
            Some(user) => *user = op,
            None => mapping.users.push(op),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 2 << 20;

    #[test]
    fn an_alias_shares_physical_pages_that_outlive_the_first_mapping() {
        let mut vm = VirtualMemory::default();
        vm.reserve(0, 8 * PAGE);
        vm.map_fresh(0, 2 * PAGE, PAGE, false);
        vm.map_fresh(2 * PAGE, 3 * PAGE, PAGE, false);
        assert_eq!(vm.physical_bytes, 3 * PAGE);
        let source = vm.translate(PAGE, 3 * PAGE).unwrap();
        assert_eq!(source.len(), 2, "one piece per mapping it spans");
        vm.map_alias(4 * PAGE, &source, PAGE);
        assert_eq!(vm.physical_bytes, 3 * PAGE, "an alias allocates nothing");
        let alias = vm.translate(4 * PAGE, 6 * PAGE).unwrap();
        assert_eq!(alias[0].physical, source[0].physical);
        assert_eq!(alias[1].physical, source[1].physical);
        // `cuMemUnmap` takes whole mappings only.
        assert!(vm.whole_mappings(0, PAGE).is_none());
        let starts = vm.whole_mappings(0, 3 * PAGE).unwrap();
        let unmapped = vm.unmap(&starts, PAGE);
        assert_eq!(unmapped.released.len(), 1);
        assert_eq!(unmapped.released[0].len, PAGE, "the page no alias holds");
        assert_eq!(vm.physical_bytes, 2 * PAGE);
        let starts = vm.whole_mappings(4 * PAGE, 6 * PAGE).unwrap();
        vm.unmap(&starts, PAGE);
        assert_eq!(vm.physical_bytes, 0);
        assert!(!vm.any_mapped(0, 8 * PAGE));
    }

    #[test]
    fn allocations_over_a_range_are_whole_mappings_and_say_which_are_second_mappings() {
        let mut vm = VirtualMemory::default();
        vm.reserve(0, 8 * PAGE);
        vm.map_fresh(0, 3 * PAGE, PAGE, true);
        let source = vm.translate(PAGE, 3 * PAGE).unwrap();
        vm.map_alias(4 * PAGE, &source, PAGE);
        let first = vm.allocations_over(PAGE + 1, 2 * PAGE + 1).unwrap();
        assert_eq!(
            first
                .iter()
                .map(|a| (a.start, a.len, a.alias))
                .collect::<Vec<_>>(),
            [(PAGE, PAGE, false), (2 * PAGE, PAGE, false)],
            "the whole pages the range touches"
        );
        let second = vm.allocations_over(4 * PAGE, 6 * PAGE).unwrap();
        assert!(second.iter().all(|a| a.alias));
        assert_eq!(second[0].physical, first[0].physical);
        assert!(vm.allocations_over(3 * PAGE, 4 * PAGE).is_none(), "a gap");
        assert!(
            vm.allocations_over(2 * PAGE, 5 * PAGE).is_none(),
            "a gap inside"
        );
    }

    #[test]
    fn a_gap_in_the_mappings_fails_translation() {
        let mut vm = VirtualMemory::default();
        vm.reserve(0, 8 * PAGE);
        vm.map_fresh(0, PAGE, PAGE, false);
        vm.map_fresh(2 * PAGE, 3 * PAGE, PAGE, false);
        assert!(vm.translate(0, PAGE).is_some());
        assert!(vm.translate(0, PAGE + 1).is_none());
        assert!(vm.translate(PAGE, 2 * PAGE).is_none());
        assert!(vm.reserved(0, 8 * PAGE) && !vm.reserved(0, 8 * PAGE + 1));
    }
}
