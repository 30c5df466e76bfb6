//! The calls with structured arguments: restoring junk checkpoints, and the p2p planner
//! on junk.

use super::{last_error, Harness, Outcome, Reader, SENTINEL};
use crate::ffi::pools::{self, StreamallocPoolBlock};
use crate::ffi::{error, p2p};
use std::ffi::c_int;
use streamalloc_allocator::DevicePtr;

impl Harness {
    /// `pool_restore` with a checkpoint taken earlier, or junk.
    pub(super) fn restore(&mut self, r: &mut Reader<'_>) -> Outcome {
        let (mut device, mut pool) = (self.device(r), self.pool(r));
        let mut blocks: Vec<StreamallocPoolBlock> = match r.below(4) {
            0 | 1 if !self.checkpoints.is_empty() => {
                let (d, p, blocks) = &self.checkpoints[r.u8() as usize % self.checkpoints.len()];
                if r.below(2) == 0 {
                    (device, pool) = (*d, *p);
                }
                blocks.clone()
            }
            2 => (0..r.below(3))
                .map(|_| StreamallocPoolBlock {
                    address: self.pointer(r),
                    size: self.size(r) as u64,
                    requested: r.u64() % 4096,
                    stream: r.u64() % 4,
                })
                .collect(),
            _ => Vec::new(),
        };
        if r.below(8) == 0 {
            if let Some(first) = blocks.first_mut() {
                first.size = first.size.wrapping_add(1 << 21);
            }
        }
        let null_blocks = r.below(8) == 0;
        let capacity = r.below(9);
        let mut freed = [0u64; 8];
        let live_before = self.pool_live(device, pool);
        // SAFETY: `blocks` readable for its length (or null, which is refused when the
        // count is not 0); `freed` has room for `capacity` <= 8 addresses.
        let n = unsafe {
            pools::pool_restore(
                &self.registry,
                device,
                pool.0,
                pool.1,
                if null_blocks {
                    std::ptr::null()
                } else {
                    blocks.as_ptr()
                },
                blocks.len(),
                freed.as_mut_ptr(),
                capacity,
            )
        };
        let call = format!(
            "pool_restore({device}, {pool:?}, {} blocks, room {capacity}) = {n}",
            blocks.len()
        );
        let mut expect = Ok(());
        if n >= 0 {
            for address in &freed[..(n as usize).min(capacity)] {
                if self.live.remove(address).is_some() {
                    self.dead.push(*address);
                } else if self.exact() {
                    expect = Err(format!("restore freed {address:#x}, which was not live"));
                }
            }
            for block in &blocks {
                if let Err(err) = self.allocated(block.address, device, block.size as usize) {
                    expect = expect.and(Err(format!("after restore: {err}")));
                }
            }
        } else if self.exact() && self.pool_live(device, pool) != live_before {
            expect = Err("a failed restore changed the pool's live allocations".to_string());
        }
        Outcome {
            call,
            failed: Some(n < 0),
            expect,
        }
    }

    /// A pool's live allocations, read without going through the C ABI (none on a device
    /// not created yet).
    pub(super) fn pool_live(&self, device: c_int, pool: (u64, u64)) -> Vec<DevicePtr> {
        self.registry.get(device).map_or_else(Vec::new, |d| {
            d.allocator()
                .pool_live_allocations(streamalloc_allocator::PoolId(pool.0, pool.1))
        })
    }

    /// The p2p planner on junk descriptions, then its readers on what came back, each
    /// checked as a call of its own.
    pub(super) fn p2p(&mut self, r: &mut Reader<'_>) -> Outcome {
        let world = r.below(4) as u32;
        let descriptions: Vec<Vec<u8>> = (0..world)
            .map(|_| (0..r.below(48)).map(|_| r.u8()).collect())
            .collect();
        let pointers: Vec<*const u8> = descriptions.iter().map(|d| d.as_ptr()).collect();
        let lengths: Vec<usize> = descriptions.iter().map(Vec::len).collect();
        let (budget, buffers, zero_copy_min) = (r.u64(), u32::from(r.u8()), r.u64());
        let rank = u32::from(r.u8() % 4);
        let mut expect = Ok(());
        let mut step = |name: &str, failed: bool| {
            let error = last_error();
            if error == SENTINEL || failed == error.is_empty() {
                expect = expect.clone().and(Err(format!(
                    "{name}: failed {failed} with last error {error:?}"
                )));
            }
            error::set(SENTINEL);
        };
        // SAFETY: `world` entries, each readable for its length.
        let plan = unsafe {
            p2p::streamalloc_p2p_plan_new(
                world,
                pointers.as_ptr(),
                lengths.as_ptr(),
                budget,
                buffers,
                zero_copy_min,
            )
        };
        step("streamalloc_p2p_plan_new", plan.is_null());
        let mut rows = [0i64; 4 * p2p::ROW_COLUMNS];
        let mut summary = [0u64; 8];
        // SAFETY: a live plan or null; buffers sized as documented.
        unsafe {
            let n = p2p::streamalloc_p2p_plan_rows(plan, rank, rows.as_mut_ptr(), 4);
            step("streamalloc_p2p_plan_rows", n < 0);
            let n = p2p::streamalloc_p2p_plan_summary(plan, rank, summary.as_mut_ptr());
            step("streamalloc_p2p_plan_summary", n < 0);
            let digest = p2p::streamalloc_p2p_plan_digest(plan);
            step("streamalloc_p2p_plan_digest", plan.is_null() && digest == 0);
            p2p::streamalloc_p2p_plan_free(plan);
        }
        Outcome {
            call: format!("p2p plan of {world} junk descriptions for rank {rank}, then free"),
            failed: Some(false),
            expect,
        }
    }
}
