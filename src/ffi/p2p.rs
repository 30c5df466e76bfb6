//! C ABI for the p2p planner, so that Python (`streamalloc.p2p`) plans with the same Rust
//! code that CI tests, instead of a port of it.
//!
//! The caller all-gathers the encoded [`LocalDescription`]s itself (through
//! `torch.distributed`), hands them all to [`streamalloc_p2p_plan_new`], exchanges the
//! digest, and reads its own rounds as a table of rows ([`streamalloc_p2p_plan_rows`]).
//! Errors come back as a null handle or a negative code, with the message in the one
//! last-error slot of the library (`streamalloc_last_error`, also exported as
//! [`streamalloc_p2p_last_error`]); no panic crosses the boundary ([`error::call`]).
//!
//! # Row format
//! One row of [`ROW_COLUMNS`] `int64` per piece a rank sends or receives, in round order:
//! `round` (the rank's own round index, from 0), `direction` (0 send, 1 receive), `peer`,
//! `kind` (0 packed, 1 zero-copy), `tensor` (index in the peer's list), `tensor_offset`,
//! `buffer_offset` (packed only), `len`, `message_len` (bytes on the wire).

use super::{error, fail};
use std::ffi::c_char;
use streamalloc_p2p::staging::plan::{Description, LocalDescription, Payload, Plan, StagingConfig};

/// Columns of one row of [`streamalloc_p2p_plan_rows`].
pub const ROW_COLUMNS: usize = 9;

/// An opaque plan handed to C.
#[derive(Debug)]
pub struct P2pPlan {
    plan: Plan,
}

/// The message of the previous call on this thread if it failed, "" if it succeeded: the
/// library's one last-error slot, the same as `streamalloc_last_error`.
#[no_mangle]
pub extern "C" fn streamalloc_p2p_last_error() -> *const c_char {
    error::last()
}

/// Decodes `world` encoded descriptions, checks them against each other, and plans.
/// `zero_copy_min` 0 means the default (one buffer). Returns null on error.
///
/// # Safety
/// `descriptions` and `lengths` must point to `world` entries; `descriptions[i]` must point
/// to `lengths[i]` readable bytes. Pointers are only read during the call.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_p2p_plan_new(
    world: u32,
    descriptions: *const *const u8,
    lengths: *const usize,
    budget_bytes: u64,
    buffers_per_direction: u32,
    zero_copy_min: u64,
) -> *mut P2pPlan {
    error::call(std::ptr::null_mut(), || {
        if world == 0 || descriptions.is_null() || lengths.is_null() {
            return fail(
                std::ptr::null_mut(),
                "streamalloc_p2p_plan_new: world must be positive and pointers non-null",
            );
        }
        let planned = (0..world as usize)
            .map(|i| {
                // SAFETY: the caller guarantees `world` entries in both arrays and
                // `lengths[i]` readable bytes at `descriptions[i]`.
                let bytes = unsafe {
                    let ptr = *descriptions.add(i);
                    let len = *lengths.add(i);
                    if ptr.is_null() {
                        &[][..]
                    } else {
                        std::slice::from_raw_parts(ptr, len)
                    }
                };
                LocalDescription::decode(bytes)
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|locals| Description::from_locals(&locals))
            .and_then(|description| {
                let config = StagingConfig {
                    budget_bytes,
                    buffers_per_direction,
                    zero_copy_min: (zero_copy_min != 0).then_some(zero_copy_min),
                };
                Plan::build(&description, config)
            });
        match planned {
            Ok(plan) => Box::into_raw(Box::new(P2pPlan { plan })),
            Err(err) => fail(std::ptr::null_mut(), err),
        }
    })
}

/// Frees a plan. Null is ignored.
///
/// # Safety
/// `plan` must come from [`streamalloc_p2p_plan_new`] and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_p2p_plan_free(plan: *mut P2pPlan) {
    error::call((), || {
        if !plan.is_null() {
            // SAFETY: the caller passes a pointer from `Box::into_raw`, once.
            drop(unsafe { Box::from_raw(plan) });
        }
    })
}

/// The plan's digest (equal on every rank that planned the same exchange); 0 for a null
/// plan.
///
/// # Safety
/// `plan` must be null or a live handle from [`streamalloc_p2p_plan_new`].
#[no_mangle]
pub unsafe extern "C" fn streamalloc_p2p_plan_digest(plan: *const P2pPlan) -> u64 {
    error::call(0, || {
        // SAFETY: the caller passes null or a live handle.
        match unsafe { plan.as_ref() } {
            Some(p) => p.plan.digest(),
            None => fail(0, "streamalloc_p2p_plan_digest: null plan"),
        }
    })
}

/// Writes 8 figures to `out`: global rounds, max ops per group, bytes moved (all ranks),
/// this rank's send buffers, send buffer bytes, receive buffers, receive buffer bytes, and
/// this rank's number of rounds. Returns 0, or -1 on a bad argument.
///
/// # Safety
/// `plan` must be null or a live handle; `out` must be null or point to 8 writable `u64`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_p2p_plan_summary(
    plan: *const P2pPlan,
    rank: u32,
    out: *mut u64,
) -> i32 {
    error::call(-1, || {
        // SAFETY: the caller passes null or a live handle.
        let Some(p) = (unsafe { plan.as_ref() }) else {
            return fail(-1, "streamalloc_p2p_plan_summary: null plan");
        };
        if out.is_null() || rank >= p.plan.world() {
            return fail(
                -1,
                "streamalloc_p2p_plan_summary: null output or rank out of range",
            );
        }
        let need = p.plan.staging_need(rank);
        let figures = [
            p.plan.rounds().len() as u64,
            u64::from(p.plan.max_ops_per_group()),
            p.plan.bytes_moved(),
            u64::from(need.send_buffers),
            need.send_buffer_bytes,
            u64::from(need.recv_buffers),
            need.recv_buffer_bytes,
            p.plan.rank_rounds(rank).len() as u64,
        ];
        // SAFETY: the caller guarantees 8 writable u64 at `out`.
        unsafe { std::ptr::copy_nonoverlapping(figures.as_ptr(), out, figures.len()) };
        0
    })
}

