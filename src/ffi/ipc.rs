//! CUDA IPC of mapped memory across the C ABI: any allocation in an expandable segment or
//! a stitched range is shared as the physical allocations behind it.
//!
//! ```c
//! int64_t streamalloc_ipc_export(void* ptr, uint8_t* out, size_t capacity, uint64_t* offset);
//! int64_t streamalloc_ipc_failure_handle(const char* message, uint8_t* out, size_t capacity);
//! void*   streamalloc_ipc_open(const uint8_t* handle, size_t len, int device);
//! int     streamalloc_ipc_close(void* base);
//! ```
//!
//! Whole segments need nothing from here: the door shares them with `cudaIpcGetMemHandle`.
//! An allocation in an expandable segment lies over one or more mappings (physical
//! allocations); the export names each of them by its descriptor in the sending process
//! (see `backend::ipc`), and the receiver maps them back to back. A stitched range is a
//! second mapping of pages of several mappings (`pool::stitch`): it has no physical
//! allocation of its own, so it is shared as its pages, in the order they appear in it
//! (`Allocator::stitched_pages`), each run whole physical allocations; the
//! receiver maps them back to back into one range of the same layout.
//!
//! A sender that cannot export writes a failed-export handle (`ipc_handle`) with its reason
//! (`streamalloc_ipc_failure_handle`), which the receiver's open raises: a failure shows in
//! both processes, and neither waits for the other.
//!
//! The logic is generic over [`IpcBackend`], so that the simulator runs it with the race
//! detector watching both sides ([`export_allocation`], [`open_handle`], [`close_import`]).

use super::ipc_handle::{decode, encode, encode_failure, SharedMappings};
use super::{error, fail, on_device};
use crate::registry::{self, Registry};
use std::ffi::{c_char, c_int, c_void, CStr};
use streamalloc_allocator::backend::ipc::{ExportedMapping, IpcBackend, IpcError};
use streamalloc_allocator::{Allocator, Backend, DevicePtr};

/// The IPC handle of `allocator`'s live allocation at `ptr` (in an expandable segment or a
/// stitched range), and the allocation's offset from the first byte the handle opens.
pub fn export_allocation<B: Backend + IpcBackend>(
    allocator: &Allocator<B>,
    ptr: u64,
) -> Result<(Vec<u8>, u64), String> {
    let site = allocator
        .allocation_at(DevicePtr(ptr))
        .ok_or_else(|| format!("{ptr:#x} is not a live allocation of streamalloc"))?;
    if !site.expandable {
        return Err(format!(
            "{ptr:#x} lies in a whole segment, which is shared with cudaIpcGetMemHandle"
        ));
    }
    let backend = allocator.backend();
    let pid = std::process::id() as i32;
    if !site.stitched {
        let mappings = backend
            .ipc_export(DevicePtr(ptr), site.size)
            .map_err(|err| err.to_string())?;
        let first = mappings.first().map_or(ptr, |m| m.address);
        return Ok((encode(pid, &mappings), ptr - first));
    }
    let pages = allocator
        .stitched_pages(DevicePtr(ptr))
        .ok_or_else(|| format!("{ptr:#x} is no longer a live stitched range"))?;
    let mut mappings: Vec<ExportedMapping> = Vec::new();
    for (run, len) in pages {
        let part = backend
            .ipc_export(run, len)
            .map_err(|err| format!("pages of the stitched range at {ptr:#x}: {err}"))?;
        // Each run is whole allocations (a stitch maps nothing else): exactly the run.
        let covered: u64 = part.iter().map(|m| m.size).sum();
        if part.first().map(|m| m.address) != Some(run.0) || covered != len {
            return Err(format!(
                "the pages at {run} (+{len} bytes) of the stitched range at {ptr:#x} are not \
                 whole allocations, which CUDA IPC needs"
            ));
        }
        mappings.extend(part);
    }
    Ok((encode(pid, &mappings), 0))
}

/// Opens `handle` (PyTorch's `'e'` or ours; a failed export's raises its reason) on
/// `allocator`'s device; returns the first byte of the mapped range.
pub fn open_handle<B: Backend + IpcBackend>(
    allocator: &Allocator<B>,
    handle: &[u8],
) -> Result<u64, String> {
    let shared = decode(handle).map_err(|err| err.to_string())?;
    import(allocator, &shared)
}

/// Maps the allocations `shared` names on `allocator`'s device.
fn import<B: Backend + IpcBackend>(
    allocator: &Allocator<B>,
    shared: &SharedMappings,
) -> Result<u64, String> {
    allocator
        .backend()
        .ipc_import(shared.pid, &shared.mappings)
        .map(|ptr| ptr.0)
        .map_err(|err: IpcError| err.to_string())
}

