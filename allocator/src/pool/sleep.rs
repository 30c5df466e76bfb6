//! Tags and sleeping memory, the records: which memory pool each tag names, what a
//! sleeping pool gave back (its mappings, to be mapped again at the same addresses) and
//! where its live blocks' contents wait (runs of a page-locked host buffer).
//!
//! A *tag* names one memory pool (`PoolId`) and a pool carries at most one tag. Putting a
//! tag to sleep unmaps every page of its pool's expandable segments and keeps everything
//! else: the address reservations, the blocks that tile them (live ones stay allocated,
//! so their addresses stay valid) and, with a backup, their bytes on the host. So a
//! sleeping pool is wholly asleep: each of its segments has no page mapped, and
//!
//! `Σ bytes of the sleeping tags' mappings == sleeping_bytes`,
//!
//! which `reserved_bytes` no longer counts. The policy (waiting for the pool's streams,
//! copying, unmapping, mapping again) lives in `allocator::sleep`; this module holds the
//! records and their arithmetic.

use crate::types::{HostPtr, PoolId};
use std::collections::{BTreeMap, HashMap};

/// The longest a tag may be, in bytes: it appears in one-line messages.
pub const MAX_TAG_LEN: usize = 256;

/// Live blocks closer than this in one mapped stretch are copied as one run (the free
/// bytes between them with them): a copy call costs about what moving this many bytes does
/// (~10 µs at 25 GB/s), so joining them makes fewer, larger copies for no loss.
pub(crate) const BACKUP_GAP: u64 = 256 << 10;

/// Waking maps contiguous pages in physical allocations of at most this many bytes: the
/// driver's cost is per allocation far more than per byte (a 2 MiB page ~60 µs to create,
/// map and grant access to and ~45 µs to unmap and release on an H100; a 512 MiB allocation
/// ~2 µs per 2 MiB for all of it on an H200), so 40 GiB take 40 allocations, not 20,480.
pub(crate) const WAKE_PIECE: u64 = 1 << 30;

/// One contiguous stretch of live blocks' bytes and where it waits in the host buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BackupRun {
    /// First device byte.
    pub(crate) device: u64,
    /// Its offset in the host buffer.
    pub(crate) host_offset: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// A page-locked host buffer of the backend's, kept by a tag between sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HostBuffer {
    /// Its address.
    pub(crate) ptr: HostPtr,
    /// Its bytes.
    pub(crate) size: u64,
}

/// What a sleeping tag gave back and kept.
#[derive(Debug)]
pub(crate) struct Asleep {
    /// The mappings unmapped, `(address, bytes)` in address order: the addresses waking
    /// maps again.
    pub(crate) mappings: Vec<(u64, u64)>,
    /// Their bytes.
    pub(crate) bytes: u64,
    /// Where the live blocks' bytes wait in the tag's host buffer; `None` without a
    /// backup (waking then maps fresh pages and restores nothing).
    pub(crate) backup: Option<Vec<BackupRun>>,
}

/// One tag.
#[derive(Debug)]
pub(crate) struct Tag {
    /// Its name.
    pub(crate) name: String,
    /// While asleep: what it gave back and kept.
    pub(crate) asleep: Option<Asleep>,
    /// The host buffer of its last backup, kept for the next one (pinning host memory
    /// costs far more than copying into it), until released.
    pub(crate) buffer: Option<HostBuffer>,
}

/// Every tag of one allocator.
#[derive(Debug, Default)]
pub(crate) struct TagTable {
    /// Name → pool.
    by_name: BTreeMap<String, PoolId>,
    /// Pool → its tag.
    by_pool: HashMap<PoolId, Tag>,
}

/// Why a name cannot be a tag, or a pool cannot take it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TagRefusal {
    /// Empty, too long, or with control characters.
    BadName,
    /// The name already names this other pool.
    NameTaken(PoolId),
    /// The pool already carries this other tag.
    PoolTagged(String),
}

