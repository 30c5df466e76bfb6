//! Stitching, the policy: serving a request that no free block fits from free pages
//! scattered over its memory pool's expandable segments, mapped a second time into one
//! range (`pool::stitch` has the records), and reviving a stitch kept from an earlier
//! free. Freeing a stitched range, keeping it dormant and unmapping it are in `unstitch`.
//!
//! # Where it sits in the policy
//! After every free block of the pool failed (the stream's own, completed events, other
//! streams' after a device-side wait) and before growing: a dormant stitch of a fitting
//! size whose pages are all free again is revived (no driver call at all); otherwise the
//! largest runs of free whole pages of the pool are stitched, if together they cover the
//! request. Only if they do not does memory grow. Stitching never runs while a capture is
//! under way (nothing is mapped during a capture, and the waits it needs are forbidden).
//!
//! # Stream-aware pages
//! A page's last uses travel with the page, not with an address: the blocks a stitch lends
//! carry the events of the streams that used them, and the stream that takes them waits
//! for those events (and for the owning stream's work so far) on the device, as for any
//! block of another stream (`State::wait_for_block`). Freeing a stitched range records one
//! event per stream that used it; the lent blocks go back to their pool as free blocks of
//! the freeing stream, pending on the other streams' events. No host synchronisation is
//! ever needed: the range stays mapped while dormant, and it is unmapped only once its
//! events are seen complete, or after a synchronisation made for another reason.
//!
//! # The cost model
//! Stitching trades driver calls for memory. A new stitch costs one address reservation,
//! one `cuMemMap` per physical allocation its pages span and one `cuMemSetAccess`; growing
//! costs one `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` per mapping and the memory
//! itself, kept until a reclaim synchronises the device to unmap it. So: reviving (free) >
//! stitching (a few calls, no memory) > growing (calls and memory) > reclaiming (a device
//! synchronisation, then calls). A stitch is made only for requests of at least
//! [`MIN_STITCH_PAGES`] pages, from at most [`MAX_SOURCES`] runs, so its calls stay few
//! next to the work such a block takes; dormant stitches are kept (address space costs no
//! memory) so that a loop whose steps repeat their sizes stops mapping once warm.

use super::*;
use crate::pool::stitch::{Source, Stitch};
use std::collections::HashSet;
use thin_vec::ThinVec;

/// Requests of at most this many pages are not stitched: any free whole page fits one
/// (so best fit finds it), and stitching pieces of pages is impossible.
const MAX_UNSTITCHED_PAGES: u64 = 1;

/// Growing only the shortfall before stitching is tried at most this many times (each
/// maps at least a page; a placement may join a free block already counted).
const SHORTFALL_TRIES: usize = 8;

/// A stitch maps at most this many runs of pages (each at least one `cuMemMap`), while
/// memory is not short. Under a memory limit, once whole growth pieces and the growth
/// the limit allows fall short (`Runs::Pages`, waiting on the device), a stitch takes as
/// many runs as covering the request needs: growing instead would cost a synchronisation
/// to unmap the scattered pages first, every time the peak comes round.
const MAX_SOURCES: usize = 32;

/// While memory is plentiful (with or without a limit) a stitch takes no run shorter than
/// this fraction (1/n) of the request, and grows the shortfall instead (at most that
/// fraction of the request). Small
/// holes between live blocks are what best fit fills with other blocks in the next step, so
/// a kept stitch that maps them is seldom revivable: replayed as three steps, BERT with
/// varying lengths made a new 1.35 GB stitch in every step and now makes none (peak 1.012
/// → 1.016 of live), FSDP2's rank 0 went from 35 second mappings in its third step to 10
/// (1.057 → 1.050); 1/32 and 1/16 settled BERT too at 1.022, 1/256 did not settle it.
const MIN_RUN_FRACTION: u64 = 128;