/// Hands `row` each of this rank's rows in order (see the module docs): counted and
/// copied out without building them in a vector first (tens of thousands of rows).
fn for_each_row(plan: &Plan, rank: u32, mut row: impl FnMut([i64; ROW_COLUMNS])) {
    for (local, rr) in plan.rank_rounds(rank).iter().enumerate() {
        let round = &plan.rounds()[rr.round as usize];
        for (direction, slot) in [(0i64, rr.send), (1, rr.recv)] {
            let Some(t) = slot.map(|i| &round.transfers[i as usize]) else {
                continue;
            };
            let peer = i64::from(if direction == 0 { t.dst } else { t.src });
            let wire = t.payload.wire_len() as i64;
            match &t.payload {
                Payload::ZeroCopy { tensor, len } => row([
                    local as i64,
                    direction,
                    peer,
                    1,
                    i64::from(*tensor),
                    0,
                    0,
                    *len as i64,
                    wire,
                ]),
                Payload::Packed { segments, .. } => {
                    for s in segments {
                        row([
                            local as i64,
                            direction,
                            peer,
                            0,
                            i64::from(s.tensor),
                            s.tensor_offset as i64,
                            s.buffer_offset as i64,
                            s.len as i64,
                            wire,
                        ]);
                    }
                }
            }
        }
    }
}

/// This rank's rounds as rows (see the module docs). With `out` null, returns the number of
/// rows; otherwise writes at most `capacity` rows and returns the number written, or -1.
///
/// # Safety
/// `plan` must be a live handle; `out`, if not null, must point to `capacity * 9`
/// writable `i64`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_p2p_plan_rows(
    plan: *const P2pPlan,
    rank: u32,
    out: *mut i64,
    capacity: usize,
) -> i64 {
    error::call(-1, || {
        // SAFETY: the caller passes null or a live handle.
        let Some(p) = (unsafe { plan.as_ref() }) else {
            return fail(-1, "streamalloc_p2p_plan_rows: null plan");
        };
        if rank >= p.plan.world() {
            return fail(-1, "streamalloc_p2p_plan_rows: rank out of range");
        }
        let mut n = 0usize;
        if out.is_null() {
            for_each_row(&p.plan, rank, |_| n += 1);
            return n as i64;
        }
        for_each_row(&p.plan, rank, |row| {
            if n < capacity {
                // SAFETY: the caller guarantees `capacity * ROW_COLUMNS` writable i64 at
                // `out`, and `n < capacity`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        row.as_ptr(),
                        out.add(n * ROW_COLUMNS),
                        ROW_COLUMNS,
                    )
                };
                n += 1;
            }
        });
        n as i64
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamalloc_p2p::staging::plan::TensorMeta;

    #[test]
    fn plans_through_the_c_abi_and_reports_mismatches() {
        let meta = TensorMeta {
            bytes: 100,
            dtype: 0,
        };
        let mut a = LocalDescription::empty(0, 2);
        let mut b = LocalDescription::empty(1, 2);
        a.sends[1] = vec![meta, meta];
        b.recvs[0] = vec![meta, meta];
        let encoded = [a.encode(), b.encode()];
        let ptrs: Vec<*const u8> = encoded.iter().map(|e| e.as_ptr()).collect();
        let lens: Vec<usize> = encoded.iter().map(Vec::len).collect();
        // SAFETY: two valid descriptions.
        let plan =
            unsafe { streamalloc_p2p_plan_new(2, ptrs.as_ptr(), lens.as_ptr(), 1 << 20, 2, 0) };
        assert!(!plan.is_null());
        // SAFETY: live plan, buffers sized as documented.
        unsafe {
            let n = streamalloc_p2p_plan_rows(plan, 0, std::ptr::null_mut(), 0);
            assert_eq!(n, 2);
            let mut rows = vec![0i64; n as usize * ROW_COLUMNS];
            assert_eq!(streamalloc_p2p_plan_rows(plan, 0, rows.as_mut_ptr(), 2), 2);
            assert_eq!(&rows[9..18], &[0, 0, 1, 0, 1, 0, 100, 100, 200]);
            let mut summary = [0u64; 8];
            assert_eq!(
                streamalloc_p2p_plan_summary(plan, 1, summary.as_mut_ptr()),
                0
            );
            assert_eq!(summary[5..7], [1, 200]);
            streamalloc_p2p_plan_free(plan);
        }
        b.recvs[0].pop();
        let encoded = [a.encode(), b.encode()];
        let ptrs: Vec<*const u8> = encoded.iter().map(|e| e.as_ptr()).collect();
        let lens: Vec<usize> = encoded.iter().map(Vec::len).collect();
        // SAFETY: two valid descriptions.
        let plan =
            unsafe { streamalloc_p2p_plan_new(2, ptrs.as_ptr(), lens.as_ptr(), 1 << 20, 2, 0) };
        assert!(plan.is_null());
        // SAFETY: the pointer is a valid C string until the next failure.
        let msg = unsafe { std::ffi::CStr::from_ptr(streamalloc_p2p_last_error()) };
        assert!(msg.to_str().unwrap().contains("mismatch"), "{msg:?}");
    }
}
