//! Sleep and wake, the policy: a tagged memory pool gives its device memory back and takes
//! it again at the same addresses (the records are in `pool::sleep`).
//!
//! Programs that put two phases on one GPU (reinforcement learning's trainer and
//! generator) need one phase's memory gone while the other runs, and back afterwards
//! without recapturing CUDA graphs, which keep raw addresses. Expandable segments already
//! separate addresses (reservations) from memory (mappings), so a pool can give every page
//! back and keep its reservations, its blocks and their addresses:
//!
//! - **Sleep.** Refuse first, changing nothing (unknown or sleeping tag, a capture under
//!   way, whole segments or stitched ranges in the pool). Then record an event on every
//!   stream that may still touch the pool (its blocks' owners, the streams recorded on its
//!   live blocks, the pending events of its free blocks) and wait for them on the host,
//!   once each: the rest of the device runs on. With a backup, copy each run of live blocks to
//!   a page-locked host buffer (one copy per run, joined over small free gaps; the buffer
//!   is kept for the next sleep) and wait for the copies. Then unmap every mapping of the
//!   pool's segments: their memory goes back to the device, `reserved_bytes` falls and
//!   `sleeping_bytes` rises by as much. Blocks stay as they are: live ones allocated, free
//!   ones listed; nothing hands them out, because the pool refuses allocations while
//!   asleep and no other pool's request looks at its blocks.
//! - **Wake.** Map the same addresses again, contiguous mappings joined into large
//!   physical allocations (`pool::sleep::WAKE_PIECE`), all of them before anything else
//!   (if the device or the limit refuses, what was mapped is unmapped, untouched, and the
//!   tags stay asleep), then copy the backup back and wait for the copies.
//! - **Mapped whole.** A tagged pool's memory is never stitched, and its mappings are made
//!   with one physical allocation each (`VirtualMemory::map_pages_whole`), whatever stitching or
//!   a limit ask of other pools: unmapping and mapping cost a driver call per allocation,
//!   so pages mapped one by one would make a 40 GiB sleep take seconds.

use super::*;
use crate::error::SleepError;
use crate::pool::arena::SegmentKey;
use crate::pool::sleep::{backup_runs, Asleep, BackupRun, HostBuffer, TagRefusal};
use crate::types::HostPtr;

/// What sleep does with the contents of a pool's live blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backup {
    /// Nothing: after waking, live blocks hold whatever fresh pages hold (for memory that
    /// is written again before it is read, like a KV cache).
    None,
    /// Copied to page-locked host memory at sleep, back at wake.
    Host,
}

/// What one [`Allocator::sleep`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Bytes of device memory given back.
    pub released: u64,
    /// Bytes copied to host memory.
    pub backed_up: u64,
    /// Copies made (one per run of live blocks).
    pub copies: u64,
}

/// What one [`Allocator::wake`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WakeReport {
    /// Bytes of device memory mapped again.
    pub mapped: u64,
    /// Bytes copied back from host memory.
    pub restored: u64,
    /// Copies made.
    pub copies: u64,
}

/// A tag, as [`Allocator::tags`] describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagInfo {
    /// Its name.
    pub name: String,
    /// The memory pool it names.
    pub pool: PoolId,
    /// Asleep: its memory is back with the device.
    pub asleep: bool,
    /// Bytes of device memory: mapped now if awake, given back if asleep.
    pub bytes: u64,
    /// Bytes of the pool's live blocks.
    pub allocated: u64,
    /// Asleep with its live blocks' contents in host memory.
    pub backed_up: bool,
    /// Bytes of page-locked host memory the tag holds (its backup buffer, kept between
    /// sleeps until [`Allocator::release_host_backup`]).
    pub host_bytes: u64,
}