/// Before those, runs of at least this fraction, what they lack grown only within the
/// growth budget (and the limit): the next step's medium tensors refill holes of a few
/// dozen MiB, and a kept stitch that took one misses. Over 25 steps FSDP2's rank 0 kept
/// its peak at 1.066 of live from the first (smaller runs alone crept from 1.050 to 1.109),
/// BERT mapped nothing after step 2 (not 16), GPT-2 after step 1; 1/4, 1/6 cost BERT 1.046,
/// 1.032. Past the budget they are a preference, not a need: a whole FSDP2 run with
/// checkpointing reserved 1.122 of its live peak on the simulator and 1.120 on an H200
/// while wide runs grew there too, 1.039 and 1.034 with narrower runs stitched first
/// (FSDP2's rank 0 replayed as 25 steps: 1.062, creeping from 1.029 by a page or two in
/// some steps, with about 7 second mappings a step instead of 1.5).
const WIDE_RUN_FRACTION: u64 = 8;

/// A dormant stitch serves a request it exceeds by at most this fraction (1/n) of the
/// request, or a page: more would lend pages the request does not need.
const REVIVE_SLACK: u64 = 8;

/// Which free pages a stitch may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pages {
    /// The requesting stream's own ready pages (PyTorch's policy: blocks never change
    /// streams).
    Own,
    /// Those, and other streams' pages that need no wait: ready, their owner's work up to
    /// their free seen complete (`lifetime::fences`).
    NoWait,
    /// Every free page of the pool, the requesting stream waiting on the device.
    Any,
}

/// Which runs of free pages a stitch takes as its sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runs {
    /// Whole growth pieces, none shorter than [`WIDE_RUN_FRACTION`] of the request.
    WidePieces,
    /// Whole growth pieces, none shorter than [`MIN_RUN_FRACTION`] of the request: the
    /// runs a kept stitch can find free again in the next step. The same choices with or
    /// without a limit, as long as it does not bind.
    Pieces,
    /// Any run of whole mappings, a page at least: every free page counts.
    Pages,
}

/// What the free pages of a pool lack to cover a request: `bytes` (0 where stitching is
/// not the way), and the free blocks whose pages the stitch would take (the first block of
/// each run: only read after a synchronisation, when free blocks side by side have merged).
struct Shortfall {
    bytes: u64,
    runs: Vec<BlockKey>,
}

/// One run of free whole pages a new stitch will take: the first of the free blocks
/// holding it (side by side, see [`State::free_run_over`]), its first byte and its bytes.
#[derive(Clone, Copy, Debug)]
struct Pick {
    block: BlockKey,
    addr: u64,
    len: u64,
}