/// Closes what [`open_handle`] returned: waits for the device, unmaps and releases it.
pub fn close_import<B: Backend + IpcBackend>(
    allocator: &Allocator<B>,
    base: u64,
) -> Result<(), String> {
    allocator
        .backend()
        .ipc_close(DevicePtr(base))
        .map_err(|err| err.to_string())
}

/// Writes `handle` into `out` if it fits in `capacity` bytes; returns its length.
///
/// # Safety
/// `out` must be null or writable for `capacity` bytes.
unsafe fn write_handle(handle: &[u8], out: *mut u8, capacity: usize) -> i64 {
    if handle.len() <= capacity && !out.is_null() {
        // SAFETY: `out` is writable for `capacity` >= `handle.len()` bytes (see # Safety)
        // and cannot overlap a fresh Vec.
        unsafe { std::ptr::copy_nonoverlapping(handle.as_ptr(), out, handle.len()) };
    }
    handle.len() as i64
}

/// Writes the IPC handle of the live allocation at `ptr`, which lies in an expandable
/// segment or a stitched range, into `out` and the allocation's offset from the first byte
/// the handle opens into `*offset`. Returns the handle's length; if that exceeds
/// `capacity`, nothing is written (call again with room for it). -1 on error (a
/// whole-segment allocation, a device that cannot export; see `streamalloc_last_error`).
///
/// # Safety
/// `out` must be null (with `capacity` 0) or writable for `capacity` bytes; `offset` must
/// be null or writable.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_ipc_export(
    ptr: *mut c_void,
    out: *mut u8,
    capacity: usize,
    offset: *mut u64,
) -> i64 {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { ipc_export(registry::global(), ptr, out, capacity, offset) }
}

/// [`streamalloc_ipc_export`] on `registry`.
///
/// # Safety
/// As [`streamalloc_ipc_export`].
pub unsafe fn ipc_export<B: Backend + IpcBackend>(
    registry: &Registry<B>,
    ptr: *mut c_void,
    out: *mut u8,
    capacity: usize,
    offset: *mut u64,
) -> i64 {
    let address = ptr as usize as u64;
    error::call(-1, || {
        let exported = match super::introspect::allocation_owner(registry, address) {
            Some((device, _)) => device
                .run(|allocator| export_allocation(allocator, address))
                .map_err(|err| super::error::unavailable_message(device.ordinal(), &err))
                .and_then(|result| {
                    result.map_err(|err| format!("device {}: {err}", device.ordinal()))
                }),
            None => Err(format!(
                "{address:#x} is not a live allocation of streamalloc"
            )),
        };
        match exported {
            Ok((handle, off)) => {
                if handle.len() <= capacity && !offset.is_null() {
                    // SAFETY: writable (see # Safety).
                    unsafe { offset.write(off) };
                }
                // SAFETY: `out` is null or writable for `capacity` bytes (see # Safety).
                unsafe { write_handle(&handle, out, capacity) }
            }
            Err(message) => fail(-1, format_args!("streamalloc_ipc_export: {message}")),
        }
    })
}

/// Writes a failed export's handle carrying `message` (the sender's reason; cut to 1024
/// bytes) into `out`, for a sender that could not export memory by any means: the receiver
/// that opens it raises the reason instead of waiting. Returns the handle's length; if that
/// exceeds `capacity`, nothing is written. -1 if `message` is null.
///
/// # Safety
/// `message` must be null or a NUL-terminated string; `out` must be null or writable for
/// `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_ipc_failure_handle(
    message: *const c_char,
    out: *mut u8,
    capacity: usize,
) -> i64 {
    error::call(-1, || {
        if message.is_null() {
            return fail(-1, "streamalloc_ipc_failure_handle: message is null");
        }
        // SAFETY: a NUL-terminated string (see # Safety).
        let message = unsafe { CStr::from_ptr(message) }.to_string_lossy();
        // SAFETY: `out` is null or writable for `capacity` bytes (see # Safety).
        unsafe { write_handle(&encode_failure(&message), out, capacity) }
    })
}

/// Opens an IPC handle of mapped memory (PyTorch's `'e'` or ours) of another process on
/// `device` and returns the first byte of the mapped range (add the sender's offset).
/// Null on error, with the reason in `streamalloc_last_error` (for a failed export's
/// handle, the sender's reason). Close it with `streamalloc_ipc_close`.
///
/// # Safety
/// `handle` must be readable for `len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn streamalloc_ipc_open(
    handle: *const u8,
    len: usize,
    device: c_int,
) -> *mut c_void {
    // SAFETY: forwarded from this function's # Safety.
    unsafe { ipc_open(registry::global(), handle, len, device) }
}

