//! Waking a sleeping memory pool, and the invariants of sleeping memory: the second half
//! of `allocator::sleep` (see its docs for the whole).

use super::*;
use crate::error::SleepError;
use crate::pool::sleep::wake_pieces;
use crate::types::HostPtr;

impl State {
    /// See [`Allocator::wake`].
    pub(super) fn wake_pools<B: Backend>(
        &mut self,
        backend: &B,
        pools: &[PoolId],
    ) -> Result<WakeReport, AllocError> {
        if self.pools.capture_underway() {
            return Err(SleepError::CaptureUnderway.into());
        }
        let mut pieces: Vec<(PoolId, Vec<(u64, u64)>)> = Vec::new();
        let mut total = 0;
        for &pool in pools {
            let Some(asleep) = self.tags.get(pool).and_then(|t| t.asleep.as_ref()) else {
                return Err(SleepError::NotAsleep(self.tag_name(pool)).into());
            };
            total += asleep.bytes;
            pieces.push((pool, wake_pieces(&asleep.mappings)));
        }
        let names = pools
            .iter()
            .map(|&p| format!("{:?}", self.tag_name(p)))
            .collect::<Vec<_>>()
            .join(", ");
        let no_room = |why: String| SleepError::NoRoom {
            tags: names.clone(),
            bytes: total,
            why,
        };
        if !self.fits_limit(total) {
            self.release_cached(backend)?;
            if !self.fits_limit(total) {
                let limit = self.limit.unwrap_or(u64::MAX);
                let room = limit.saturating_sub(self.stats.reserved_bytes.current);
                return Err(no_room(format!(
                    "the memory limit {} leaves {}",
                    crate::config::format_bytes(limit),
                    crate::config::format_bytes(room)
                ))
                .into());
            }
        }
        // Map everything first; if the device refuses after cached memory went back, undo.
        let mut mapped: Vec<(u64, u64)> = Vec::new();
        let mut released = false;
        for (_, list) in &pieces {
            for &(at, len) in list {
                let mut result = backend.map_pages_whole(DevicePtr(at), len);
                if result.as_ref().is_err_and(|e| e.out_of_memory) && !released {
                    released = true;
                    self.release_cached(backend)?;
                    result = backend.map_pages_whole(DevicePtr(at), len);
                }
                if let Err(err) = result {
                    for &(done, done_len) in &mapped {
                        // Untouched: unmapping needs no synchronisation.
                        backend.unmap_pages(DevicePtr(done), done_len)?;
                    }
                    return Err(if err.out_of_memory {
                        no_room(err.to_string()).into()
                    } else {
                        err.into()
                    });
                }
                mapped.push((at, len));
            }
        }
        let mut report = WakeReport::default();
        for (pool, list) in pieces {
            let owner = self.owner_of(pool, &list);
            for (at, len) in list {
                let vmm = self.growth.expandable_mut().expect("expandable");
                vmm.add_mapping_as(at, len, false);
                vmm.mapped += len;
                // Reserved again, in PyTorch's terms too (one device call).
                self.count_mapped(at, len, len);
                self.stats.sleeping_bytes -= len;
                self.note(backend, TraceAction::Wake, at, len, owner);
                report.mapped += len;
            }
            let tag = self.tags.get_mut(pool).expect("a tagged pool");
            let asleep = tag.asleep.take().expect("checked asleep");
            let (Some(runs), Some(buffer)) = (asleep.backup, tag.buffer) else {
                continue;
            };
            for run in runs {
                if let Err(source) = backend.copy_to_device(
                    DevicePtr(run.device),
                    HostPtr(buffer.ptr.0 + run.host_offset),
                    run.len,
                ) {
                    return Err(SleepError::PartWay {
                        what: "restoring",
                        tag: tag.name.clone(),
                        done: report.restored,
                        source,
                    }
                    .into());
                }
                report.copies += 1;
                report.restored += run.len;
            }
        }
        if report.copies > 0 {
            backend.synchronize_copies()?;
        }
        tracing::debug!(?report, "memory pools awake");
        Ok(report)
    }

    /// The slot that owns the segment holding the first of `pieces`, for the trace.
    pub(super) fn owner_of(&self, pool: PoolId, pieces: &[(u64, u64)]) -> StreamSlot {
        let Some(&(at, _)) = pieces.first() else {
            return StreamSlot::MAX;
        };
        self.pool_segments(pool)
            .into_iter()
            .map(|s| self.arena.segment(s))
            .find(|seg| seg.addr() <= at && at < seg.addr() + seg.size())
            .map_or(StreamSlot::MAX, |seg| seg.stream())
    }

    // ---- Checks --------------------------------------------------------------------------

    /// Bytes of every sleeping pool's mappings (what `reserved_bytes` and the expandable
    /// segments' mapped count leave out).
    pub(super) fn sleeping_bytes(&self) -> u64 {
        self.tags.sleeping_bytes()
    }

    /// Sleeping memory: `sleeping_bytes` and `host_backup_bytes` are what the tags hold; a
    /// sleeping pool has nothing mapped and its mappings lie on its own segments' blocks,
    /// none of them unmapped; a pool with a tag has no stitched range.
    pub(super) fn check_sleep(&self) -> Result<(), String> {
        if self.stats.sleeping_bytes != self.tags.sleeping_bytes() {
            return Err(format!(
                "sleeping_bytes is {} but the sleeping tags hold {}",
                self.stats.sleeping_bytes,
                self.tags.sleeping_bytes()
            ));
        }
        if self.stats.host_backup_bytes != self.tags.host_bytes() {
            return Err(format!(
                "host_backup_bytes is {} but the tags hold {}",
                self.stats.host_backup_bytes,
                self.tags.host_bytes()
            ));
        }
        let Some(vmm) = self.growth.expandable() else {
            return Ok(());
        };
        for (pool, tag) in self.tags.iter() {
            let segments = self.pool_segments(pool);
            if segments
                .iter()
                .any(|&s| self.arena.segment(s).is_stitched())
            {
                return Err(format!("tagged pool {:?} holds a stitched range", tag.name));
            }
            let Some(asleep) = &tag.asleep else {
                continue;
            };
            for &segment in &segments {
                let seg = self.arena.segment(segment);
                if !vmm.whole_mappings(seg.addr(), seg.size()).is_empty() {
                    return Err(format!("sleeping pool {:?} has pages mapped", tag.name));
                }
            }
            for &(at, len) in &asleep.mappings {
                let inside = segments.iter().any(|&segment| {
                    let seg = self.arena.segment(segment);
                    seg.addr() <= at
                        && at + len <= seg.addr() + seg.size()
                        && self.arena.segment_blocks(segment).all(|(_, b)| {
                            !b.is_unmapped() || b.addr() + b.size() <= at || at + len <= b.addr()
                        })
                });
                if !inside {
                    return Err(format!(
                        "sleeping pool {:?}: [{at:#x}, +{len:#x}) is not on its segments' blocks",
                        tag.name
                    ));
                }
            }
        }
        Ok(())
    }
}