impl<B: Backend> Allocator<B> {
    /// Tags memory pool `pool` (live, not the default one) with `tag`, so that
    /// [`Allocator::sleep`] and [`Allocator::wake`] can name it. A tag names one pool and a
    /// pool carries one tag; tagging a pool again with its own tag changes nothing. From
    /// now on the pool's memory is mapped in whole physical allocations and never stitched.
    /// Needs expandable segments and memory pools (`graph_pools`).
    pub fn tag_pool(&self, pool: PoolId, tag: &str) -> Result<(), AllocError> {
        if pool.is_default() {
            return Err(AllocError::DefaultPool("tagged"));
        }
        if !self.config.graph_pools {
            return Err(SleepError::NeedsGraphPools.into());
        }
        let mut state = self.state.lock();
        if state.growth.expandable().is_none() {
            return Err(SleepError::NeedsExpandableSegments.into());
        }
        if !state.pools.is_live(pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        state.tags.tag(pool, tag).map_err(|refusal| {
            match refusal {
                TagRefusal::BadName => SleepError::BadTag(tag.to_owned()),
                TagRefusal::NameTaken(pool) => SleepError::TagTaken {
                    tag: tag.to_owned(),
                    pool,
                },
                TagRefusal::PoolTagged(tag) => SleepError::PoolTagged { pool, tag },
            }
            .into()
        })
    }

    /// The memory pool `tag` names, if any.
    pub fn tagged_pool(&self, tag: &str) -> Option<PoolId> {
        self.state.lock().tags.pool(tag)
    }

    /// Every tag, by name.
    pub fn tags(&self) -> Vec<TagInfo> {
        self.state.lock().tag_infos()
    }

    /// Puts the memory pools `tags` name to sleep: waits on the host for the streams that
    /// may still use them, copies their live blocks to page-locked host memory if `backup`
    /// asks, and gives every page back to the device, keeping addresses and blocks (see
    /// the module docs). Refused, with nothing changed, for an unknown or sleeping tag,
    /// while a pool is being allocated to, or for a pool with whole segments or stitched
    /// ranges.
    pub fn sleep(&self, tags: &[&str], backup: Backup) -> Result<SleepReport, AllocError> {
        self.operation(|state| {
            let pools = state.resolve_tags(tags)?;
            state.sleep_pools(&self.backend, &pools, backup)
        })
    }

    /// Wakes the sleeping memory pools `tags` name: maps fresh memory at the addresses
    /// they left and copies their backups back. Refused, with nothing changed, for an
    /// unknown or awake tag, while a pool is being allocated to, or when the limit or the
    /// device has no room (after releasing cached memory).
    pub fn wake(&self, tags: &[&str]) -> Result<WakeReport, AllocError> {
        self.operation(|state| {
            let pools = state.resolve_tags(tags)?;
            state.wake_pools(&self.backend, &pools)
        })
    }

    /// Frees the host buffers that the awake tags `tags` keep for their next backup.
    /// Returns the bytes freed.
    pub fn release_host_backup(&self, tags: &[&str]) -> Result<u64, AllocError> {
        let mut state = self.state.lock();
        let pools = state.resolve_tags(tags)?;
        for &pool in &pools {
            let tag = state.tags.get(pool).expect("resolved");
            if tag.asleep.as_ref().is_some_and(|a| a.backup.is_some()) {
                return Err(SleepError::BackupInUse(tag.name.clone()).into());
            }
        }
        let mut freed = 0;
        for pool in pools {
            if let Some(buffer) = state.tags.get_mut(pool).and_then(|t| t.buffer.take()) {
                self.backend.free_host(buffer.ptr, buffer.size)?;
                state.stats.host_backup_bytes -= buffer.size;
                freed += buffer.size;
            }
        }
        Ok(freed)
    }
}

impl State {
    /// True if `pool`'s memory is mapped whole and never stitched: it carries a tag.
    #[inline]
    pub(super) fn maps_whole(&self, pool: PoolId) -> bool {
        self.tags.is_tagged(pool)
    }

    /// The pools `tags` name, each once, in the order given.
    pub(super) fn resolve_tags(&self, tags: &[&str]) -> Result<Vec<PoolId>, SleepError> {
        if tags.is_empty() {
            return Err(SleepError::NoTags);
        }
        let mut pools = Vec::with_capacity(tags.len());
        for &tag in tags {
            let pool = self.tags.pool(tag).ok_or_else(|| SleepError::UnknownTag {
                tag: tag.to_owned(),
                known: self.tags.names(),
            })?;
            if !pools.contains(&pool) {
                pools.push(pool);
            }
        }
        Ok(pools)
    }

    pub(super) fn tag_name(&self, pool: PoolId) -> String {
        self.tags
            .get(pool)
            .map_or_else(String::new, |t| t.name.clone())
    }

    /// The segments of `pool`, stitched ranges included.
    pub(super) fn pool_segments(&self, pool: PoolId) -> Vec<SegmentKey> {
        self.arena
            .segments()
            .filter(|(_, seg)| self.streams.pool(seg.stream()) == pool)
            .map(|(key, _)| key)
            .collect()
    }

    fn tag_infos(&self) -> Vec<TagInfo> {
        let vmm = self.growth.expandable();
        self.tags
            .iter()
            .map(|(pool, tag)| {
                let segments = self.pool_segments(pool);
                let mut allocated = 0;
                let mut mapped = 0;
                for &segment in &segments {
                    let seg = self.arena.segment(segment);
                    if let Some(vmm) = vmm {
                        mapped += vmm
                            .whole_mappings(seg.addr(), seg.size())
                            .iter()
                            .map(|&(_, len)| len)
                            .sum::<u64>();
                    }
                    allocated += self
                        .arena
                        .segment_blocks(segment)
                        .filter(|(_, b)| b.is_allocated())
                        .map(|(_, b)| b.size())
                        .sum::<u64>();
                }
                TagInfo {
                    name: tag.name.clone(),
                    pool,
                    asleep: tag.asleep.is_some(),
                    bytes: tag.asleep.as_ref().map_or(mapped, |a| a.bytes),
                    allocated,
                    backed_up: tag.asleep.as_ref().is_some_and(|a| a.backup.is_some()),
                    host_bytes: tag.buffer.map_or(0, |b| b.size),
                }
            })
            .collect()
    }

