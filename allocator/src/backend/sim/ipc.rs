//! CUDA IPC on the simulated device ([`IpcBackend`]): the sender and the receiver are two
//! allocators on one [`SimBackend`], as two processes share one GPU. An export gives each
//! allocation mapped first at the range a descriptor of the device's own; an import maps
//! the physical pages those descriptors stand for, back to back, into fresh addresses, so
//! the race detector sees a byte written by the sender and read by the receiver as one
//! byte; closing an import waits for the device and unmaps it with the detector's check.
//!
//! As with the driver: only allocations mapped there first can be exported (a stitched
//! range's second mappings are not), a descriptor closes when its mapping is unmapped (an
//! import after that fails as `pidfd_getfd` does, `EBADF`), and imported pages stay
//! allocated until the import is closed, whatever the sender unmaps meanwhile.

use super::{SimBackend, SimState, PAGE_SIZE, SEGMENT_GUARD};
use crate::backend::ipc::{check_import, ExportedMapping, ForeignMapping, IpcBackend, IpcError};
use crate::error::BackendError;
use crate::types::DevicePtr;
use std::collections::HashMap;

/// Linux's `errno` for a descriptor the process does not have.
const EBADF: i32 = 9;

/// The device's descriptors and imports.
#[derive(Debug, Default)]
pub(super) struct SimIpc {
    /// Descriptor → the allocation it stands for: physical first byte, bytes.
    descriptors: HashMap<i32, (u64, u64)>,
    /// First virtual byte of an exported mapping → its descriptor, made on first export.
    exported: HashMap<u64, i32>,
    /// First byte of an open import → its bytes.
    imports: HashMap<u64, u64>,
    /// The last descriptor handed out.
    last_fd: i32,
}

impl SimIpc {
    /// Closes the descriptors of the mappings starting at `starts`, being unmapped.
    pub(super) fn forget_exports(&mut self, starts: &[u64]) {
        for start in starts {
            if let Some(fd) = self.exported.remove(start) {
                self.descriptors.remove(&fd);
            }
        }
    }
}

impl IpcBackend for SimBackend {
    fn ipc_export(&self, ptr: DevicePtr, size: u64) -> Result<Vec<ExportedMapping>, IpcError> {
        let mut state = self.call("ipc_export");
        let not_mapped = IpcError::NotMapped { ptr: ptr.0, size };
        let allocations = ptr
            .0
            .checked_add(size)
            .and_then(|end| state.vm.allocations_over(ptr.0, end))
            .ok_or(not_mapped.clone())?;
        if allocations.iter().any(|a| a.alias) {
            return Err(not_mapped);
        }
        let ipc = &mut state.ipc;
        let mut out = Vec::with_capacity(allocations.len());
        for allocation in allocations {
            let fd = match ipc.exported.get(&allocation.start) {
                Some(&fd) => fd,
                None => {
                    ipc.last_fd += 1;
                    let fd = ipc.last_fd;
                    ipc.exported.insert(allocation.start, fd);
                    ipc.descriptors
                        .insert(fd, (allocation.physical, allocation.len));
                    fd
                }
            };
            out.push(ExportedMapping {
                address: allocation.start,
                size: allocation.len,
                fd,
            });
        }
        Ok(out)
    }

    fn ipc_import(&self, pid: i32, mappings: &[ForeignMapping]) -> Result<DevicePtr, IpcError> {
        let total = check_import(mappings, PAGE_SIZE)?;
        if pid <= 0 {
            return Err(IpcError::Invalid(format!("sender pid {pid}")));
        }
        let mut state = self.call("ipc_import");
        let mut allocations = Vec::with_capacity(mappings.len());
        for mapping in mappings {
            match state.ipc.descriptors.get(&mapping.fd) {
                Some(&(physical, len)) if len == mapping.size => allocations.push((physical, len)),
                Some(&(_, len)) => {
                    return Err(IpcError::Driver(BackendError::new(
                        "cuMemMap",
                        format!(
                            "descriptor {} stands for {len} bytes, not {}",
                            mapping.fd, mapping.size
                        ),
                    )))
                }
                None => {
                    return Err(IpcError::Os {
                        call: "pidfd_getfd",
                        errno: EBADF,
                        message: "Bad file descriptor (the sender no longer has that \
                                  descriptor: its memory was released)"
                            .to_string(),
                    })
                }
            }
        }
        let base = state.next_address;
        state.next_address += total + SEGMENT_GUARD;
        state.vm.reserve(base, total);
        state.vm.map_imported(base, &allocations, PAGE_SIZE);
        state.ipc.imports.insert(base, total);
        Ok(DevicePtr(base))
    }

    fn ipc_import_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.state.lock().ipc.imports.get(&ptr.0).copied()
    }

    fn ipc_close(&self, ptr: DevicePtr) -> Result<(), IpcError> {
        let mut state = self.call("ipc_close");
        let size = state
            .ipc
            .imports
            .remove(&ptr.0)
            .ok_or(IpcError::UnknownImport {
                ptr: ptr.0,
                ordinal: 0,
            })?;
        close_import(&mut state, ptr.0, size)?;
        self.publish(&state);
        Ok(())
    }
}

/// What closing the import at `base` does on the device: synchronise it (`cuCtxSynchronize`:
/// the receiver's work on the memory must be done, and unmapping does not wait), unmap it
/// under the race detector's check, and free its addresses.
fn close_import(state: &mut SimState, base: u64, size: u64) -> Result<(), IpcError> {
    if !state.capturing.is_empty() {
        state.capture_violation(format!("closing the IPC import at {base:#x} synchronises"));
    }
    state.sync_host_to_device();
    state.unmap_checked(base, base + size, "ipc_close")?;
    state.vm.release(base);
    Ok(())
}