impl State {
    /// Serves `need` from a stitched range, reviving a dormant one or stitching free pages
    /// of its memory pool; `None` if stitching is off, the request is small, or the pool's
    /// free pages do not cover it. At [`Effort::Light`] only pages that need no device
    /// wait are taken (the stream's own ready ones), and memory grows for the shortfall only
    /// within the growth budget; past it, pages of every stream of the pool, the caller's
    /// stream waiting on the device for their last uses (the shortfall of wide runs still
    /// within the budget, of narrower ones up to the limit). The range is an unlisted free
    /// block owned by the request's slot, to be handed out whole
    /// ([`State::hand_out_whole`]).
    pub(super) fn stitch<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        policy: ReusePolicy,
        effort: Effort,
    ) -> Result<Option<BlockKey>, AllocError> {
        let Some(vmm) = self.growth.expandable() else {
            return Ok(None);
        };
        let page = vmm.page;
        if !self.stitching || need.size <= MAX_UNSTITCHED_PAGES * page {
            return Ok(None);
        }
        let memory_pool = self.streams.pool(need.slot);
        if self.maps_whole(memory_pool) {
            // A tagged pool's pages go back whole (`allocator::sleep`): never stitched.
            return Ok(None);
        }
        // Under PyTorch's policy a block never moves between streams or waits on events:
        // only the stream's own ready pages are stitched.
        let pages = match (policy, effort) {
            (ReusePolicy::Pytorch, _) => Pages::Own,
            (ReusePolicy::StreamWait, Effort::Light) => {
                // Which of other streams' pages need no wait: fences seen complete.
                self.complete_fences(backend)?;
                Pages::NoWait
            }
            (ReusePolicy::StreamWait, _) => Pages::Any,
        };
        if let Some(index) = self.revivable(need, memory_pool, page, pages) {
            return self.revive_as(backend, index, need, pages).map(Some);
        }
        if effort != Effort::Synchronised && !self.remap_affordable(backend) {
            // Remapping costs more than its share of time (stitches evicted before they
            // were ever revived among it): sizes churn faster than kept ranges can serve
            // them. Grow within a wider slack instead, where the limit allows.
            self.widen_throttled_slack("stitch");
            if self.within_budget(self.page_rounded(need.size)) {
                return Ok(None);
            }
        }
        if effort == Effort::Synchronised {
            return self.stitch_runs(backend, need, pages, effort, Runs::Pages);
        }
        for runs in [Runs::WidePieces, Runs::Pieces] {
            let stitched = self.stitch_runs(backend, need, pages, effort, runs)?;
            if stitched.is_some() || !self.stitching {
                return Ok(stitched); // served, or the driver refused a second mapping
            }
        }
        // Where pages are their own allocations and memory is short (a limit that could
        // not hold the request as new memory, a nearly full device), every page counts
        // before a synchronisation; a limit that could changes no choice.
        let short = self.limit.is_none() || !self.fits_limit(self.page_rounded(need.size));
        if effort == Effort::Waiting && self.table().page_granular && short {
            return self.stitch_runs(backend, need, pages, effort, Runs::Pages);
        }
        Ok(None)
    }

    /// Stitches free runs of `runs`' kind for `need`, growing the shortfall where `effort`
    /// allows; `None` if the runs fall short.
    fn stitch_runs<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        pages: Pages,
        effort: Effort,
        runs: Runs,
    ) -> Result<Option<BlockKey>, AllocError> {
        let page = self.table().page;
        let memory_pool = self.streams.pool(need.slot);
        // Holes much smaller than the request are left to best fit and the shortfall is
        // grown (see [`MIN_RUN_FRACTION`]) until a limit binds or the device has been
        // synchronised; under a limit, as many runs as it takes (see [`MAX_SOURCES`]).
        let sparing = |fraction: u64| (need.size / fraction / page * page).max(page);
        let (min_run, max_sources) = match runs {
            Runs::WidePieces => (sparing(WIDE_RUN_FRACTION), MAX_SOURCES),
            Runs::Pieces => (sparing(MIN_RUN_FRACTION), MAX_SOURCES),
            Runs::Pages if self.limit.is_some() => (page, usize::MAX),
            Runs::Pages if effort == Effort::Synchronised => (page, MAX_SOURCES),
            Runs::Pages => (sparing(MIN_RUN_FRACTION), MAX_SOURCES),
        };
        for _ in 0..SHORTFALL_TRIES {
            let Shortfall {
                bytes: shortfall,
                runs: taken,
            } = match self.pick_free_pages(need, pages, runs, max_sources, min_run) {
                Ok(picks) => return self.make_stitch(backend, need, memory_pool, pages, picks),
                Err(shortfall) if shortfall.bytes == 0 => return Ok(None),
                Err(shortfall) => shortfall,
            };
            let shortfall = shortfall.max(min_run);
            let grown = self.page_rounded(shortfall);
            if pages == Pages::Any
                && !self.fits_limit(grown)
                && self.join_across_streams(backend, need)?
            {
                // Pages shared by free blocks of different streams became whole: pick again.
                continue;
            }
            // Light effort grows nothing past the growth budget, and wide runs never do:
            // they are a preference, not a need, so past the budget narrower runs are
            // stitched before memory grows (see [`WIDE_RUN_FRACTION`]).
            let budget_binds = effort == Effort::Light || runs == Runs::WidePieces;
            if budget_binds && !self.within_budget_serving(grown, need.size) {
                return Ok(None);
            }
            if effort == Effort::Synchronised && !self.fits_limit(grown) {
                // Make room for the shortfall with free pages the stitch will not take.
                let excess =
                    self.stats.reserved_bytes.current + grown - self.limit.unwrap_or(u64::MAX);
                self.unmap_free_pages_upto(backend, excess, Release::Unpinned, &taken)?;
            }
            // Map only what the pool's free pages lack, then stitch them all: memory grows
            // by the shortfall, not by the request.
            if !self.grow_shortfall(backend, need, shortfall)? {
                return Ok(None);
            }
        }
        Ok(None)
    }

    /// Maps at least `shortfall` bytes into `need.slot`'s reservation (mapping only, no
    /// reclaim: every free page is about to be used) and lists the free block that holds
    /// them. False if the limit, the device or the address space refuses.
    fn grow_shortfall<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        shortfall: u64,
    ) -> Result<bool, AllocError> {
        let Need { slot, pool, .. } = need;
        let segment = self.expandable_segment_for(backend, pool, slot)?;
        let Some(placement) = self.placement_mapping(segment, shortfall, slot) else {
            return Ok(false);
        };
        match self.map_placement(backend, segment, placement, shortfall, slot)? {
            Some(key) => {
                self.list(key);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The smallest dormant stitch of `memory_pool` that fits `need` within
    /// [`REVIVE_SLACK`] and whose pages all lie in free blocks now that `pages` allows.
    fn revivable(&self, need: Need, memory_pool: PoolId, page: u64, pages: Pages) -> Option<usize> {
        let slack = (need.size / REVIVE_SLACK).max(page);
        let mut best: Option<(u64, usize)> = None;
        for (index, stitch) in self.stitches.dormant().iter().enumerate() {
            if stitch.memory_pool != memory_pool
                || stitch.size < need.size
                || stitch.size - need.size > slack
                || best.is_some_and(|(size, _)| size <= stitch.size)
            {
                continue;
            }
            if stitch
                .sources
                .iter()
                .all(|source| self.free_run_over(source, need.slot, pages).is_some())
            {
                best = Some((stitch.size, index));
            }
        }
        best.map(|(_, index)| index)
    }

    /// Runs of free whole pages of `memory_pool`, each of at least `min_run` bytes, that
    /// cover `need` together: the largest first (fewest mappings), and for what remains the
    /// smallest run that covers it (so a large run is not cut for a little). If the pool's
    /// free pages fall short, the bytes they lack (0 if there are none at all, or if
    /// covering would take more than `max_sources` runs: growing is then the better
    /// choice), with the blocks of the runs a stitch would take once the shortfall is
    /// grown.
    fn pick_free_pages(
        &self,
        need: Need,
        pages: Pages,
        kind: Runs,
        max_sources: usize,
        min_run: u64,
    ) -> Result<Vec<Pick>, Shortfall> {
        let memory_pool = self.streams.pool(need.slot);
        let vmm = self.table();
        let page = vmm.page;
        let want = need.size.div_ceil(page) * page;
        let mut runs: Vec<Pick> = Vec::new();
        let mut heads = HashSet::new();
        for &index in self.streams.free_slots() {
            let state = self.streams.get(index);
            if state.pool != memory_pool || (pages == Pages::Own && index != need.slot) {
                continue;
            }
            let lists = [
                Some(&state.ready[need.pool as usize]),
                (pages == Pages::Any).then_some(&state.pending[need.pool as usize]),
            ];
            for list in lists.into_iter().flatten() {
                for key in list.keys_at_least(page) {
                    let block = self.arena.block(key);
                    if !block.is_expandable() || !self.may_take(key, need.slot, pages) {
                        continue;
                    }
                    // Free blocks side by side that the stitch may take form one run (they
                    // differ only in owner or events): counted once, from the first.
                    let (head, start, end) = self.takeable_run_around(key, need.slot, pages);
                    if !heads.insert(head) {
                        continue;
                    }
                    // Whole mappings only: the driver maps nothing else a second time.
                    let span = match kind {
                        Runs::WidePieces | Runs::Pieces => vmm.whole_piece_span(start, end - start),
                        Runs::Pages => vmm.whole_mapping_span(start, end - start),
                    };
                    if let Some((addr, len)) = span.filter(|&(_, len)| len >= min_run) {
                        runs.push(Pick {
                            block: head,
                            addr,
                            len,
                        });
                    }
                }
            }
        }
        // Largest first; among equals, lowest address first, so choices are deterministic.
        runs.sort_unstable_by(|a, b| b.len.cmp(&a.len).then(a.addr.cmp(&b.addr)));
        // What the largest runs lack (one source is left for the memory grown for it).
        let usable: u64 = runs.iter().take(max_sources - 1).map(|run| run.len).sum();
        if usable < want {
            return Err(Shortfall {
                bytes: if usable > 0 { want - usable } else { 0 },
                runs: runs
                    .iter()
                    .take(max_sources - 1)
                    .map(|run| run.block)
                    .collect(),
            });
        }
        let mut picks = Vec::new();
        let mut got = 0;
        let mut rest = runs.as_slice();
        while got < want && picks.len() < max_sources {
            let left = want - got;
            // The smallest run that covers what is left ends the search.
            if let Some(last) = rest.iter().rev().find(|run| run.len >= left) {
                // Up to the end of the mapping (or piece) that holds its last byte needed.
                let end = match kind {
                    Runs::WidePieces | Runs::Pieces => vmm.piece_end(last.addr + left - 1),
                    Runs::Pages => vmm.mapping_end(last.addr + left - 1),
                }
                .unwrap_or(last.addr + left);
                picks.push(Pick {
                    len: end - last.addr,
                    ..*last
                });
                got = want;
                break;
            }
            let Some((run, tail)) = rest.split_first() else {
                break;
            };
            picks.push(*run);
            got += run.len;
            rest = tail;
        }
        if got >= want {
            Ok(picks)
        } else {
            Err(Shortfall {
                bytes: 0,
                runs: Vec::new(),
            })
        }
    }

    /// Reserves a range for `picks`, maps their pages into it, lends them and registers the
    /// stitch as active; the range's block is returned unlisted, owned by `need.slot`.
    fn make_stitch<B: Backend>(
        &mut self,
        backend: &B,
        need: Need,
        memory_pool: PoolId,
        pages: Pages,
        picks: Vec<Pick>,
    ) -> Result<Option<BlockKey>, AllocError> {
        let started_ns = backend.precise_ns();
        let size: u64 = picks.iter().map(|pick| pick.len).sum();
        let addr = match backend.reserve_address_space(size) {
            Ok(ptr) => ptr.0,
            Err(err) => return self.stop_stitching(err),
        };
        // Mapped while the pages are still free blocks: if the driver refuses, nothing has
        // changed but the reservation, and the new mappings were never touched.
        let mut at = addr;
        for pick in &picks {
            if let Err(err) = backend.alias_pages(DevicePtr(at), DevicePtr(pick.addr), pick.len) {
                if at > addr {
                    backend.unmap_pages(DevicePtr(addr), at - addr)?;
                }
                backend.release_address_space(DevicePtr(addr), size)?;
                return if err.out_of_memory {
                    Ok(None)
                } else {
                    self.stop_stitching(err)
                };
            }
            at += pick.len;
        }
        let sources: Vec<Source> = picks
            .iter()
            .map(|pick| Source {
                addr: pick.addr,
                len: pick.len,
                segment: self.arena.block(pick.block).segment(),
            })
            .collect();
        let mut lent = Vec::with_capacity(picks.len());
        for source in &sources {
            lent.push(self.lend_source(backend, source, need.slot, pages)?);
        }
        let map_ns = self.count_vmm(backend, started_ns);
        self.stats.stitches += 1;
        self.stats.stitched_map_bytes += size;
        self.note(backend, TraceAction::Stitch, addr, size, need.slot);
        tracing::debug!(addr, size, sources = sources.len(), "free pages stitched");
        let stitch = Stitch {
            addr,
            size,
            memory_pool,
            sources,
            lent,
            last_use: ThinVec::new(),
            idle_since: 0,
            map_ns,
            revived: false,
        };
        Ok(Some(self.activate_stitch(stitch, need)))
    }

    /// A driver that refuses to map pages a second time (an old driver, a device without
    /// the support) must not fail the program's requests: stitching is switched off for
    /// this allocator, with one warning, and requests grow memory as without it.
    fn stop_stitching(&mut self, err: BackendError) -> Result<Option<BlockKey>, AllocError> {
        tracing::warn!(%err, "stitching switched off: the device refused a second mapping");
        self.stitching = false;
        Ok(None)
    }

    /// Revives dormant stitch `index` for `need` after a synchronisation (every free page
    /// may be taken): [`State::revive_as`].
    pub(super) fn revive<B: Backend>(
        &mut self,
        backend: &B,
        index: usize,
        need: Need,
    ) -> Result<BlockKey, AllocError> {
        self.revive_as(backend, index, need, Pages::Any)
    }

    /// Revives dormant stitch `index` for `need`: lends its pages again (all free and
    /// takeable as `pages` allows, checked by [`State::revivable`]); maps nothing.
    fn revive_as<B: Backend>(
        &mut self,
        backend: &B,
        index: usize,
        need: Need,
        pages: Pages,
    ) -> Result<BlockKey, AllocError> {
        let mut stitch = self.stitches.take_dormant(index);
        for event in std::mem::take(&mut stitch.last_use) {
            self.events.release(event, &mut self.stats);
        }
        let mut lent = Vec::with_capacity(stitch.sources.len());
        for source in &stitch.sources {
            lent.push(self.lend_source(backend, source, need.slot, pages)?);
        }
        stitch.lent = lent;
        stitch.revived = true;
        self.stats.stitch_revivals += 1;
        self.note(
            backend,
            TraceAction::Stitch,
            stitch.addr,
            stitch.size,
            need.slot,
        );
        Ok(self.activate_stitch(stitch, need))
    }

    /// Registers `stitch` as active: its range becomes a segment of one free block owned by
    /// `need.slot`, returned unlisted.
    fn activate_stitch(&mut self, stitch: Stitch, need: Need) -> BlockKey {
        let key = self
            .arena
            .add_stitched_segment(stitch.addr, stitch.size, need.pool, need.slot);
        let segment = self.arena.block(key).segment();
        self.stitches.activate(segment, stitch);
        key
    }

    /// Takes `[addr, addr + len)`, whole pages inside the listed free block `key`, out of
    /// circulation for a stitched range of `slot`: what lies on either side stays listed
    /// with the block's events; `slot`'s stream waits on the device for everything that may
    /// still use the pages. Returns the lent block.
    pub(super) fn lend_pages<B: Backend>(
        &mut self,
        backend: &B,
        key: BlockKey,
        addr: u64,
        len: u64,
        slot: StreamSlot,
    ) -> Result<BlockKey, AllocError> {
        self.unlist(key);
        let (block_addr, block_size) = {
            let block = self.arena.block(key);
            (block.addr(), block.size())
        };
        let mut middle = key;
        if addr > block_addr {
            middle = self.split_keeping_events(key, addr - block_addr);
            self.list(key);
        }
        if addr + len < block_addr + block_size {
            let rest = self.split_keeping_events(middle, len);
            self.list(rest);
        }
        self.wait_or_relist(backend, middle, slot)?;
        self.release_pending(middle);
        self.arena.lend(middle);
        Ok(middle)
    }

    /// Splits the unlisted free block `key` at `at` bytes; the right part (returned) waits
    /// for the same events.
    fn split_keeping_events(&mut self, key: BlockKey, at: u64) -> BlockKey {
        let right = self.arena.split(key, at);
        self.arena.copy_pending(key, right);
        for &event in self.arena.block(right).pending() {
            self.events.retain(event);
        }
        right
    }

    /// Gives the unlisted free block `key` of a stitched range to `slot` whole (a stitched
    /// range is never split: its pages go back together).
    pub(super) fn hand_out_whole(
        &mut self,
        key: BlockKey,
        slot: StreamSlot,
        requested: u64,
        now: u64,
    ) -> Allocation {
        let addr = self.arena.hand_out(key, slot, requested).addr();
        self.allocated.insert(addr, key);
        self.account_alloc(key, slot, requested, now)
    }
}