    // ---- Sleep ---------------------------------------------------------------------------

    /// See [`Allocator::sleep`].
    fn sleep_pools<B: Backend>(
        &mut self,
        backend: &B,
        pools: &[PoolId],
        backup: Backup,
    ) -> Result<SleepReport, AllocError> {
        // Refusals first: nothing changes.
        if self.pools.capture_underway() {
            return Err(SleepError::CaptureUnderway.into());
        }
        for &pool in pools {
            let tag = self.tag_name(pool);
            if self.tags.asleep(pool).is_some() {
                return Err(SleepError::AlreadyAsleep(tag).into());
            }
            let segments = self.pool_segments(pool);
            let stitched = segments
                .iter()
                .filter(|&&s| self.arena.segment(s).is_stitched())
                .count();
            if stitched > 0 {
                return Err(SleepError::Stitched {
                    tag,
                    count: stitched,
                }
                .into());
            }
            if segments
                .iter()
                .any(|&s| !self.arena.segment(s).is_expandable())
            {
                return Err(SleepError::WholeSegments { tag }.into());
            }
        }
        self.wait_for_pools(backend, pools)?;
        let mut report = SleepReport::default();
        // Every backup before any unmap: a copy that fails leaves the pools awake.
        let mut backups: Vec<Option<Vec<BackupRun>>> = Vec::with_capacity(pools.len());
        for &pool in pools {
            backups.push(match backup {
                Backup::None => None,
                Backup::Host => Some(self.back_up(backend, pool, &mut report)?),
            });
        }
        if backup == Backup::Host {
            backend.synchronize_copies()?;
        }
        for (&pool, runs) in pools.iter().zip(backups) {
            report.released += self.unmap_pool(backend, pool, runs)?;
        }
        tracing::debug!(?report, "memory pools asleep");
        Ok(report)
    }

    /// Waits on the host for every stream that may still touch `pools`' memory: one event
    /// recorded on each stream that owns a block of the pools and each stream recorded on
    /// their live blocks, then one host wait per event, and the pending events of their free
    /// blocks and of their dormant stitched ranges, which are then marked complete (and the
    /// stitches unmapped). The rest of the device is not waited for.
    fn wait_for_pools<B: Backend>(
        &mut self,
        backend: &B,
        pools: &[PoolId],
    ) -> Result<(), BackendError> {
        let mut streams: Vec<StreamId> = Vec::new();
        let mut pending: Vec<EventKey> = Vec::new();
        let add = |streams: &mut Vec<StreamId>, id: StreamId| {
            if !streams.contains(&id) {
                streams.push(id);
            }
        };
        for &pool in pools {
            for segment in self.pool_segments(pool) {
                for (_, block) in self.arena.segment_blocks(segment) {
                    // Its owner's work on it, and its other users' (a stream that holds no
                    // block of the pool any more may be gone: it is not asked).
                    if !block.is_unmapped() {
                        add(&mut streams, self.streams.id(block.owner()));
                    }
                    for &slot in block.uses() {
                        add(&mut streams, self.streams.id(slot));
                    }
                    pending.extend_from_slice(block.pending());
                }
            }
        }
        for stitch in self.stitches.dormant() {
            if pools.contains(&stitch.memory_pool) {
                pending.extend(stitch.last_use.iter().copied());
            }
        }
        // Record every event first, then wait: the waits overlap the streams' work.
        let mut recorded = Vec::with_capacity(streams.len());
        for &stream in &streams {
            let handle = self.events.acquire_handle(backend, &mut self.stats)?;
            if let Err(err) = backend.record_event(handle, stream) {
                self.events.recycle_handle(handle);
                for handle in recorded {
                    self.events.recycle_handle(handle);
                }
                return Err(err);
            }
            self.stats.events_recorded += 1;
            recorded.push(handle);
        }
        let mut waited = Ok(());
        for &handle in &recorded {
            if waited.is_ok() {
                waited = backend.synchronize_event(handle);
            }
        }
        for handle in recorded {
            self.events.recycle_handle(handle);
        }
        waited?;
        for &event in &pending {
            if !self.events.is_complete(event) {
                backend.synchronize_event(self.events.handle(event))?;
                self.events.mark_complete(event);
            }
        }
        self.promote_completed(backend);
        for &pool in pools {
            for segment in self.pool_segments(pool) {
                let seg = self.arena.segment(segment);
                let (addr, size) = (seg.addr(), seg.size());
                self.evict_stitches_over(backend, addr, size)?;
            }
        }
        Ok(())
    }