impl TagTable {
    /// Tags `pool` with `name`; tagging a pool again with its own tag changes nothing.
    pub(crate) fn tag(&mut self, pool: PoolId, name: &str) -> Result<(), TagRefusal> {
        if !valid_name(name) {
            return Err(TagRefusal::BadName);
        }
        match (self.by_name.get(name), self.by_pool.get(&pool)) {
            (Some(&named), _) if named == pool => return Ok(()),
            (Some(&named), _) => return Err(TagRefusal::NameTaken(named)),
            (None, Some(tag)) => return Err(TagRefusal::PoolTagged(tag.name.clone())),
            (None, None) => {}
        }
        self.by_name.insert(name.to_owned(), pool);
        self.by_pool.insert(
            pool,
            Tag {
                name: name.to_owned(),
                asleep: None,
                buffer: None,
            },
        );
        Ok(())
    }

    /// The pool `name` tags.
    pub(crate) fn pool(&self, name: &str) -> Option<PoolId> {
        self.by_name.get(name).copied()
    }

    /// The tag of `pool`, if it has one.
    pub(crate) fn get(&self, pool: PoolId) -> Option<&Tag> {
        self.by_pool.get(&pool)
    }

    /// The tag of `pool`, if it has one.
    pub(crate) fn get_mut(&mut self, pool: PoolId) -> Option<&mut Tag> {
        self.by_pool.get_mut(&pool)
    }

    /// True if `pool` carries a tag: its memory is mapped whole and never stitched.
    #[inline]
    pub(crate) fn is_tagged(&self, pool: PoolId) -> bool {
        !self.by_pool.is_empty() && self.by_pool.contains_key(&pool)
    }

    /// The tag of `pool` if it is asleep.
    #[inline]
    pub(crate) fn asleep(&self, pool: PoolId) -> Option<&Tag> {
        if self.by_pool.is_empty() {
            return None;
        }
        self.by_pool.get(&pool).filter(|tag| tag.asleep.is_some())
    }

    /// Every tag, by name, with its pool.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (PoolId, &Tag)> + '_ {
        self.by_name
            .values()
            .map(|&pool| (pool, &self.by_pool[&pool]))
    }

    /// Every tag's name, in order.
    pub(crate) fn names(&self) -> Vec<String> {
        self.by_name.keys().cloned().collect()
    }

    /// Bytes of every sleeping tag's mappings.
    pub(crate) fn sleeping_bytes(&self) -> u64 {
        self.by_pool
            .values()
            .filter_map(|tag| tag.asleep.as_ref())
            .map(|asleep| asleep.bytes)
            .sum()
    }

    /// Bytes of the host buffers the tags hold.
    pub(crate) fn host_bytes(&self) -> u64 {
        self.by_pool
            .values()
            .filter_map(|tag| tag.buffer)
            .map(|buffer| buffer.size)
            .sum()
    }
}

/// True if `name` can be a tag: 1 to [`MAX_TAG_LEN`] bytes, no control characters.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_TAG_LEN && !name.chars().any(char::is_control)
}

/// The runs to copy for a backup: `blocks` is one segment's blocks in address order, as
/// `(address, bytes, live, mapped)`; live blocks (and the mapped bytes between live blocks
/// less than [`BACKUP_GAP`] apart) form runs, laid out back to back from `host_offset`.
/// Returns the runs and the offset after them.
pub(crate) fn backup_runs(
    blocks: impl IntoIterator<Item = (u64, u64, bool, bool)>,
    mut host_offset: u64,
) -> (Vec<BackupRun>, u64) {
    let mut runs: Vec<BackupRun> = Vec::new();
    // Whether every byte since the last run's end is mapped (so the run may grow over it).
    let mut bridgeable = false;
    for (addr, size, live, mapped) in blocks {
        if !mapped {
            bridgeable = false;
            continue;
        }
        if !live {
            continue;
        }
        match runs.last_mut() {
            Some(run) if bridgeable && addr - (run.device + run.len) < BACKUP_GAP => {
                let grown = addr + size - (run.device + run.len);
                run.len += grown;
                host_offset += grown;
            }
            _ => {
                runs.push(BackupRun {
                    device: addr,
                    host_offset,
                    len: size,
                });
                host_offset += size;
            }
        }
        bridgeable = true;
    }
    (runs, host_offset)
}