/// [`streamalloc_ipc_open`] on `registry`.
///
/// # Safety
/// As [`streamalloc_ipc_open`].
pub unsafe fn ipc_open<B: Backend + IpcBackend>(
    registry: &Registry<B>,
    handle: *const u8,
    len: usize,
    device: c_int,
) -> *mut c_void {
    error::call(std::ptr::null_mut(), || {
        if handle.is_null() {
            return fail(std::ptr::null_mut(), "streamalloc_ipc_open: handle is null");
        }
        // SAFETY: readable for `len` bytes (see # Safety).
        let bytes = unsafe { std::slice::from_raw_parts(handle, len) };
        // The handle is read first: a refused or failed export's reason needs no device.
        let opened = decode(bytes)
            .map_err(|err| err.to_string())
            .and_then(|shared| {
                on_device(registry, device, |allocator| {
                    import(allocator, &shared).map_err(|err| format!("device {device}: {err}"))
                })
            });
        match opened {
            Ok(ptr) => ptr as usize as *mut c_void,
            Err(message) => fail(
                std::ptr::null_mut(),
                format_args!("streamalloc_ipc_open: {message}"),
            ),
        }
    })
}

/// Closes what `streamalloc_ipc_open` returned: synchronises its device, unmaps and
/// releases the memory. 0, or -1 (not an open handle, or a driver error).
#[no_mangle]
pub extern "C" fn streamalloc_ipc_close(base: *mut c_void) -> c_int {
    ipc_close(registry::global(), base)
}

/// [`streamalloc_ipc_close`] on `registry`.
pub fn ipc_close<B: Backend + IpcBackend>(registry: &Registry<B>, base: *mut c_void) -> c_int {
    let ptr = DevicePtr(base as usize as u64);
    error::call(-1, || {
        let owner = registry.initialized().find(|device| {
            device
                .run(|allocator| allocator.backend().ipc_import_size(ptr).is_some())
                .unwrap_or(false)
        });
        let closed = match owner {
            Some(device) => on_device(registry, device.ordinal(), |allocator| {
                close_import(allocator, ptr.0)
                    .map_err(|err| format!("device {}: {err}", device.ordinal()))
            }),
            None => Err(format!("{base:p} is not an open IPC handle")),
        };
        match closed {
            Ok(()) => 0,
            Err(message) => fail(-1, format_args!("streamalloc_ipc_close: {message}")),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_c_abi_reports_errors_without_a_gpu() {
        let mut out = [0u8; 64];
        let mut offset = 0u64;
        // SAFETY: valid buffers.
        let n = unsafe {
            streamalloc_ipc_export(0x1000 as *mut c_void, out.as_mut_ptr(), 64, &mut offset)
        };
        assert_eq!(n, -1);
        assert!(error::last_string().contains("not a live allocation"));
        let bad = [9u8, b'e'];
        // SAFETY: readable for two bytes.
        let p = unsafe { streamalloc_ipc_open(bad.as_ptr(), bad.len(), 0) };
        assert!(p.is_null());
        assert!(error::last_string().contains("version 9"));
        // SAFETY: null is refused.
        assert!(unsafe { streamalloc_ipc_open(std::ptr::null(), 0, 0) }.is_null());
        assert_eq!(streamalloc_ipc_close(0x2000 as *mut c_void), -1);
        assert!(error::last_string().contains("not an open IPC handle"));
    }

    #[test]
    fn a_failure_handle_carries_the_senders_reason_to_the_receivers_open() {
        let reason = c"device 0: cudaIpcGetMemHandle failed: invalid argument";
        let mut out = [0u8; 128];
        // SAFETY: a NUL-terminated message and a buffer of 128 bytes.
        let n = unsafe { streamalloc_ipc_failure_handle(reason.as_ptr(), out.as_mut_ptr(), 128) };
        assert!(n > 2 && n <= 128);
        // SAFETY: readable for n bytes.
        let p = unsafe { streamalloc_ipc_open(out.as_ptr(), n as usize, 0) };
        assert!(p.is_null());
        let message = error::last_string();
        assert!(
            message.contains("the sending process could not share this memory")
                && message.contains("cudaIpcGetMemHandle failed"),
            "{message}"
        );
        // Too little room: the length, nothing written.
        let mut small = [0u8; 4];
        // SAFETY: as above.
        let needed =
            unsafe { streamalloc_ipc_failure_handle(reason.as_ptr(), small.as_mut_ptr(), 4) };
        assert_eq!(needed, n);
        assert_eq!(small, [0; 4]);
        // SAFETY: a null message is refused; `out` is writable for 128 bytes.
        let null =
            unsafe { streamalloc_ipc_failure_handle(std::ptr::null(), out.as_mut_ptr(), 128) };
        assert_eq!(null, -1);
    }
}