    /// Copies `pool`'s live blocks to its host buffer (made or grown as needed), one copy
    /// per run; returns the runs.
    fn back_up<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolId,
        report: &mut SleepReport,
    ) -> Result<Vec<BackupRun>, BackendError> {
        let mut runs = Vec::new();
        let mut end = 0;
        for segment in self.pool_segments(pool) {
            let blocks = self
                .arena
                .segment_blocks(segment)
                .map(|(_, b)| (b.addr(), b.size(), b.is_allocated(), !b.is_unmapped()));
            let (more, after) = backup_runs(blocks, end);
            runs.extend(more);
            end = after;
        }
        if end == 0 {
            return Ok(runs);
        }
        let buffer = self.host_buffer(backend, pool, end)?;
        for run in &runs {
            backend.copy_to_host(
                HostPtr(buffer.ptr.0 + run.host_offset),
                DevicePtr(run.device),
                run.len,
            )?;
            report.copies += 1;
            report.backed_up += run.len;
        }
        Ok(runs)
    }

    /// `pool`'s host buffer, at least `bytes` long: the one kept from its last backup if
    /// large enough, else a new one (the old one freed).
    fn host_buffer<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolId,
        bytes: u64,
    ) -> Result<HostBuffer, BackendError> {
        let tag = self.tags.get_mut(pool).expect("a tagged pool");
        if let Some(buffer) = tag.buffer.filter(|b| b.size >= bytes) {
            return Ok(buffer);
        }
        if let Some(old) = tag.buffer.take() {
            backend.free_host(old.ptr, old.size)?;
            self.stats.host_backup_bytes -= old.size;
        }
        let buffer = HostBuffer {
            ptr: backend.alloc_host(bytes)?,
            size: bytes,
        };
        self.tags.get_mut(pool).expect("a tagged pool").buffer = Some(buffer);
        self.stats.host_backup_bytes += bytes;
        Ok(buffer)
    }

    /// Unmaps every mapping of `pool`'s segments, contiguous ones in one call, and marks
    /// the pool asleep with them and its backup `runs`. Returns the bytes given back. If
    /// the driver fails part way, the pool is asleep with what was unmapped.
    fn unmap_pool<B: Backend>(
        &mut self,
        backend: &B,
        pool: PoolId,
        runs: Option<Vec<BackupRun>>,
    ) -> Result<u64, AllocError> {
        let mut targets: Vec<(SegmentKey, Vec<(u64, u64)>)> = Vec::new();
        {
            let vmm = self
                .growth
                .expandable()
                .expect("a tagged pool is expandable");
            for segment in self.pool_segments(pool) {
                let seg = self.arena.segment(segment);
                targets.push((segment, vmm.whole_mappings(seg.addr(), seg.size())));
            }
        }
        let mut done: Vec<(u64, u64)> = Vec::new();
        let mut bytes = 0;
        let mut failure = None;
        'segments: for (segment, mappings) in targets {
            let owner = self.arena.segment(segment).stream();
            for (start, len) in contiguous_runs(&mappings) {
                if let Err(err) = backend.unmap_pages(DevicePtr(start), len) {
                    failure = Some(err);
                    break 'segments;
                }
                let vmm = self.growth.expandable_mut().expect("expandable");
                vmm.remove_mappings(start, len);
                vmm.mapped -= len;
                // Out of reserved memory in PyTorch's terms too (one device call).
                self.count_unmapped(start, len);
                self.stats.sleeping_bytes += len;
                self.note(backend, TraceAction::Sleep, start, len, owner);
                bytes += len;
                done.extend(
                    mappings
                        .iter()
                        .filter(|&&(at, _)| start <= at && at < start + len),
                );
            }
        }
        let tag = self.tags.get_mut(pool).expect("a tagged pool");
        tag.asleep = Some(Asleep {
            mappings: done,
            bytes,
            backup: runs,
        });
        match failure {
            None => Ok(bytes),
            Some(source) => Err(SleepError::PartWay {
                what: "sleeping",
                tag: tag.name.clone(),
                done: bytes,
                source,
            }
            .into()),
        }
    }
}

/// `mappings` (address order) joined where contiguous: one unmap call each.
fn contiguous_runs(mappings: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &(at, len) in mappings {
        match runs.last_mut() {
            Some(last) if last.0 + last.1 == at => last.1 += len,
            _ => runs.push((at, len)),
        }
    }
    runs
}