/// `mappings` (address order) joined where contiguous into pieces of at most
/// [`WAKE_PIECE`] bytes (a mapping larger than that stays whole).
pub(crate) fn wake_pieces(mappings: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut pieces: Vec<(u64, u64)> = Vec::new();
    for &(addr, len) in mappings {
        match pieces.last_mut() {
            Some(last) if last.0 + last.1 == addr && last.1 + len <= WAKE_PIECE => last.1 += len,
            _ => pieces.push((addr, len)),
        }
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_tag_names_one_pool_and_a_pool_carries_one_tag() {
        let mut tags = TagTable::default();
        let (kv, weights) = (PoolId(0, 1), PoolId(0, 2));
        assert_eq!(tags.tag(kv, "kv_cache"), Ok(()));
        assert_eq!(tags.tag(kv, "kv_cache"), Ok(()), "again: no change");
        assert_eq!(
            tags.tag(weights, "kv_cache"),
            Err(TagRefusal::NameTaken(kv))
        );
        assert_eq!(
            tags.tag(kv, "weights"),
            Err(TagRefusal::PoolTagged("kv_cache".into()))
        );
        for bad in ["", "a\nb", &"x".repeat(MAX_TAG_LEN + 1)] {
            assert_eq!(tags.tag(weights, bad), Err(TagRefusal::BadName), "{bad:?}");
        }
        assert_eq!(tags.tag(weights, "weights"), Ok(()));
        assert_eq!(tags.names(), ["kv_cache", "weights"]);
        assert_eq!(tags.pool("weights"), Some(weights));
        assert!(tags.is_tagged(kv) && !tags.is_tagged(PoolId(0, 3)));
        assert!(tags.asleep(kv).is_none());
    }

    #[test]
    fn live_blocks_near_each_other_are_copied_as_one_run() {
        let blocks = [
            (0, MIB, true, true),
            (MIB, 4096, false, true),           // a small free gap: bridged
            (MIB + 4096, MIB, true, true),      // joins the first run
            (2 * MIB + 4096, MIB, false, true), // a large free gap: not bridged
            (3 * MIB + 4096, 512, true, true),
            (3 * MIB + 4608, 4096, false, false), // unmapped: never bridged
            (3 * MIB + 8704, 512, true, true),
        ];
        let (runs, end) = backup_runs(blocks, 100);
        assert_eq!(
            runs,
            [
                BackupRun {
                    device: 0,
                    host_offset: 100,
                    len: 2 * MIB + 4096
                },
                BackupRun {
                    device: 3 * MIB + 4096,
                    host_offset: 100 + 2 * MIB + 4096,
                    len: 512
                },
                BackupRun {
                    device: 3 * MIB + 8704,
                    host_offset: 100 + 2 * MIB + 4608,
                    len: 512
                },
            ]
        );
        assert_eq!(end, 100 + 2 * MIB + 5120);
    }

    #[test]
    fn waking_joins_contiguous_mappings_up_to_a_piece() {
        let page = 2 * MIB;
        let pages: Vec<(u64, u64)> = (0..1024).map(|i| (i * page, page)).collect();
        let pieces = wake_pieces(&pages);
        assert_eq!(pieces, [(0, WAKE_PIECE), (WAKE_PIECE, WAKE_PIECE)]);
        let apart = [(0, page), (2 * page, page), (3 * page, 2 * WAKE_PIECE)];
        assert_eq!(
            wake_pieces(&apart),
            [(0, page), (2 * page, page), (3 * page, 2 * WAKE_PIECE)],
            "a gap splits; an oversized mapping stays whole"
        );
    }
}
